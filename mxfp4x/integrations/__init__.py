"""Entry points into other libraries: :mod:`mxfp4x.integrations.transformers` loads
Hugging Face transformers models with their experts kept MXFP4 and run on mxfp4x.

Nothing here is imported by ``import mxfp4x``; each integration imports its library only
when it is itself imported."""
