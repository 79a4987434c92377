"""PromptCache (glimmer_mlx/prompt_cache.py): copies, longest-prefix choice, LRU order, byte budget, dominated
entries, the prefix cap, sliding windows that cannot go back, and reuse on the embedded model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.cache import CacheRewindError, KVCache, rewind_cache
from glimmer_mlx.prompt_cache import (
    Hit,
    PromptCache,
    copy_cache,
    min_keep,
    prefix_length,
)

H, D = 2, 4
ROW_BYTES = 2 * H * D * 4  # keys + values of one position in one layer, float32


def rows(n: int, seed: int) -> tuple[mx.array, mx.array]:
    g = np.random.default_rng(seed)
    return (mx.array(g.standard_normal((1, H, n, D)).astype(np.float32)),
            mx.array(g.standard_normal((1, H, n, D)).astype(np.float32)))


def make(n: int, seed: int = 0, windows=(None, None), max_rewind: int = 4, chunk: int = 7,
         step: int = 16) -> list[KVCache]:
    """A cache of len(windows) layers holding n positions of random rows (appended `chunk` at a time, so sliding
    layers compact as in a real prefill; buffers grow by `step` rows, so a sliding window wraps soon)."""
    cache = [KVCache(window=w, max_rewind=max_rewind) for w in windows]
    for li, c in enumerate(cache):
        c.step = step
        k, v = rows(n, seed * 100 + li)
        for s in range(0, n, chunk):
            c.update(k[..., s : s + chunk, :], v[..., s : s + chunk, :])
    return cache


def snap(cache: list[KVCache]) -> list[tuple]:
    """(positions, keys, values) of every layer's valid rows, as numpy."""
    out = []
    for c in cache:
        if c.keys is None:
            out.append((c.start, c.offset, None, None))
            continue
        k, v, p0 = c.view()
        out.append((p0, c.offset, np.array(k), np.array(v)))
    return out


def assert_same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:2] == y[:2]
        if x[2] is None:
            assert y[2] is None
            continue
        np.testing.assert_array_equal(x[2], y[2])
        np.testing.assert_array_equal(x[3], y[3])


def truncated(s: list[tuple], n: int) -> list[tuple]:
    """What snap() of a cache rewound to n positions shows."""
    return [(p0, n, k[..., : n - p0, :], v[..., : n - p0, :]) for p0, _, k, v in s]


def entry_bytes(cache: list[KVCache]) -> int:
    return sum(c.rows for c in cache) * ROW_BYTES


# -- copy_cache ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("windows", [(None, None), (8, None)])
def test_copy_is_independent(windows):
    orig = make(30, seed=1, windows=windows)
    before = snap(orig)
    cp = copy_cache(orig)
    assert_same(snap(cp), before)
    for c, d in zip(orig, cp):
        assert (d.window, d.max_rewind, d.origin, d.start, d.offset) == (c.window, c.max_rewind, c.origin, c.start,
                                                                         c.offset)
        assert d.keys is not c.keys and d.values is not c.values
        assert d.keys.shape[2] == d.rows  # only the valid rows
    # a fetched copy is rewound and extended over rows the original still holds
    rewind_cache(cp, 3)
    for li, c in enumerate(cp):
        c.update(*rows(3, 900 + li))
    mx.eval([a for c in cp for a in c.state])
    assert_same(snap(orig), before)
    # and the other way round
    cp_before = snap(cp)
    rewind_cache(orig, 2)
    for li, c in enumerate(orig):
        c.update(*rows(9, 700 + li))
    assert_same(snap(cp), cp_before)


def test_copy_behaves_like_the_original():
    """A copy of a wrapped sliding-window cache extends, masks and rewinds as the original would (it may keep
    fewer spare rows than the original's buffer happened to hold, never fewer than max_rewind)."""
    MR = 3
    a = make(40, seed=2, windows=(8, None), max_rewind=MR)
    assert a[0].start > 0  # wrapped
    b = copy_cache(a)
    for step in range(4):
        for li, (x, y) in enumerate(zip(a, b)):
            new = rows(5, 50 + 10 * step + li)
            kx, vx, m_x = x.update(*new)
            ky, vy, m_y = y.update(*new)
            np.testing.assert_array_equal(np.array(kx), np.array(ky))
            np.testing.assert_array_equal(np.array(vx), np.array(vy))
            assert (m_x is None) == (m_y is None)
            if m_x is not None:
                np.testing.assert_array_equal(np.array(m_x), np.array(m_y))
            lo = x.offset - (x.retained or x.offset)  # the rows both must still hold
            np.testing.assert_array_equal(np.array(x.view(lo)[0]), np.array(y.view(lo)[0]))
            for n in range(MR + 1):
                x.check_rewind(n)
                y.check_rewind(n)


