"""Block-verify attention over a token tree (issue 23): the TREE variant of block_attention_partial.metal (through the
MSL-on-CPU harness, and through MLX on a Mac) against the pure-MLX reference with `cache.tree_mask`'s dense mask and
a float64 numpy oracle that derives visibility from the tree's parents and positions on its own; a tree that is a
chain equals the chain kernel; mutants of the real kernel text that must fail; the dispatcher's self-test, first-use
check and fallback (MLX's SDPA with the dense mask); the model's tree verify through the kernel."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx.cache import KVCache, tree_mask
from glimmer_mlx.kernels import _core, attention
from glimmer_mlx.kernels._core import metal_available
from glimmer_mlx.speculative.tree import TokenTree
from hf_fixtures import TINY_TEXT
from msl_harness import harness

needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")
needs_metal = pytest.mark.skipif(not metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")

TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


@pytest.fixture
def simulated_metal(monkeypatch, tmp_path):
    """Metal 'available', every launch through the MSL-on-CPU harness, a private self-test cache, fresh verdicts;
    yields the list of launched kernel names (with ':tree' for the TREE variant)."""
    launched = []

    def through_harness(call):
        launched.append(call.spec.name + (":tree" if ("TREE", True) in call.template else ""))
        return harness.run(call)

    monkeypatch.delenv(_core.ENV, raising=False)
    monkeypatch.setattr(_core, "metal_available", lambda: True)
    monkeypatch.setattr(_core.KernelCall, "run_metal", through_harness)
    monkeypatch.setattr(_core, "selftest_cache_path", lambda: tmp_path / "kernel-selftest.json")
    monkeypatch.setattr(attention, "checked_variants", set())
    _core.reset_selftests()
    yield launched
    _core.reset_selftests()


def qkv(seed, Hq, Hkv, L, N, D, dtype, qscale=1.0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32) * qscale).astype(dtype)
    k = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dtype)
    return q, k, v


def make_tree(kind, L, seed):
    """parents, depths of an L-node tree: chain, star, random, wide (attention.random_tree) or deep (two long
    branches from the root, the second forking once more halfway)."""
    if kind == "deep":
        half = L // 2
        parents = [-1] + [i - 1 for i in range(1, half + 1)] + [0] + [i - 1 for i in range(half + 2, L)]
        if L > 6:
            parents[-1] = half // 2  # one more fork, off the first branch
        parents = parents[:L]
        depths = [0] * L
        for i in range(1, L):
            depths[i] = depths[parents[i]] + 1
        return parents, depths
    return attention.random_tree(np.random.default_rng(seed), L, kind)


def numpy_tree_oracle(q, k, v, scale, qk, window, parents, depths):
    """float64 attention, visibility written from the tree itself: node i sits at position qk + depths[i]; context
    key j (< qk, at position j) is visible iff it is less than `window` positions behind node i; node b (key qk + b)
    iff b is i or one of i's ancestors (walking `parents`) and less than `window` positions behind."""
    q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64)[0] for a in (q, k, v))
    Hq, L, D = q.shape
    Hkv, N, _ = k.shape
    W = np.inf if window is None else window
    out = np.zeros_like(q)
    for i in range(L):
        pos_i = qk + depths[i]
        ok = np.zeros(N, dtype=bool)
        ok[:qk] = pos_i - np.arange(qk) < W
        b = i
        while b >= 0:
            ok[qk + b] = pos_i - (qk + depths[b]) < W
            b = parents[b]
        for h in range(Hq):
            kh, vh = k[h // (Hq // Hkv)], v[h // (Hq // Hkv)]
            s = np.where(ok, (q[h, i] * scale) @ kh.T, -np.inf)
            p = np.exp(s - s.max())
            out[h, i] = (p / p.sum()) @ vh
    return out[None]


def run_kernel(q, k, v, scale, qk, window, tree, split=None, spec=None):
    part, combine = attention.block_attention_calls(q, k, v, scale=scale, qk=qk, window=window, split=split,
                                                    tree=tree)
    if spec is not None:
        part.spec = spec
    o_part, ml = harness.run(part)
    return harness.run(combine(o_part, ml))[0][None]


def case_id(c):
    Hq, Hkv, L, N, D, window, split, dtype, kind = c
    return f"Hq{Hq}-Hkv{Hkv}-L{L}-N{N}-D{D}-w{window}-s{split}-{str(dtype).split('.')[-1]}-{kind}"


# (Hq, Hkv, L, N, D, window, split, dtype, tree kind); the queries are the last L keys (qk = N - L, the model's
# convention). Windows: wider than the context, crossing the context at a depth-dependent key, smaller than the tree's
# depth (ancestors drop out of the window); GQA groups 1, 2, 4, 16 (G·L = 80: two row groups); L up to 32 (bit 31);
# the self-test's two variants (bf16 G4 L12 D128, fp16 G2 L9 D64) so that their compilation is shared
CASES = [
    (4, 2, 16, 300, 64, None, 64, mx.float32, "random"),
    (4, 1, 9, 137, 64, 40, 64, mx.float32, "wide"),
    (2, 2, 32, 90, 32, 5, 32, mx.float32, "random"),   # window 5 < depth: ancestors drop out; bit 31 used
    (8, 2, 12, 203, 128, None, 64, mx.bfloat16, "random"),
    (4, 2, 9, 77, 64, 6, 32, mx.float16, "wide"),
    (16, 1, 5, 70, 64, 30, 64, mx.float32, "star"),    # 80 rows: 2 row groups
    (4, 4, 14, 60, 32, 9, 16, mx.float32, "deep"),
]
SLOW_CASES = [
    (4, 2, L, 40 + 5 * L, 64, window, 32, dtype, kind)
    for L, window, dtype, kind in ((1, None, mx.float32, "chain"), (2, 3, mx.float16, "star"),
                                   (7, 4, mx.bfloat16, "deep"), (24, 10, mx.float32, "wide"),
                                   (31, None, mx.float16, "random"), (32, 12, mx.bfloat16, "star"),
                                   (32, 40, mx.float32, "deep"), (20, 2, mx.float32, "random"))
] + [(4 * g, 4, L, 100, D, 16, 48, mx.float32, "random") for g in (1, 4) for L in (8, 16, 32) for D in (64, 256)]


def check_kernel(case, seed=1):
    Hq, Hkv, L, N, D, window, split, dtype, kind = case
    q, k, v = qkv(seed, Hq, Hkv, L, N, D, dtype)
    parents, depths = make_tree(kind, L, seed)
    tree = attention.tree_inputs(parents, depths)
    scale, qk = D**-0.5, N - L
    got = run_kernel(q, k, v, scale, qk, window, tree, split)
    ref = attention.block_attention_reference(q, k, v, scale=scale, qk=qk, window=window, tree=tree)
    assert got.dtype == dtype and got.shape == ref.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])
    return q, k, v, tree, parents, depths


