"""Block-verify attention: L <= 16 query rows (anchor + drafts) against a long KV cache, GQA, causal inside the
block, optional sliding window; or L <= 32 flattened nodes of a token tree (`tree=(depths, ancestors)`).
RoPE / NoPE does not matter here: it is applied to q and k before.

Positions: the L queries sit at absolute positions q0..q0+L-1 and the N keys at k0..k0+N-1; only `qk = q0 - k0`
matters. Query i sees key j iff `j <= qk + i` and, with a window W, `j > qk + i - W` (W keys including itself),
which is exactly the mask `KVCache.update` builds.

Token trees (speculative/tree.py): the L block rows are the tree's nodes in topological order, node i at position
q0 + depths[i]; the mask is `cache.tree_mask` (the one definition, used here as the fallback's and the reference's
mask): a context key j < qk is visible iff `j > qk + depths[i] - W` on a sliding layer (always on a full one), a
block key qk + b iff `ancestors[i, b]` (and `depths[i] - depths[b] < W`). The kernel gets the block part as one
uint32 bitmask per row plus the row's depth (appended to `meta`, `tree_meta`): one register per lane and a shift
per key in the inner loop, no [L, L] matrix read there; the chain variant is compiled with TREE = false and runs the
same code as before.

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

from ..cache import tree_mask
from ._core import FLOAT_DTYPES, KernelCall, KernelSpec, SelfTest, register_selftest, run_or_fallback, use_metal

# strided inputs: the keys / values are views into the KV cache's buffer (no copy of the cache per call)
PARTIAL = KernelSpec("glimmer_block_attn_partial", "block_attention_partial.metal",
                     ("q", "k", "v", "meta", "fmeta"), ("o_part", "ml"), ensure_row_contiguous=False)
COMBINE = KernelSpec("glimmer_block_attn_combine", "block_attention_combine.metal", ("o_part", "ml", "meta"),
                     ("out",))

MAX_ROWS = 16          # verify width L (a template parameter of the kernels: one variant per L)
TREE_MAX_ROWS = 32     # nodes of a token tree: one uint32 of ancestor bits per row
MAX_HEAD_DIM = 256     # head dims: multiples of 32 up to this
MAX_SIMDGROUPS = 8     # simdgroups (8-row tiles) per threadgroup: 256 threads. Each lane keeps Q and O fragments
#                        for its tile (D/4 + D/4 floats, 64 at D = 128); at 1024 threads that register use could
#                        lower the pipeline's thread limit below the launch size, so groups with G·L > 64 rows are
#                        split into row groups that each read the chunk's K/V once (still not once per query head).
#                        Raise it after `glimmer bench kernels` on a Mac shows 512/1024-thread groups launch and win.
TARGET_THREADGROUPS = 128  # key chunks are sized so that about this many threadgroups run per call
LOG2E = 1.4426950408889634


def _check(q: mx.array, k: mx.array, v: mx.array, qk: int, window: int | None, tree=None):
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
    if tree is not None:
        if not isinstance(tree, (tuple, list)) or len(tree) != 2:
            raise ValueError("tree must be (depths [L], ancestors [L, L])")
        depths, ancestors = tree
        if tuple(depths.shape) != (L,) or tuple(ancestors.shape) != (L, L):
            raise ValueError(f"tree: depths must be [{L}] and ancestors [{L}, {L}] for {L} query rows, got "
                             f"{tuple(depths.shape)} and {tuple(ancestors.shape)}")
    return B, Hq, L, D, Hkv, N


def block_mask(L: int, N: int, qk: int, window: int | None) -> mx.array:
    """[L, N] bool: query i sees key j."""
    qpos = mx.arange(qk, qk + L)[:, None]
    kpos = mx.arange(N)[None, :]
    m = kpos <= qpos
    if window is not None:
        m = m & (kpos > qpos - window)
    return m


def attention_mask(L: int, N: int, qk: int, window: int | None, tree=None) -> mx.array:
    """[L, N] bool: the chain's `block_mask`, or for a token tree `cache.tree_mask` with the context's keys at
    0..qk-1 and the nodes' rows at qk.. (only qk = q0 - k0 matters, as for the chain)."""
    if tree is None:
        return block_mask(L, N, qk, window)
    return tree_mask(tree[0], tree[1], qk, 0, window)


