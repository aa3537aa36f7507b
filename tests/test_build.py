"""The tests run against the installed build, built the way we ship it."""
import os

import pytest

import mxfp4x

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imported_from_installed_package():
    where = os.path.dirname(os.path.abspath(mxfp4x.__file__))
    if os.environ.get("CI") and where == os.path.join(ROOT, "mxfp4x"):
        pytest.fail(f"CI imported the source tree ({where}), not the installed wheel")
    assert mxfp4x.__version__ != "0+unknown" or not os.environ.get("CI")


def test_no_forbidden_flags_in_the_build():
    with open(os.path.join(ROOT, "setup.py")) as f:
        code = f.read()
    for flag in ("-march=native", "-ffast-math", "-Ofast", '"-mavx', "'-mavx"):
        assert flag not in code.split('"""', 2)[-1], flag
    assert "-ffp-contract=off" in code
