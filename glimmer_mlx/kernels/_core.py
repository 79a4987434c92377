"""Shared machinery of the custom kernels: the `GLIMMER_KERNELS` switch, the loader of `metal_kernels/*.metal`,
and `KernelCall` — one fully specified launch (inputs, template, grid, threadgroup, outputs) that runs either through
`mx.fast.metal_kernel` on a Mac or through the MSL-on-CPU test harness (tests/msl_harness), so both execute the
same body with the same launch parameters.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

ENV = "GLIMMER_KERNELS"
MODES = ("auto", "reference", "metal")


class KernelUnavailable(RuntimeError):
    """GLIMMER_KERNELS=metal was requested on a machine without a Metal back-end."""


def mode() -> str:
    """The value of GLIMMER_KERNELS: auto (default: Metal kernels when available), reference (pure MLX always),
    metal (kernels required: error when Metal is unavailable)."""
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {m!r}")
    return m


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # a build without the metal module
        return False


def use_metal() -> bool:
    """True when dispatchers should run the Metal kernels (for supported shapes and dtypes)."""
    m = mode()
    if m == "reference":
        return False
    available = metal_available()
    if m == "metal" and not available:
        raise KernelUnavailable(f"{ENV}=metal but this MLX build has no Metal back-end (mx.metal.is_available() "
                                f"is False); use {ENV}=auto or reference")
    return available


def kernel_dir() -> Path:
    """Folder of the .metal bodies: `glimmer_mlx/metal_kernels` in an installed wheel (a link to the repository's
    `metal_kernels/` in a checkout), else the repository root's `metal_kernels/`."""
    here = Path(__file__).resolve().parent.parent
    for cand in (here / "metal_kernels", here.parent / "metal_kernels"):
        if cand.is_dir() and any(cand.glob("*.metal")):
            return cand
    raise FileNotFoundError(f"no metal_kernels/*.metal next to {here} (broken installation?)")


@functools.lru_cache(maxsize=None)
def load_source(filename: str) -> str:
    path = kernel_dir() / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel body {path} is missing")
    return path.read_text()


@dataclass(frozen=True)
class KernelSpec:
    name: str
    filename: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    text: str | None = None  # an inline body instead of a file (used by the harness's own tests)
    ensure_row_contiguous: bool = True  # False: inputs are passed as they are (views), the body uses *_strides

    @property
    def source(self) -> str:
        return self.text if self.text is not None else load_source(self.filename)

    def build(self):
        return _build(self)


@functools.lru_cache(maxsize=None)
def _build(spec: KernelSpec):
    # built once per process (each build is a new Metal library); building works without Metal, calling does not
    return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                output_names=list(spec.output_names), source=spec.source,
                                ensure_row_contiguous=spec.ensure_row_contiguous)


@dataclass
class KernelCall:
    spec: KernelSpec
    inputs: list
    output_shapes: list
    output_dtypes: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list = field(default_factory=list)
    init_value: float | None = None

    def kwargs(self) -> dict:
        kw = dict(inputs=self.inputs, template=self.template, grid=self.grid, threadgroup=self.threadgroup,
                  output_shapes=self.output_shapes, output_dtypes=self.output_dtypes)
        if self.init_value is not None:
            kw["init_value"] = self.init_value
        return kw

    def run_metal(self) -> list[mx.array]:
        return self.spec.build()(**self.kwargs())


FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
