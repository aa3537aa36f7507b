import os
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

import mxfp4x
from mxfp4x._core import cpu as _cpu

# Hypothesis profiles, chosen by MXFP4X_HYPOTHESIS_PROFILE: "ci" (default, quick),
# "dev" (more examples), "long" (a long run by hand).
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=10_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MXFP4X_HYPOTHESIS_PROFILE", "ci"))

SEED = int(os.environ.get("MXFP4X_TEST_SEED", np.random.SeedSequence().entropy % 2**32))


def pytest_report_header(config):
    info = mxfp4x.backend_info()
    return [
        f"mxfp4x {info['version']} from {os.path.dirname(mxfp4x.__file__)}",
        f"mxfp4x: seed={SEED} (MXFP4X_TEST_SEED) isa={info['isa']} isas={info['isas']} "
        f"compiled={info['compiled_isas']} openmp={info['openmp']} "
        f"threads={info['num_threads']} torch={info['torch']} cuda={info['cuda']}",
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A failing run names its seed even where the header is not printed (``-q``)."""
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(f"mxfp4x: this run's seed: MXFP4X_TEST_SEED={SEED}")


def rng_for(seed, nodeid):
    """The generator of one test: from the session seed and a stable hash of the test's
    id (CRC-32, not hash(), which changes with PYTHONHASHSEED), so MXFP4X_TEST_SEED
    reproduces a failure in any process."""
    return np.random.default_rng([seed, zlib.crc32(nodeid.encode())])


@pytest.fixture
def rng(request):
    """Fresh random inputs per test, reproducible from the seed in the header."""
    return rng_for(SEED, request.node.nodeid)


def _isa_params():
    runnable = set(_cpu.runnable_isas())
    return [pytest.param(name, marks=() if name in runnable else pytest.mark.skip(
        reason=f"this CPU cannot run {name}")) for name in _cpu.compiled_isas()]


@pytest.fixture(params=_isa_params())
def isa(request):
    """Each compiled ISA this CPU can run; a test passes it to its calls (isa=...)."""
    return request.param


FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
