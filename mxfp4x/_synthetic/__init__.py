"""Random MXFP4 layers and random checkpoints of each model family, with the float64
references they are checked against: for ``python -m mxfp4x check`` and ``layer`` and for
the tests (through ``mxfp4x.testing``)."""