def tree_meta(tree, window: int | None) -> mx.array:
    """[2L] int32 (lazy): bits[L] — bit b of bits[i] set iff node i sees node b, i.e. the block columns of
    `cache.tree_mask` (ancestors, and the window rule between nodes), as uint32 reinterpreted as int32 — then
    depths[L]; appended to the kernel's `meta`."""
    depths, ancestors = tree
    L = depths.shape[0]
    own = tree_mask(depths, ancestors, 0, 0, window)  # [L, L]: no context columns
    bits = mx.sum(mx.left_shift(own.astype(mx.uint32), mx.arange(L, dtype=mx.uint32)[None, :]), axis=1)
    return mx.concatenate([bits.astype(mx.uint32).view(mx.int32), depths.astype(mx.int32)])


_recent_tree_meta: list = []  # [(tree, window, meta)]: the last trees seen, newest first


def shared_tree_meta(tree, window: int | None) -> mx.array:
    """`tree_meta`, built once per (tree object, window): every layer of one verify forward passes the same `tree`
    tuple, so the few small ops that make the bits run once per layer type instead of once per layer. Keyed by
    identity (the entries hold the tuple, so an id is never reused while cached); a tree's arrays are not to be
    modified in place between calls (`TokenTree.attention_inputs` makes new ones per round)."""
    for t, w, m in _recent_tree_meta:
        if t is tree and w == window:
            return m
    m = tree_meta(tree, window)
    _recent_tree_meta.insert(0, (tree, window, m))
    del _recent_tree_meta[4:]
    return m


def block_attention_reference(q, k, v, *, scale: float, qk: int, window: int | None = None, tree=None) -> mx.array:
    """q [B, Hq, L, D], k/v [B, Hkv, N, D] → [B, Hq, L, D] in q's dtype; float32 softmax. tree: None (a chain) or
    (depths [L], ancestors [L, L]) of a token tree's flattened nodes (the mask is `attention_mask`)."""
    B, Hq, L, D, Hkv, N = _check(q, k, v, qk, window, tree)
    G = Hq // Hkv
    qf = (q.astype(mx.float32) * scale).reshape(B, Hkv, G * L, D)
    s = qf @ k.astype(mx.float32).transpose(0, 1, 3, 2)  # [B, Hkv, G*L, N]
    mask = mx.tile(attention_mask(L, N, qk, window, tree), (G, 1))
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


def block_attention_calls(q, k, v, *, scale: float, qk: int, window: int | None = None, split: int | None = None,
                          tree=None):
    """The two launches (batch 1). Returns (partial_call, make_combine_call(o_part, ml)). tree: see
    `block_attention_reference` (the TREE variant, `tree_meta` appended to meta)."""
    _, Hq, L, D, Hkv, N = _check(q, k, v, qk, window, tree)
    if not supported(q, k, v, tree):
        raise ValueError(f"block-attention kernel: unsupported q {q.dtype} {tuple(q.shape)}, k {k.dtype} "
                         f"{tuple(k.shape)} (needs batch 1, L <= {MAX_ROWS} ({TREE_MAX_ROWS} for a tree), head "
                         f"dim a multiple of 32 <= {MAX_HEAD_DIM}, one float dtype)")
    G = Hq // Hkv
    nsg, rg, rp = launch_shape(Hq, Hkv, L)
    bk = block_keys(D)
    SS = split or split_size(N, Hkv, rg, bk)
    S = math.ceil(N / SS)
    meta = mx.array([N, qk, window or 0, SS, S], dtype=mx.int32)
    if tree is not None:
        meta = mx.concatenate([meta, shared_tree_meta(tree, window)])
    part = KernelCall(PARTIAL, [q[0], k[0], v[0], meta, mx.array([scale * LOG2E], dtype=mx.float32)],
                      output_shapes=[(Hkv, S, rp, D), (Hkv, S, rp, 2)], output_dtypes=[mx.float32, mx.float32],
                      grid=(32 * nsg, Hkv * rg, S), threadgroup=(32 * nsg, 1, 1),
                      template=[("T", q.dtype), ("D", D), ("L", L), ("G", G), ("BK", bk), ("NSG", nsg),
                                ("TREE", tree is not None)])

    def combine(o_part, ml):
        return KernelCall(COMBINE, [o_part, ml, meta], output_shapes=[(Hq, L, D)], output_dtypes=[q.dtype],
                          grid=(32, Hq, L), threadgroup=(32, 1, 1),
                          template=[("T", q.dtype), ("D", D), ("L", L), ("G", G), ("RP", rp)])

    return part, combine