def test_copy_to_offset():
    a = make(40, seed=3, windows=(8, None), max_rewind=4)  # sliding layer wrapped
    mk = min_keep(a)
    assert 0 < mk < 40
    want = truncated(snap(a), mk)
    assert_same(snap(copy_cache(a, mk)), want)
    with pytest.raises(CacheRewindError):
        copy_cache(a, mk - 1)
    assert a[0].offset == 40 and a[1].offset == 40


def test_min_keep_matches_check_rewind():
    for n, windows, mr in [(30, (None,), 4), (6, (8,), 2), (30, (8, None), 2), (100, (16, 8), 5), (0, (8,), 2)]:
        cache = make(n, seed=n, windows=windows, max_rewind=mr)
        brute = 0
        while True:
            try:
                for c in cache:
                    c.check_rewind(n - brute)
                break
            except CacheRewindError:
                brute += 1
        assert min_keep(cache) == brute, (n, windows, mr)


def test_prefix_length():
    a = list(range(1000))
    assert prefix_length(a, a) == 1000
    assert prefix_length(a, a[:300] + [-1]) == 300
    assert prefix_length(a, a[:256] + [-1]) == 256
    assert prefix_length(a, [5]) == 0
    assert prefix_length([], a) == 0
    assert prefix_length([("image", "h", 0), 3], [("image", "h", 0), 4]) == 1


# -- fetch -----------------------------------------------------------------------------------------------------------
def test_hit_miss_and_longest_prefix():
    pc = PromptCache(max_bytes=1 << 30)
    A = list(range(1, 11))
    B = [1, 2, 3, 20, 21, 22, 23, 24]
    C = [50, 51, 52]
    caches = {"A": make(len(A), 1), "B": make(len(B), 2), "C": make(len(C), 3)}
    snaps = {k: snap(v) for k, v in caches.items()}
    for name, keys in (("A", A), ("B", B), ("C", C)):
        assert pc.insert(keys, caches[name], extra=name)
    assert len(pc) == 3

    hit = pc.fetch([1, 2, 3, 4, 5, 99])
    assert isinstance(hit, Hit) and hit and (hit.reused, hit.extra, hit.entry_length) == (5, "A", 10)
    assert_same(snap(hit.cache), truncated(snaps["A"], 5))

    hit = pc.fetch([1, 2, 3, 20, 21, 22, 30])
    assert (hit.reused, hit.extra, hit.entry_length) == (6, "B", 8)
    assert_same(snap(hit.cache), truncated(snaps["B"], 6))

    hit = pc.fetch([1, 2, 3, 77])  # A and B share 3 positions: the most recently used (B) wins the tie
    assert (hit.reused, hit.extra) == (3, "B")
    assert_same(snap(hit.cache), truncated(snaps["B"], 3))
    pc.fetch([1, 2, 3, 4, 0])  # now A
    hit = pc.fetch([1, 2, 3, 77])
    assert (hit.reused, hit.extra) == (3, "A")
    assert_same(snap(hit.cache), truncated(snaps["A"], 3))

    for miss in ([7, 8, 9], [], [50], [2, 1]):
        hit = pc.fetch(miss)
        assert not hit and (hit.cache, hit.reused, hit.extra, hit.entry_length) == (None, 0, None, 0)
    assert (pc.stats.hits, pc.stats.misses, pc.stats.reused_tokens) == (5, 4, 21)
    assert pc.stats_dict()["entries"] == 3


def test_fetch_leaves_one_token_to_prefill():
    pc = PromptCache(max_bytes=1 << 30)
    A = list(range(100, 112))
    orig = make(len(A), 4)
    s = snap(orig)
    pc.insert(A, orig)
    hit = pc.fetch(A)  # the same prompt again: its last token is prefilled for the logits
    assert hit.reused == len(A) - 1 and hit.cache[0].offset == len(A) - 1
    assert_same(snap(hit.cache), truncated(s, len(A) - 1))
    hit = pc.fetch(A + [1, 2])  # a longer prompt: the whole entry
    assert hit.reused == len(A) and hit.cache[0].offset == len(A)
    assert not pc.fetch(A[:1])  # one token: nothing can be reused