@pytest.mark.parametrize("case", CASES + SLOW_CASES[:3], ids=case_id)
def test_reference_matches_the_numpy_oracle_and_stock_sdpa(case):
    Hq, Hkv, L, N, D, window, split, dtype, kind = case
    q, k, v = qkv(0, Hq, Hkv, L, N, D, dtype)
    parents, depths = make_tree(kind, L, 0)
    tree = attention.tree_inputs(parents, depths)
    np.testing.assert_array_equal(np.array(tree[1]), TokenTree(list(range(L)), parents).ancestors())
    scale, qk = D**-0.5, N - L
    ref = np.array(attention.block_attention_reference(q, k, v, scale=scale, qk=qk, window=window,
                                                       tree=tree).astype(mx.float32))
    np.testing.assert_allclose(ref, numpy_tree_oracle(q, k, v, scale, qk, window, parents, depths),
                               atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                 mask=tree_mask(tree[0], tree[1], qk, 0, window))
    np.testing.assert_allclose(ref, np.array(stock.astype(mx.float32)), atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)


def test_tree_meta_is_the_block_part_of_the_cache_mask():
    """bits[i] bit b == tree_mask's column qk + b (ancestors and the window between nodes), depths follow."""
    for kind, L, window in (("random", 32, None), ("deep", 20, 4), ("wide", 9, 2), ("chain", 1, 3)):
        parents, depths = make_tree(kind, L, 3)
        tree = attention.tree_inputs(parents, depths)
        meta = np.array(attention.tree_meta(tree, window))
        assert meta.dtype == np.int32 and meta.shape == (2 * L,)
        bits = meta[:L].view(np.uint32)
        got = (bits[:, None] >> np.arange(L, dtype=np.uint32)[None, :]) & 1
        want = np.array(tree_mask(tree[0], tree[1], 50, 40, window))[:, 10:]
        np.testing.assert_array_equal(got.astype(bool), want)
        assert meta[L:].tolist() == depths
    # built once per (tree, window) for the layers of one forward; a new round's tree gets its own
    a, b = attention.tree_inputs(*make_tree("star", 5, 0)), attention.tree_inputs(*make_tree("chain", 5, 0))
    assert attention.shared_tree_meta(a, 3) is attention.shared_tree_meta(a, 3)
    assert attention.shared_tree_meta(a, None) is not attention.shared_tree_meta(a, 3)
    assert np.array(attention.shared_tree_meta(b, 3)).tolist() == np.array(attention.tree_meta(b, 3)).tolist()
    assert np.array(attention.shared_tree_meta(a, 3)).tolist() != np.array(attention.shared_tree_meta(b, 3)).tolist()


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tree_kernel_matches_reference(case):
    check_kernel(case)


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_tree_kernel_matches_reference_sweep(case):
    check_kernel(case)


