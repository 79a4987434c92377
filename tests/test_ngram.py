"""N-gram prompt lookup: the index, the drafter on the engine (greedy identical to plain decoding; at T = 1 the
one-hot q keeps rejection sampling exact)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx.speculative.ngram import NGramDrafter, NGramIndex, point_mass_logprobs


def test_lookup_prefers_the_longest_earlier_match():
    idx = NGramIndex(1, 3)
    idx.reset([5, 1, 2, 9, 9, 1, 2, 3, 7, 1, 2])
    # suffix (1, 2): latest earlier occurrence ends at index 7 -> continuation 3, 7, 1
    assert idx.lookup(3) == ([3, 7, 1], 2)
    idx.extend([3])  # suffix (1, 2, 3) occurred before: continuation 7, 1, 2, 3, then the copy reads itself
    assert idx.lookup(4) == ([7, 1, 2, 3], 3)
    assert idx.lookup(0) == ([], 0)


def test_a_continuation_reaching_the_end_is_an_overlapping_copy():
    """What followed an occurrence P tokens before the end is the last P tokens: the draft repeats them (LZ77's
    overlapping copy), so a loop of period P drafts as many tokens as asked, not P."""
    idx = NGramIndex(1, 3)
    idx.reset([5, 1, 2, 9, 9, 1, 2, 3, 7, 1, 2, 3])
    assert idx.lookup(10) == ([7, 1, 2, 3, 7, 1, 2, 3, 7, 1], 3)  # period 4
    idx.reset([8, 4, 6, 6])
    assert idx.lookup(5) == ([6, 6, 6, 6, 6], 1)  # period 1
    idx.reset([1, 2, 3, 1, 2, 3, 1, 2])
    assert idx.lookup(7) == ([3, 1, 2, 3, 1, 2, 3], 3)  # the latest earlier occurrence: period 3
    tree_idx = NGramIndex(1, 3, all_ends=True)
    tree_idx.reset([1, 2, 3, 1, 2, 3, 1, 2])
    # every occurrence of the loop continues it alike: one path
    assert tree_idx.continuations(6, limit=4) == [[3, 1, 2, 3, 1, 2]]


def test_no_match_and_single_token_fallback():
    idx = NGramIndex(2, 4)
    idx.reset([1, 2, 3, 4])
    assert idx.lookup(4) == ([], 0)  # no bigram repeats, unigrams not allowed
    idx1 = NGramIndex(1, 4)
    idx1.reset([1, 2, 3, 1])
    assert idx1.lookup(2) == ([2, 3], 1)
    with pytest.raises(ValueError):
        NGramIndex(3, 2)


def test_incremental_index_equals_rebuilt():
    """Extended a few tokens at a time (a pass per token) or many (`NGramIndex._extend_bulk`, a pass per n), the
    index is the one a token-by-token build from scratch makes: latest and previous end of every n-gram, and every
    end where trees keep them."""
    rng = np.random.RandomState(0)
    toks = [int(x) for x in rng.randint(0, 6, size=300)]

    def by_token(seq, all_ends):  # the definition, one token at a time
        last, prev, ends = {}, {}, {}
        for e in range(1, len(seq) + 1):
            for n in range(1, min(4, e) + 1):
                key = tuple(seq[e - n:e])
                if key in last:
                    prev[key] = last[key]
                last[key] = e
                ends.setdefault(key, []).append(e)
        return last, prev, (ends if all_ends else {})

    for all_ends in (False, True):
        inc = NGramIndex(1, 4, all_ends=all_ends)
        inc.reset(toks[:2])
        i = 2
        for step in [7, 40, 1, 17, 3, 100, 16, 2, 60, 5, 50]:
            inc.extend(toks[i:i + step])
            i = min(i + step, 300)
            full = NGramIndex(1, 4, all_ends=all_ends)
            full.reset(toks[:i])
            assert inc.lookup(5) == full.lookup(5)
            assert (inc.last, inc.prev, inc.ends) == (full.last, full.prev, full.ends) == by_token(toks[:i], all_ends)
        assert i == 300


def test_a_drafters_accepted_tokens_are_indexed_when_it_is_next_read():
    """`NGramDrafter.accept` only notes the tokens; reading `index` (a lookup, an offer, a draft, the context's
    length) indexes them first, in order: after any mix of accepts and reads its index is the one a build from the
    same tokens makes, and what it drafts is what that index drafts. Catches: tokens dropped or indexed twice, a
    read that does not index them first, a restart that keeps the noted tokens."""
    rng = np.random.RandomState(1)
    toks = [int(x) for x in rng.randint(0, 5, size=200)]
    d = NGramDrafter(8, max_drafts=6)
    d.start([], toks[:10])
    i = 10
    for step, read in [(1, False), (3, True), (1, False), (1, False), (7, True), (2, False), (30, True), (1, True)]:
        for j in range(i, i + step):
            d.accept([], [toks[j]])
        i += step
        assert len(d._index.tokens) <= i and d._unindexed == toks[len(d._index.tokens):i]  # noted, not indexed
        if read:
            full = NGramIndex(1, 4)
            full.reset(toks[:i])
            assert d.peek(6) == full.lookup(6) and d.context_length() == i - 1
            assert (d.index.last, d.index.prev, d.index.tokens) == (full.last, full.prev, full.tokens)
            assert d._unindexed == []
    d.accept([], toks[i:i + 5])
    d.start([], toks[:4])  # a new context: what was noted for the old one goes with it
    assert d.index.tokens == toks[:4] and d._unindexed == []


def test_offer_names_a_copy_the_output_follows():
    """`offer` is `peek` named as the option auto prices it as: "ngram@run" only where the tokens committed since the
    latest earlier offer are its drafts and the new offer's first draft is its next; else the matched size's."""
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 5]  # "5" occurred before, followed by 6 7 8 9
    d = NGramDrafter(1000, max_drafts=4)
    d.start([], ids)
    assert d.offer(4) == ([6, 7, 8, 9], "ngram@1") == d.offer(4)  # asked again at the same position: the same
    d.accept([], [6])  # the offer's first draft
    assert d.offer(4) == ([7, 8, 9, 10], "ngram@run")
    d.accept([], [7, 8])  # two more of it (a model drafter's round, say)
    assert d.offer(4) == ([9, 10, 11, 12], "ngram@run")
    d.accept([], [9, 10, 11, 12])  # the offer's every draft: nothing of it is left to go on with
    assert d.offer(4) == ([40, 41, 5, 6], "ngram@4")
    d.start([], ids)
    d.offer(4)
    d.accept([], [7])  # not the first draft: "7" occurred before, a fresh match
    assert d.offer(4) == ([8, 9, 10, 11], "ngram@1")
    d.start([], ids)  # a new context forgets the offers of the last one
    d.offer(4)
    d.start([], [6] + ids[1:] + [6])
    assert d.offer(4)[1] == "ngram@1"
    # an offer the confirmed tokens lead to that drafts another continuation is its size's: the copy's first token
    # was right, then the longest match (4 tokens at most) moved to another occurrence
    d.start([], [2, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1])
    assert d.offer(4) == ([1, 1, 1, 2], "ngram@4")
    d.accept([], [1])
    assert d.offer(4) == ([2, 1, 1, 1], "ngram@4")


def test_point_mass_logprobs():
    q = point_mass_logprobs([2, 0], 4)
    assert q.shape == (2, 4)
    assert mx.exp(q).tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_drafter_validation_and_sync_check():
    with pytest.raises(ValueError):
        NGramDrafter(10, max_drafts=0)
    d = NGramDrafter(10, max_drafts=3)
    d.start([], [1, 2, 3, 1, 2])
    from glimmer_mlx.sampling import Sampler, SamplingParams

    s = Sampler(SamplingParams())
    assert d.propose(2, 4, 5, s, [1, 2, 3, 1]) == ([3, 1, 2], None)  # capped at max_drafts
    with pytest.raises(RuntimeError, match="out of sync"):
        d.propose(7, 4, 2, s, [])
    drafts, q = d.propose(2, 4, 2, Sampler(SamplingParams(temperature=1.0), seed=0), [])
    assert drafts == [3, 1] and q.shape == (2, 10)


@pytest.fixture(scope="module")
def cyclic_target(tmp_path_factory):
    """The token-map target of the DFlash tests: its greedy continuations fall into short cycles."""
    from dflash_training import token_map_target

    path = tmp_path_factory.mktemp("token_map")
    token_map_target(path)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    return model


def test_ngram_greedy_identical_to_plain_and_accepts(cyclic_target):
    model = cyclic_target
    rng = np.random.RandomState(3)
    taus = []
    for _ in range(4):
        prompt = [int(x) for x in rng.randint(10, 48, size=8)]
        plain = glimmer_mlx.generate(model, prompt, max_tokens=48).tokens
        r = glimmer_mlx.generate(model, prompt, max_tokens=48, drafter=NGramDrafter(48, max_drafts=6))
        assert r.tokens == plain
        taus.append(r.stats.extra["tau"])
    assert np.mean(taus) > 1.5  # cycles are copied from the context


def test_ngram_drafts_past_a_cycles_period_and_stays_identical_to_plain(cyclic_target):
    """Once the greedy output cycles with a short period P, a round drafts (and accepts) the whole width, not P:
    the overlapping copy. (Copying only what the context holds accepts at most P drafts a round.)"""
    model = cyclic_target
    rng = np.random.RandomState(5)
    beyond = 0
    for _ in range(4):
        prompt = [int(x) for x in rng.randint(10, 48, size=8)]
        plain = glimmer_mlx.generate(model, prompt, max_tokens=64).tokens
        tail = plain[-24:]
        period = next(p for p in range(1, 13) if tail[p:] == tail[:-p])
        r = glimmer_mlx.generate(model, prompt, max_tokens=64, drafter=NGramDrafter(48, max_drafts=8))
        assert r.tokens == plain
        hist = r.stats.extra["acceptance_histogram"]
        if period < 8:
            beyond += 1
            # tokens a round committed: its accepted drafts + the target's own
            assert max(int(n) for n, c in hist.items() if c) - 1 > period, (period, hist)
    assert beyond >= 2  # the cycles were short enough to tell


def test_ngram_sampling_matches_target_distribution(tiny_checkpoint):
    from glimmer_mlx.sampling import SamplingParams
    from test_dflash import V_SMALL, _exact_joint, _marginal_tests, _spec_counts

    path, _ = tiny_checkpoint(seed=3, vocab_size=V_SMALL)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    params = SamplingParams(temperature=1.0)
    prompt = [3, 7, 2, 3, 7, 2, 3]  # the suffix recurs: drafts [7, 2] are proposed from the first round
    n = 600
    counts = _spec_counts(model, NGramDrafter(V_SMALL, max_drafts=2), prompt, params, n)
    assert _marginal_tests(counts, _exact_joint(model, prompt, params), n) < 1.0
