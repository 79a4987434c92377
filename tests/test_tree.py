"""Token-tree verification (issue 23): the tree structure, the tree attention mask (vs numpy), the tree verify
forward and `cache.keep_path` (vs from-scratch forwards of the committed tokens, full and sliding-window layers, past
the window), greedy identity with trees (vs plain decoding, EOS and max_tokens inside a tree), and lossless tree
sampling at T = 1 (vs enumerated distributions, chi-square), each with a deliberately broken sibling residual that
must fail. DFlash trees (v1 and v2): greedy identity on the embedded set past both windows, EOS and max_tokens inside
a tree, a tree of the chain's budget is the chain round, and the exact T = 1 distribution with a broken q that
fails."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx.cache import CacheRewindError, KVCache, keep_path, tree_mask
from glimmer_mlx.sampling import Sampler, SamplingParams, process
from glimmer_mlx.speculative import verify
from glimmer_mlx.speculative.ngram import NGramDrafter, NGramIndex
from glimmer_mlx.speculative.tree import TokenTree
from glimmer_mlx.strategy import ModeError
from hf_fixtures import TINY_TEXT
from chi_square import chi2, chi2_critical

V = TINY_TEXT["vocab_size"]
W = TINY_TEXT["sliding_window"]  # 8


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    folder, _ = tiny_checkpoint()
    m, _ = glimmer_mlx.load(folder)
    m.eos_token_ids = set()
    return m


def random_tree(rng, root: int, nodes: int, vocab: int, max_children: int = 3) -> TokenTree:
    """A random tree with distinct sibling tokens, in topological order."""
    tokens, parents = [root], [-1]
    used: dict[int, set] = {0: set()}
    while len(tokens) <= nodes:
        p = int(rng.integers(0, len(tokens)))
        if len(used[p]) >= min(max_children, vocab):
            continue
        t = int(rng.integers(0, vocab))
        if t in used[p]:
            continue
        used[p].add(t)
        used[len(tokens)] = set()
        tokens.append(t)
        parents.append(p)
    return TokenTree(tokens, parents)


# ---------------------------------------------------------------------------------------------------------------
# structure


def test_from_paths_merges_a_trie_within_the_budget():
    t = TokenTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5], [1, 6, 7, 8]], budget=6)
    assert t.tokens == [9, 1, 2, 3, 4, 5, 6] and t.parents == [-1, 0, 1, 2, 2, 0, 1]
    assert t.depths == [0, 1, 2, 3, 3, 1, 2]
    assert t.path_tokens(4) == [1, 2, 4] and t.path(6) == [1, 6]
    assert not t.is_chain and TokenTree.chain(9, [1, 2]).is_chain
    assert TokenTree.from_paths(9, [[1, 2, 3, 4]], budget=8, max_depth=2).tokens == [9, 1, 2]
    # ancestors, re-derived from the paths
    a = t.ancestors()
    for i in range(len(t)):
        assert set(np.nonzero(a[i])[0]) == {0, i, *t.path(i)}
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="sibling"):
        TokenTree([1, 2, 2], [-1, 0, 0])


def test_ngram_continuations_first_path_is_the_chain_draft():
    toks = [5, 1, 2, 3, 7, 1, 2, 4, 8, 6, 2, 9, 0, 1, 2]
    idx = NGramIndex(1, 3, all_ends=True)
    idx.reset(toks)
    chain, _ = idx.lookup(3)
    # suffix (1, 2): its latest earlier occurrence (the chain's draft), the one before; then the unigram (2)'s new
    # continuation (its other two repeat those already taken)
    assert idx.continuations(3, limit=8) == [chain, [3, 7, 1], [9, 0, 1]] and chain == [4, 8, 6]
    d = NGramDrafter(V, max_drafts=3, min_n=1, max_n=3, trees=True)
    d.start([], toks)
    tree, q = d.propose_tree(2, len(toks) - 1, 3, 5, Sampler(SamplingParams()), toks)
    assert q is None and tree.tokens == [2, 4, 8, 6, 3, 7] and tree.parents == [-1, 0, 1, 2, 0, 4]


# ---------------------------------------------------------------------------------------------------------------
# the tree mask and the tree verify forward


@pytest.mark.parametrize("window", [None, 3, 8])
def test_tree_attention_against_numpy(window):
    """cache.update(tree=...) + scaled_dot_product_attention vs a numpy attention with the mask written from the
    rules (absolute positions, ancestors, window), after the sliding cache has compacted."""
    rng = np.random.default_rng(0 if window is None else window)
    H, D = 2, 8
    c = KVCache(window=window, max_rewind=12)
    c.step = 4
    ctx_len = 23
    kc = rng.standard_normal((1, H, ctx_len, D)).astype(np.float32)
    vc = rng.standard_normal((1, H, ctx_len, D)).astype(np.float32)
    for s in range(0, ctx_len, 5):
        c.update(mx.array(kc[:, :, s:s + 5]), mx.array(vc[:, :, s:s + 5]))
    tree = random_tree(rng, 0, 9, 50)
    L = len(tree)
    q = rng.standard_normal((1, H, L, D)).astype(np.float32)
    kt = rng.standard_normal((1, H, L, D)).astype(np.float32)
    vt = rng.standard_normal((1, H, L, D)).astype(np.float32)
    keys, values, mask = c.update(mx.array(kt), mx.array(vt), tree=tree.attention_inputs())
    out = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), keys, values, scale=D ** -0.5, mask=mask))
    # numpy reference over every key ever written
    K = np.concatenate([kc, kt], axis=2)[0]
    Vv = np.concatenate([vc, vt], axis=2)[0]
    kpos = list(range(ctx_len)) + [ctx_len + d for d in tree.depths]
    ref = np.zeros((H, L, D))
    for i in range(L):
        qpos = ctx_len + tree.depths[i]
        anc = {0, i, *tree.path(i)}
        vis = np.array([(j < ctx_len or (j - ctx_len) in anc) and (window is None or qpos - kpos[j] < window)
                        for j in range(ctx_len + L)])
        for h in range(H):
            s = (K[h] @ q[0, h, i]) * D ** -0.5
            s = np.where(vis, s, -np.inf)
            w = np.exp(s - s.max())
            ref[h, i] = (w / w.sum()) @ Vv[h]
    np.testing.assert_allclose(out[0], ref, atol=1e-5)


def test_tree_mask_function_rules():
    t = TokenTree.from_paths(0, [[1, 2, 3], [4, 5]], budget=5)
    d, a = t.attention_inputs()
    m = np.array(tree_mask(d, a, 10, 7, 3))  # keys: context 7, 8, 9 then the 5 nodes + root
    # node 3 (depth 3, position 13) sees no context (13 - 9 >= 3), its ancestors within 3 positions: 1, 2, 3
    assert m[3].tolist() == [False, False, False, False, True, True, True, False, False]
    # the root (position 10) sees positions 8, 9 and itself
    assert m[0].tolist() == [False, True, True, True, False, False, False, False, False]


def from_scratch_last(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids], dtype=mx.int32))[0, -1])


@pytest.mark.parametrize("ctx_len", [5, 30])
def test_tree_verify_forward_equals_from_scratch_paths(model, ctx_len):
    """Row i of one tree forward = the last row of a cache-free forward over context + root..node i (sliding layers
    of window 8 included: ctx 30 has wrapped them)."""
    rng = np.random.default_rng(ctx_len)
    ctx = rng.integers(0, V, ctx_len).tolist()
    cache = model.make_cache(max_rewind=16)
    for c in cache:
        c.step = 8
    model(mx.array([ctx[:-1]], dtype=mx.int32), cache)
    tree = random_tree(rng, ctx[-1], 12, V)
    out = np.array(model(mx.array([tree.tokens], dtype=mx.int32), cache, tree=tree.attention_inputs())[0])
    for i in range(len(tree)):
        ref = from_scratch_last(model, ctx + tree.path_tokens(i))
        np.testing.assert_allclose(out[i], ref, atol=1e-4, err_msg=f"node {i}")


def test_keep_path_against_from_scratch(model):
    """Many rounds of tree verify + keep_path on a random path, far past the window (tight caches that evict):
    every tree row equals a from-scratch forward of the committed tokens + its path, and so does decoding after."""
    rng = np.random.default_rng(5)
    cache = model.make_cache(max_rewind=16)
    for c in cache:
        c.step = 8
    committed = rng.integers(0, V, 6).tolist()
    model(mx.array([committed[:-1]], dtype=mx.int32), cache)
    while len(committed) < 60:
        tree = random_tree(rng, committed[-1], int(rng.integers(1, 10)), V)
        pos = cache[0].offset
        out = np.array(model(mx.array([tree.tokens], dtype=mx.int32), cache, tree=tree.attention_inputs())[0])
        leaf = int(rng.integers(0, len(tree)))
        np.testing.assert_allclose(out[leaf], from_scratch_last(model, committed + tree.path_tokens(leaf)),
                                   atol=1e-4)
        path = tree.path(int(rng.integers(0, len(tree))))
        keep_path(cache, pos, [0] + path)
        committed = committed + [tree.tokens[i] for i in path] + [int(rng.integers(0, V))]
        assert all(c.offset == len(committed) - 1 for c in cache)
    assert all(c.start > 0 for c in cache if c.window is not None), "the sliding caches should have wrapped"
    more = rng.integers(0, V, 3).tolist()
    out = np.array(model(mx.array([[committed[-1]] + more], dtype=mx.int32), cache)[0])
    for j in range(4):
        np.testing.assert_allclose(out[j], from_scratch_last(model, committed + more[:j]), atol=1e-4)


def test_keep_path_is_atomic_and_checked():
    a, b = KVCache(), KVCache(window=4, max_rewind=2)
    for c in (a, b):
        c.step = 2
        for _ in range(17):
            c.update(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    assert b.start == 11
    with pytest.raises(CacheRewindError):
        keep_path([a, b], 12, [0])  # position 13 would need rows from 10 on: the sliding cache starts at 11
    assert a.offset == b.offset == 17
    with pytest.raises(ValueError, match="increasing"):
        keep_path([a, b], 12, [0, 3, 2])
    keep_path([a, b], 12, [0, 2, 3, 4])
    assert a.offset == b.offset == 16


# ---------------------------------------------------------------------------------------------------------------
# greedy identity


class OracleTreeDrafter(NGramDrafter):
    """Trees that hold the plain continuation (`truth`) on a random branch, cut or corrupted at a random depth,
    among random decoys: acceptance deep in the tree and on later siblings."""

    def __init__(self, truth: list[int], prompt_len: int, seed: int):
        super().__init__(V, max_drafts=6, trees=True)
        self.truth, self.prompt_len, self.rng = truth, prompt_len, np.random.default_rng(seed)

    def propose_tree(self, anchor, pos, depth, budget, sampler, history):
        g = len(history) - self.prompt_len  # tokens generated so far
        depth = min(depth, self.max_drafts)
        true = list(self.truth[g:g + int(self.rng.integers(0, depth + 1))])
        if true and self.rng.random() < 0.3:
            j = int(self.rng.integers(0, len(true)))
            true[j] = (true[j] + 1) % V
        decoys = [self.rng.integers(0, V, int(self.rng.integers(1, depth + 1))).tolist() for _ in range(3)]
        paths = decoys[:int(self.rng.integers(0, 4))] + [true] + decoys
        return TokenTree.from_paths(anchor, paths, budget, max_depth=depth), None


def test_greedy_identity_with_oracle_trees(model):
    for seed, n in [(1, 3), (2, 12), (3, 30)]:
        ids = np.random.default_rng(seed).integers(10, V, n).tolist()
        plain = glimmer_mlx.generate(model, ids, max_tokens=60).tokens
        d = OracleTreeDrafter(plain + [0] * 8, len(ids), seed)
        r = glimmer_mlx.generate(model, ids, max_tokens=60, drafter=d, tree=12, block_size=6)
        assert r.tokens == plain
        assert r.stats.extra["tau"] > 2.0  # the oracle's branches are accepted, deep and on later siblings


@pytest.mark.parametrize("nodes", [1, 5, 16])
def test_greedy_identity_ngram_trees(model, nodes):
    rng = np.random.default_rng(nodes)
    base = rng.integers(10, 60, 25).tolist()
    ids = base + base[:12] + base[3:15]  # repeats: matches with several continuations
    plain = glimmer_mlx.generate(model, ids, max_tokens=50).tokens
    r = glimmer_mlx.generate(model, ids, max_tokens=50, drafter=NGramDrafter(V, max_drafts=5), tree=nodes)
    assert r.tokens == plain and len(r.tokens) == 50
    assert r.stats.extra["mean_tree_rows"] > 1.0


def test_greedy_identity_eos_and_max_tokens_inside_a_tree(model):
    ids = np.random.default_rng(7).integers(10, V, 10).tolist()
    plain = glimmer_mlx.generate(model, ids, max_tokens=40).tokens
    stop = plain[17]
    saved = model.eos_token_ids
    model.eos_token_ids = {stop}
    try:
        d = OracleTreeDrafter(plain + [0] * 8, len(ids), 0)
        s = glimmer_mlx.generate(model, ids, max_tokens=40, drafter=d, tree=10, block_size=6)
    finally:
        model.eos_token_ids = saved
    assert s.tokens == plain[: plain.index(stop)] and s.finish_reason == "stop"
    for m in (1, 2, 5, 13):
        d = OracleTreeDrafter(plain + [0] * 8, len(ids), m)
        assert glimmer_mlx.generate(model, ids, max_tokens=m, drafter=d, tree=10, block_size=6).tokens == plain[:m]


def test_tree_mode_errors(model):
    from glimmer_mlx.strategy import make_tree_decoder

    with pytest.raises(ModeError, match="token trees .*for modes dflash, mtp and ngram"):
        glimmer_mlx.generate(model, [5, 6], max_tokens=3, tree=4)
    for bad in (0, 65, "x"):
        with pytest.raises(ModeError, match="tree nodes"):
            make_tree_decoder(model, NGramDrafter(V), Sampler(SamplingParams()), nodes=bad)


# ---------------------------------------------------------------------------------------------------------------
# sampling is lossless on trees


def _worst(counts, joint, n):
    worst = 0.0
    for axes in [(1, 2), (0, 2), (0, 1), (0,), ()]:
        c, p = counts.sum(axis=axes).ravel(), joint.sum(axis=axes).ravel()
        stat, df = chi2(c, p, n)
        worst = max(worst, stat / chi2_critical(df))
    return worst


def broken_residual(p, q, x):
    """A classic bug: after a sibling is rejected the next one is tested against the unchanged p."""
    return p


MARKOV_V = 5


def preferred_tree(rng, root: int, prefer: list[list[int]], nodes: int) -> TokenTree:
    """A tree whose node with token a has as children the first 1-3 tokens of prefer[a] (a deterministic drafter's
    ranked candidates), breadth first, within `nodes` nodes."""
    tokens, parents, i = [root], [-1], 0
    while i < len(tokens) and len(tokens) <= nodes:
        for t in prefer[tokens[i]][:int(rng.integers(1, 4))]:
            if len(tokens) > nodes:
                break
            tokens.append(t)
            parents.append(i)
        i += 1
    return TokenTree(tokens, parents)


def _markov_rounds(P: np.ndarray, start: int, n: int, seed: int) -> np.ndarray:
    """n samples of 3 tokens after `start` from tree rounds over a Markov target P[a, b] = p(b | a), with random
    deterministic trees (several siblings per node), verified by verify_tree_sampling."""
    rng = np.random.default_rng(seed)
    logP = mx.array(np.log(P).astype(np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0), seed)
    counts = np.zeros((MARKOV_V,) * 3)
    prefer = [rng.permutation(MARKOV_V).tolist() for _ in range(MARKOV_V)]  # the drafter's candidates, in order
    for _ in range(n):
        out = [start]
        while len(out) < 4:
            tree = preferred_tree(rng, out[-1], prefer, int(rng.integers(1, 9)))
            p = logP[mx.array(tree.tokens, dtype=mx.int32)]
            path, nxt = verify.verify_tree_sampling(p, tree, None, sampler)
            out += [tree.tokens[i] for i in path] + [nxt]
        counts[tuple(out[1:4])] += 1
    return counts


def _markov_target():
    rng = np.random.default_rng(11)
    P = rng.dirichlet(np.ones(MARKOV_V) * 0.8, size=MARKOV_V)
    start = 2
    joint = P[start][:, None, None] * P[:, :, None] * P[None, :, :]
    return P, start, joint


def test_tree_sampling_enumerated_markov_target():
    """verify_tree_sampling alone, against a target whose every conditional is known (a Markov table): the first
    three tokens' joint distribution is enumerated exactly."""
    P, start, joint = _markov_target()
    n = 4000
    assert _worst(_markov_rounds(P, start, n, 0), joint, n) < 1.0


