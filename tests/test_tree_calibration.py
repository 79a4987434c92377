"""Calibrated DFlash trees (issue 23): the rank statistics (`dflash.RankCalibration`) against hand-computed counts,
the best-first slot growth (`dflash.grow_slots`) against hand-computed trees, the T > 0 candidates
(`dflash.sampled_children`: a first child drawn from q, then the likeliest others) against its exact distribution,
and a drafter's trees following its statistics (a drafter that ignores them fails). Greedy identity and the exact
T = 1 distribution of calibrated trees are in tests/test_tree.py (DFlash tree tests run the calibrated default)."""

from __future__ import annotations

import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx.runtime.loop import GenerationStats, collect, stream
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative import dflash as dflash_mod
from glimmer_mlx.speculative import engine as engine_mod
from glimmer_mlx.speculative.dflash import CAL_PRIOR, CAL_WEIGHT, RankCalibration, grow_slots, sampled_children
from glimmer_mlx.speculative.engine import TreeDecoder
from glimmer_mlx.speculative.tree import TokenTree


def small_tree() -> TokenTree:
    # root 100: children 5 (node 1), 6 (node 2); node 1: child 7 (node 3)
    return TokenTree([100, 5, 6, 7], [-1, 0, 0, 1])


LISTS = {0: [5, 6, 8], 1: [7, 9, 3], 2: [4, 2, 1], 3: [11, 12, 13]}


def test_rank_statistics_of_deterministic_candidates_by_hand():
    c = RankCalibration(4, 3)
    tree = small_tree()
    c.observe(tree, LISTS, [5, 9])  # root: rank 0 accepted; node 1: the target's token is its rank 1 (not in tree)
    c.observe(tree, LISTS, [6, 1])  # root: rank 1 accepted; node 2 (depth 1): rank 2
    c.observe(tree, LISTS, [42])  # root: none of its candidates
    c.observe(tree, LISTS, [5, 7, 12])  # rank 0, rank 0, then node 3 (depth 2): rank 1
    tried = np.zeros((4, 3))
    hit = np.zeros((4, 3))
    tried[0] = [1 + 1 + 1 + 1, 1 + 1, 1]
    hit[0] = [2, 1, 0]
    tried[1] = [1 + 1 + 1, 1 + 1, 1]
    hit[1] = [1, 1, 1]
    tried[2] = [1, 1, 0]
    hit[2] = [0, 1, 0]
    np.testing.assert_array_equal(c.tried, tried)
    np.testing.assert_array_equal(c.hit, hit)
    prior = np.array([CAL_PRIOR[0], CAL_PRIOR[1], CAL_PRIOR[1]])
    cond = (hit + CAL_WEIGHT * prior) / (tried + CAL_WEIGHT)
    np.testing.assert_allclose(c.conditional(), cond)
    # P(rank r accepted) = c_r * prod_{j<r} (1 - c_j), depth 0 by hand
    c0 = cond[0]
    want = np.log([c0[0], (1 - c0[0]) * c0[1], (1 - c0[0]) * (1 - c0[1]) * c0[2]])
    np.testing.assert_allclose(c.slot_logp()[0], want)


def test_rank_statistics_of_drawn_first_children_by_hand():
    """drawn = 1 (T > 0): rank 0 was drawn from q; it counts only when in the tree, and never matches the last
    committed token (a residual's or the bonus row's); the point masses (ranks 1..) count as deterministic."""
    c = RankCalibration(4, 3)
    tree = small_tree()
    c.observe(tree, LISTS, [5, 7, 12], drawn=1)  # root: rank 0 accepted; node 1: rank 0 (7) accepted; node 3 leaf
    c.observe(tree, LISTS, [5, 7], drawn=1)  # node 1's drawn child 7 equals the last token: rejected, not a hit
    c.observe(tree, LISTS, [6, 2], drawn=1)  # root: rank 1 accepted; node 2 has no children in the tree: stop
    tried = np.zeros((4, 3))
    hit = np.zeros((4, 3))
    tried[0] = [3, 1, 0]
    hit[0] = [2, 1, 0]
    tried[1] = [2, 1, 1]  # the rejected drawn 7: ranks 0 (in tree), 1, 2 (point masses, not in tree) tried
    hit[1] = [1, 0, 0]
    np.testing.assert_array_equal(c.tried, tried)
    np.testing.assert_array_equal(c.hit, hit)


