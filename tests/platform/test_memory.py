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
    # every page of it, the partial 2 MiB at either end too (their faults read ahead)
    assert "hg" in _mapping_of(big.ctypes.data)[2]
    assert "hg" in _mapping_of(big.ctypes.data + big.size - 1)[2]
    assert "hg" not in _mapping_of(small.ctypes.data)[2]


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_weights_in_a_file_mapping_ask_for_huge_pages_on_every_page(tmp_path):
    """ask_huge_pages_of: a tensor viewing a file's mapping is advised on every page it
    touches, however small (a fault where nothing was asked would read the bytes after it
    ahead in small folios), each storage once; memory of no file keeps the large-buffer
    rule."""
    import mmap

    import numpy as np

    path = tmp_path / "weights.bin"
    np.random.default_rng(0).integers(0, 256, 3 * memory.HUGE_PAGE, np.uint8).tofile(path)
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    tensor = torch.empty(0, dtype=torch.uint8).set_(whole.untyped_storage()[5000:8000])
    anonymous = torch.zeros(1000, dtype=torch.uint8)  # torch's, under MIN_BYTES
    assert "hg" not in _mapping_of(tensor.data_ptr())[2]
    assert memory.ask_huge_pages_of([tensor, tensor, anonymous]) == 1
    assert "hg" in _mapping_of(tensor.data_ptr())[2]  # its pages: bytes 4096 to 8191
    assert "hg" in _mapping_of(tensor.data_ptr() + 2999)[2]
    assert "hg" not in _mapping_of(whole.data_ptr() + 2 * memory.HUGE_PAGE)[2]
    assert torch.equal(tensor, whole[5000:8000])
    del tensor, whole


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_read_in_huge_folios_reads_every_2mib_but_the_skipped(tmp_path, monkeypatch):
    """read_in_huge_folios faults each 2 MiB window of its files in (counted in bytes),
    but the windows wholly inside a skipped range, and reads nothing where the files
    would not fit in the memory available; the files are left as they were."""
    import numpy as np

    data = np.random.default_rng(7).integers(0, 256, 5 * memory.HUGE_PAGE + 123, np.uint8)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    data.tofile(a)
    data[: memory.HUGE_PAGE].tofile(b)
    H = memory.HUGE_PAGE
    assert memory.read_in_huge_folios([str(a), str(b)]) == 6 * H + H
    # [H + 5, 4 H + 7) holds the windows at 2 H and 3 H whole; those at H and 4 H in part
    assert memory.read_in_huge_folios([str(a), str(b)], [(str(a), H + 5, 4 * H + 7)]) == 5 * H
    monkeypatch.setattr(memory, "available_memory", lambda: 7 * H)
    assert memory.read_in_huge_folios([str(a), str(b)]) == 0  # 7 H > 4/5 of 7 H
    monkeypatch.setattr(memory, "available_memory", lambda: None)
    assert memory.read_in_huge_folios([str(a)]) == 0
    assert np.array_equal(np.fromfile(a, np.uint8), data)