def test_tree_sampling_broken_residual_fails_markov(monkeypatch):
    monkeypatch.setattr(verify, "sibling_residual", broken_residual)
    P, start, joint = _markov_target()
    n = 4000
    assert _worst(_markov_rounds(P, start, n, 0), joint, n) > 1.0


def _markov_sampled_rounds(P: np.ndarray, Q: np.ndarray, start: int, n: int, seed: int):
    """As `_markov_rounds`, with an MTP-like drafter: a chain of 2 drafts each sampled from Q[parent token], plus up
    to 2 alternatives per depth (the likeliest other tokens of that Q row: point masses)."""
    rng = np.random.default_rng(seed)
    logP = mx.array(np.log(P).astype(np.float32))
    logQ = np.log(Q).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0), seed)
    counts = np.zeros((MARKOV_V,) * 3)
    for _ in range(n):
        out = [start]
        while len(out) < 4:
            tokens, parents, qrows = [out[-1]], [-1], [None]
            chain = [0]
            for _d in range(2):
                a = tokens[chain[-1]]
                x = int(rng.choice(MARKOV_V, p=Q[a]))
                tokens.append(x)
                parents.append(chain[-1])
                qrows.append(mx.array(logQ[a]))
                chain.append(len(tokens) - 1)
            for d in range(2):
                a, x = tokens[chain[d]], tokens[chain[d + 1]]
                for y in [t for t in np.argsort(-Q[a]).tolist() if t != x][:int(rng.integers(0, 3))]:
                    tokens.append(y)
                    parents.append(chain[d])
                    qrows.append(None)
            tree = TokenTree(tokens, parents)
            p = logP[mx.array(tree.tokens, dtype=mx.int32)]
            path, nxt = verify.verify_tree_sampling(p, tree, qrows, sampler)
            out += [tree.tokens[i] for i in path] + [nxt]
        counts[tuple(out[1:4])] += 1
    return counts