def supported(q, k, v, tree=None) -> bool:
    """Shapes the kernels take: batch 1, L <= MAX_ROWS rows (TREE_MAX_ROWS nodes for a tree), head dim a multiple
    of 32 up to MAX_HEAD_DIM, q, k, v of one float dtype."""
    rows = MAX_ROWS if tree is None else TREE_MAX_ROWS
    return (q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and q.shape[0] == 1 and 1 <= q.shape[2] <= rows
            and q.shape[3] % 32 == 0 and q.shape[3] <= MAX_HEAD_DIM and q.dtype in FLOAT_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0)


def enabled() -> bool:
    """Whether the model should route block verification through `block_attention` (Metal only: on CPU the model
    keeps MLX's stock attention, numerically unchanged)."""
    return use_metal()


def builtin_attention(q, k, v, *, scale: float, qk: int, window: int | None = None, tree=None) -> mx.array:
    """MLX's own fused attention with the block (or tree) mask (in q's dtype, reading the cache as it is)."""
    _, _, L, _, _, N = _check(q, k, v, qk, window, tree)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=attention_mask(L, N, qk, window, tree))


def kernel_attention(q, k, v, *, scale: float, qk: int, window: int | None = None, tree=None) -> mx.array:
    """The two Metal passes (lazy), [1, Hq, L, D] in q's dtype."""
    part, combine = block_attention_calls(q, k, v, scale=scale, qk=qk, window=window, tree=tree)
    o_part, ml = part.run_metal()
    return combine(o_part, ml).run_metal()[0][None]


