"""The roofs of the machine the tests and benchmarks run on: ``mxfp4x._measure.roofline``,
what ``python -m mxfp4x roofline`` and ``bench`` measure with."""
from .._measure.roofline import (
    FLAGS,
    ReadProbe,
    best_time,
    cpu_model,
    matmul_rate,
    measure,
    read_bandwidth,
    read_bandwidth_torch,
)

__all__ = ["FLAGS", "ReadProbe", "best_time", "cpu_model", "matmul_rate", "measure",
           "read_bandwidth", "read_bandwidth_torch"]
