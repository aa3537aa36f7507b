"""The installed distribution's version ("0+unknown" when built in place, never installed)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mxfp4x")
except PackageNotFoundError:
    __version__ = "0+unknown"