@pytest.mark.parametrize("bug", [None, pytest.param("no residual", marks=pytest.mark.slow),
                                 "sampled node as a point mass"])
def test_tree_sampling_sampled_chain_with_point_mass_alternatives(bug, monkeypatch):
    """Mixed q: sampled chain nodes (their q rows) and deterministic alternatives (point masses) — lossless; a
    residual left unchanged after a rejection, or one that removes only the rejected token of a *sampled* node
    (max(0, p − onehot) instead of max(0, p − q)), must fail."""
    right = verify.sibling_residual
    if bug == "no residual":
        monkeypatch.setattr(verify, "sibling_residual", broken_residual)
    elif bug is not None:
        monkeypatch.setattr(verify, "sibling_residual", lambda p, q, x: right(p, None, x))
    P, start, joint = _markov_target()
    Q = np.random.default_rng(12).dirichlet(np.ones(MARKOV_V), size=MARKOV_V)
    n = 3000
    worst = _worst(_markov_sampled_rounds(P, Q, start, n, 1), joint, n)
    assert (worst > 1.0) if bug else (worst < 1.0), worst


V_SMALL = 12


@pytest.fixture(scope="module")
def small_model(tiny_checkpoint):
    path, _ = tiny_checkpoint(seed=3, vocab_size=V_SMALL)
    m, _ = glimmer_mlx.load(path)
    m.eos_token_ids = set()
    return m


