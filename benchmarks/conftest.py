import os

import pytest
import torch

import mxfp4x


def pytest_report_header(config):
    info = mxfp4x.backend_info()
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    return [f"mxfp4x {info['version']} isa={info['isa']} isas={info['isas']} "
            f"openmp={info['openmp']} threads={info['num_threads']} small={small}"]


@pytest.fixture
def threads(request):
    n = request.param
    if n > os.cpu_count():
        pytest.skip(f"{n} threads > {os.cpu_count()} CPUs")
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(old)