def test_grow_slots_follows_the_statistics_by_hand():
    cands = [(10, np.log(0.6)), (11, np.log(0.3)), (12, np.log(0.1))]

    def children(node, d, token):
        return [(t + 10 * d, lp) for t, lp in cands]

    deep = np.log(np.array([[0.9, 0.05, 0.01]] * 4))  # rank 0 nearly always right: a chain
    wide = np.log(np.array([[0.3, 0.25, 0.2], [0.1, 0.05, 0.01], [0.1, 0.05, 0.01], [0.1, 0.05, 0.01]]))
    t, lists = grow_slots(1, 4, 4, children, deep, 1.0)
    assert t.parents == [-1, 0, 1, 2, 3] and t.tokens == [1, 10, 20, 30, 40]
    assert lists[0] == children(0, 0, 1)
    t, _ = grow_slots(1, 4, 4, children, wide, 1.0)
    # .3, .25, .2 at depth 1; then .3 * .1 = .03 under the first: the 4th node
    assert t.parents == [-1, 0, 0, 0, 1] and t.tokens == [1, 10, 11, 12, 20]
    # blend 0: the draft log-probabilities alone (.6, .36 = .6 * .6, .3, ...)
    t, _ = grow_slots(1, 4, 3, children, wide, 0.0)
    assert t.parents == [-1, 0, 1, 0] and t.tokens == [1, 10, 20, 11]
    # a drawn rank (< drawn) is scored by its rank rate only, never by its own probability: the depth-1 drawn
    # child (probability .99, rate .01) loses to the root's point mass 11 (.3) with drawn = 1, wins with drawn = 0
    rates = np.log(np.array([[0.6, 0.3, 0.2], [0.01, 0.01, 0.01]]))
    lists = {0: [(10, np.log(0.6)), (11, np.log(0.3))], 1: [(20, np.log(0.99)), (21, np.log(0.005))]}
    t, _ = grow_slots(1, 2, 2, lambda node, d, token: lists[d], rates, 0.0, drawn=1)
    assert t.tokens == [1, 10, 11] and t.parents == [-1, 0, 0]
    t, _ = grow_slots(1, 2, 2, lambda node, d, token: lists[d], rates, 0.0, drawn=0)
    assert t.tokens == [1, 10, 20] and t.parents == [-1, 0, 1]