def variant(q, k, tree: bool = False) -> tuple:
    """What one compiled variant of the kernels is specialised on (dtype, D, L, G[, "tree"])."""
    return (str(q.dtype), q.shape[3], q.shape[2], q.shape[1] // k.shape[1]) + (("tree",) if tree else ())


FIRST_USE_TOL = 0.05  # relative to max(1, max |out|): catches a broken variant (NaN, garbage), not rounding
checked_variants: set = set()


def _first_use_check(q, k, v, out, *, scale, qk, window, tree=None) -> None:
    """The first call of a variant in this process is evaluated at once and compared with `builtin_attention` on
    the same inputs (the self-test compiles only its own variants); a failure raises, and `run_or_fallback` then
    demotes the kernel (the chain's or the tree's) for the rest of the process."""
    key = variant(q, k, tree is not None)
    if key in checked_variants:
        return
    want = builtin_attention(q, k, v, scale=scale, qk=qk, window=window, tree=tree)
    mx.eval(out, want)
    got_np, want_np = (np.array(a.astype(mx.float32)) for a in (out, want))
    err = float(np.abs(got_np - want_np).max()) if got_np.size else 0.0
    if not np.isfinite(got_np).all() or err > FIRST_USE_TOL * max(1.0, float(np.abs(want_np).max())):
        raise RuntimeError(f"block-attention variant {key} differs from mx.fast.scaled_dot_product_attention at "
                           f"first use (max abs error {err:.3g})")
    checked_variants.add(key)


def block_attention(q, k, v, *, scale: float, qk: int, window: int | None = None, tree=None) -> mx.array:
    """Dispatcher: the Metal kernels when enabled (self-tested; each variant checked at its first use) and the
    shapes are supported, else `builtin_attention` (MLX's fused SDPA with the same mask). tree: None (a chain) or
    (depths [L], ancestors [L, L]) of a token tree's flattened nodes: the TREE variant, self-tested and demoted
    separately ("block_attention_tree"), so a failing tree kernel leaves the chain kernel in use."""
    _check(q, k, v, qk, window, tree)

    def builtin():
        return builtin_attention(q, k, v, scale=scale, qk=qk, window=window, tree=tree)

    if not supported(q, k, v, tree):
        return builtin()

    def kernel():
        out = kernel_attention(q, k, v, scale=scale, qk=qk, window=window, tree=tree)
        _first_use_check(q, k, v, out, scale=scale, qk=qk, window=window, tree=tree)
        return out

    return run_or_fallback("block_attention" if tree is None else "block_attention_tree", kernel, builtin)


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


def register_attention_selftest(name: str, inputs) -> None:
    """The kernel vs the reference (and the built-in's timing) on `inputs()`'s cases, as self-test `name`."""
    register_selftest(SelfTest(
        name,
        lambda cases: tuple(kernel_attention(q, k, v, **kw) for q, k, v, kw in cases),
        lambda cases: tuple(block_attention_reference(q, k, v, **kw) for q, k, v, kw in cases),
        inputs,
        run_builtin=lambda cases: tuple(builtin_attention(q, k, v, **kw) for q, k, v, kw in cases),
        builtin="mx.fast.scaled_dot_product_attention", sources=(PARTIAL.filename, COMBINE.filename),
        rtol=2e-2, atol=2e-2))


register_attention_selftest("block_attention", selftest_inputs)


def random_tree(rng, L: int, kind: str = "random") -> tuple[list[int], list[int]]:
    """(parents, depths) of an L-node tree in topological order (node 0 the root): "chain", "star" (every node a
    child of the root), "random" (each parent uniform over the earlier nodes) or "wide" (a few long branches
    forking from the root and from each other's nodes). For the self-test, the tests and `glimmer bench kernels`."""
    if kind not in ("chain", "star", "random", "wide"):
        raise ValueError(f"tree kind must be chain, star, random or wide, got {kind!r}")
    parents = [-1]
    for i in range(1, L):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        elif kind == "random":
            parents.append(int(rng.integers(0, i)))
        else:  # mostly extend the previous node, sometimes fork from an earlier one
            parents.append(i - 1 if rng.random() < 0.7 else int(rng.integers(0, i)))
    depths = [0] * L
    for i in range(1, L):
        depths[i] = depths[parents[i]] + 1
    return parents, depths


def tree_inputs(parents: list[int], depths: list[int]) -> tuple[mx.array, mx.array]:
    """(depths [L] int32, ancestors [L, L] bool) of a tree given by its parents (the `tree=` argument)."""
    L = len(parents)
    a = np.zeros((L, L), dtype=bool)
    for i in range(L):
        if parents[i] >= 0:
            a[i] = a[parents[i]]
        a[i, i] = True
    return mx.array(depths, dtype=mx.int32), mx.array(a)


def tree_selftest_inputs():
    """Two tree variants: bf16, G = 4, 12 nodes of a random tree, D = 128, full attention; fp16, G = 2, 9 nodes of a
    wide tree, D = 64, a window of 6 that cuts into the context differently per depth."""
    rng = np.random.default_rng(2025)
    cases = []
    for Hq, Hkv, L, N, D, window, dt, kind in ((8, 2, 12, 203, 128, None, mx.bfloat16, "random"),
                                              (4, 2, 9, 77, 64, 6, mx.float16, "wide")):
        q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32) * 2).astype(dt)
        k = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dt)
        v = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dt)
        tree = tree_inputs(*random_tree(rng, L, kind))
        cases.append((q, k, v, dict(scale=1.0 / math.sqrt(D), qk=N - L, window=window, tree=tree)))
    return cases


register_attention_selftest("block_attention_tree", tree_selftest_inputs)