# every token follows several different ones (up to 7): n-gram lookup finds several distinct continuations (siblings)
SMALL_PROMPT = [8, 11, 10, 6, 11, 11, 11, 0, 5, 7, 3, 4, 7, 9, 6, 2, 8, 10, 2, 6, 4, 10, 0, 5, 10, 5, 1, 9, 11, 11, 11,
                4, 8, 11, 6, 11, 7, 2, 5, 7, 3, 8, 4, 11, 2, 7, 1, 1, 6, 5, 5, 5, 10, 6, 4, 11, 10, 4, 2, 2]


def _exact_joint(model, prompt, params):
    """P(t1, t2, t3) of plain sampling, by enumerating every continuation."""
    def dist(seqs):
        return np.exp(np.array(process(model(mx.array(seqs, dtype=mx.int32))[:, -1], params)))

    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(V_SMALL)])
    p3 = dist([prompt + [a, b] for a in range(V_SMALL) for b in range(V_SMALL)]).reshape((V_SMALL,) * 3)
    return p1[:, None, None] * p2[:, :, None] * p3


def _tree_counts(model, params, n):
    counts = np.zeros((V_SMALL,) * 3)
    branched = 0
    for seed in range(n):
        d = NGramDrafter(V_SMALL, max_drafts=1)  # trees of depth 1: up to 6 siblings at the root
        r = glimmer_mlx.generate(model, SMALL_PROMPT, max_tokens=3, temperature=params.temperature, seed=seed,
                                 drafter=d, tree=6)
        counts[tuple(r.tokens)] += 1
        branched += r.stats.extra["mean_tree_rows"] > 2.5
    return counts, branched


