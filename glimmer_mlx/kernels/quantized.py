"""Small-M affine-quantized matmul `x[M <= 16, K] @ dequant(Wq)^T` for the k+1 rows of a verification forward: a
`simdgroup_matrix` kernel (`metal_kernels/qmm_small.metal`) that reads each packed weight word once for all M rows,
and the dispatch table that decides, per GPU generation and M, whether it or MLX's own `mx.quantized_matmul` runs.

`qmm_reference` is the pure-MLX definition (dequantize in float32, matmul in float32, one rounding) — the tests'
oracle only; everything that does not take the kernel runs `mx.quantized_matmul`. `KernelQuantizedLinear` is an
`nn.QuantizedLinear` that routes 2..16-row inputs through `qmm` on Metal; `install_block_kernels` installs it.

Which wins where (`choose`). NOTHING HERE IS MEASURED ON A MAC: this machine has no Metal, so the default table is
reasoned from MLX 0.32's own dispatch (mlx/backend/metal/quantized.cpp, kernels/quantized.h) and is to be replaced
by measurements (`glimmer bench kernels` on a Mac, then an entry in `MEASURED`). For x[M, K] @ w[N, K]^T MLX runs:
  * M >= qmv_batch_limit(K, N, gpu) (6..33, by generation and matrix size; see `mlx_qmv_limit`): split-K `qmm_t`,
    steel MMA tiles of 32 rows of M — the weights are read once. MLX is expected at least as fast: its tiles are
    tuned and ours have no advantage in traffic -> MLX.
  * below that, on generation >= 15 (M3 and later): `qmv_wide`, which reuses each decoded weight group across up
    to 5 vectors — weights read ceil(M/5) times. M <= 5: once, MLX's tuned kernel -> MLX. M = 6..limit-1: 2-3
    reads (from cache when they fit), ours reads once -> the kernel (expected, unmeasured).
  * below that, on generations 13/14 (M1/M2): `qmv`, one vector per pass — weights read M times (the repeats are
    cache hits at best) -> the kernel for M >= 2 (expected, unmeasured).
  * M = 1: `qmv` / `qmv_fast` reads the weights once and is what MLX tunes hardest -> MLX always.
The kernel's costs that the argument ignores: per 32-value block each lane decodes 8 values and runs 4·ceil(M/8)
8x8 MMAs, and x is re-read per 8 output columns (like qmv_wide's per-8-row threadgroups) — which is why a
measurement may overrule it.
"""

from __future__ import annotations

import functools
import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ._core import FLOAT_DTYPES, KernelCall, KernelSpec, SelfTest, register_selftest, run_or_fallback, use_metal

QMM = KernelSpec("glimmer_qmm_small", "qmm_small.metal", ("x", "w", "scales", "biases", "meta"), ("y",))

MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
SIMDGROUPS = 4  # per threadgroup (NSG in the body), splitting K

# Measured overrides of the reasoned choice, from `glimmer bench kernels` on a Mac: {(generation, size letter, M):
# ("kernel" | "mlx", "where it was measured")}; generation as in MLX's get_architecture_gen (13 = M1, 14 = M2,
# 15 = M3, 16 = M4, 17 = M5), size letter the last character of the architecture name ('p', 'g', 's', 'd', ...).
# Empty: nothing has been measured on a Mac yet.
MEASURED: dict[tuple[int, str, int], tuple[str, str]] = {}


