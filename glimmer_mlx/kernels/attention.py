"""Block-verify attention: L <= 16 query rows (anchor + drafts) against a long KV cache, GQA, causal inside the
block, optional sliding window. RoPE / NoPE does not matter here: it is applied to q and k before.

Positions: the L queries sit at absolute positions q0..q0+L-1 and the N keys at k0..k0+N-1; only `qk = q0 - k0`
matters. Query i sees key j iff `j <= qk + i` and, with a window W, `j > qk + i - W` (W keys including itself),
which is exactly the mask `KVCache.update` builds.

Two Metal passes (`block_attention_partial.metal`, `block_attention_combine.metal`): the G·L query rows of a GQA
group form one matrix problem against the group's K/V; a threadgroup per (KV head, key chunk[, row group]) loads each
K/V row of its chunk once for all its rows and computes QKᵀ and PV with 8x8 `simdgroup_matrix` tiles and an online
softmax; the combine merges the chunks with a running max. `block_attention_reference` is the pure-MLX float32
definition (the tests' oracle); shapes the kernel does not take go to MLX's `mx.fast.scaled_dot_product_attention`
(`builtin_attention`), never to the reference, which would cast the whole cache to float32.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ._core import FLOAT_DTYPES, KernelCall, KernelSpec, SelfTest, register_selftest, run_or_fallback, use_metal

# strided inputs: the keys / values are views into the KV cache's buffer (no copy of the cache per call)
PARTIAL = KernelSpec("glimmer_block_attn_partial", "block_attention_partial.metal",
                     ("q", "k", "v", "meta", "fmeta"), ("o_part", "ml"), ensure_row_contiguous=False)
COMBINE = KernelSpec("glimmer_block_attn_combine", "block_attention_combine.metal", ("o_part", "ml", "meta"),
                     ("out",))

MAX_ROWS = 16          # verify width L (a template parameter of the kernels: one variant per L)
MAX_HEAD_DIM = 256     # head dims: multiples of 32 up to this
MAX_SIMDGROUPS = 8     # simdgroups (8-row tiles) per threadgroup: 256 threads. Each lane keeps Q and O fragments
#                        for its tile (D/4 + D/4 floats, 64 at D = 128); at 1024 threads that register use could
#                        lower the pipeline's thread limit below the launch size, so groups with G·L > 64 rows are
#                        split into row groups that each read the chunk's K/V once (still not once per query head).
#                        Raise it after `glimmer bench kernels` on a Mac shows 512/1024-thread groups launch and win.
TARGET_THREADGROUPS = 128  # key chunks are sized so that about this many threadgroups run per call
LOG2E = 1.4426950408889634


def _check(q: mx.array, k: mx.array, v: mx.array, qk: int, window: int | None):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, H, L, D]; got {q.shape}, {k.shape}, {v.shape}")
    B, Hq, L, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, Hkv, N, {D}]")
    Hkv, N = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if not 0 <= qk or qk + L > N:
        raise ValueError(f"queries at key offsets {qk}..{qk + L - 1} must lie inside the {N} keys")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    return B, Hq, L, D, Hkv, N


def block_mask(L: int, N: int, qk: int, window: int | None) -> mx.array:
    """[L, N] bool: query i sees key j."""
    qpos = mx.arange(qk, qk + L)[:, None]
    kpos = mx.arange(N)[None, :]
    m = kpos <= qpos
    if window is not None:
        m = m & (kpos > qpos - window)
    return m


def block_attention_reference(q, k, v, *, scale: float, qk: int, window: int | None = None) -> mx.array:
    """q [B, Hq, L, D], k/v [B, Hkv, N, D] → [B, Hq, L, D] in q's dtype; float32 softmax."""
    B, Hq, L, D, Hkv, N = _check(q, k, v, qk, window)
    G = Hq // Hkv
    qf = (q.astype(mx.float32) * scale).reshape(B, Hkv, G * L, D)
    s = qf @ k.astype(mx.float32).transpose(0, 1, 3, 2)  # [B, Hkv, G*L, N]
    mask = mx.tile(block_mask(L, N, qk, window), (G, 1))
    s = mx.where(mask, s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    o = (p @ v.astype(mx.float32)).reshape(B, Hq, L, D)
    return o.astype(q.dtype)


def block_keys(D: int) -> int:
    """Keys per block of the partial pass: 16, or 8 for D > 128, so that the float32 K and V tiles (padded rows)
    fit in 32 KiB of threadgroup memory."""
    return 16 if D <= 128 else 8


def launch_shape(Hq: int, Hkv: int, L: int) -> tuple[int, int, int]:
    """(NSG simdgroups per threadgroup, RG row groups, RP padded rows) for G = Hq / Hkv heads of L rows."""
    rt = math.ceil(Hq // Hkv * L / 8)
    nsg = min(rt, MAX_SIMDGROUPS)
    return nsg, math.ceil(rt / nsg), rt * 8


def split_size(N: int, Hkv: int, row_groups: int = 1, bk: int = 16) -> int:
    """Keys per chunk: about TARGET_THREADGROUPS threadgroups per call, at least 64 keys each, a multiple of the
    key block."""
    target = max(1, math.ceil(TARGET_THREADGROUPS / (Hkv * row_groups)))
    ss = max(64, math.ceil(N / target))
    return math.ceil(ss / bk) * bk


def block_attention_calls(q, k, v, *, scale: float, qk: int, window: int | None = None, split: int | None = None):
    """The two launches (batch 1). Returns (partial_call, make_combine_call(o_part, ml))."""
    _, Hq, L, D, Hkv, N = _check(q, k, v, qk, window)
    if not supported(q, k, v):
        raise ValueError(f"block-attention kernel: unsupported q {q.dtype} {tuple(q.shape)}, k {k.dtype} "
                         f"{tuple(k.shape)} (needs batch 1, L <= {MAX_ROWS}, head dim a multiple of 32 <= "
                         f"{MAX_HEAD_DIM}, one float dtype)")
    G = Hq // Hkv
    nsg, rg, rp = launch_shape(Hq, Hkv, L)
    bk = block_keys(D)
    SS = split or split_size(N, Hkv, rg, bk)
    S = math.ceil(N / SS)
    meta = mx.array([N, qk, window or 0, SS, S], dtype=mx.int32)
    part = KernelCall(PARTIAL, [q[0], k[0], v[0], meta, mx.array([scale * LOG2E], dtype=mx.float32)],
                      output_shapes=[(Hkv, S, rp, D), (Hkv, S, rp, 2)], output_dtypes=[mx.float32, mx.float32],
                      grid=(32 * nsg, Hkv * rg, S), threadgroup=(32 * nsg, 1, 1),
                      template=[("T", q.dtype), ("D", D), ("L", L), ("G", G), ("BK", bk), ("NSG", nsg)])

    def combine(o_part, ml):
        return KernelCall(COMBINE, [o_part, ml, meta], output_shapes=[(Hq, L, D)], output_dtypes=[q.dtype],
                          grid=(32, Hq, L), threadgroup=(32, 1, 1),
                          template=[("T", q.dtype), ("D", D), ("L", L), ("G", G), ("RP", rp)])

    return part, combine


def supported(q, k, v) -> bool:
    return (q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and q.shape[0] == 1 and 1 <= q.shape[2] <= MAX_ROWS
            and q.shape[3] % 32 == 0 and q.shape[3] <= MAX_HEAD_DIM and q.dtype in FLOAT_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0)


def enabled() -> bool:
    """Whether the model should route block verification through `block_attention` (Metal only: on CPU the model
    keeps MLX's stock attention, numerically unchanged)."""
    return use_metal()


def builtin_attention(q, k, v, *, scale: float, qk: int, window: int | None = None) -> mx.array:
    """MLX's own fused attention with the block mask (in q's dtype, reading the cache as it is)."""
    _, _, L, _, _, N = _check(q, k, v, qk, window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=block_mask(L, N, qk, window))


def kernel_attention(q, k, v, *, scale: float, qk: int, window: int | None = None) -> mx.array:
    """The two Metal passes (lazy), [1, Hq, L, D] in q's dtype."""
    part, combine = block_attention_calls(q, k, v, scale=scale, qk=qk, window=window)
    o_part, ml = part.run_metal()
    return combine(o_part, ml).run_metal()[0][None]


def variant(q, k) -> tuple:
    """What one compiled variant of the kernels is specialised on (dtype, D, L, G)."""
    return (str(q.dtype), q.shape[3], q.shape[2], q.shape[1] // k.shape[1])


FIRST_USE_TOL = 0.05  # relative to max(1, max |out|): catches a broken variant (NaN, garbage), not rounding
checked_variants: set = set()


def _first_use_check(q, k, v, out, *, scale, qk, window) -> None:
    """The first call of a variant in this process is evaluated at once and compared with `builtin_attention` on
    the same inputs (the self-test compiles only its own variants); a failure raises, and `run_or_fallback` then
    demotes the kernel for the rest of the process."""
    key = variant(q, k)
    if key in checked_variants:
        return
    want = builtin_attention(q, k, v, scale=scale, qk=qk, window=window)
    mx.eval(out, want)
    got_np, want_np = (np.array(a.astype(mx.float32)) for a in (out, want))
    err = float(np.abs(got_np - want_np).max()) if got_np.size else 0.0
    if not np.isfinite(got_np).all() or err > FIRST_USE_TOL * max(1.0, float(np.abs(want_np).max())):
        raise RuntimeError(f"block-attention variant {key} differs from mx.fast.scaled_dot_product_attention at "
                           f"first use (max abs error {err:.3g})")
    checked_variants.add(key)


def block_attention(q, k, v, *, scale: float, qk: int, window: int | None = None) -> mx.array:
    """Dispatcher: the Metal kernels when enabled (self-tested; each variant checked at its first use) and the
    shapes are supported, else `builtin_attention` (MLX's fused SDPA)."""
    _check(q, k, v, qk, window)

    def builtin():
        return builtin_attention(q, k, v, scale=scale, qk=qk, window=window)

    if not supported(q, k, v):
        return builtin()

    def kernel():
        out = kernel_attention(q, k, v, scale=scale, qk=qk, window=window)
        _first_use_check(q, k, v, out, scale=scale, qk=qk, window=window)
        return out

    return run_or_fallback("block_attention", kernel, builtin)


# -- self-test (small deterministic inputs; see _core) ------------------------------------------------------------
def selftest_inputs():
    """Two variants: bf16 with G = 4, L = 4, D = 128, scores in the hundreds, a key count that is not a multiple
    of the chunk; fp16 with G = 2, L = 3, D = 64 and a window cutting into the block."""
    rng = np.random.default_rng(2024)
    cases = []
    for Hq, Hkv, L, N, D, window, dt, qscale in ((8, 2, 4, 203, 128, None, mx.bfloat16, 4.0),
                                                (4, 2, 3, 77, 64, 5, mx.float16, 1.0)):
        q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32) * qscale).astype(dt)
        k = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dt)
        v = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dt)
        cases.append((q, k, v, dict(scale=1.0 / math.sqrt(D), qk=N - L, window=window)))
    return cases


register_selftest(SelfTest(
    "block_attention",
    lambda cases: tuple(kernel_attention(q, k, v, **kw) for q, k, v, kw in cases),
    lambda cases: tuple(block_attention_reference(q, k, v, **kw) for q, k, v, kw in cases),
    selftest_inputs,
    run_builtin=lambda cases: tuple(builtin_attention(q, k, v, **kw) for q, k, v, kw in cases),
    builtin="mx.fast.scaled_dot_product_attention", sources=(PARTIAL.filename, COMBINE.filename),
    rtol=2e-2, atol=2e-2))