@pytest.mark.slow
def test_tree_sampling_matches_target_distribution(small_model):
    params = SamplingParams(temperature=1.0)
    joint = _exact_joint(small_model, SMALL_PROMPT, params)
    n = 1200
    counts, branched = _tree_counts(small_model, params, n)
    assert branched > n // 4  # many generations verified trees of several nodes
    assert _worst(counts, joint, n) < 1.0


@pytest.mark.slow
def test_tree_sampling_broken_residual_is_detected(small_model, monkeypatch):
    monkeypatch.setattr(verify, "sibling_residual", broken_residual)
    params = SamplingParams(temperature=1.0)
    joint = _exact_joint(small_model, SMALL_PROMPT, params)
    n = 1200
    counts, _ = _tree_counts(small_model, params, n)
    assert _worst(counts, joint, n) > 1.0


# ---------------------------------------------------------------------------------------------------------------
# MTP trees: the chain plus the next most likely tokens at each depth


@pytest.fixture(scope="module")
def mtp_model(tiny_checkpoint):
    from hf_fixtures import tiny_mtp_pair

    return tiny_mtp_pair(tiny_checkpoint)


@pytest.mark.parametrize("depth,nodes", [(2, 6), (3, 9), (1, 4)])
def test_greedy_identity_mtp_trees(mtp_model, depth, nodes):
    model, drafter = mtp_model
    for seed, n in [(4, 3), (6, 30)]:
        ids = np.random.default_rng(seed).integers(10, V, n).tolist()
        plain = glimmer_mlx.generate(model, ids, max_tokens=50).tokens
        r = glimmer_mlx.generate(model, ids, max_tokens=50, drafter=drafter, block_size=depth, tree=nodes)
        assert r.tokens == plain
        assert r.stats.extra["mean_tree_rows"] > depth + 1  # alternatives were verified beside the chain
    for m in (1, 2, 5):
        assert glimmer_mlx.generate(model, ids, max_tokens=m, drafter=drafter, block_size=depth,
                                    tree=nodes).tokens == plain[:m]


def test_mtp_tree_shape(mtp_model):
    model, drafter = mtp_model
    from glimmer_mlx.strategy import make_tree_decoder

    ids = np.random.default_rng(1).integers(10, V, 12).tolist()
    dec = make_tree_decoder(model, drafter, Sampler(SamplingParams()), nodes=7, block_size=2)
    dec.prefill(ids)
    dec.step(20)
    dec.step(20)
    t = dec.last_tree
    # the chain (nodes 1, 2), then alternatives at depths 1, 2, 1, 2, 1 (round robin, shallow first)
    assert t.parents == [-1, 0, 1, 0, 1, 0, 1, 0] and t.depths == [0, 1, 2, 1, 2, 1, 2, 1]


@pytest.mark.slow
def test_mtp_tree_sampling_matches_target_distribution(tiny_checkpoint):
    """T = 1 with MTP trees: the chain's nodes sampled from q (their q rows), the alternatives point masses."""
    from hf_fixtures import build_hf_mtp, save_mtp_weights

    path, hf = tiny_checkpoint(seed=3, vocab_size=V_SMALL, num_mtp_layers=2,
                               mtp_layer_types=["sliding_attention", "full_attention"])
    save_mtp_weights(build_hf_mtp(hf, 2, seed=2), path)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    drafter = glimmer_mlx.load_drafter(path, model)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 7, 2, 9, 4]
    joint = _exact_joint(model, prompt, params)
    n = 1500
    counts = np.zeros((V_SMALL,) * 3)
    for seed in range(n):
        r = glimmer_mlx.generate(model, prompt, max_tokens=3, temperature=1.0, seed=seed, drafter=drafter,
                                 block_size=2, tree=6)
        counts[tuple(r.tokens)] += 1
    assert _worst(counts, joint, n) < 1.0


# ---------------------------------------------------------------------------------------------------------------
# DFlash trees (v1 and v2): the chain plus the best other nodes by cumulative draft probability


from glimmer_mlx.runtime.loop import GenerationStats, collect, stream  # noqa: E402
from glimmer_mlx.speculative import dflash as dflash_mod  # noqa: E402
from glimmer_mlx.speculative import dflash2 as dflash2_mod  # noqa: E402
from glimmer_mlx.speculative import engine as engine_mod  # noqa: E402
from glimmer_mlx.speculative.engine import SpeculativeDecoder, TreeDecoder  # noqa: E402


