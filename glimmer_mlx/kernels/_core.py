"""Shared machinery of the custom kernels: the `GLIMMER_KERNELS` switch, the loader of `metal_kernels/*.metal`,
`KernelCall` — one fully specified launch (inputs, template, grid, threadgroup, outputs) that runs either through
`mx.fast.metal_kernel` on a Mac or through the MSL-on-CPU test harness (tests/msl_harness), so both execute the
same body with the same launch parameters — and the runtime self-test that decides, once per process, whether a
kernel may run at all.

Self-test and fallback. Each kernel module registers a `SelfTest` (name, run_kernel, run_reference, make_inputs):
small deterministic inputs, the kernel path and its reference, both returning lazy MLX arrays. The first time a
dispatcher asks `kernel_enabled(name)` on a machine with Metal, the kernel is built, run and compared with its
reference. The verdict is kept for the process and on disk (`machine.cache_dir()/kernel-selftest.json`, keyed by
the GPU, the OS, the MLX version and the kernel's source text), so later processes skip the test. On any failure —
the Metal compiler refuses the body, the launch raises, the result differs — one `RuntimeWarning` is issued and the
dispatcher uses the built-in MLX path for the rest of the process; `kernel_stats()` records it. A kernel that raises
later, at a real call (`run_or_fallback`), is demoted the same way. `GLIMMER_KERNELS=metal` turns every such
failure into an error instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..files import FileFormatError, read_json, write_atomic
from ..machine import cache_dir, package_version

ENV = "GLIMMER_KERNELS"
MODES = ("auto", "reference", "metal")
SELFTEST_FILE = "kernel-selftest.json"


class KernelUnavailable(RuntimeError):
    """GLIMMER_KERNELS=metal was requested on a machine without a Metal back-end, or for a kernel that failed its
    self-test."""


def mode() -> str:
    """The value of GLIMMER_KERNELS: auto (default: Metal kernels when available and self-tested), reference (pure
    MLX always), metal (kernels required: error when Metal is unavailable or a kernel fails its self-test)."""
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
    """True when dispatchers may run Metal kernels at all (each kernel also needs `kernel_enabled(name)`)."""
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
        """The callable that launches this kernel on the GPU (the kernel builder; tests replace it to simulate a
        Metal compiler failure or a wrong result)."""
        return mlx_kernel(self)


@functools.lru_cache(maxsize=None)
def mlx_kernel(spec: KernelSpec):
    """`mx.fast.metal_kernel` for `spec`, built once per process (each build is a new Metal library); building works
    without Metal, calling does not."""
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


# -- self-test registry -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SelfTest:
    """What a kernel module registers. `make_inputs()` gives small deterministic inputs; `run_kernel(inputs)` and
    `run_reference(inputs)` return lazy MLX arrays (one array or a tuple) that must agree — exactly when
    rtol = atol = 0, else within `np.allclose(rtol, atol)`. `run_builtin` is what dispatchers run instead of the
    kernel (default: the reference), named by `builtin`; `sources` are the .metal files the kernel is built from."""
    name: str
    run_kernel: Callable[[Any], Any]
    run_reference: Callable[[Any], Any]
    make_inputs: Callable[[], Any]
    run_builtin: Callable[[Any], Any] | None = None
    builtin: str = "pure-MLX reference"
    sources: tuple[str, ...] = ()
    rtol: float = 0.0
    atol: float = 0.0

    def builtin_fn(self) -> Callable[[Any], Any]:
        return self.run_builtin or self.run_reference


_REGISTRY: dict[str, SelfTest] = {}


def register_selftest(entry: SelfTest) -> SelfTest:
    """Register (or replace) the self-test of kernel `entry.name`; returns it."""
    _REGISTRY[entry.name] = entry
    return entry


def selftests() -> list[SelfTest]:
    """Every registered self-test, in registration order."""
    return list(_REGISTRY.values())


def _entry(name: str) -> SelfTest:
    if name not in _REGISTRY:
        raise ValueError(f"kernel {name!r} has no registered self-test (registered: {', '.join(_REGISTRY) or 'none'})")
    return _REGISTRY[name]


@dataclass
class Verdict:
    """status: ok | failed | unavailable (no Metal) | disabled (GLIMMER_KERNELS=reference); path: what dispatchers
    run ("metal kernel" or the built-in's name)."""
    name: str
    status: str
    path: str
    reason: str = ""
    cached: bool = False  # read from the on-disk cache instead of tested in this process
    seconds: float | None = None  # how long the self-test took

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_VERDICTS: dict[str, Verdict] = {}


def reset_selftests() -> None:
    """Forget this process's verdicts (as a new process would; the on-disk cache stays)."""
    _VERDICTS.clear()


def gpu_identity() -> dict:
    """What the self-test cache is keyed by besides the kernel text: GPU, OS, MLX version."""
    try:
        info = mx.device_info()
    except Exception:  # an MLX without device_info
        info = {}
    return {"gpu": str(info.get("device_name", "")), "architecture": str(info.get("architecture", "")),
            "os": platform.platform(), "mlx": package_version("mlx") or getattr(mx, "__version__", "")}


def _source_text(entry: SelfTest) -> str:
    return "\n".join(load_source(f) for f in entry.sources)


def cache_key(entry: SelfTest) -> str:
    ident = json.dumps(gpu_identity(), sort_keys=True)
    return hashlib.sha256(f"{ident}\n{entry.name}\n{_source_text(entry)}".encode()).hexdigest()[:24]


def selftest_cache_path() -> Path:
    return cache_dir() / SELFTEST_FILE


def _read_cache() -> dict:
    path = selftest_cache_path()
    if not path.exists():
        return {}
    try:
        data = read_json(path, expect=dict)
    except FileFormatError as e:
        warnings.warn(f"ignoring the kernel self-test cache: {e}", RuntimeWarning, stacklevel=3)
        return {}
    return data


def _write_cache(entry: SelfTest, v: Verdict) -> None:
    data = _read_cache()
    data[cache_key(entry)] = {"name": v.name, "status": v.status, "reason": v.reason, **gpu_identity()}
    try:
        write_atomic(selftest_cache_path(), json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:  # a read-only home: the verdict still holds for this process
        warnings.warn(f"could not write the kernel self-test cache {selftest_cache_path()}: {e}", RuntimeWarning,
                      stacklevel=3)


def _host(x) -> list[np.ndarray]:
    xs = x if isinstance(x, (tuple, list)) else (x,)
    mx.eval(*xs)
    return [np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in xs]


def _agree(entry: SelfTest, got: list[np.ndarray], want: list[np.ndarray]) -> str:
    """'' when they agree, else a short description of the first difference."""
    if len(got) != len(want):
        return f"{len(got)} outputs, the reference has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape}, the reference's is {w.shape}"
        same = (np.array_equal(g, w, equal_nan=g.dtype.kind == "f") if entry.rtol == entry.atol == 0
                else np.allclose(g, w, rtol=entry.rtol, atol=entry.atol, equal_nan=True))
        if not same:
            bad = np.flatnonzero(~np.isclose(g, w, rtol=entry.rtol, atol=entry.atol, equal_nan=True)
                                 if g.dtype.kind == "f" else g.reshape(-1) != w.reshape(-1))
            j = int(bad[0]) if bad.size else 0
            return (f"output {i} differs from the reference at {bad.size} of {g.size} elements (first: flat index "
                    f"{j}: {g.reshape(-1)[j]!r} vs {w.reshape(-1)[j]!r})")
    return ""


def run_selftest(entry: SelfTest) -> Verdict:
    """Build, run and check one kernel now (no cache). Needs Metal (or a substituted kernel builder in tests)."""
    t0 = time.perf_counter()
    try:
        inputs = entry.make_inputs()
        want = _host(entry.run_reference(inputs))
    except Exception as e:  # the reference itself must work; a bug here is ours, not the GPU's
        raise RuntimeError(f"self-test inputs or reference of kernel {entry.name} failed: {e}") from e
    try:
        got = _host(entry.run_kernel(inputs))
    except Exception as e:
        return Verdict(entry.name, "failed", entry.builtin, f"build or launch failed: {type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400],
                       seconds=time.perf_counter() - t0)
    diff = _agree(entry, got, want)
    if diff:
        return Verdict(entry.name, "failed", entry.builtin, f"wrong result on the self-test inputs: {diff}",
                       seconds=time.perf_counter() - t0)
    return Verdict(entry.name, "ok", "metal kernel", seconds=time.perf_counter() - t0)


def _announce(v: Verdict) -> None:
    if v.status == "failed":
        warnings.warn(f"glimmer kernel {v.name} disabled: {v.reason}; using the {v.path} for the rest of this "
                      f"process (run `glimmer doctor` for a report)", RuntimeWarning, stacklevel=4)


def verdict(name: str) -> Verdict:
    """This process's verdict for kernel `name`, testing it (or reading the on-disk cache) the first time."""
    if name in _VERDICTS:
        return _VERDICTS[name]
    entry = _entry(name)
    if mode() == "reference":
        v = Verdict(name, "disabled", entry.builtin, f"{ENV}=reference")
    elif not metal_available():
        v = Verdict(name, "unavailable", entry.builtin, "not available: no Metal")
    else:
        rec = _read_cache().get(cache_key(entry))
        if isinstance(rec, dict) and rec.get("status") in ("ok", "failed"):
            ok = rec["status"] == "ok"
            v = Verdict(name, rec["status"], "metal kernel" if ok else entry.builtin, str(rec.get("reason", "")),
                        cached=True)
        else:
            v = run_selftest(entry)
            _write_cache(entry, v)
    _VERDICTS[name] = v
    _announce(v)
    return v


def kernel_enabled(name: str) -> bool:
    """Whether dispatchers should run kernel `name` now: Metal in use and the kernel's self-test passed. With
    GLIMMER_KERNELS=metal a failed self-test raises KernelUnavailable."""
    if not use_metal():
        return False
    v = verdict(name)
    if not v.ok and mode() == "metal":
        raise KernelUnavailable(f"{ENV}=metal but kernel {name} failed its self-test: {v.reason}")
    return v.ok


def demote(name: str, error: BaseException) -> Verdict:
    """Record that kernel `name` failed at a real call: one warning, the built-in path for the rest of the process
    (and in the on-disk cache)."""
    entry = _entry(name)
    v = Verdict(name, "failed", entry.builtin, f"failed at a call: {type(error).__name__}: "
                f"{(str(error).strip().splitlines() or [''])[0]}"[:400])
    _VERDICTS[name] = v
    _write_cache(entry, v)
    _announce(v)
    return v


def run_or_fallback(name: str, kernel: Callable[[], Any], builtin: Callable[[], Any]):
    """`kernel()` when kernel `name` is enabled, else `builtin()`; a kernel that raises is demoted (see `demote`)
    and `builtin()` answers instead (GLIMMER_KERNELS=metal re-raises)."""
    if not kernel_enabled(name):
        return builtin()
    try:
        return kernel()
    except Exception as e:
        if mode() == "metal":
            raise
        demote(name, e)
        return builtin()


def kernel_stats() -> dict:
    """The verdicts reached in this process, for a run's statistics: {name: {status, path, reason, cached}}."""
    return {n: {k: val for k, val in asdict(v).items() if k in ("status", "path", "reason", "cached")}
            for n, v in _VERDICTS.items()}


# -- timing ---------------------------------------------------------------------------------------------------------
def time_calls(fn: Callable[[], Any], *, calls: int = 50, windows: int = 5, warmup: int = 1) -> float:
    """Median µs per call of `fn` (which returns lazy MLX arrays): each timing window issues `calls` calls without
    a host synchronisation in between and evaluates all their outputs once at the end, so launch overhead is
    amortised as in a decode loop rather than dominated by one sync per call."""
    if calls < 1 or windows < 1:
        raise ValueError("calls and windows must be >= 1")
    for _ in range(warmup):
        mx.eval(fn())
    per_call = []
    for _ in range(windows):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        mx.eval(outs)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call) * 1e6