def test_fetched_copy_is_independent():
    pc = PromptCache(max_bytes=1 << 30)
    A = list(range(20))
    orig = make(len(A), 5, windows=(8, None), max_rewind=8)
    s = snap(orig)
    pc.insert(A, orig)
    hit = pc.fetch(A[:15] + [99, 98, 97, 96, 95])
    assert hit.reused == 15
    for li, c in enumerate(hit.cache):  # prefill the new tail over rows the entry still holds
        c.update(*rows(5, 300 + li))
    mx.eval([a for c in hit.cache for a in c.state])
    assert_same(snap(pc.entries()[0].cache), s)
    again = pc.fetch(A + [1])
    assert again.reused == len(A)
    assert_same(snap(again.cache), s)


# -- LRU and the byte budget ------------------------------------------------------------------------------------------
def test_lru_evicts_least_recently_used():
    n = 10
    one = 2 * n * ROW_BYTES  # an entry of n positions in 2 full layers
    pc = PromptCache(max_bytes=3 * one)
    A, B, C, Dk = ([base + i for i in range(n)] for base in (1000, 2000, 3000, 4000))
    for keys, seed in ((A, 1), (B, 2), (C, 3)):
        assert pc.insert(keys, make(n, seed))
    assert pc.nbytes == 3 * one
    assert pc.fetch(A[:5] + [0]).reused == 5  # A is now the most recently used; B the oldest
    assert pc.insert(Dk, make(n, 4))
    left = {e.keys[0] for e in pc.entries()}
    assert left == {1000, 3000, 4000}, left  # FIFO would have dropped A
    assert pc.stats.evictions == 1 and pc.nbytes == 3 * one
    assert not pc.fetch(B[:5] + [0])
    assert pc.insert(B, make(n, 2))  # now C is the oldest
    assert {e.keys[0] for e in pc.entries()} == {1000, 4000, 2000}


def test_max_entries():
    pc = PromptCache(max_bytes=1 << 30, max_entries=2)
    for base in (10, 20, 30):
        pc.insert([base, base + 1, base + 2], make(3, base))
    assert len(pc) == 2 and [e.keys[0] for e in pc.entries()] == [20, 30]
    assert pc.stats.evictions == 1


def test_byte_accounting():
    pc = PromptCache(max_bytes=2 * 50 * ROW_BYTES + 2 * 30 * ROW_BYTES)
    a, b, c = make(50, 1), make(30, 2), make(40, 3)
    assert a[0].keys.shape[2] == 64  # capacity rounded up: the stored entry is compacted to its rows
    assert pc.insert(range(50), a)
    assert pc.nbytes == entry_bytes(a) == 2 * 50 * ROW_BYTES
    assert pc.insert(range(100, 130), b)
    assert pc.nbytes == entry_bytes(a) + entry_bytes(b) == pc.max_bytes
    assert pc.insert(range(200, 240), c)  # over budget: the oldest (a) goes
    assert [e.keys[0] for e in pc.entries()] == [100, 200]
    assert pc.nbytes == entry_bytes(b) + entry_bytes(c) == sum(sum(x.nbytes for x in e.cache) for e in pc.entries())
    assert pc.nbytes <= pc.max_bytes
    big = make(200, 4)
    assert not pc.insert(range(1000, 1200), big)  # larger than the whole budget: refused, nothing evicted
    assert len(pc) == 2 and pc.stats.rejected == 1 and pc.nbytes == entry_bytes(b) + entry_bytes(c)
    assert not pc.fetch(list(range(1000, 1010)))
    # extra bytes count too
    assert pc.insert(range(300, 310), make(10, 5), extra="s", extra_nbytes=7)
    assert pc.nbytes == sum(e.nbytes for e in pc.entries())
    assert pc.entries()[-1].nbytes == 2 * 10 * ROW_BYTES + 7
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0


# -- dominated entries -------------------------------------------------------------------------------------------------
def test_prefix_entry_is_replaced():
    pc = PromptCache(max_bytes=1 << 30)
    A = list(range(40))
    pc.insert(A[:12], make(12, 1), extra="short")
    long = make(len(A), 2)
    s = snap(long)
    pc.insert(A, long, extra="long")
    assert len(pc) == 1 and pc.nbytes == entry_bytes(long) and pc.stats.replaced == 1
    hit = pc.fetch(A[:12] + [-1])
    assert (hit.reused, hit.extra) == (12, "long")
    assert_same(snap(hit.cache), truncated(s, 12))
    # identical keys: the new entry replaces the old one
    newer = make(len(A), 3)
    pc.insert(A, newer, extra="newer")
    assert len(pc) == 1 and pc.nbytes == entry_bytes(newer)
    hit = pc.fetch(A + [7])
    assert hit.extra == "newer"
    assert_same(snap(hit.cache), snap(pc.entries()[0].cache))
    # a prefix of a stored entry is not stored again: the stored one serves it
    assert not pc.insert(A[:20], make(20, 4))
    assert len(pc) == 1
    # nor are identical keys without an extra: the stored entry's extra (its drafters' states) is kept
    assert not pc.insert(A, make(len(A), 5))
    assert len(pc) == 1 and pc.fetch(A + [7]).extra == "newer" and pc.stats.replaced == 2


