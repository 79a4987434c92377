"""Block-verify attention: the two .metal passes (through the MSL-on-CPU harness, and through MLX on a Mac) against
the pure-MLX reference and MLX's stock SDPA with the cache's own mask."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.cache import KVCache
from glimmer_mlx.kernels import attention
from glimmer_mlx.kernels._core import metal_available
from msl_harness import harness

needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")
needs_metal = pytest.mark.skipif(not metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")


def qkv(seed, Hq, Hkv, L, N, D, dtype):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dtype)
    return q, k, v


def numpy_oracle(q, k, v, scale, qk, window):
    q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64)[0] for a in (q, k, v))
    Hq, L, D = q.shape
    Hkv, N, _ = k.shape
    out = np.zeros_like(q)
    for h in range(Hq):
        kh, vh = k[h // (Hq // Hkv)], v[h // (Hq // Hkv)]
        for i in range(L):
            j = np.arange(N)
            ok = (j <= qk + i) & ((window is None) | (j > qk + i - (window or 0)))
            s = (q[h, i] * scale) @ kh.T
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max())
            out[h, i] = (p / p.sum()) @ vh
    return out[None]


def run_kernel(q, k, v, scale, qk, window, split=None):
    part, combine = attention.block_attention_calls(q, k, v, scale=scale, qk=qk, window=window, split=split)
    o_part, ml = harness.run(part)
    return harness.run(combine(o_part, ml))[0][None]


TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}

# (Hq, Hkv, L, N, D, qk, window, split, dtype): k+1 = 1, 2, 5, 16; GQA 1..4; windows cutting inside the block,
# at the block edge, and wider than the cache; chunks that some rows see nothing of; fp32 / fp16 / bf16
CASES = [
    (4, 2, 16, 300, 64, 284, None, 64, mx.float32),
    (4, 1, 5, 137, 64, 132, 40, 64, mx.float32),
    (4, 2, 1, 90, 64, 89, None, 64, mx.float32),
    (2, 2, 16, 40, 64, 24, 8, 64, mx.float32),     # window 8 < block 16: early keys of the block drop out
    (4, 2, 2, 64, 64, 10, 30, 64, mx.float32),     # queries in the middle of the keys (later keys masked)
    (4, 2, 8, 260, 128, 252, 2048, 64, mx.bfloat16),
    (4, 4, 16, 100, 64, 84, 16, 32, mx.float16),   # window == block size
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Hq{c[0]}-Hkv{c[1]}-L{c[2]}-N{c[3]}-D{c[4]}-w{c[6]}-{c[8]}")
def test_reference_matches_numpy_and_stock_sdpa(case):
    Hq, Hkv, L, N, D, qk, window, split, dtype = case
    q, k, v = qkv(0, Hq, Hkv, L, N, D, dtype)
    scale = D**-0.5
    ref = attention.block_attention_reference(q, k, v, scale=scale, qk=qk, window=window)
    np.testing.assert_allclose(np.array(ref.astype(mx.float32)), numpy_oracle(q, k, v, scale, qk, window),
                               atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                 mask=attention.block_mask(L, N, qk, window))
    np.testing.assert_allclose(np.array(ref.astype(mx.float32)), np.array(stock.astype(mx.float32)),
                               atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Hq{c[0]}-Hkv{c[1]}-L{c[2]}-N{c[3]}-D{c[4]}-w{c[6]}-{c[8]}")
def test_kernel_matches_reference(case):
    Hq, Hkv, L, N, D, qk, window, split, dtype = case
    q, k, v = qkv(1, Hq, Hkv, L, N, D, dtype)
    scale = D**-0.5
    got = run_kernel(q, k, v, scale, qk, window, split)
    ref = attention.block_attention_reference(q, k, v, scale=scale, qk=qk, window=window)
    assert got.dtype == dtype and got.shape == ref.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_model_convention_matches_the_cache_mask_after_the_window_wrapped():
    """The model calls the kernel with qk = N - L on the keys `KVCache.update` returns; that must equal attention
    with the cache's own mask, also for a sliding cache that has dropped rows."""
    rng = np.random.default_rng(4)
    Hq, Hkv, D, W = 4, 2, 32, 24
    for window in (None, W):
        cache = KVCache(window=window, max_rewind=16)
        for L in (50, 1, 1, 7, 16, 3):
            k = mx.array(rng.standard_normal((1, Hkv, L, D)).astype(np.float32))
            v = mx.array(rng.standard_normal((1, Hkv, L, D)).astype(np.float32))
            q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32))
            keys, values, mask = cache.update(k, v)
            if L == 1:
                continue
            stock = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)
            ref = attention.block_attention_reference(q, keys, values, scale=D**-0.5, qk=keys.shape[2] - L,
                                                      window=window)
            np.testing.assert_allclose(np.array(ref), np.array(stock), atol=2e-5, rtol=2e-5)


def test_bad_positions_are_rejected_and_unsupported_shapes_fall_back():
    q, k, v = qkv(2, 4, 2, 4, 10, 64, mx.float32)
    with pytest.raises(ValueError, match="inside the 10 keys"):
        attention.block_attention_reference(q, k, v, scale=0.1, qk=8, window=None)
    q3, k3, v3 = qkv(2, 3, 2, 4, 10, 64, mx.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention.block_attention_reference(q3, k3, v3, scale=0.1, qk=6)
    assert not attention.supported(*qkv(3, 4, 2, 17, 40, 64, mx.float32))  # > 16 rows
    assert not attention.supported(*qkv(3, 4, 2, 4, 40, 48, mx.float32))   # head dim not a multiple of 32
    # the dispatcher on this machine (no Metal) is the reference
    out = attention.block_attention(q, k, v, scale=0.1, qk=6, window=5)
    np.testing.assert_array_equal(np.array(out),
                                  np.array(attention.block_attention_reference(q, k, v, scale=0.1, qk=6, window=5)))


@needs_metal
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Hq{c[0]}-Hkv{c[1]}-L{c[2]}-N{c[3]}-D{c[4]}-w{c[6]}-{c[8]}")
def test_metal_kernel_matches_reference(case):
    Hq, Hkv, L, N, D, qk, window, split, dtype = case
    q, k, v = qkv(1, Hq, Hkv, L, N, D, dtype)
    part, combine = attention.block_attention_calls(q, k, v, scale=D**-0.5, qk=qk, window=window, split=split)
    o_part, ml = part.run_metal()
    got = combine(o_part, ml).run_metal()[0][None]
    ref = attention.block_attention_reference(q, k, v, scale=D**-0.5, qk=qk, window=window)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


@needs_metal
def test_metal_kernel_reads_cache_views_in_place():
    """k / v as views into a larger cache buffer (what KVCache.update returns) give the same result."""
    Hq, Hkv, L, N, D = 4, 2, 8, 200, 64
    q, kb, vb = qkv(5, Hq, Hkv, L, N + 9, D, mx.float32)
    k, v = kb[:, :, 4:4 + N, :], vb[:, :, 4:4 + N, :]
    qt = q.transpose(0, 2, 1, 3).transpose(0, 2, 1, 3)  # a transposed (non-contiguous) query as in the model
    part, combine = attention.block_attention_calls(qt, k, v, scale=D**-0.5, qk=N - L, window=64)
    o_part, ml = part.run_metal()
    got = combine(o_part, ml).run_metal()[0][None]
    ref = attention.block_attention_reference(q, k, v, scale=D**-0.5, qk=N - L, window=64)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=2e-5, rtol=2e-5)
