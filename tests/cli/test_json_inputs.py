"""The JSON files a command reads (a checkpoint's config.json, verify's --manifest) are
capped at MAX_JSON_BYTES: a larger one is exit status 2 naming it, its size and the cap,
before it is read (sparse files: their length costs no disk)."""
import shutil
import tracemalloc

import pytest

from mxfp4x.checkpoints.safetensors import MAX_JSON_BYTES


def _sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def _traced(call, *argv):
    tracemalloc.start()
    try:
        result = call(*argv)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


@pytest.mark.parametrize("which", ["--manifest", "config.json"])
def test_verify_refuses_a_json_file_over_the_cap_unread(tmp_path, k3, cli_main, which):
    folder = tmp_path / "ck"
    shutil.copytree(k3, folder)
    size = MAX_JSON_BYTES + 1
    if which == "config.json":
        big = _sparse(folder / "config.json", size)
        argv = ("verify", folder)
    else:
        big = _sparse(tmp_path / "sha256.json", size)
        argv = ("verify", folder, "--manifest", big)
    (code, _, err), peak = _traced(cli_main, *argv)
    assert code == 2 and big in err and f"{size} bytes" in err, err
    assert f"cap of {MAX_JSON_BYTES} bytes" in err and "MAX_JSON_BYTES" in err, err
    assert peak < 64 << 20, peak  # the checkpoint's headers, not the 100 MB file
