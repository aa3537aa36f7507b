"""python -m mxfp4x: the command line, in :mod:`mxfp4x.cli`."""
import sys

from mxfp4x.cli import main

if __name__ == "__main__":
    sys.exit(main())