def test_an_entry_with_fewer_states_does_not_replace_one_with_more():
    """Extras that are mappings (a server's drafter states by kind): a conversation continued by a row that stopped
    carrying a drafter (its entry holds MTP's state only) keeps the shorter entry that holds DFlash's too — a fetch
    that needs DFlash's state finds it there and prefills only the rest — and the same conversation again with fewer
    states is not stored over the fuller entry; one with every state the shorter entry held replaces it as before.
    Catches: any mapping extra replacing the prefix entries it extends (the fuller states were lost, and the next
    request needing them prefilled the whole conversation again or went without the drafter)."""
    pc = PromptCache(max_bytes=1 << 30)
    A = list(range(40))
    both, mtp_only = {"dflash": 1, "mtp": 2}, {"mtp": 3}
    needs_dflash = lambda ex: isinstance(ex, dict) and "dflash" in ex  # noqa: E731
    assert pc.insert(A[:12], make(12, 1), extra=both)
    assert pc.insert(A, make(len(A), 2), extra=mtp_only)
    assert len(pc) == 2 and pc.stats.replaced == 0
    # `reusable` tells what a fetch would reuse, copying and counting nothing
    assert pc.reusable(A + [7]) == (40, mtp_only) and pc.reusable(A + [7], usable=needs_dflash) == (12, both)
    assert pc.reusable([999, 1]) == (0, None) and pc.stats.hits == pc.stats.misses == 0
    hit = pc.fetch(A + [7], usable=needs_dflash)
    assert (hit.reused, hit.extra) == (12, both)
    assert pc.fetch(A + [7]).extra == mtp_only  # the longest entry still serves whoever needs no DFlash
    # identical keys with fewer states: not stored, the fuller entry kept (and made most recently used)
    assert pc.insert(A[:12] + [90], make(13, 3), extra=both)
    assert not pc.insert(A[:12] + [90], make(13, 4), extra={"dflash": 5})
    assert pc.fetch(A[:12] + [90, 7]).extra == both
    # every state the shorter entries held, and more positions: they are replaced (A[:12] and A[:12] + [90])
    assert pc.insert(A[:12] + [90, 91], make(14, 5), extra={"dflash": 6, "mtp": 7, "other": 8})
    assert sorted(len(e.keys) for e in pc.entries()) == [14, 40] and pc.stats.replaced == 2


def test_prefix_entry_kept_when_the_new_one_cannot_rewind_to_it():
    pc = PromptCache(max_bytes=1 << 30)
    P = list(range(10))
    short = make(len(P), 1, windows=(8, None), max_rewind=2)
    s_short = snap(short)
    pc.insert(P, short, extra="short")
    L = P + list(range(100, 140))
    pc.insert(L, make(len(L), 2, windows=(8, None), max_rewind=2), extra="long")
    assert len(pc) == 2  # the long one's window wrapped: it cannot go back to 10 positions
    hit = pc.fetch(P + [-5, -6])
    assert (hit.reused, hit.extra) == (10, "short")
    assert_same(snap(hit.cache), s_short)
    hit = pc.fetch(L[:-1] + [-5])
    assert (hit.reused, hit.extra) == (len(L) - 1, "long")


# -- sliding windows that wrapped -------------------------------------------------------------------------------------
def test_wrapped_window_cannot_go_back_far():
    W, MR, n = 8, 2, 40
    pc = PromptCache(max_bytes=1 << 30)
    A = list(range(n))
    orig = make(n, 7, windows=(W, None), max_rewind=MR)
    s = snap(orig)
    assert orig[0].start > 0  # wrapped
    pc.insert(A, orig)
    mk = pc.entries()[0].min_keep
    assert mk == min_keep(orig) and 10 < mk <= n - MR
    hit = pc.fetch(A[:10] + [-1, -2])  # a short common prefix: no wrong cache, a miss
    assert not hit and hit.cache is None and pc.stats.unrewindable == 1
    hit = pc.fetch(A[: mk - 1] + [-1])
    assert not hit
    hit = pc.fetch(A[:mk] + [-1])  # as far back as the sliding layer can go: fine
    assert hit.reused == mk
    assert_same(snap(hit.cache), truncated(s, mk))
    for li, c in enumerate(hit.cache):
        c.update(*rows(3, 60 + li))  # the copy works as a cache
    # a shorter entry that can be cut back is the fallback
    pc.insert(A[:6] + [500, 501], make(8, 8, windows=(W, None), max_rewind=MR), extra="fallback")
    hit = pc.fetch(A[:10] + [-1])
    assert (hit.reused, hit.extra) == (6, "fallback")


