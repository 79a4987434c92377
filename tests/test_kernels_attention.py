"""Block-verify attention: the two .metal passes (through the MSL-on-CPU harness, and through MLX on a Mac) against
the pure-MLX reference and MLX's stock SDPA with the cache's own mask."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.cache import KVCache
from glimmer_mlx.kernels import _core, attention
from glimmer_mlx.kernels._core import metal_available
from msl_harness import harness

needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")
needs_metal = pytest.mark.skipif(not metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")


@pytest.fixture
def simulated_metal(monkeypatch, tmp_path):
    """Metal 'available', every launch through the MSL-on-CPU harness, a private self-test cache, fresh verdicts;
    yields the list of launched kernel names."""
    launched = []

    def through_harness(call):
        launched.append(call.spec.name)
        return harness.run(call)

    monkeypatch.delenv(_core.ENV, raising=False)
    monkeypatch.setattr(_core, "metal_available", lambda: True)
    monkeypatch.setattr(_core.KernelCall, "run_metal", through_harness)
    monkeypatch.setattr(_core, "selftest_cache_path", lambda: tmp_path / "kernel-selftest.json")
    monkeypatch.setattr(attention, "checked_variants", set())
    _core.reset_selftests()
    yield launched
    _core.reset_selftests()


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


def case_id(c):
    return f"Hq{c[0]}-Hkv{c[1]}-L{c[2]}-N{c[3]}-D{c[4]}-w{c[6]}-s{c[7]}-{str(c[8]).split('.')[-1]}"


# (Hq, Hkv, L, N, D, qk, window, split, dtype): GQA groups G = 1, 2, 4, 16; k+1 = 1, 2, 3, 5, 8, 16; head dims 64,
# 128, 256 (8-key blocks); windows cutting inside the block, at the block edge and wider than the cache; chunks some
# rows see nothing of; key lengths that are not multiples of the chunk or of the 16-key block; G·L = 256 rows (4
# row groups of 8 tiles); idle simdgroups that race ahead to the next block's loads (the barrier that stops them is
# tested only there); fp32 / fp16 / bf16
CASES = [
    (4, 2, 16, 300, 64, 284, None, 64, mx.float32),
    (4, 1, 5, 137, 64, 132, 40, 64, mx.float32),
    (4, 4, 1, 90, 64, 89, None, 64, mx.float32),
    (2, 2, 16, 40, 64, 24, 8, 64, mx.float32),     # window 8 < block 16: early keys of the block drop out
    (4, 2, 2, 64, 64, 10, 30, 64, mx.float32),     # queries in the middle of the keys (later keys masked)
    (4, 2, 8, 260, 128, 252, 2048, 64, mx.bfloat16),
    (16, 1, 16, 75, 64, 59, None, 32, mx.float16),  # G = 16, 256 rows: 4 row groups
    (16, 1, 3, 70, 128, 67, None, 48, mx.float32),  # G = 16, 48 rows: one threadgroup for the whole group
    (16, 1, 5, 70, 64, 65, None, 64, mx.float32),   # 80 rows: the 2nd row group has 2 busy and 6 idle simdgroups
]
SLOW_CASES = [
    (4, 4, 16, 100, 64, 84, 16, 32, mx.float16),    # window == block size
    (2, 1, 4, 50, 256, 46, None, 16, mx.float32),   # D = 256: 8-key blocks
    (8, 2, 7, 333, 128, 326, 100, 80, mx.bfloat16),
] + [(4 * g, 4, L, 61 + 3 * L, D, 61 + 2 * L, None, 32, mx.float32)
     for g in (1, 4, 16) for L in (1, 2, 7, 9, 16) for D in (64, 128)] \
  + [(8, 2, L, 45, 64, 45 - L, 12, 16, mx.float16) for L in range(1, 17)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
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


def check_kernel(case, seed=1):
    Hq, Hkv, L, N, D, qk, window, split, dtype = case
    q, k, v = qkv(seed, Hq, Hkv, L, N, D, dtype)
    scale = D**-0.5
    got = run_kernel(q, k, v, scale, qk, window, split)
    ref = attention.block_attention_reference(q, k, v, scale=scale, qk=qk, window=window)
    assert got.dtype == dtype and got.shape == ref.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_reference(case):
    check_kernel(case)


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_kernel_matches_reference_sweep(case):
    check_kernel(case)


@needs_cxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_scores_of_magnitude_hundreds_do_not_overflow(dtype):
    """Scores of ±100..600 (exp of them overflows float32 without the running-max subtraction, in the partial and
    in the combine: chunks with very different maxima), against a float64 numpy softmax."""
    Hq, Hkv, L, N, D, qk = 8, 2, 4, 200, 64, 196
    rng = np.random.default_rng(7)
    q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32) * 12).astype(dtype)
    kf = rng.standard_normal((1, Hkv, N, D)).astype(np.float32) * 3
    kf[:, :, 70:90] *= 4  # one chunk holds far larger scores than the others
    k = mx.array(kf).astype(dtype)
    v = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dtype)
    s = np.einsum("hld,hnd->hln", np.array(q.astype(mx.float32))[0].reshape(Hkv, -1, D),
                  np.array(k.astype(mx.float32))[0])
    assert 100 < np.abs(s).max() < 5000  # the regime this test is about
    got = run_kernel(q, k, v, 1.0, qk, None, split=64)
    assert np.isfinite(np.array(got.astype(mx.float32))).all()
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), numpy_oracle(q, k, v, 1.0, qk, None),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


@needs_cxx
def test_partial_pass_writes_per_chunk_softmax_states():
    """o_part / ml of pass 1 against numpy: per (KV head, chunk, row g*L+i) the base-2 running max, the sum of
    exp2(s - max) and the unnormalised P·V over the chunk's visible keys; padding rows fully masked."""
    Hq, Hkv, L, N, D, qk, window, split = 6, 2, 5, 150, 64, 145, 70, 48
    q, k, v = qkv(3, Hq, Hkv, L, N, D, mx.float32)
    scale = D**-0.5
    part, _ = attention.block_attention_calls(q, k, v, scale=scale, qk=qk, window=window, split=split)
    o_part, ml = (np.array(a) for a in harness.run(part))
    G, S = Hq // Hkv, -(-N // split)
    rp = 8 * -(-G * L // 8)
    assert o_part.shape == (Hkv, S, rp, D) and ml.shape == (Hkv, S, rp, 2)
    qn, kn, vn = (np.array(a, dtype=np.float64)[0] for a in (q, k, v))
    for kvh in range(Hkv):
        for s in range(S):
            for r in range(rp):
                m2, l, o = ml[kvh, s, r, 0], ml[kvh, s, r, 1], o_part[kvh, s, r]
                j = np.arange(s * split, min(N, (s + 1) * split))
                if r >= G * L:
                    assert m2 == -np.inf and l == 0 and not o.any()
                    continue
                g, i = divmod(r, L)
                j = j[(j <= qk + i) & (j > qk + i - window)]
                if j.size == 0:
                    assert m2 == -np.inf and l == 0 and not o.any()
                    continue
                s2 = (qn[kvh * G + g, i] @ kn[kvh, j].T) * scale * np.log2(np.e)
                p = np.exp2(s2 - s2.max())
                assert m2 == pytest.approx(s2.max(), rel=1e-5, abs=1e-5)
                assert l == pytest.approx(p.sum(), rel=1e-5)
                np.testing.assert_allclose(o, p @ vn[kvh, j], rtol=1e-4, atol=1e-5)


@needs_cxx
def test_dispatcher_self_tests_then_runs_the_kernels_and_falls_back_to_sdpa(simulated_metal, monkeypatch):
    """Metal simulated: the first call runs the registered self-test (through the harness: it must pass), then the
    two passes; unsupported shapes (head dim 48, batch 2) are MLX's fused SDPA, never the float32 reference."""
    q, k, v = qkv(6, 4, 2, 3, 70, 64, mx.float16)
    got = attention.block_attention(q, k, v, scale=0.125, qk=67, window=None)
    assert _core.kernel_stats()["block_attention"]["status"] == "ok"
    assert simulated_metal[-2:] == ["glimmer_block_attn_partial", "glimmer_block_attn_combine"]
    assert len(simulated_metal) == 2 + 2 * len(attention.selftest_inputs())  # the self-test's launches first
    ref = attention.block_attention_reference(q, k, v, scale=0.125, qk=67)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=2e-3,
                               rtol=2e-3)

    def no_reference(*a, **kw):
        raise AssertionError("the float32 reference must not serve as the fallback")

    monkeypatch.setattr(attention, "block_attention_reference", no_reference)
    for shape in ((1, 4, 2, 3, 40, 48), (2, 4, 2, 3, 40, 64)):
        B, Hq, Hkv, L, N, D = shape
        rng = np.random.default_rng(0)
        q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float16))
        k = mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float16))
        v = mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float16))
        simulated_metal.clear()
        got = attention.block_attention(q, k, v, scale=0.1, qk=N - L, window=9)
        assert simulated_metal == [] and got.dtype == mx.float16
        stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1,
                                                     mask=attention.block_mask(L, N, N - L, 9))
        np.testing.assert_array_equal(np.array(got), np.array(stock))