def tree_generate(model, drafter, ids, *, nodes, depth, max_tokens, temperature=0.0, seed=None, eos=()):
    """A generation through `TreeDecoder` (nodes draft nodes per round, paths at most `depth` deep)."""
    st = GenerationStats()
    dec = TreeDecoder(model, drafter, Sampler(SamplingParams(temperature=temperature), seed), nodes, depth)
    return collect(stream(dec, ids, max_tokens=max_tokens, eos=set(eos), stats=st), st, False)


def chain_length(tree: TokenTree) -> int:
    """The chain's nodes 1..n (a `grow_tree` tree puts them first)."""
    n = 0
    while n + 1 < len(tree) and tree.parents[n + 1] == n:
        n += 1
    return n


@pytest.fixture(scope="module")
def embedded():
    from glimmer_mlx.session import load_session

    s = load_session(None)
    s.model.eos_token_ids = set()
    prompts = __import__("json").load(open(__import__("pathlib").Path(glimmer_mlx.__file__).parent / "bench" /
                                            "prompts" / "prompts.json"))
    ids = s.tokenizer.apply_chat_template([{"role": "user", "content": prompts["code"][0]}],
                                          add_generation_prompt=True, tokenize=True)
    return s.model, s.drafters.dflash, ids


def test_grow_tree_best_first_by_cumulative_probability():
    lp = np.log([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.9, 0.05, 0.05]])
    cands = [sorted(zip(range(3), row.tolist()), key=lambda x: -x[1]) for row in lp]
    chain = [0, 0, 0]
    tree = dflash_mod.grow_tree(7, chain, [lp[j, 0] for j in range(3)], 3, 6, lambda d, t: cands[d])
    # chain (scores .5, .3, .27), then best first: 1 @ depth 1 (.3), 2 @ depth 1 (.2), 1-0 (.18); not 0-1 (.15)
    assert tree.tokens == [7, 0, 0, 0, 1, 2, 0] and tree.parents == [-1, 0, 1, 2, 0, 0, 4]
    # ties and the depth limit: no node deeper than 2, every parent kept first
    t2 = dflash_mod.grow_tree(7, chain, [lp[j, 0] for j in range(3)], 2, 8, lambda d, t: cands[d])
    assert t2.max_depth == 2 and len(t2) == 9 and all(p < i for i, p in enumerate(t2.parents))
    assert dflash_mod.grow_tree(7, chain, [0.0] * 3, 3, 2, lambda d, t: cands[d]).tokens == [7, 0, 0]


@pytest.mark.parametrize("nodes,depth,scoring", [(7, 4, "draft"), (15, 6, "draft"), (15, 6, "calibrated")])
def test_greedy_identity_dflash_trees_embedded_past_both_windows(embedded, nodes, depth, scoring, monkeypatch):
    """The embedded target and DFlash drafter (sliding windows 128 both): 170 tokens, token-identical to plain
    decoding, with accepted paths that leave the chain (the drafter's state kept the non-contiguous path's taps)."""
    model, drafter, ids = embedded
    monkeypatch.setattr(drafter, "tree_scoring", scoring)
    left = []
    right = engine_mod.verify_tree_greedy

    def spy(logits, tree, sampler, history):
        path, nxt = right(logits, tree, sampler, history)
        left.append(any(i > chain_length(tree) for i in path))
        return path, nxt

    monkeypatch.setattr(engine_mod, "verify_tree_greedy", spy)
    n = 170
    plain = glimmer_mlx.generate(model, ids, max_tokens=n).tokens
    r = tree_generate(model, drafter, ids, nodes=nodes, depth=depth, max_tokens=n)
    assert r.tokens == plain and len(plain) == n and len(ids) + n > 128 + 16
    assert r.stats.extra["mean_tree_rows"] > depth + 1 and sum(left) >= 3
    assert r.stats.extra["tau"] > 1.5


def test_dflash_tree_eos_and_max_tokens_inside_a_tree(embedded):
    model, drafter, ids = embedded
    plain = glimmer_mlx.generate(model, ids, max_tokens=40).tokens
    stop = plain[17]
    s = tree_generate(model, drafter, ids, nodes=12, depth=5, max_tokens=40, eos={stop})
    assert s.tokens == plain[: plain.index(stop)] and s.finish_reason == "stop"
    for m in (1, 2, 5, 13):
        r = tree_generate(model, drafter, ids, nodes=12, depth=5, max_tokens=m)
        assert r.tokens == plain[:m] and r.finish_reason == "length"