def test_copy_extra():
    pc = PromptCache(max_bytes=1 << 30, copy_extra=lambda x: dict(x))
    state = {"drafter": 1}
    pc.insert([1, 2, 3, 4], make(4, 1), extra=state)
    hit = pc.fetch([1, 2, 3, 9])
    assert hit.extra == state and hit.extra is not state and hit.entry_length == 4


def test_insert_checks_keys_against_the_cache():
    pc = PromptCache(max_bytes=1 << 30)
    with pytest.raises(ValueError):
        pc.insert([1, 2, 3], make(4, 1))
    assert not pc.insert([], make(0, 1))
    assert len(pc) == 0


# -- the embedded model -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from glimmer_mlx.embedded import resolve_model
    from glimmer_mlx.loading import load

    m, tok = load(resolve_model(None))
    return m, tok


def _greedy(m, cache, logits, n):
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits, axis=-1).item())
        out.append(t)
        logits = m(mx.array([[t]], dtype=mx.int32), cache)[:, -1]
    return out


def _ids(tok, text):
    return tok.encode_text(text, add_special_tokens=True)


def test_reuse_on_the_embedded_model(model):
    from glimmer_mlx.runtime.prefill import prefill

    m, tok = model
    A = _ids(tok, "user: " + " ".join(f"agent one asks about item {i}." for i in range(12)) + "\nassistant: ok")
    B = _ids(tok, "user: " + " ".join(f"a second agent lists colour {i}." for i in range(12)) + "\nassistant: ")
    turn = tok.encode_text("\nuser: and now the next question, please?\nassistant:", add_special_tokens=False)
    pc = PromptCache(max_bytes=1 << 30)
    for ids in (A, B):
        cache = m.make_cache()
        prefill(m, cache, ids, 16)
        pc.insert(ids, cache)

    def check(prompt, want_reused):
        hit = pc.fetch(prompt)
        assert hit.reused == want_reused
        logits = prefill(m, hit.cache, prompt[hit.reused :], 16)
        fresh = m.make_cache()
        ref = prefill(m, fresh, prompt, 16)
        np.testing.assert_allclose(np.array(logits.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                                   atol=1e-4, rtol=1e-4)
        assert _greedy(m, hit.cache, logits, 8) == _greedy(m, fresh, ref, 8)

    check(A + turn, len(A))  # conversation A grows by a turn: only the turn is prefilled
    check(B + turn, len(B))
    k = len(A) - 20  # a re-rendered tail: the entry is rewound 20 positions
    check(A[:k] + turn, k)
    # the stored entries are unchanged by all that: A again
    check(A + turn, len(A))


def test_wrapped_window_on_the_embedded_model(model):
    """With few spare rows a long conversation's sliding layers cannot go back far: a short common prefix is a
    miss (never a cache rewound past what it holds), a long one is reused and exact."""
    from glimmer_mlx.runtime.prefill import prefill

    m, tok = model
    W = m.args.sliding_window
    A = _ids(tok, " ".join(f"line {i} of a long tool output." for i in range(60)))
    assert len(A) > W + 40
    cache = m.make_cache(max_rewind=4)
    prefill(m, cache, A, 32)
    pc = PromptCache(max_bytes=1 << 30)
    pc.insert(A, cache)
    mk = pc.entries()[0].min_keep
    assert W < mk <= len(A) - 4
    turn = tok.encode_text(" and then?", add_special_tokens=False)
    assert not pc.fetch(A[:W // 2] + turn)
    assert not pc.fetch(A[: mk - 1] + turn)
    hit = pc.fetch(A[:mk] + turn)
    assert hit.reused == mk
    logits = prefill(m, hit.cache, (A[:mk] + turn)[hit.reused :], 32)
    ref = prefill(m, m.make_cache(), A[:mk] + turn, 32)
    np.testing.assert_allclose(np.array(logits.astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=1e-4,
                               rtol=1e-4)