@needs_cxx
def test_a_variant_that_is_wrong_at_first_use_is_demoted_to_sdpa(simulated_metal, monkeypatch):
    """The self-test passes, but the L = 5 variant returns garbage on this 'GPU': its first call is checked, the
    kernel is demoted with one warning, the answer is SDPA's, and later calls launch nothing."""
    assert _core.kernel_enabled("block_attention")
    through_harness = _core.KernelCall.run_metal

    def wrong_for_l5(call):
        out = through_harness(call)
        if call.spec is attention.COMBINE and ("L", 5) in call.template:
            return [mx.full(out[0].shape, 7.0, dtype=out[0].dtype)]
        return out

    monkeypatch.setattr(_core.KernelCall, "run_metal", wrong_for_l5)
    q, k, v = qkv(8, 4, 2, 5, 50, 64, mx.float32)
    with pytest.warns(RuntimeWarning, match="block_attention disabled"):
        got = attention.block_attention(q, k, v, scale=0.125, qk=45)
    np.testing.assert_array_equal(np.array(got), np.array(attention.builtin_attention(q, k, v, scale=0.125,
                                                                                        qk=45)))
    assert _core.kernel_stats()["block_attention"]["status"] == "failed"
    simulated_metal.clear()
    attention.block_attention(*qkv(9, 4, 2, 3, 50, 64, mx.float32), scale=0.125, qk=47)
    assert simulated_metal == []


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
    with pytest.raises(ValueError, match="inside the 10 keys"):
        attention.block_attention(q, k, v, scale=0.1, qk=8, window=None)
    q3, k3, v3 = qkv(2, 3, 2, 4, 10, 64, mx.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention.block_attention_reference(q3, k3, v3, scale=0.1, qk=6)
    assert not attention.supported(*qkv(3, 4, 2, 17, 40, 64, mx.float32))  # > 16 rows
    assert not attention.supported(*qkv(3, 4, 2, 4, 40, 48, mx.float32))   # head dim not a multiple of 32
    with pytest.raises(ValueError, match="unsupported"):
        attention.block_attention_calls(*qkv(3, 4, 2, 17, 40, 64, mx.float32), scale=0.1, qk=23)
    # the dispatcher without the kernels is MLX's fused attention with the block mask
    out = attention.block_attention(q, k, v, scale=0.1, qk=6, window=5)
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=attention.block_mask(4, 10, 6, 5))
    np.testing.assert_array_equal(np.array(out), np.array(stock))
    np.testing.assert_allclose(np.array(out), numpy_oracle(q, k, v, 0.1, 6, 5), atol=1e-5, rtol=1e-5)


@needs_metal
@pytest.mark.parametrize("case", CASES + SLOW_CASES, ids=case_id)
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
