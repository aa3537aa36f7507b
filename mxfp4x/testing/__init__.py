"""Helpers for tests and benchmarks: random layers and the error bound (``layers``),
float64 references and random checkpoints of each model family (``gpt_oss``,
``kimi_k3``), the machine's roofs (``roofline``) and benchmark cases (``bench``)."""