@needs_cxx
def test_a_tree_that_is_a_chain_equals_the_chain_kernel():
    """A chain through the TREE variant gives the chain variant's bytes (same scores, same mask), on a sliding layer
    whose window cuts into the context."""
    Hq, Hkv, L, N, D, window = 4, 2, 9, 137, 64, 40
    q, k, v = qkv(11, Hq, Hkv, L, N, D, mx.float32)
    tree = attention.tree_inputs(*make_tree("chain", L, 0))
    for w in (window, None):
        got = run_kernel(q, k, v, D**-0.5, N - L, w, tree, split=64)
        part, combine = attention.block_attention_calls(q, k, v, scale=D**-0.5, qk=N - L, window=w, split=64)
        chain = harness.run(combine(*harness.run(part)))[0][None]
        np.testing.assert_array_equal(np.array(got), np.array(chain))


@needs_cxx
def test_tree_kernel_reads_cache_views_past_the_window_wrap():
    """The model's convention: KVCache.update(tree=...) on a sliding cache that has dropped rows returns views of its
    buffer and the tree mask; the kernel with qk = N - L on those views equals SDPA with that mask."""
    rng = np.random.default_rng(4)
    Hq, Hkv, D, W = 4, 2, 32, 24
    parents, depths = make_tree("wide", 11, 2)
    tree = attention.tree_inputs(parents, depths)
    for window in (W, None):
        cache = KVCache(window=window, max_rewind=16)
        cache.step = 32
        for n in (50, 7, 16):
            cache.update(*(mx.array(rng.standard_normal((1, Hkv, n, D)).astype(np.float32)) for _ in range(2)))
        assert window is None or cache.start > 0
        k = mx.array(rng.standard_normal((1, Hkv, 11, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, Hkv, 11, D)).astype(np.float32))
        q = mx.array(rng.standard_normal((1, Hq, 11, D)).astype(np.float32))
        keys, values, mask = cache.update(k, v, tree=tree)
        N = keys.shape[2]
        np.testing.assert_array_equal(np.array(attention.attention_mask(11, N, N - 11, window, tree)),
                                      np.array(mask))
        stock = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)
        got = run_kernel(q, keys, values, D**-0.5, N - 11, window, tree, split=32)
        np.testing.assert_allclose(np.array(got), np.array(stock), atol=2e-5, rtol=2e-5)


# -- mutants of the real kernel text: each must fail the comparison ------------------------------------------------
MUTANTS = {
    "ancestor bit off by one": ("(tbits >> uint(j - qk))", "(tbits >> uint(j - qk + 1))"),
    "window by row index, not depth": ("j > tpos - W", "j > qk + i - W"),
    "mask ignored for block rows": ("((tbits >> uint(j - qk)) & 1u) != 0u", "j <= qk + i"),
    "depth read from the bits' slot": ("qk + meta[5 + L + i]", "qk + meta[5 + i]"),
    "context window ignored": ("(W == 0 || j > tpos - W)", "true"),
}