def test_sampled_children_draws_the_first_from_q():
    """The first candidate is distributed as q (chi-square over 4000 draws); the others are the likeliest tokens
    other than it, in order."""
    rng = np.random.default_rng(0)
    q = np.array([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    lq = np.log(np.where(q > 0, q, 1e-300))
    lq[q == 0] = -np.inf
    top = np.argsort(-lq, kind="stable")
    n = 4000
    counts = np.zeros(len(q))
    for _ in range(n):
        out = sampled_children(lq, None, top, 3, rng)
        first = out[0][0]
        counts[first] += 1
        assert [t for t, _ in out[1:]] == [int(b) for b in top if b != first][:2]
    assert counts[5] == 0
    exp = q[:5] * n
    chi2 = (((counts[:5] - exp) ** 2) / exp).sum()
    assert chi2 < 18.5, chi2  # chi-square(4) 0.999 quantile
    # tokens given: entries name tokens through toks
    out = sampled_children(lq, np.array([50, 51, 52, 53, 54, 55]), top, 2, rng)
    assert all(50 <= t <= 54 for t, _ in out)


@pytest.fixture(scope="module")
def embedded_v1():
    from glimmer_mlx.session import load_session

    s = load_session(None)
    s.model.eos_token_ids = set()
    d = glimmer_mlx.load_drafter(str(__import__("pathlib").Path(glimmer_mlx.__file__).parent / "embedded" /
                                     "glimmer-tiny-dflash"), s.model)
    ids = s.tokenizer.apply_chat_template([{"role": "user", "content": "Write a function that adds two numbers."}],
                                          add_generation_prompt=True, tokenize=True)
    return s.model, d, ids


def _shapes(model, d, ids, hit_rates):
    """The trees of a greedy run (15 nodes, depth 8) when the greedy statistics hold `hit_rates` [15, 8] from 10^6
    tries (so a run's own observations barely move them)."""
    d.tree_calibration = {}
    cal = d.calibration(True)
    cal.tried[:] = 1e6
    cal.hit[:] = np.asarray(hit_rates) * 1e6
    trees = []
    right = engine_mod.verify_tree_greedy

    def spy(logits, tree, sampler, history):
        trees.append(tree)
        return right(logits, tree, sampler, history)

    engine_mod.verify_tree_greedy = spy
    try:
        st = GenerationStats()
        dec = TreeDecoder(model, d, Sampler(SamplingParams(temperature=0.0)), 15, 8)
        r = collect(stream(dec, ids, max_tokens=24, eos=set(), stats=st), st, False)
    finally:
        engine_mod.verify_tree_greedy = right
    return r.tokens, trees


def test_drafter_trees_follow_their_statistics(embedded_v1, monkeypatch):
    """Statistics saying rank 0 is always right give chains to the full depth; saying only depth 1 is ever right
    give a wide root of 8 candidates. Output stays the plain tokens either way."""
    model, d, ids = embedded_v1
    monkeypatch.setattr(d, "tree_blend", 1.0)
    plain = glimmer_mlx.generate(model, ids, max_tokens=24).tokens
    chain = np.full((15, 8), 1e-4)
    chain[:, 0] = 0.999
    toks, trees = _shapes(model, d, ids, chain)
    assert toks == plain
    full = [t for t in trees if len(t) == 16]
    assert full and all(t.max_depth == 8 for t in full)
    wide = np.full((15, 8), 1e-4)
    wide[0, :] = 0.3
    toks, trees = _shapes(model, d, ids, wide)
    assert toks == plain
    full = [t for t in trees if len(t) == 16]
    assert full and all(len(t.children[0]) == 8 for t in full)


def test_accept_counts_the_verified_trees(embedded_v1):
    """The drafter's greedy statistics after a run hold, at least, a hit for every accepted node at its rank among
    its parent's children (children are kept in rank order), plus at most one more per round (the target's token
    after the path, when it was a candidate outside the tree)."""
    model, d, ids = embedded_v1
    d.tree_calibration = {}
    d.tree_blend = dflash_mod.TREE_BLEND
    seen = []
    right = engine_mod.verify_tree_greedy

    def spy(logits, tree, sampler, history):
        path, nxt = right(logits, tree, sampler, history)
        seen.append((tree, path))
        return path, nxt

    engine_mod.verify_tree_greedy = spy
    try:
        dec = TreeDecoder(model, d, Sampler(SamplingParams(temperature=0.0)), 12, 6)
        st = GenerationStats()
        collect(stream(dec, ids, max_tokens=40, eos=set(), stats=st), st, False)
    finally:
        engine_mod.verify_tree_greedy = right
    want = np.zeros_like(d.calibration(True).hit)
    for tree, path in seen:
        for c in path:
            par = tree.parents[c]
            want[tree.depths[par], tree.children[par].index(c)] += 1
    got = d.calibration(True).hit
    assert want.sum() > 5 and (got >= want).all() and (got - want).sum() <= len(seen)
    assert (d.calibration(True).tried >= got).all()


def test_greedy_identity_calibrated_v1_trees_past_both_windows(embedded_v1):
    """The embedded v1 drafter's calibrated trees (its default): 160 tokens past both sliding windows (128),
    token-identical to plain decoding, the statistics learned on the way."""
    model, d, ids = embedded_v1
    d.tree_calibration = {}
    d.tree_blend = dflash_mod.TREE_BLEND
    assert d.tree_scoring == "calibrated"
    plain = glimmer_mlx.generate(model, ids, max_tokens=160).tokens
    st = GenerationStats()
    dec = TreeDecoder(model, d, Sampler(SamplingParams(temperature=0.0)), 15, 8)
    r = collect(stream(dec, ids, max_tokens=160, eos=set(), stats=st), st, False)
    assert r.tokens == plain and len(ids) + 160 > 128 + 16
    assert st.extra["tau"] > 1.5 and d.calibration(True).hit.sum() > 20
