"""The core of mxfp4x, private: the format, the op and its backends, nothing above them.

* the spec: ``format`` (every format fact and the accumulation-dtype rule) and
  ``reference`` (the float64 reference and the error bound);
* the fast paths: ``cpu`` (the compiled boundary and parallel driver: ``cpu.pyx`` and the
  ``cpu_*.pxi`` it includes, ``capi.pxd`` the 1:1 mirror of include/mxfp4x/, ``probes``
  its roofline loops and test hooks), ``cpu_impl`` (tensors to a driver call),
  ``torch_impl`` and ``triton_impl`` (the GPU path), ``dense`` (bf16 projections);
* the choice between them: ``api`` (the facade), ``ops`` (torch.library custom ops),
  ``threads`` (the thread policy);
* the arguments' rules: ``coerce``, ``validation``, ``arguments``; and the helpers the
  packages above share: ``quantize``, ``files`` (atomic writes), ``progress``,
  ``weak_group``.

The core imports nothing of the packages above it (models, checkpoints, distributed, cli):
they import from here.  This file imports nothing, so that the torch-free QEMU probes can
load ``cpu`` and ``probes`` alone.
"""