def mutant(spec, old, new):
    src = spec.source
    assert src.count(old) == 1, f"mutation site {old!r} not once in {spec.filename}: update the mutant"
    return dataclasses.replace(spec, name=f"{spec.name}_tree_m{abs(hash((old, new))) % 10**8}",
                               text=src.replace(old, new))


@needs_cxx
@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutated_tree_kernels_fail(name):
    """A wide 9-node tree (depths below the row indices) on a sliding layer whose window (6) cuts into the context
    at a depth-dependent key: the real kernel passes, each mutant differs from the reference."""
    Hq, Hkv, L, N, D, window = 4, 2, 9, 60, 32, 6
    q, k, v = qkv(21, Hq, Hkv, L, N, D, mx.float32, qscale=3.0)
    parents, depths = make_tree("wide", L, 1)
    assert any(d < i for i, d in enumerate(depths)) and len(set(parents)) < L - 1  # a real tree
    tree = attention.tree_inputs(parents, depths)
    ref = np.array(attention.block_attention_reference(q, k, v, scale=D**-0.5, qk=N - L, window=window, tree=tree))
    good = np.array(run_kernel(q, k, v, D**-0.5, N - L, window, tree, split=32))
    np.testing.assert_allclose(good, ref, atol=2e-5, rtol=2e-5)
    old, new = MUTANTS[name]
    bad = np.array(run_kernel(q, k, v, D**-0.5, N - L, window, tree, split=32,
                              spec=mutant(attention.PARTIAL, old, new)))
    assert not np.allclose(bad, ref, atol=1e-3, rtol=1e-3, equal_nan=True), f"mutant {name!r} not caught"


# -- dispatcher ---------------------------------------------------------------------------------------------------
@needs_cxx
def test_dispatcher_self_tests_the_tree_kernel_then_runs_it_and_falls_back_to_sdpa(simulated_metal, monkeypatch):
    """Metal simulated: the first tree call runs the tree self-test (through the harness: it must pass), then the two
    passes of the TREE variant; shapes the kernel does not take (33 nodes, head dim 48, batch 2) are MLX's SDPA with
    the dense tree mask, never the float32 reference."""
    q, k, v = qkv(6, 4, 2, 10, 70, 64, mx.float32)
    parents, depths = make_tree("random", 10, 6)
    tree = attention.tree_inputs(parents, depths)
    got = attention.block_attention(q, k, v, scale=0.125, qk=60, window=20, tree=tree)
    assert _core.kernel_stats()["block_attention_tree"]["status"] == "ok"
    assert "block_attention" not in _core.kernel_stats()  # the chain kernel's self-test is not needed for trees
    assert simulated_metal[-2:] == ["glimmer_block_attn_partial:tree", "glimmer_block_attn_combine"]
    assert len(simulated_metal) == 2 + 2 * len(attention.tree_selftest_inputs())
    np.testing.assert_allclose(np.array(got), numpy_tree_oracle(q, k, v, 0.125, 60, 20, parents, depths),
                               atol=2e-5, rtol=2e-5)

    def no_reference(*a, **kw):
        raise AssertionError("the float32 reference must not serve as the fallback")

    monkeypatch.setattr(attention, "block_attention_reference", no_reference)
    for B, Hq, Hkv, L, N, D in ((1, 4, 2, 33, 60, 64), (1, 4, 2, 5, 40, 48), (2, 4, 2, 5, 40, 64)):
        q, k, v = (mx.array(a) for a in qkv(0, Hq, Hkv, L, N, D, mx.float16))
        if B == 2:
            q, k, v = (mx.concatenate([a, a]) for a in (q, k, v))
        tree = attention.tree_inputs(*make_tree("star", L, 0))
        simulated_metal.clear()
        got = attention.block_attention(q, k, v, scale=0.1, qk=N - L, window=9, tree=tree)
        assert simulated_metal == [] and got.dtype == mx.float16
        stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1,
                                                     mask=tree_mask(tree[0], tree[1], N - L, 0, 9))
        np.testing.assert_array_equal(np.array(got), np.array(stock))