def _lockstep(model, drafter, ids, k, temperature, seed, n=40):
    """A chain decoder of k drafts and a tree decoder of k nodes, k deep, stepped together: every round's drafts
    and committed tokens, which must agree (while the budget leaves room for k drafts: near max_tokens the depth is
    capped below the node budget and the tree gets alternatives). At T > 0 the first speculative round only: the
    same drafts from the same random draws, the same drafts accepted (the same uniforms test them); the token after
    a rejection comes from a different uniform of the round's draw in the chain kernel than in the tree walk (both
    exact), so the streams part there."""
    a = SpeculativeDecoder(model, drafter.fork(), Sampler(SamplingParams(temperature=temperature), seed), k)
    b = TreeDecoder(model, drafter.fork(), Sampler(SamplingParams(temperature=temperature), seed), k, k)
    a.prefill(ids)
    b.prefill(ids)
    got, n = 0, n + k + 1
    while got < n - k - 1:
        ta, tb = a.step(n - got), b.step(n - got)
        assert tb[:-1] == ta[:-1] and (tb == ta or temperature > 0)
        if a.last_round == "spec":
            assert b.last_tree.is_chain and b.last_drafts == a.last_drafts and len(a.last_drafts) == k
            if temperature > 0:
                return a.rounds
        got += len(ta)
    return a.rounds


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dflash_tree_of_chain_budget_is_the_chain_round(embedded, temperature):
    model, drafter, ids = embedded
    for k in (3, 15):
        assert _lockstep(model, drafter, ids, k, temperature, seed=3) >= (1 if temperature else 5)


@pytest.fixture(scope="module")
def dflash2_target(tiny_checkpoint, tmp_path_factory):
    from test_dflash2 import tiny_config, write_checkpoint

    path, _ = tiny_checkpoint()
    m, _ = glimmer_mlx.load(path)
    m.eos_token_ids = set()
    d = glimmer_mlx.load_drafter(write_checkpoint(tmp_path_factory.mktemp("d2t"), tiny_config(), code_scale=1.0), m)
    return m, d


@pytest.mark.parametrize("scoring", ["draft", "calibrated"])
def test_greedy_identity_dflash2_trees_past_window(dflash2_target, scoring, monkeypatch):
    """DFlash 2 (the selector's pairwise scores give every node its own children): token-identical to plain
    decoding past the target's window 8 and the drafter's 6; the tree of the chain's budget is the chain round."""
    model, d = dflash2_target
    monkeypatch.setattr(d, "tree_scoring", scoring)
    assert d.variant == "dflash2"
    seen = []
    right = engine_mod.verify_tree_greedy

    def spy(logits, tree, sampler, history):
        seen.append(tree)
        return right(logits, tree, sampler, history)

    monkeypatch.setattr(engine_mod, "verify_tree_greedy", spy)
    rng = np.random.default_rng(2)
    for n in (3, 30):
        ids = rng.integers(10, 512, n).tolist()
        plain = glimmer_mlx.generate(model, ids, max_tokens=60).tokens
        for nodes, depth in ((6, 2), (9, 3)):
            r = tree_generate(model, d, ids, nodes=nodes, depth=depth, max_tokens=60)
            assert r.tokens == plain
        assert _lockstep(model, d, ids, 3, 0.0, None) > 5
    assert any(not t.is_chain and t.max_depth == 3 for t in seen)
    # an alternative's children are scored given the alternative (the pairwise term): not always the chain's
    assert any(sorted(t.tokens[c] for c in t.children[t.children[0][1]] if t.children[0][1:]) !=
               sorted(t.tokens[c] for c in t.children[1]) for t in seen if len(t.children[0]) > 1
               and t.children[t.children[0][1]] and t.children[1])


# -- T = 1: the exact target distribution with DFlash trees (vocabulary 12) ----------------------------------------


@pytest.fixture(scope="module")
def dflash_small(small_model, tmp_path_factory):
    from hf_fixtures import build_hf_drafter
    from test_dflash2 import tiny_config, write_checkpoint

    d1 = tmp_path_factory.mktemp("d1v12")
    build_hf_drafter({"mask_token_id": V_SMALL - 1}, seed=5).save_pretrained(d1)
    raw = tiny_config(vocab=V_SMALL, selector_top_k=6, mask_token_id=V_SMALL - 1)
    d2 = write_checkpoint(tmp_path_factory.mktemp("d2v12"), raw, seed=5, code_scale=1.2)
    return {"dflash": glimmer_mlx.load_drafter(d1, small_model), "dflash2": glimmer_mlx.load_drafter(d2, small_model)}


DFLASH_PROMPT = [3, 7, 2, 9, 4]


def _dflash_tree_worst(model, drafter, n, nodes=6, depth=2):
    joint = _exact_joint(model, DFLASH_PROMPT, SamplingParams(temperature=1.0))
    counts = np.zeros((V_SMALL,) * 3)
    branched = 0
    for seed in range(n):
        r = tree_generate(model, drafter, DFLASH_PROMPT, nodes=nodes, depth=depth, max_tokens=3, temperature=1.0,
                          seed=seed)
        counts[tuple(r.tokens)] += 1
        branched += r.stats.extra["mean_tree_rows"] > depth + 1
    assert branched == n  # every round verified alternatives beside the chain
    return _worst(counts, joint, n)


def alternatives_sampled_from_q(tree, q, n_chain):
    """A broken q: every alternative claims it was drawn from its position's q row (it was chosen, not drawn)."""
    if q is None:
        return None
    return [None] + [q[tree.depths[i] - 1] for i in range(1, len(tree))]


BROKEN_Q = {"alternatives sampled from q": alternatives_sampled_from_q}


