"""Measuring on this machine, for ``python -m mxfp4x roofline`` and ``bench`` and for the
benchmarks (through ``mxfp4x.testing``): the roofs of the CPU (``roofline``) and of a
CUDA device (``gpu``), each with its best-of timer, and the benchmark cases (``bench``)."""
