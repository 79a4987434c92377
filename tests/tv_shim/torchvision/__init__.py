"""A minimal stand-in for torchvision, for the test oracle only (tests/hf_processor_oracle.py).

transformers' Muse Glimmer image/video processors exist only with the torchvision backend, and PyPI's torchvision
wheels cannot be imported beside the CPU build of torch these tests use. What the processors need from torchvision
on a CPU is small: `transforms.v2.functional.resize` on uint8 tensors, which in torchvision 0.28 is
`torch.nn.functional.interpolate(..., antialias=True)` on the uint8 tensor for LANCZOS/BICUBIC (AVX2 CPUs also
for BILINEAR), plus `normalize`, `grayscale_to_rgb` and `to_dtype`. This package provides exactly those, following
torchvision 0.28's tensor kernels, and is put on sys.path only in the oracle's subprocess when no real torchvision
imports.
"""

__version__ = "0.28.0"

from . import io, transforms  # noqa: E402,F401