def drawn_children_claim_a_uniform_row(grow):
    """A broken calibrated tree (`DFlashDrafter.grow_calibrated`): every drawn child claims it was drawn uniformly."""
    def wrapped(self, *a, **k):
        tree, q = grow(self, *a, **k)
        flat = mx.full((V_SMALL,), -float(np.log(V_SMALL)))
        return tree, None if q is None else [None if row is None else flat for row in q]
    return wrapped


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("scoring,bug", [("calibrated", None), ("calibrated", "no residual update"),
                                         ("calibrated", "drawn children claim a uniform row"), ("draft", None),
                                         ("draft", "alternatives sampled from q"), ("draft", "no residual update")])
def test_dflash_tree_sampling_matches_target_distribution(small_model, dflash_small, variant, scoring, bug,
                                                          monkeypatch):
    """T = 1 with DFlash trees — calibrated (each node's first child drawn from its q row, the others point masses,
    the shape from rank statistics learned over the n generations) and "draft" (chain sampled from q, alternatives
    point masses): the first three tokens' joint distribution equals plain sampling's, enumerated exactly; a q that
    misstates how a node was drawn, or siblings tested against a residual never updated after a rejection, fail.

    (Treating the sampled nodes as point masses too — acceptance p(x), x removed after a rejection — is not a bug:
    it is exact for any candidate drawn independently of the verifier's uniforms, only less accepting than min(1,
    p/q), since p·q <= min(p, q).)"""
    drafter = dflash_small[variant]
    monkeypatch.setattr(drafter, "tree_scoring", scoring)
    monkeypatch.setattr(drafter, "tree_calibrated_sampling", True)
    monkeypatch.setattr(drafter, "tree_calibration", {})
    if bug == "no residual update":
        monkeypatch.setattr(verify, "sibling_residual", broken_residual)
    elif bug == "drawn children claim a uniform row":
        monkeypatch.setattr(dflash_mod.DFlashDrafter, "grow_calibrated",
                            drawn_children_claim_a_uniform_row(dflash_mod.DFlashDrafter.grow_calibrated))
    elif bug is not None:
        for mod in (dflash_mod, dflash2_mod):
            monkeypatch.setattr(mod, "tree_q", BROKEN_Q[bug])
    n = 1000
    worst = _dflash_tree_worst(small_model, drafter, n)
    assert (worst > 1.0) if bug else (worst < 1.0), worst


def test_session_turns_with_trees_equal_plain_and_reuse_the_cache():
    """`Session.stream(tree=N)` (chat's `--tree`): two turns of one conversation with DFlash and n-gram trees,
    the second continuing the first's cache (prefill of the new turn only), each equal to plain decoding's; trees
    for auto / ar, 0 or 65 nodes, or block_size 'auto' are one clear ModeError before the cache is touched."""
    from glimmer_mlx.session import load_session

    s = load_session(None)
    tok = s.tokenizer
    turn1 = tok.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True,
                                    tokenize=True)
    for mode, tree in (("dflash", 15), ("ngram", 8)):
        s.reset()
        plain = s.generate(turn1, mode="ar", max_tokens=24)[0]
        s.reset()
        t1, _, _, st1 = s.generate(turn1, mode=mode, tree=tree, block_size=6 if mode == "dflash" else None,
                                   max_tokens=24)
        assert t1 == plain and st1.extra["tree_nodes"] == tree
        turn2 = turn1 + t1 + tok.encode(" and then")
        t2, _, _, st2 = s.generate(turn2, mode=mode, tree=tree, max_tokens=16)
        assert st2.extra["cached_tokens"] > len(turn1)  # the first turn's cache was continued
        s.reset()
        assert t2 == s.generate(turn2, mode="ar", max_tokens=16)[0]
    for bad in (dict(mode="auto", tree=8), dict(mode="ar", tree=8), dict(mode="dflash", tree=0),
                dict(mode="ngram", tree=65), dict(mode="dflash", tree=8, block_size="auto")):
        with pytest.raises(ModeError):
            s.generate(turn1, max_tokens=4, **bad)


def test_chat_with_trees_answers_as_plain_and_its_tree_commands(tmp_path):
    """`glimmer chat --tree N` (the Chat app in-process, scripted input): answers equal plain decoding's turn by
    turn, `/tree` shows / sets / clears the trees, a mode trees cannot run in is refused while they are on."""
    import io

    from rich.console import Console

    from glimmer_mlx.chat import Chat
    from glimmer_mlx.session import load_session

    s = load_session(None)
    script = ["def add(a, b):", "and a docstring", "/tree", "/mode auto", "/tree 0", "/tree x", "/tree off",
              "/mode auto", "/exit"]

    def chat(mode, tree, lines):
        s.reset()
        feed, log = iter(lines), io.StringIO()
        app = Chat(s, mode=mode, tree=tree, max_tokens=20, calibrate=False, show_stats=False,
                   console=Console(file=log, width=200), input_fn=lambda _: next(feed), out=io.StringIO())
        assert app.run() == 0
        return [m["content"] for m in app.messages if m["role"] == "assistant"], log.getvalue(), app

    plain, _, _ = chat("ar", None, script[:2] + ["/exit"])
    answers, log, app = chat("ngram", 8, script)
    assert answers == plain and len(answers) == 2
    assert "trees of 8 nodes" in log and "/tree off first" in log and "usage: /tree N" in log
    assert "tree nodes must be an integer in [1, 64]" in log and app.tree is None and app.mode == "auto"
    with pytest.raises(ModeError):
        Chat(s, mode="auto", tree=8, calibrate=False)
