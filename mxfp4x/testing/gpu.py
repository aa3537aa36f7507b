"""The roofs of a CUDA device and its timer: ``mxfp4x._measure.gpu``, what ``python -m
mxfp4x bench --device cuda`` measures with."""
from .._measure.gpu import (
    exact_float32,
    matmul_peer,
    matmul_rate,
    measure,
    read_bandwidth,
    synchronized_time,
)

__all__ = ["exact_float32", "matmul_peer", "matmul_rate", "measure", "read_bandwidth",
           "synchronized_time"]