def _check(x, w, scales, biases, group_size: int, bits: int):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"unsupported bits {bits}")
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
    N = w.shape[0]
    if w.dtype != mx.uint32 or w.shape[1] * 32 != K * bits:
        raise ValueError(f"packed weight must be uint32 [N, K*bits/32] = [{N}, {K * bits // 32}], got "
                         f"{w.dtype} {tuple(w.shape)}")
    if tuple(scales.shape) != (N, K // group_size) or biases is None or tuple(biases.shape) != tuple(scales.shape):
        raise ValueError(f"scales and biases must be [{N}, {K // group_size}] (affine mode)")
    return M, K, N


def qmm_reference(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> mx.array:
    """x [M, K] @ dequantize(w)^T → [M, N] in x's dtype."""
    _check(x, w, scales, biases, group_size, bits)
    wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return (x.astype(mx.float32) @ wf.T).astype(x.dtype)


def qmm_call(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> KernelCall:
    M, K, N = _check(x, w, scales, biases, group_size, bits)
    if not supported(x, w, scales, biases, group_size, bits):
        raise ValueError(f"qmm kernel: unsupported shapes/dtypes x {x.dtype} {tuple(x.shape)}, bits {bits}, "
                         f"group {group_size}")
    return KernelCall(QMM, [x, w, scales.astype(x.dtype), biases.astype(x.dtype),
                            mx.array([M, N, K], dtype=mx.int32)],
                      output_shapes=[(M, N)], output_dtypes=[x.dtype], grid=(32 * SIMDGROUPS, math.ceil(N / 8), 1),
                      threadgroup=(32 * SIMDGROUPS, 1, 1),
                      template=[("T", x.dtype), ("M", M), ("BITS", bits), ("GS", group_size)])


def supported(x, w, scales, biases, group_size: int, bits: int) -> bool:
    return (x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in FLOAT_DTYPES and bits in BITS
            and group_size in GROUP_SIZES and biases is not None and w.dtype == mx.uint32 and w.ndim == 2
            and x.shape[1] % group_size == 0 and w.shape[1] * 32 == x.shape[1] * bits
            and scales.dtype in FLOAT_DTYPES and biases.dtype in FLOAT_DTYPES)


# -- which path wins --------------------------------------------------------------------------------------------
def parse_architecture(name: str) -> tuple[int, str] | None:
    """'applegpu_g15s' -> (15, 's') as MLX reads it (get_architecture_gen and the last letter); None if not an
    Apple GPU name."""
    m = re.fullmatch(r"applegpu_g(\d+)([a-z]?)", name.strip())
    return (int(m.group(1)), m.group(2)) if m else None


@functools.lru_cache(maxsize=1)
def gpu_architecture() -> tuple[int, str] | None:
    """This machine's Apple GPU (generation, size letter), or None (no Metal)."""
    try:
        return parse_architecture(str(mx.device_info().get("architecture", "")))
    except Exception:  # an MLX without device_info
        return None


def mlx_qmv_limit(K: int, N: int, gen: int, size: str) -> int:
    """MLX 0.32's get_qmv_batch_limit(K, N): from this many rows on, mx.quantized_matmul (transposed weights) runs
    its split-K MMA qmm instead of a matrix-vector kernel."""
    small, mid = K <= 2048 and N <= 2048, K <= 4096 and N <= 4096
    if gen >= 17 and size != "d":
        return 33 if small else 25 if mid else 13
    if gen >= 15 and size != "d":
        return 13 if small else 15 if mid else 13
    if size == "d":
        return 32 if small else 18 if mid else 12
    if gen >= 13:
        return 14 if small else 10 if mid else 6
    return 18 if small else 12 if mid else 10


def mlx_path(M: int, K: int, N: int, gen: int, size: str) -> tuple[str, int]:
    """(MLX's kernel for x[M, K] @ w[N, K]^T, affine, how many times it reads the weights) — see the module doc."""
    if M >= mlx_qmv_limit(K, N, gen, size):
        return "qmm_splitk", 1
    if K in (64, 128):
        return "qmv_quad", 1  # a tiny K: the whole weight is a few KB and stays cached
    if M == 1:
        return "qmv", 1
    if gen >= 15:
        return "qmv_wide", math.ceil(M / 5)
    return "qmv", M


def choose(M: int, K: int, N: int, arch: tuple[int, str] | None = None) -> tuple[str, str]:
    """("kernel" | "mlx", why) for M rows on GPU `arch` (default: this machine's): a `MEASURED` entry if there is
    one, else the reasoned rule: the kernel where MLX's path reads the weights more than once."""
    arch = arch if arch is not None else gpu_architecture()
    if arch is None or not 1 <= M <= MAX_ROWS:
        return "mlx", "no Apple GPU / M outside 1..16"
    gen, size = arch
    if (gen, size, M) in MEASURED:
        choice, where = MEASURED[(gen, size, M)]
        return choice, f"measured: {where}"
    name, reads = mlx_path(M, K, N, gen, size)
    if reads >= 2:
        return "kernel", f"expected (unmeasured): MLX's {name} reads the weights {reads}x, the kernel once"
    return "mlx", f"expected (unmeasured): MLX's {name} reads the weights once"


def builtin_qmm(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> mx.array:
    """MLX's own quantized matmul (what runs wherever the kernel does not)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


FIRST_USE_TOL = 0.05  # relative to max(1, max |y|): catches a broken variant (NaN, garbage), not rounding
checked_variants: set = set()


def _first_use_check(x, w, scales, biases, y, *, group_size: int, bits: int) -> None:
    """The first call of a variant (dtype, M, bits, group) in this process is evaluated at once and compared with
    `mx.quantized_matmul` on the same inputs; a failure raises, and `run_or_fallback` demotes the kernel."""
    key = (str(x.dtype), x.shape[0], bits, group_size)
    if key in checked_variants:
        return
    want = builtin_qmm(x, w, scales, biases, group_size=group_size, bits=bits)
    mx.eval(y, want)
    got_np, want_np = (np.array(a.astype(mx.float32)) for a in (y, want))
    err = float(np.abs(got_np - want_np).max()) if got_np.size else 0.0
    if not np.isfinite(got_np).all() or err > FIRST_USE_TOL * max(1.0, float(np.abs(want_np).max())):
        raise RuntimeError(f"qmm variant {key} differs from mx.quantized_matmul at first use (max abs error "
                           f"{err:.3g})")
    checked_variants.add(key)


def kernel_wanted(x, w, scales, biases, group_size: int, bits: int) -> bool:
    """Whether `qmm` would try the kernel for these arguments (Metal in use, supported, chosen for this GPU and M);
    the self-test verdict is consulted after this, by `run_or_fallback`."""
    return (use_metal() and supported(x, w, scales, biases, group_size, bits)
            and choose(x.shape[0], x.shape[1], w.shape[0])[0] == "kernel")


def qmm(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> mx.array:
    """Dispatcher: the Metal kernel when enabled (self-tested; each variant checked at its first use), supported
    and chosen for this GPU and M, else `mx.quantized_matmul` (never the float32 reference)."""
    _check(x, w, scales, biases, group_size, bits)

    def builtin():
        return builtin_qmm(x, w, scales, biases, group_size=group_size, bits=bits)

    if not kernel_wanted(x, w, scales, biases, group_size, bits):
        return builtin()

    def kernel():
        y = qmm_call(x, w, scales, biases, group_size=group_size, bits=bits).run_metal()[0]
        _first_use_check(x, w, scales, biases, y, group_size=group_size, bits=bits)
        return y

    return run_or_fallback("qmm", kernel, builtin)


class KernelQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose 2..16-row calls (block verification) go through `qmm` on Metal (the kernel where
    `choose` picks it); every other call (decode, prefill, unsupported modes) is the stock `mx.quantized_matmul`."""

    def __call__(self, x):
        rows = x.size // x.shape[-1] if x.ndim else 0
        if (2 <= rows <= MAX_ROWS and getattr(self, "mode", "affine") == "affine"
                and kernel_wanted(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self.get("biases"),
                                  self.group_size, self.bits)):
            y = qmm(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self["biases"],
                    group_size=self.group_size, bits=self.bits)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            if "bias" in self:
                y = y + self["bias"]
            return y
        return super().__call__(x)

def install_block_kernels(model) -> int:
    """Route the block-verification matmuls of `model`'s affine 4/8-bit `QuantizedLinear` layers through the
    small-row kernel. Only when Metal kernels are in use; returns the number of layers switched (0 on CPU)."""
    if not use_metal():
        return 0
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear and getattr(m, "mode", "affine") == "affine" and m.bits in BITS \
                and m.group_size in GROUP_SIZES:
            m.__class__ = KernelQuantizedLinear
            n += 1
    return n


# -- self-test (small deterministic inputs; see _core) ------------------------------------------------------------
def selftest_inputs():
    """Two variants: bf16, M = 6, 4-bit, group 64 (one 8-row tile, N not a multiple of 8); fp16, M = 16, 8-bit,
    group 32 (two tiles)."""
    rng = np.random.default_rng(77)
    cases = []
    for M, K, N, bits, gs, dt in ((6, 512, 44, 4, 64, mx.bfloat16), (16, 256, 24, 8, 32, mx.float16)):
        wf = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(dt)
        w, s, b = mx.quantize(wf, group_size=gs, bits=bits)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dt)
        cases.append((x, w, s, b, dict(group_size=gs, bits=bits)))
    return cases


register_selftest(SelfTest(
    "qmm",
    lambda cases: tuple(qmm_call(x, w, s, b, **kw).run_metal()[0] for x, w, s, b, kw in cases),
    lambda cases: tuple(qmm_reference(x, w, s, b, **kw) for x, w, s, b, kw in cases),
    selftest_inputs,
    run_builtin=lambda cases: tuple(builtin_qmm(x, w, s, b, **kw) for x, w, s, b, kw in cases),
    builtin="mx.quantized_matmul", sources=(QMM.filename,), rtol=3e-2, atol=3e-2))
