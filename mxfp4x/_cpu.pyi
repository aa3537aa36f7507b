# Type stub of the compiled extension (mxfp4x/_cpu.pyx).
from typing import Any

import numpy as np

GROUP: int
GROUP_BYTES: int
GGUF_BLOCK_BYTES: int
DTYPES: tuple[str, ...]
MAX_THREADS: int

def compiled_isas() -> list[str]: ...
def runnable_isas() -> list[str]: ...
def threads_backend() -> str: ...
def cpu_features() -> list[str]: ...
def default_isa() -> str: ...
def build_info() -> dict[str, Any]: ...
def _resolve(name: Any, source: str) -> int: ...
def combine(out: np.ndarray, dots: np.ndarray, selected: np.ndarray, mix: np.ndarray, *,
            n_threads: int = 1, thread_log: np.ndarray | None = None) -> None: ...
def dense_bf16(x: np.ndarray, w: np.ndarray, out: np.ndarray, *, isa: Any = None,
               n_threads: int = 1) -> None: ...

class Experts:
    n_experts: int
    d_out: int
    n_groups: int
    owner: Any
    form: str
    def __init__(self, table: np.ndarray, *, d_out: int, n_groups: int, owner: Any,
                 form: str = "split") -> None: ...

class Call:
    experts: Experts
    isa: str
    n_threads: int
    def __init__(self, experts: Experts, *, product: str, compute: str, selected: np.ndarray,
                 mix: np.ndarray | None, src: np.ndarray, src_dtype: str, src_rows: str,
                 dst: np.ndarray, dst_rows: str, isa: str | None = None,
                 n_threads: int = 1) -> None: ...
    def run(self, thread_log: np.ndarray | None = None) -> None: ...