@needs_cxx
def test_a_failing_tree_self_test_falls_back_with_one_warning_and_keeps_the_chain_kernel(simulated_metal,
                                                                                         monkeypatch):
    """The TREE variant returns garbage on this 'GPU': the tree self-test fails with one warning, tree calls are
    SDPA with the dense mask (nothing launched), and the chain kernel still runs."""
    through_harness = _core.KernelCall.run_metal

    def tree_broken(call):
        out = through_harness(call)
        if ("TREE", True) in call.template:
            return [mx.zeros_like(out[0]), out[1]]
        return out

    monkeypatch.setattr(_core.KernelCall, "run_metal", tree_broken)
    q, k, v = qkv(8, 4, 2, 6, 50, 64, mx.float32)
    tree = attention.tree_inputs(*make_tree("wide", 6, 8))
    with pytest.warns(RuntimeWarning, match="block_attention_tree disabled: wrong result"):
        got = attention.block_attention(q, k, v, scale=0.125, qk=44, tree=tree)
    np.testing.assert_array_equal(np.array(got), np.array(attention.builtin_attention(q, k, v, scale=0.125, qk=44,
                                                                                        tree=tree)))
    simulated_metal.clear()
    attention.block_attention(q, k, v, scale=0.125, qk=44, tree=tree)
    assert simulated_metal == []
    chain = attention.block_attention(q, k, v, scale=0.125, qk=44)
    assert _core.kernel_stats()["block_attention"]["status"] == "ok"
    assert simulated_metal[-2:] == ["glimmer_block_attn_partial", "glimmer_block_attn_combine"]
    np.testing.assert_allclose(np.array(chain), np.array(attention.block_attention_reference(q, k, v, scale=0.125,
                                                                                             qk=44)), atol=2e-5)


@needs_cxx
def test_a_tree_variant_wrong_at_first_use_is_demoted_to_sdpa(simulated_metal, monkeypatch):
    """The tree self-test passes, but the 7-node variant is wrong: its first call is checked against SDPA with the
    dense mask, the tree kernel is demoted with one warning and the answer is SDPA's."""
    assert _core.kernel_enabled("block_attention_tree")
    through_harness = _core.KernelCall.run_metal

    def wrong_for_l7(call):
        out = through_harness(call)
        if call.spec is attention.COMBINE and ("L", 7) in call.template:
            return [mx.full(out[0].shape, 7.0, dtype=out[0].dtype)]
        return out

    monkeypatch.setattr(_core.KernelCall, "run_metal", wrong_for_l7)
    q, k, v = qkv(9, 4, 2, 7, 50, 64, mx.float32)
    tree = attention.tree_inputs(*make_tree("deep", 7, 0))
    with pytest.warns(RuntimeWarning, match="block_attention_tree disabled"):
        got = attention.block_attention(q, k, v, scale=0.125, qk=43, window=10, tree=tree)
    np.testing.assert_array_equal(np.array(got), np.array(attention.builtin_attention(q, k, v, scale=0.125, qk=43,
                                                                                        window=10, tree=tree)))
    assert _core.kernel_stats()["block_attention_tree"]["status"] == "failed"


def test_bad_trees_are_rejected():
    q, k, v = qkv(2, 4, 2, 4, 10, 64, mx.float32)
    d, a = attention.tree_inputs(*make_tree("star", 4, 0))
    with pytest.raises(ValueError, match=r"tree: depths must be \[4\] and ancestors \[4, 4\]"):
        attention.block_attention(q, k, v, scale=0.1, qk=6, tree=(d[:3], a))
    with pytest.raises(ValueError, match="tree must be"):
        attention.block_attention_reference(q, k, v, scale=0.1, qk=6, tree=d)
    assert attention.supported(*qkv(3, 4, 2, 32, 40, 64, mx.float32), tree=(d, a))
    assert not attention.supported(*qkv(3, 4, 2, 33, 40, 64, mx.float32), tree=(d, a))
    assert not attention.supported(*qkv(3, 4, 2, 17, 40, 64, mx.float32))  # chains stay at <= 16 rows
    with pytest.raises(ValueError, match="tree kind"):
        attention.random_tree(np.random.default_rng(0), 4, "bush")
    # without the kernels the dispatcher is SDPA with the dense tree mask
    out = attention.block_attention(q, k, v, scale=0.1, qk=6, window=5, tree=(d, a))
    stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=tree_mask(d, a, 6, 0, 5))
    np.testing.assert_array_equal(np.array(out), np.array(stock))


