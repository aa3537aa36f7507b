"""Helpers for tests and benchmarks: random layers and the error bound (``layers``),
float64 references and random checkpoints of each model family (``gpt_oss``,
``kimi_k3``), the machine's roofs (``roofline``, ``gpu``) and benchmark cases (``bench``).
What ``python -m mxfp4x`` also needs lives in ``mxfp4x._synthetic`` and ``mxfp4x._measure``
(the commands do not import this package); these modules name it."""
