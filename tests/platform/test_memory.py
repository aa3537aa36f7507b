"""mxfp4x._core.memory.zeros: zeroed tensors, on transparent huge pages where Linux lets a
process ask for them, freed with their last view."""
import gc
import sys

import pytest
import torch

from mxfp4x._core import memory

LINUX = sys.platform.startswith("linux")


def _mapping_of(address):
    """(start, end, VmFlags words) of the mapping in /proc/self/smaps holding
    ``address``, or None."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = (lo, hi) if lo <= address < hi else None
            elif found and line.startswith("VmFlags:"):
                return found + (line.split()[1:],)
    return None


@pytest.mark.parametrize("shape,dtype", [((3, 5, 7), torch.uint8),
                                         ((1,), torch.bfloat16),
                                         ((33, 5761, 17), torch.uint8),  # above MIN_BYTES
                                         ((257, 4099), torch.float32),
                                         ((3, 1111, 1009), torch.bfloat16)])
def test_zeros_are_zero_writable_and_of_their_shape(shape, dtype):
    t = memory.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous()
    assert not t.any()
    g = torch.Generator().manual_seed(sum(shape))
    src = torch.randint(0, 100, shape, generator=g).to(dtype)
    t.copy_(src)  # writable, every element its own
    assert torch.equal(t, src)
    assert memory.zeros(shape, dtype).count_nonzero() == 0  # a fresh one is zero again


@pytest.mark.skipif(not (LINUX and memory.huge_pages_asked()), reason="Linux only")
def test_large_buffers_ask_for_huge_pages_on_a_2mib_boundary():
    t = memory.zeros((memory.MIN_BYTES + 12345,), torch.uint8)
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    t[::4096] = 1  # touched
    start, end, flags = _mapping_of(t.data_ptr())
    assert "hg" in flags, flags  # MADV_HUGEPAGE on the mapping holding it
    assert end >= t.data_ptr() + t.numel()


@pytest.mark.skipif(not (LINUX and memory.huge_pages_asked()), reason="Linux only")
def test_the_mapping_lives_as_long_as_a_view_and_no_longer():
    t = memory.zeros((2, memory.MIN_BYTES), torch.uint8)
    address = t.data_ptr()
    half = t[1]  # a view keeps the mapping
    half.fill_(7)
    del t
    gc.collect()
    assert _mapping_of(address) is not None
    assert int(half.sum()) == 7 * memory.MIN_BYTES
    del half
    gc.collect()
    mapping = _mapping_of(address)
    assert mapping is None or "hg" not in mapping[2]  # unmapped (the range may be reused)


@pytest.mark.skipif(not (LINUX and memory.huge_pages_asked()), reason="Linux only")
def test_checkpoint_mappings_ask_for_huge_pages_from_the_minimum(tmp_path):
    """A checkpoint read's private mapping (``map_file_bytes``) of at least MIN_BYTES asks
    for huge pages (its faults read 2 MiB folios where the file system makes them); a
    smaller one does not; both read the file's bytes."""
    import numpy as np

    from mxfp4x.checkpoints._files import map_file_bytes
    data = np.random.default_rng(5).integers(0, 256, 3 * memory.HUGE_PAGE + 4321, np.uint8)
    path = tmp_path / "bytes.bin"
    data.tofile(path)
    with open(path, "rb") as fh:
        size = data.size
        big = map_file_bytes(fh, str(path), 777, size, size, ["big"])
        small = map_file_bytes(fh, str(path), 4096 + 5, 4096 + 5 + 70000, size, ["small"])
    assert np.array_equal(big, data[777:]) and np.array_equal(small, data[4101:74101])
    assert "hg" in _mapping_of(big.ctypes.data + memory.HUGE_PAGE)[2]
    assert "hg" not in _mapping_of(small.ctypes.data)[2]