# -- the model's tree verify -----------------------------------------------------------------------------------------
@needs_cxx
def test_model_tree_verify_through_the_kernel_equals_the_cpu_path(tiny_checkpoint, simulated_metal, monkeypatch):
    """A tiny Muse Glimmer (head dim 32, window 8) past its window: one tree verify forward with the kernels
    (simulated Metal: every layer's attention is the TREE variant through the harness) equals the CPU path's rows."""
    folder, _ = tiny_checkpoint(head_dim=32)
    model, _ = glimmer_mlx.load(folder)
    rng = np.random.default_rng(3)
    ctx = rng.integers(0, TINY_TEXT["vocab_size"], 50).tolist()
    tokens = [ctx[-1]] + rng.integers(0, TINY_TEXT["vocab_size"], 11).tolist()  # the attention ignores the tokens
    tree = attention.tree_inputs(*make_tree("random", 12, 3))

    def verify():
        cache = model.make_cache(max_rewind=16)
        for c in cache:
            c.step = 8  # tight buffers: the sliding caches compact
        model(mx.array([ctx[:30]], dtype=mx.int32), cache)
        model(mx.array([ctx[30:-1]], dtype=mx.int32), cache)  # 19 rows: no chain kernel
        assert any(c.start > 0 for c in cache if c.window is not None)  # the sliding layers have dropped rows
        return np.array(model(mx.array([tokens], dtype=mx.int32), cache, tree=tree)[0])

    monkeypatch.setenv(_core.ENV, "reference")
    want = verify()
    assert simulated_metal == []
    monkeypatch.delenv(_core.ENV)
    got = verify()
    tree_launches = simulated_metal.count("glimmer_block_attn_partial:tree")
    assert tree_launches == TINY_TEXT["num_hidden_layers"] + len(attention.tree_selftest_inputs())
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@needs_metal
@pytest.mark.parametrize("case", CASES + SLOW_CASES, ids=case_id)
def test_metal_tree_kernel_matches_reference(case):
    Hq, Hkv, L, N, D, window, split, dtype, kind = case
    q, k, v = qkv(1, Hq, Hkv, L, N, D, dtype)
    tree = attention.tree_inputs(*make_tree(kind, L, 1))
    got = attention.kernel_attention(q, k, v, scale=D**-0.5, qk=N - L, window=window, tree=tree)
    ref = attention.block_attention_reference(q, k, v, scale=D**-0.5, qk=N - L, window=window, tree=tree)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.skipif(metal_available(), reason="checks the behaviour without Metal")
def test_kernel_bench_times_the_tree_rows_without_metal():
    """`glimmer bench kernels` with block_attention_tree: rows up to 32 nodes when it is the only kernel; without
    Metal the kernel column is "no Metal" and SDPA with the tree mask and the reference are timed."""
    from glimmer_mlx.bench import kernels as kb

    res = kb.run_kernel_bench(rows=(4, 32), contexts=(96,), kernels=("block_attention_tree",), heads=4, kv_heads=2,
                              head_dim=64, window=40, calls=2, windows=1, warmup=0)
    assert res["kernel_status"] == {"block_attention_tree": "no Metal"} and res["settings"]["tree_kind"] == "wide"
    assert [(r["kernel"], r["rows"], r["context"]) for r in res["results"]] == [
        ("block_attention_tree", 4, 96), ("block_attention_tree", 32, 96)]
    assert all(r["kernel_us"] is None and r["builtin_us"] > 0 and r["reference_us"] > 0 for r in res["results"])
    with pytest.raises(ValueError, match="1..32 when block_attention_tree is the only kernel"):
        kb.run_kernel_bench(rows=(32,), kernels=("block_attention", "block_attention_tree"))
