"""The continuous-batching engine (`speculative.batch.BatchGenerator`, `cache.BatchKVCache`/`BatchLayout`,
`speculative.auto.batch.BatchAuto`) against solo decoding on the embedded model (target + DFlash + MTP).

Every test names, in a comment, the broken implementation it catches (each was tried by monkeypatching)."""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.cache import BatchKVCache, BatchLayout, KVCache, make_batch_cache
from glimmer_mlx.runtime.loop import GenerationStats, collect, stop_ids, stream
from glimmer_mlx.sampling import Sampler, SamplingParams, process
from glimmer_mlx.speculative.auto.batch import BatchAuto
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest
from glimmer_mlx.strategy import DecodeSpec, build_decoder

MODES = ("ar", "ngram", "dflash", "mtp")
TEXTS = ["def fibonacci(n):", "The capital of France is", "Write a JSON object with name and age:",
         "1, 2, 3, 4,", "Once upon a time"]
LONG_TEXT = ("import os\nimport sys\n\ndef main(argv):\n    for i, arg in enumerate(argv):\n        print(i, arg)\n"
             "    return 0\n\nif __name__ == '__main__':\n    sys.exit(main(sys.argv))\n") * 4


@pytest.fixture(scope="module")
def sess():
    from glimmer_mlx.session import load_session

    return load_session(None)


@pytest.fixture(scope="module")
def ids(sess):
    tok = sess.tokenizer
    out = [tok.encode(t) for t in TEXTS]
    long = tok.encode(LONG_TEXT)
    assert len(long) >= 150
    out.append(long[:40])  # > prefill_step=16: a chunked prefill (3 chunks)
    return out


def params(temp=0.0, **kw):
    return SamplingParams(temperature=temp, **kw)


def drafter_for(sess, mode):
    d, k = sess.drafters.resolve(DecodeSpec(mode, None))
    return (d.fork() if d is not None else None), k


def solo(sess, ids, mode, p, seed, n, eos=None, stop=None):
    """(tokens, text, finish_reason) of the request decoded alone."""
    d, k = drafter_for(sess, mode)
    dec = build_decoder(sess.model, d, Sampler(p, seed), drafts=k)
    st = GenerationStats()
    eos = stop_ids(sess.model, sess.tokenizer) if eos is None else eos
    r = collect(stream(dec, ids, max_tokens=n, eos=eos, tokenizer=sess.tokenizer, stop=stop, stats=st), st, True)
    return r.tokens, r.text, r.finish_reason


def request(sess, ids, mode, p, seed, n, eos=None, stop=None, **kw):
    d, k = drafter_for(sess, mode) if mode != "auto" else (None, None)
    eos = stop_ids(sess.model, sess.tokenizer) if eos is None else eos
    return BatchRequest(list(ids), Sampler(p, seed), n, eos, sess.tokenizer, stop=stop, drafter=d, width=k,
                        auto=mode == "auto", **kw)


def run(gen, plan, on_step=None, keep_cache=False):
    """plan: [(join step, BatchRequest)]. Steps until every row is done. Returns ({index: [tokens, text, finish]},
    {index: Row}). Checks the layout after every step: one length per row in the batch, each = committed positions
    (the history but its last token)."""
    out, rows, t = {}, {}, 0
    pending = sorted(enumerate(plan), key=lambda x: x[1][0])
    while pending or len(gen):
        while pending and pending[0][1][0] <= t:
            i, (_, req) = pending.pop(0)
            rows[i] = gen.add(req)
            out[i] = [[], "", None]
        index = {id(r): i for i, r in rows.items()}
        for r, ch in gen.step(keep_cache=keep_cache):
            o = out[index[id(r)]]
            assert o[2] is None, "a chunk after the row finished"
            o[0] += ch.tokens
            o[1] += ch.text
            o[2] = ch.finish_reason
        assert len(gen.layout) == len(gen.rows)
        assert gen.layout.lengths == [len(r.history) - 1 for r in gen.rows]
        for c in gen.cache:
            assert c.keys is None or c.keys.shape[0] == len(gen.rows)
        if on_step is not None:
            on_step(t, rows)
        t += 1
        assert t < 2000
    return out, rows


# -- 1. greedy: batched == solo ------------------------------------------------------------------------------------

MIXES = [("ar",) * 6, ("ngram",) * 6, ("dflash",) * 6, ("mtp",) * 6, ("ar", "dflash", "mtp", "ngram", "dflash", "ar")]


@pytest.mark.parametrize("modes", MIXES, ids=["ar", "ngram", "dflash", "mtp", "mixed"])
def test_greedy_batched_equals_solo(sess, ids, modes):
    """Rows join at different steps (one mid-chunked-prefill of another), prompts of different lengths (one of 40
    tokens, prefilled in 16-token chunks), different max_tokens. Catches: a row's keys written at the wrong
    position (BatchKVCache.update offsets), masks that ignore row lengths or let a row see another's padding, RoPE
    offsets shared by the batch, the committed length off by one (layout.commit), a chunked prefill that drops or
    repeats a chunk, taps sliced from the wrong row, a drafter state shared between rows."""
    gen = BatchGenerator(sess.model, prefill_step=16)
    joins = [0, 0, 2, 5, 1, 9]
    maxes = [24, 17, 30, 9, 21, 26]
    plan = [(joins[i], request(sess, ids[i], modes[i], params(), 0, maxes[i])) for i in range(6)]
    out, _ = run(gen, plan)
    for i in range(6):
        ref = solo(sess, ids[i], modes[i], params(), 0, maxes[i])
        assert out[i][0] == ref[0], (i, modes[i])
        assert out[i][1] == ref[1] and out[i][2] == ref[2], (i, modes[i])
    assert len(gen.rows) == 0 and len(gen.waiting) == 0
    assert max(gen.step_rows) >= 3  # they really shared steps


def test_auto_rows_greedy_equal_plain_solo(sess, ids):
    """auto rows (the batch's chooser picks the option and width per step) next to fixed rows. Catches: an auto
    row verified against the wrong drafts, an option's state not advanced with the row's commits (`Row.accept` for
    every drafter in `options`), the width capped wrongly by the budget (tokens past max_tokens)."""
    gen = BatchGenerator(sess.model, prefill_step=16, auto=sess.drafters.batch_auto())
    closed = []
    close_row = gen.auto.close_row
    gen.auto.close_row = lambda here: (closed.append(here), close_row(here))
    modes = ["auto", "auto", "dflash", "auto", "ar", "auto"]
    maxes = [20, 13, 18, 25, 11, 22]
    plan = [(i, request(sess, ids[i], modes[i], params(), 0, maxes[i])) for i in range(6)]
    out, rows = run(gen, plan)
    assert len(closed) == modes.count("auto")  # each auto row's measure joins the spread between requests
    for i in range(6):
        ref = solo(sess, ids[i], "ar", params(), 0, maxes[i])
        assert out[i][0] == ref[0], (i, modes[i])
        assert out[i][2] == ref[2]
    assert all(rows[i].stats.mode == "auto" for i in range(6) if modes[i] == "auto")


def test_auto_rows_offer_a_copy_they_follow_as_its_own_option(sess, ids, monkeypatch):
    """A batch's auto row names its n-gram offers as the solo auto does (`NGramDrafter.offer`): an offer that goes
    on with a copy the row's committed tokens confirmed is "ngram@run", drafted from where its estimate pays, and the
    output stays plain decoding's. Catches: a row's offers named by matched size only (its run never offered), a
    row's offers compared with another row's. The batch is held open (`BatchAuto.closed`) and asking every step
    (`BatchAuto.asks`): the session's auto is shared with the tests before, whose timings can leave its ledger barring
    speculation or a check due, or its asks quiet, and a closed batch asks its rows nothing (CI once failed this
    way)."""
    auto = sess.drafters.batch_auto()
    monkeypatch.setattr(auto, "closed", lambda fixed_width: False)
    monkeypatch.setattr(auto, "asks", lambda: True)
    offered = []
    real = auto.choose
    monkeypatch.setattr(auto, "choose", lambda rows, *a: (offered.extend(set(row[2]) for row in rows),
                                                          real(rows, *a))[1])
    stats = auto.acceptance("ngram@run", "greedy")  # shared with the session's auto: restored afterwards
    saved = (stats.acc[:], stats.tried[:], stats.shrink)
    stats.set_alphas([0.95])
    try:
        gen = BatchGenerator(sess.model, prefill_step=16, auto=auto)
        prompt = ids[4][:30] * 2  # the answer soon repeats what the prompt holds
        plan = [(0, request(sess, prompt, "auto", params(), 0, 40)),
                (1, request(sess, ids[0], "auto", params(), 0, 30))]
        out, _ = run(gen, plan)
    finally:
        stats.acc, stats.tried, stats.shrink = saved
    assert out[0][0] == solo(sess, prompt, "ar", params(), 0, 40)[0]
    assert out[1][0] == solo(sess, ids[0], "ar", params(), 0, 30)[0]
    assert any("ngram@run" in o for o in offered)


# -- 2. seeded sampling ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", [{"top_p": 0.9}, {"repetition_penalty": 1.2}], ids=["top_p", "penalty"])
def test_seeded_sampling_batched_equals_solo(sess, ids, mode, extra):
    """T=1, the same seed per request: the same tokens batched as alone. Catches: a sampler shared by the rows (or
    called in another order than the solo decoder: an extra draw per step), the penalty window built from the
    batch's history instead of the row's, draft probabilities q taken from the wrong row."""
    p = params(1.0, **extra)
    gen = BatchGenerator(sess.model, prefill_step=16)
    plan = [(j, request(sess, ids[i], mode, p, 100 + i, 20)) for j, i in enumerate([0, 2, 5, 3])]
    out, _ = run(gen, plan)
    for j, i in enumerate([0, 2, 5, 3]):
        assert out[j][0] == solo(sess, ids[i], mode, p, 100 + i, 20)[0], (mode, i)


class FirstFixed:
    """A sampler whose first draw (the prefill's token) is `first`, then the real seeded sampler: the second token
    is the first one the batched decode step samples."""

    def __init__(self, inner: Sampler, first: int):
        self.inner, self.first, self.calls = inner, first, 0
        self.params = inner.params

    def __call__(self, logits, history=None):
        self.calls += 1
        if self.calls == 1:
            return mx.array([self.first], dtype=mx.int32)
        return self.inner(logits, history)

    def __getattr__(self, name):
        return getattr(self.inner, name)


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}  # p = 0.001


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_sampled_token_distribution_matches_target(sess, ids, mode):
    """300 rows (batches of up to 16, joining as others leave), T=1, top_k=8: the distribution of the first token
    the batched decode step samples (after a fixed prompt and a fixed first token) against the target's exact
    softmax from a solo forward (`sampling.process`); chi-square at p = 0.001. In dflash mode the token comes out of
    `verify_sampling` (accept a draft or resample the residual). Catches: sampling from the padded row's (or
    another row's) logits, a verify that always accepts the draft, a residual not normalised against q."""
    p = params(1.0, top_k=8)
    prompt = ids[1]
    first = solo(sess, prompt, "ar", params(), 0, 1)[0][0]
    logits = sess.model(mx.array([prompt + [first]], dtype=mx.int32), sess.model.make_cache())[0, -1:]
    probs = np.array(mx.exp(process(logits, p)).astype(mx.float32)[0])
    N = 300
    gen = BatchGenerator(sess.model, max_batch=16)
    counts = Counter()
    rows = []
    for s in range(N):
        req = request(sess, prompt, mode, p, 1000 + s, 3)  # budget 2 after the prefill: dflash drafts 1
        req.sampler = FirstFixed(req.sampler, first)
        rows.append(gen.add(req))
    while len(gen):
        gen.step()
        assert len(gen.rows) <= 16
    for r in rows:
        assert r.out.finish == "length" and r.history[len(prompt)] == first
        if mode == "dflash":
            assert r.rounds - r.plain_rounds == 1  # its first decode round drafted: the token came out of verify_sampling
        counts[r.history[len(prompt) + 1]] += 1
    support = set(np.nonzero(probs > 0)[0].tolist())
    assert set(counts) <= support, (set(counts) - support)
    # bins: every token expected >= 5 times alone, the rest merged
    order = sorted(support, key=lambda t: -probs[t])
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for t in order:
        e = N * probs[t]
        if e >= 5:
            obs.append(counts[t])
            exp.append(e)
        else:
            rest_o += counts[t]
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    df = len(obs) - 1
    assert df >= 1, probs[order]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    assert chi2 < CHI2_999[df], (chi2, df, obs, [round(e, 1) for e in exp])


# -- 3. cancel -----------------------------------------------------------------------------------------------------

def test_cancel_frees_the_row_and_others_are_unchanged(sess, ids):
    """Catches: a cancelled row kept in the layout (its length stays and the caches keep B rows), `_leave` keeping
    the wrong rows (remove_rows / layout.keep out of step: another row continues on the cancelled row's keys), a
    chunk produced for a cancelled row."""
    gen = BatchGenerator(sess.model, prefill_step=16)
    modes = ["dflash", "ar", "mtp", "ngram"]
    plan = [(0, request(sess, ids[i], modes[i], params(), 0, 30)) for i in range(4)]
    sizes = []

    def on_step(t, rows):
        sizes.append(len(gen.rows))
        if t == 8:
            assert len(gen.rows) == 4
            gen.cancel(rows[1])
            gen.cancel(rows[2])  # two at once, one in the middle of the layout

    out, rows = run(gen, plan, on_step=on_step)
    assert sizes[9] == 2, sizes  # freed at the very next step
    assert rows[1].cancelled and rows[1].out.finish is None and out[1][2] is None
    assert len(out[1][0]) < 30 and len(out[2][0]) < 30
    for i in (0, 3):
        assert out[i][0] == solo(sess, ids[i], modes[i], params(), 0, 30)[0], i
    # a row cancelled while still waiting for its prefill never joins
    gen = BatchGenerator(sess.model, prefill_step=16)
    r = gen.add(request(sess, ids[5], "ar", params(), 0, 5))
    gen.step()  # its first chunk
    gen.cancel(r)
    assert gen.step() == [] and len(gen) == 0


# -- 4. EOS, stop strings, max_tokens --------------------------------------------------------------------------------

def test_eos_stop_strings_and_max_tokens_per_row(sess, ids):
    """Each row its own end: EOS in the middle of a speculative block (tokens after it dropped), a stop string
    (text cut, finish "stop"), max_tokens hit inside a verify block (finish "length", never more tokens), and a row
    whose first token is EOS (finishes in its prefill, never joins the batch). Catches: one row's EOS set applied
    to another, tokens past max_tokens when a block overshoots, a first-token EOS row added to the layout."""
    tok = sess.tokenizer
    ref = {m: solo(sess, ids[0], m, params(), 0, 30, eos=set())[0] for m in ("dflash", "ar")}
    j = next(j for j in range(4, 30) if ref["dflash"][j] not in ref["dflash"][:j])
    eos_mid = {ref["dflash"][j]}
    text = tok.decode(ref["ar"])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    first_eos = {solo(sess, ids[2], "ar", params(), 0, 1, eos=set())[0][0]}
    reqs = [request(sess, ids[0], "dflash", params(), 0, 30, eos=eos_mid),
            request(sess, ids[0], "ar", params(), 0, 30, eos=set(), stop=[stop]),
            request(sess, ids[0], "dflash", params(), 0, 7, eos=set()),
            request(sess, ids[2], "mtp", params(), 0, 30, eos=first_eos),
            request(sess, ids[3], "ngram", params(), 0, 13)]
    joined = []
    gen = BatchGenerator(sess.model)
    out, rows = run(gen, [(0, r) for r in reqs], on_step=lambda t, rows: joined.extend(id(r) for r in gen.rows))
    assert out[0][0] == ref["dflash"][:j] and out[0][2] == "stop"
    assert out[0][0] == solo(sess, ids[0], "dflash", params(), 0, 30, eos=eos_mid)[0]
    r1 = solo(sess, ids[0], "ar", params(), 0, 30, eos=set(), stop=[stop])
    assert (out[1][1], out[1][2]) == (r1[1], "stop") and stop not in out[1][1]
    assert out[2][0] == ref["dflash"][:7] and out[2][2] == "length"
    assert out[3] == [[], "", "stop"] and id(rows[3]) not in joined
    assert out[4][0] == solo(sess, ids[3], "ngram", params(), 0, 13)[0] and out[4][2] == "length"
    assert all(len(out[i][0]) == rows[i].stats.generation_tokens for i in range(5))


# -- 5. finished rows hand back a solo cache -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_finished_cache_continues_like_a_fresh_prefill(sess, ids, mode):
    """step(keep_cache=True): Row.final_cache holds exactly the committed positions (prompt + all generated tokens
    but the last), sliding-window layers retained as a solo cache would (one prompt longer than the window and its
    rewind margin).
    Prefilling the rest of a longer prompt on it gives a fresh prefill's logits. Catches: row_cache of the wrong
    row (after another row left), a final cache that keeps rejected drafts (length = fed, not committed), a
    sliding layer cut to the window without the rewind margin, final_cache taken after the rows were removed."""
    tok = sess.tokenizer
    long = tok.encode(LONG_TEXT * 2)
    prompts = [long[:300], ids[0], long[:90]]  # 300 > window - 1 + max_rewind: the sliding layers drop rows
    gen = BatchGenerator(sess.model)
    plan = [(0, request(sess, prompts[0], mode, params(), 0, 12)), (0, request(sess, prompts[1], "ar", params(), 0, 5)),
            (1, request(sess, prompts[2], mode, params(), 0, 20))]
    out, rows = run(gen, plan, keep_cache=True)
    more = tok.encode(" and then some more text follows here")
    for i in (0, 2):
        r = rows[i]
        fc = r.final_cache
        assert fc is not None and len(fc) == len(sess.model.make_cache())
        full = r.history[:-1]
        assert full == prompts[i] + out[i][0][:-1]
        assert all(c.offset == len(full) for c in fc)
        for c, ref_c in zip(fc, sess.model.make_cache()):
            assert c.window == ref_c.window
            if c.window is not None:
                assert c.start == max(0, len(full) - c.retained)
                assert (c.start > 0) == (i == 0)
        rest = [r.history[-1]] + more
        got = sess.model(mx.array([rest], dtype=mx.int32), fc)
        fresh = sess.model(mx.array([full + rest], dtype=mx.int32), sess.model.make_cache())[:, -len(rest):]
        np.testing.assert_allclose(np.array(got), np.array(fresh), atol=1e-4)
    assert rows[1].final_cache is not None and rows[1].final_cache[0].offset == len(rows[1].history) - 1


def test_one_token_request_hands_back_its_prompt_cache(sess, ids):
    """A request done at its first token (max_tokens 1) never joins the batch; with keep_cache its solo prefill
    cache is its final cache (the whole prompt), so a server's prompt cache learns from it. Catches: a final cache
    only for rows that joined (a 1-token warm-up then cached nothing)."""
    gen = BatchGenerator(sess.model)
    out, rows = run(gen, [(0, request(sess, ids[0], "ar", params(), 0, 1))], keep_cache=True)
    fc = rows[0].final_cache
    assert len(out[0][0]) == 1 and fc is not None and all(c.offset == len(ids[0]) for c in fc)
    rest = [rows[0].history[-1]]
    got = sess.model(mx.array([rest], dtype=mx.int32), fc)
    fresh = sess.model(mx.array([ids[0] + rest], dtype=mx.int32), sess.model.make_cache())[:, -1:]
    np.testing.assert_allclose(np.array(got), np.array(fresh), atol=1e-4)


# -- 6. BatchLayout / BatchKVCache -----------------------------------------------------------------------------------

def test_layout_masks():
    """Catches: a mask that ignores a row's length (causal over the padded block from 0), a window off by one,
    padded queries (past a short row's block) with no key at all (NaN softmax)."""
    lay = BatchLayout([3, 0, 7])
    for window in (None, 3):
        L = 4
        m = np.array(lay.mask(L, window))
        N = 7 + L
        assert m.shape == (3, 1, L, N)
        for b, n in enumerate(lay.lengths):
            for j in range(L):
                q = n + j
                for k in range(N):
                    want = k <= q and (window is None or k > q - window)
                    assert m[b, 0, j, k] == want, (b, j, k, window)
                assert m[b, 0, j, q]  # its own key
    np.testing.assert_array_equal(np.array(lay.offsets()), [3, 0, 7])
    lay.commit(1, 2)
    lay.rewind(2, 3)
    assert lay.lengths == [3, 2, 4] and np.array(lay.offsets()).tolist() == [3, 2, 4]
    m = np.array(lay.mask(1, None))  # memo cleared by commit/rewind
    assert m.shape == (3, 1, 1, 5) and m[1, 0, 0].tolist() == [True, True, True, False, False]
    lay.keep([2, 0])
    assert lay.lengths == [4, 3] and np.array(lay.offsets()).tolist() == [4, 3]
    assert lay.append(0) == 2
    with pytest.raises(Exception):
        lay.rewind(0, 5)


def test_put_row_remove_rows_row_cache():
    """put_row from a wrapped sliding-window solo cache (rows before its start stay zero), remove_rows keeping an
    order, row_cache back to a solo cache with what a solo one retains. Catches: put_row writing at buffer row 0
    instead of the solo cache's first position, remove_rows taking the wrong rows, row_cache ignoring the window."""
    rng = np.random.default_rng(0)
    H, D, W = 2, 4, 4
    solos = []
    for n, window in ((30, W), (5, W), (12, None)):
        c = KVCache(window=window, max_rewind=2)
        c.step = 6  # small buffers: the sliding cache compacts (drops rows its window no longer sees)
        for s in range(0, n, 3):  # in blocks: the sliding one wraps (its start moves past 0)
            L = min(3, n - s)
            c.update(mx.array(rng.standard_normal((1, H, L, D)), dtype=mx.float32),
                     mx.array(rng.standard_normal((1, H, L, D)), dtype=mx.float32))
        solos.append(c)
    assert solos[0].start > 0
    lay = BatchLayout()
    bcs = {W: BatchKVCache(lay, window=W), None: BatchKVCache(lay, window=None)}
    for c in solos:
        b = lay.append(c.offset)
        bcs[W].put_row(b, c)  # all three into the windowed layer (the unit under test)
    bc = bcs[W]
    for b, c in enumerate(solos):
        k, v, first = c.view(0)
        np.testing.assert_array_equal(np.array(bc.keys[b : b + 1, :, first : c.offset]), np.array(k))
        np.testing.assert_array_equal(np.array(bc.values[b : b + 1, :, first : c.offset]), np.array(v))
        assert not np.array(bc.keys[b, :, :first]).any()
        back = bc.row_cache(b, max_rewind=2)
        assert back.offset == c.offset and back.window == W
        assert back.start == max(0, c.offset - back.retained)
        kk, vv, f2 = back.view(0)
        lo = back.start - first
        assert lo >= 0
        np.testing.assert_array_equal(np.array(kk), np.array(k[:, :, lo:]))
    keys_before = np.array(bc.keys)
    bc.remove_rows([2, 0])
    lay.keep([2, 0])
    assert bc.keys.shape[0] == 2
    np.testing.assert_array_equal(np.array(bc.keys[0]), keys_before[2])
    np.testing.assert_array_equal(np.array(bc.keys[1]), keys_before[0])
    # update writes each row at its own length, and returns the keys from the first one the shorter row's window
    # sees (12 - W + 1 = 9) with the masks of those lengths
    k_new = mx.array(rng.standard_normal((2, H, 2, D)), dtype=mx.float32)
    keys, values, mask = bc.update(k_new, k_new)
    lo = 12 - W + 1
    assert keys.shape[2] == 32 - lo and mask.shape == (2, 1, 2, 32 - lo)
    for b, n in enumerate([12, 30]):
        np.testing.assert_array_equal(np.array(bc.keys[b, :, n : n + 2]), np.array(k_new[b]))
        np.testing.assert_array_equal(np.array(keys[b, :, n - lo : n - lo + 2]), np.array(k_new[b]))
        for j in range(2):  # each query sees its own window, positions n + j - W + 1 .. n + j
            want = [n + j - W < p <= n + j for p in range(lo, 32)]
            assert np.array(mask[b, 0, j]).tolist() == want, (b, j)
    np.testing.assert_array_equal(np.array(keys[1, :, : 30 - lo]), np.array(keys_before[0][:, lo:30]))


def prefilled_batch(model, prompts):
    """(layout, batch caches, solo caches): each prompt prefilled alone, then copied in as a row of one batch."""
    layout, bcache = make_batch_cache(model.args)
    solos = []
    for p in prompts:
        c = model.make_cache()
        model(mx.array([p], dtype=mx.int32), c)
        b = layout.append(c[0].offset)
        for bc, sc in zip(bcache, c):
            bc.put_row(b, sc)
        solos.append(c)
    return layout, bcache, solos


def test_batched_forward_equals_solo_forward_for_ragged_blocks(sess, ids):
    """Three rows (5, 40 and 150 tokens: past the 128-token sliding window), blocks of 1, 3 and 4 tokens padded to
    4, then a second step after committing each row's block: every real position's logits equal a solo forward's.
    Catches: padding keys visible to the next step (commit counts fed instead of real tokens), RoPE at the wrong
    offsets, a windowed layer's mask not applied in the batch."""
    model, tok = sess.model, sess.tokenizer
    long = tok.encode(LONG_TEXT)
    layout, bcache, solos = prefilled_batch(model, [ids[3][:5], long[:40], long[:150]])
    rng = np.random.default_rng(1)
    for widths in ([1, 3, 4], [2, 1, 2]):
        L = max(widths)
        blocks = [rng.integers(10, 1000, size=w).tolist() for w in widths]
        x = mx.array([bl + [bl[-1]] * (L - len(bl)) for bl in blocks], dtype=mx.int32)
        got = model(x, bcache)
        for b, bl in enumerate(blocks):
            ref = model(mx.array([bl], dtype=mx.int32), solos[b])
            np.testing.assert_allclose(np.array(got[b, : len(bl)]), np.array(ref[0]), atol=1e-4)
            layout.commit(b, len(bl))
    assert layout.lengths == [c[0].offset for c in solos]


@pytest.mark.parametrize("cuts", [(150, 150), (150, 137), (150, 137, 141, 150, 133, 146)])
def test_batched_forward_past_the_window_equals_solo_forward(sess, cuts):
    """Rows past the 128-token sliding window, of one length (a 1-token step then needs no mask: `BatchLayout.mask`
    is None, every row written as one slice) and of several (the windowed layers' keys start where the shortest
    row's window does, `BatchLayout.first_key`; each row written as its own slice, or past `cache.SLICED_ROWS` rows
    by one scatter): steps of 1, 3 and 1 tokens, every real position's logits equal a solo forward's. Catches: keys
    cut at a longer row's window start (a shorter row loses keys it sees), a mask dropped where lengths differ, a
    row's keys written at another's length."""
    model, tok = sess.model, sess.tokenizer
    long = tok.encode(LONG_TEXT)
    assert len(long) >= max(cuts) + 3 * len(cuts) and min(cuts) > model.args.sliding_window
    layout, bcache, solos = prefilled_batch(model, [long[3 * i : 3 * i + n] for i, n in enumerate(cuts)])
    W = model.args.sliding_window
    assert layout.first_key(1, W) == min(cuts) - W + 1
    alike = len(set(cuts)) == 1
    assert (layout.mask(1, W) is None) == alike and (layout.mask(1, None) is None) == alike
    rng = np.random.default_rng(2)
    for L in (1, 3, 1):
        blocks = [rng.integers(10, 1000, size=L).tolist() for _ in cuts]
        got = model(mx.array(blocks, dtype=mx.int32), bcache)
        for b, bl in enumerate(blocks):
            ref = model(mx.array([bl], dtype=mx.int32), solos[b])
            np.testing.assert_allclose(np.array(got[b]), np.array(ref[0]), atol=1e-4)
            layout.commit(b, L)
    assert layout.lengths == [c[0].offset for c in solos]


# -- 7. BatchAuto.choose -------------------------------------------------------------------------------------------

@pytest.fixture
def ba(sess):
    """A BatchAuto over the session's auto with its acceptance tables restored afterwards (they are shared)."""
    auto = sess.drafters.auto()
    saved = {name: {key: (a.acc[:], a.tried[:], a.shrink) for key, a in o.stats.items()}
             for name, o in auto.chooser.options.items()}
    between = {name: dict(o.between) for name, o in auto.chooser.options.items()}
    for o in auto.chooser.options.values():
        o.between = {}  # how far requests differ (`Option.here_weight`): as a fresh process starts, whatever ran before
    b = BatchAuto(auto)
    b.draft_cost = lambda name, k: 1e-5 * k  # drafting nearly free: the tests are about the step cost
    yield b
    for name, o in auto.chooser.options.items():
        for key in [k for k in o.stats if k not in saved[name]]:
            del o.stats[key]
        for key, (acc, tried, shrink) in saved[name].items():
            a = o.stats[key]
            a.acc, a.tried, a.shrink = acc, tried, shrink
        o.between = between[name]


def phase_keys(ba, regime):
    """`regime` and its keys in every phase of a response (`BatchAuto.key`)."""
    return [regime] + [ba.key(regime, n) for n in (0, *(ba.chooser.phases or ()))]


def pin(ba, name, regime, alpha):
    """`name`'s estimates of `regime` pinned at `alpha`, in every phase as well."""
    for key in phase_keys(ba, regime):
        ba.acceptance(name, key).set_alphas([alpha])


def test_auto_speculates_when_verification_is_nearly_free(ba):
    """A flat cost curve (a step over 64 positions costs what one over 1 does) and good acceptance: speculate,
    each row with its best option, never more drafts than its budget allows. Catches: choose always plain, the
    budget cap ignored, the worse option picked."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.8)
    pin(ba, "mtp", "greedy", 0.3)
    rows = [("greedy", 100, {"dflash": 15, "mtp": 1}), ("greedy", 100, {"dflash": 15}), ("greedy", 3, {"dflash": 15})]
    k, plan = ba.choose(rows, 0, 1, 0.0, 15)
    assert k >= 4, (k, plan)
    assert plan[0][0] == "dflash" and plan[1][0] == "dflash" and plan[0][1] == k
    assert plan[2] == ("dflash", 2)  # budget 3: at most 2 drafts
    # with fixed rows in the batch too
    k2, _ = ba.choose(rows[:1], 3, 1, 3.0, 15)
    assert k2 > 0


def test_auto_plain_when_compute_bound(ba):
    """Step cost linear in the positions fed (compute-bound): E(k) < k + 1 drafted tokens per k + 1 positions, so
    plain wins at any acceptance. Also from `measured` alone (the calibration flat, the measured steps linear).
    Catches: choose ignoring the step cost of B·L positions (speculating whenever drafts are accepted), step_cost
    preferring the calibration over a measured n."""
    ba.curve = {n: 0.001 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.9)
    pin(ba, "mtp", "greedy", 0.9)
    rows = [("greedy", 100, {"dflash": 15, "mtp": 1})] * 4
    k, plan = ba.choose(rows, 0, 1, 0.0, 15)
    assert k == 0 and plan == [(None, 0)] * 4
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0  # the same rows speculate when verification is free
    ba.measured, ba.plain_by_rows = {n: 0.001 * n for n in range(1, 257)}, {}
    k, plan = ba.choose(rows, 0, 1, 0.0, 15)
    assert k == 0 and plan == [(None, 0)] * 4


def test_a_rows_own_rounds_scale_its_estimates_and_a_row_drafting_at_a_loss_steps_plainly(ba):
    """Each auto row's model drafters are priced as its own rounds of them did against the estimates (`BatchAuto.rho`,
    the solo chooser's ρ): a row whose DFlash drafts keep failing steps plainly beside a row that drafts (its drafting
    is worth fewer tokens than the step's rate commits in that time), and a lone row whose rounds accept far more than
    the pooled estimates drafts where they alone would not pay. Catches: the pooled estimates alone (both rows
    drafting, the lone row plain), every row of a speculative step drafting whatever its drafting costs, a row's
    measure noted after the estimates learned from its round or under the wrong option."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # verification free: drafting is the cost
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.draft_cost = lambda name, k: 2e-3
    pin(ba, "dflash", "greedy", 0.7)
    dflash = ba.chooser.options["dflash"]
    failing, fresh = {}, {}
    for _ in range(40):  # 40 rounds that accepted no draft, each expected to accept 0.7 of its first one
        dflash.note_here("greedy", 15, 0, failing.setdefault("dflash", {}))
    assert ba.rho("dflash", "greedy#1", failing) == pytest.approx(16 / (28 + 16), abs=0.005)
    assert ba.rho("dflash", "greedy", fresh) is None and ba.rhos(fresh, "greedy") == ()
    rows = [("greedy", 100, {"dflash": 15}, ba.rhos(failing, "greedy")), ("greedy", 100, {"dflash": 15}, ())]
    k, plan = ba.choose(rows, 0, 1, 0.0, 15)
    assert k > 0 and plan[0] == (None, 0) and plan[1] == ("dflash", k), (k, plan)
    k, plan = ba.choose([rows[1], rows[1]], 0, 1, 0.0, 15)
    assert k > 0 and [p[0] for p in plan] == ["dflash", "dflash"]  # without its measure it drafts

    ba.curve = {1: 0.01, 2: 0.012, 4: 0.014, 8: 0.017, 16: 0.02, 32: 0.04, 64: 0.08, 128: 0.16, 256: 0.32}
    pin(ba, "dflash", "greedy", 0.3)
    assert ba.choose([("greedy", 100, {"dflash": 15})], 0, 1, 0.0, 15)[0] == 0  # the pooled estimates: plain
    lucky = {}
    for _ in range(4):  # every draft accepted, in rounds of 15 (through `update`, as a batch's row notes them)
        ba.update("dflash", "greedy", 15, 15, here=lucky)
        pin(ba, "dflash", "greedy", 0.3)
    # against the estimates before learning (accepted, expected, their variance Σ α(1 − α))
    assert lucky["dflash"]["greedy"][:3] == [60.0, pytest.approx(4 * 15 * 0.3), pytest.approx(4 * 15 * 0.3 * 0.7)]
    assert ba.rho("dflash", "greedy", lucky) > 2.0
    k, plan = ba.choose([("greedy", 100, {"dflash": 15}, ba.rhos(lucky, "greedy"))], 0, 1, 0.0, 15)
    assert k > 0 and plan == [("dflash", k)]
    ba.update("ngram@1", "greedy", 3, 0, here=lucky)  # n-gram lookup learns from every offer: no measure of its own
    assert set(lucky) == {"dflash"}
    # the row finishes: how far it was from the estimates joins the measure of how far requests differ, as a lone
    # request's does (`chooser.Option.close_here`): ρ weighs the estimates less from now on
    from glimmer_mlx.speculative.auto.chooser import HERE_WEIGHT
    assert dflash.here_weight("greedy") == HERE_WEIGHT
    ba.close_row(lucky)
    assert dflash.here_weight("greedy") < HERE_WEIGHT / 2


def test_auto_never_speculates_without_drafts(ba):
    """No row has drafts (no option available: an n-gram row whose suffix never occurred; or budget 1), even with
    drafting free and acceptance 1. Catches: a plan drafting for a row with no option, a width past the budget."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.99)
    k, plan = ba.choose([("greedy", 100, {}), ("greedy", 50, {})], 0, 1, 0.0, 15)
    assert k == 0 and plan == [(None, 0)] * 2
    k, plan = ba.choose([("greedy", 1, {"dflash": 15}), ("greedy", 100, {})], 2, 1, 2.0, 15)
    assert k == 0 and plan == [(None, 0)] * 2


def stepper(gen, rows: int = 2):
    """step(L, seconds, chained=True, queued=True, committed=None): one step of `rows` rows feeding L positions each,
    `seconds` long, handed to `gen._observe` as `BatchGenerator.step` lands it (chained: queued behind the step
    before it; queued: the next one queued behind it)."""
    from glimmer_mlx.speculative.batch import Launched

    clock = [100.0]

    def step(L, seconds, chained=True, queued=True, committed=None):
        st = Launched(rows=[], widths=[], logits=None, tapped=None, want=(), tokens={}, t0=clock[0], chained=chained)
        gen._landed = clock[0]
        clock[0] += seconds
        gen._observe(st, rows, L, clock[0], committed, queued)

    return step


def test_the_batch_ledger_turns_speculation_off_once_it_lost_its_budget(sess, ba):
    """Speculative stretches that measurably lose (their committed tokens at a plain step's time per row, and the
    plain steps of their span at their price, take less than their wall time) beyond `LOSS_BUDGET` of the batch's
    decoding time make every step plain, whatever the estimates say; plain steps earn the budget back. A stretch goes
    to the ledger when its span ends (`span_after` plain steps after it). Catches: a ledger never consulted, a
    speculative step credited at the wrong plain cost, the plain steps after it not charged, a stretch of fixed-mode
    rows credited, a stall counted in full. And `LEDGER_FLOOR`: early on a loss of a few plain steps bars nothing."""
    from glimmer_mlx.speculative.auto.chooser import LEDGER_FLOOR, LEDGER_ROUND_CAP, LEDGER_ROUNDS, LOSS_BUDGET

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {2: 0.01}, None, {}, 0.0, 0.0
    ba.span_after = 2
    pin(ba, "dflash", "greedy", 0.8)
    rows = [("greedy", 100, {"dflash": 15})] * 2
    assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0
    gen = BatchGenerator(sess.model, auto=ba)
    for shape in ((2, 9), (2, 1)):  # steps of these shapes ran before (the first of each is not priced: `first_of`)
        ba.first_of(*shape)
    f = 1 - 1 / LEDGER_ROUNDS  # the ledger fades a step at a time
    step = stepper(gen)

    def stretch(spec_seconds, after=(0.010, 0.010), committed=6):
        step(9, spec_seconds, chained=False, queued=False, committed=committed)
        step(1, after[0], chained=False)
        for s in after[1:]:
            step(1, s)

    ba.elapse(0.2)  # decoded before: a 1 ms budget, under the floor's LEDGER_FLOOR plain steps of 10 ms
    # a speculative step of 2 rows x 9 positions committing 6 tokens in 40 ms (6 x 5 ms - 40 ms = -10 ms), two plain
    # steps at the price after it: -10 ms, on the books once the span ends
    step(9, 0.040, chained=False, queued=False, committed=6)
    assert ba.saved == 0.0
    step(1, 0.010, chained=False)
    step(1, 0.010)
    assert ba.saved == pytest.approx(-0.010, rel=1e-2)
    assert not ba.barred and ba.choose(rows, 0, 1, 0.0, 15)[0] > 0  # one unlucky stretch of a young batch
    # 6 tokens in 85 ms and a plain step of 15 ms after it: -60 ms more, past the floor's 40
    stretch(0.085, after=(0.015, 0.010))
    assert ba.saved == pytest.approx(-0.010 * f ** 3 - 0.060, rel=1e-2)
    assert ba.barred and ba.choose(rows, 0, 1, 0.0, 15) == (0, [(None, 0)] * 2)
    while ba.barred:  # plain steps of 10 ms earn it back
        ba.elapse(0.010)
    assert ba.saved + max(LOSS_BUDGET * ba.elapsed, LEDGER_FLOOR * 0.010) >= 0
    assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0
    # a speculative step of fixed-mode rows only (no auto row drafted): not the ledger's, but the slow plain step
    # after it is still that step's cost (`charge`), not a plain step's
    saved, plain2, spec = ba.saved, ba.measured[2], ba.measured[18]
    stretch(0.040, after=(0.015, 0.010), committed=None)
    assert ba.saved == pytest.approx(saved * f ** 3)
    assert ba.measured[2] == plain2 and ba.measured[18] == pytest.approx(0.8 * spec + 0.2 * 0.040 + 0.2 * 0.005)
    # a one-second stall in a speculative step is charged at most LEDGER_ROUND_CAP plain steps
    before = ba.saved
    stretch(1.0)
    assert ba.saved - before * f ** 3 == pytest.approx(-LEDGER_ROUND_CAP * ba.step_cost(2), rel=0.05)


def test_a_stretchs_span_is_measured_whole_and_its_plain_steps_price_nothing(sess, ba):
    """Where queueing a step runs most of its forward (MLX's CPU back-end), the plain step read back before a
    speculative stretch with nothing queued behind it costs a fraction of a step, and the first one after it two:
    neither is a plain step's price. Each is measured with the stretch (`Span`): summed they cost what the plain steps
    cost (here: 2 + 18 ms against 2 x 10), so the stretch is credited its own gain only. A chain that breaks without
    a speculative step (the chooser, a token behind, would have drafted) prices neither of its two steps. Catches:
    the cheap step pulling the plain step's price down, the long one charged to the stretch (a whole step's loss
    per stretch where there is none), the broken chain's steps priced."""

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {2: 0.010, 18: 0.030}, 1.0, {}, 0.0, 0.0
    ba.span_after = 3
    gen = BatchGenerator(sess.model, auto=ba)
    for shape in ((2, 9), (2, 1)):
        ba.first_of(*shape)
    step = stepper(gen)

    step(1, 0.002, queued=False)  # read back with nothing queued behind it
    step(9, 0.030, chained=False, queued=False, committed=8)  # 8 tokens: 40 ms of plain steps, in 30
    step(1, 0.018, chained=False)  # queued behind nothing: its own forward and the next one's
    step(1, 0.010)
    assert ba.saved == 0.0  # the span goes on
    step(1, 0.010)
    assert ba.measured[2] == 0.010 and ba.measured[18] == pytest.approx(0.030)  # nothing charged: 2 + 18 = 2 x 10
    assert ba.saved == pytest.approx(0.010, rel=1e-2)
    step(1, 0.012)  # after the span: a plain step's price again
    assert ba.measured[2] == pytest.approx(0.8 * 0.010 + 0.2 * 0.012)
    # a broken chain with no speculative step: neither its short step nor its long one is a price
    p2 = ba.measured[2]
    step(1, 0.002, queued=False)
    step(1, 0.018, chained=False)
    assert ba.measured[2] == p2
    step(1, 0.010)
    assert ba.measured[2] == pytest.approx(0.8 * p2 + 0.2 * 0.010)
    # steps never pipelined (a row with a repetition penalty): each its own price
    step(1, 0.011, chained=False, queued=False)
    assert ba.measured[2] == pytest.approx(0.8 * (0.8 * p2 + 0.2 * 0.010) + 0.2 * 0.011)


def test_plain_steps_are_priced_again_when_stretches_leave_none(sess, ba):
    """A stretch's plain steps price nothing (`Span`), so where stretches follow one another the plain step's price
    would stay what one moment measured. After `STALE_ROUNDS` steps with no plain step priced, the batch's auto rows
    step plainly until `CHECK_SAMPLES` plain steps are priced (the last stretch's span first runs out), then
    speculate again on the fresh price; a batch whose fixed rows feed blocks is never held plain for it (no step of
    it can be plain). Catches: no check (a plain price 40 % dear, from before the stretches, kept), a check that ends
    on the span's unpriced steps, a check holding a batch no plain step can price."""
    from glimmer_mlx.speculative.auto.chooser import CHECK_SAMPLES, STALE_ROUNDS

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {2: 0.014}, None, {2: 0.014}, 0.0, 0.0
    ba.span_after = 2
    pin(ba, "dflash", "greedy", 0.8)
    rows = [("greedy", 100, {"dflash": 8})] * 2
    gen = BatchGenerator(sess.model, auto=ba)
    for shape in ((2, 9), (2, 1)):
        ba.first_of(*shape)
    step = stepper(gen)

    step(1, 0.014)  # a plain step priced (a slow moment: 14 ms)
    priced = ba.stepped
    while ba.stepped - priced < STALE_ROUNDS:  # stretches back to back: none of their plain steps prices anything
        step(9, 0.012, chained=False, queued=False, committed=12)
        if ba.stepped % 8 == 0 and ba.stepped - priced < STALE_ROUNDS:
            step(1, 0.010, chained=False)
    assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0 and ba.checks == 0
    step(9, 0.012, chained=False, queued=False, committed=12)
    assert ba.choose(rows, 0, 3, 3.0, 15)[0] > 0  # a fixed row feeds a block: the step cannot be plain
    assert ba.choose(rows, 0, 1, 0.0, 15) == (0, [(None, 0)] * 2) and ba.checks == 1
    step(1, 0.010, chained=False)  # the span's steps: not prices
    step(1, 0.010)
    assert ba.choose(rows, 0, 1, 0.0, 15)[0] == 0 and ba.plain_by_rows[2] == pytest.approx(0.014)
    for _ in range(CHECK_SAMPLES):
        assert ba.choose(rows, 0, 1, 0.0, 15)[0] == 0
        step(1, 0.010)
    assert ba.plain_by_rows[2] == pytest.approx(0.010)  # the check's own steps only
    assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0 and ba.checks == 1


def test_a_speculative_step_is_priced_in_plain_steps_of_its_rows(ba):
    """A speculative shape's steps are kept in plain steps of their rows, priced when they ran (`relative`), and
    priced at the plain step's price now: a slow moment that raises the plain price raises theirs with it. Kept in
    seconds, the shapes stayed at the fast moment they were measured in while the plain price rose, and the batch
    speculated exactly when the machine was slow (its plain price 5.5-9.4 ms at its speculative choices, its plain
    steps 4.1-6.4 on average). Catches: speculative shapes priced in seconds (a DFlash step that loses at 5 ms a plain
    step chosen at 8 ms)."""
    from glimmer_mlx.speculative.auto.batch import StepChoice
    from glimmer_mlx.speculative.auto.chooser import ENTER_GAIN, PRICE_WINDOW

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.5)  # ~2 tokens a round at any width
    rows = [("greedy", 100, {"dflash": 8})]
    for _ in range(PRICE_WINDOW):
        ba.observe(1, 0.005, spec=False, rows=1)
    for _ in range(40):  # 1-row verifies of 2-9 positions: 2.4 plain steps each
        for L in range(2, 10):
            ba.observe(L, 0.012, spec=True, rows=1)

    def speculates():
        step = StepChoice(ba, rows, 0, 1, 0.0, 8)
        return step.best()[1] > step.plain_rate * (1 + ENTER_GAIN)

    assert ba.step_cost(9, rows=1) == pytest.approx(0.012, rel=1e-3) and not speculates()
    for _ in range(PRICE_WINDOW):  # the machine slows down: plain steps at 8 ms
        ba.observe(1, 0.008, spec=False, rows=1)
    assert ba.step_cost(1, rows=1) == pytest.approx(0.008)
    assert ba.step_cost(9, rows=1) == pytest.approx(2.4 * 0.008, rel=1e-3) and not speculates()
    assert ba.relative[1][9] == pytest.approx(2.4, rel=1e-3)  # (kept in plain steps of its rows)


def test_a_plain_step_of_fewer_rows_is_never_priced_above_one_of_more(ba):
    """A row count's first plain steps may be slow ones (the step after a row left, a stretch's wake), and a stretch
    prices no plain step after them: on the embedded model at N = 2 the 1-row plain step was priced 7.0 ms beside the
    2-row one's 5.9, its steps taking ~4.4, and the lone row drafted DFlash at a loss on that price. A plain step of
    fewer rows is priced at most a larger row count's (`BatchAuto.plain_price`), and what its speculative shapes cost
    is kept in plain steps of that price (`relative`); a price below the larger one's is its own. Catches: each row
    count's own price alone, and the 1-row DFlash step that then looks like a win."""
    from glimmer_mlx.speculative.auto.batch import StepChoice
    from glimmer_mlx.speculative.auto.chooser import ENTER_GAIN

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.5)  # ~2 tokens a round at any width
    for _ in range(40):
        ba.observe(2, 0.0059, spec=False, rows=2)
    for _ in range(3):  # a lone row's first plain steps, slow ones
        ba.observe(1, 0.0070, spec=False, rows=1)
    assert ba.plain_by_rows[1] == pytest.approx(0.0070)
    assert ba.step_cost(1, rows=1) == pytest.approx(0.0059) and ba.plain_price(2) == pytest.approx(0.0059)
    for _ in range(40):  # its verifies of 2-9 positions: 12.4 ms, 2.1 plain steps at the cap's price (1.8 at 7.0)
        for L in range(2, 10):
            ba.observe(L, 0.0124, spec=True, rows=1)
    assert ba.relative[1][9] == pytest.approx(0.0124 / 0.0059, rel=1e-3)
    step = StepChoice(ba, [("greedy", 100, {"dflash": 8})], 0, 1, 0.0, 8)
    assert not step.best()[1] > step.plain_rate * (1 + ENTER_GAIN)  # ~2 tokens for 2.1 plain steps: plain
    for _ in range(40):  # its own price, once below the larger one's, is its own
        ba.observe(1, 0.0044, spec=False, rows=1)
    assert ba.step_cost(1, rows=1) == pytest.approx(0.0044)


def test_a_row_counts_first_speculative_steps_are_priced_by_the_nearest_row_counts_shapes(ba):
    """A speculative shape (rows, L) not run yet is priced by the same width's cost in plain steps at the nearest row
    count that ran it (`BatchAuto._relative_prior`), times this row count's plain price — not by the solo
    calibration's curve, which knows neither a batch verify's own cost nor the wake a stretch leaves (a server's
    first 2-row steps after a level at 1 row drafted lone n-gram steps on the curve's price until each width learned
    its own). Its own steps, once run, price it. Catches: no transfer (a flat curve prices a 2 x 9 verify as a plain
    step), a prior that overrides the row count's own measure."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    for _ in range(40):
        ba.observe(1, 0.005, spec=False, rows=1)
        ba.observe(9, 0.015, spec=True, rows=1)  # 3 plain steps of 1 row
        ba.observe(2, 0.007, spec=False, rows=2)
    assert ba.step_cost(18, rows=2) == pytest.approx(3 * 0.007, rel=1e-3)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.007) and ba.step_cost(9, rows=1) == pytest.approx(0.015)
    for _ in range(40):
        ba.observe(18, 0.014, spec=True, rows=2)  # its own: 2 plain steps of 2 rows
    assert ba.step_cost(18, rows=2) == pytest.approx(0.014, rel=1e-3)
    assert ba.step_cost(9, rows=1) == pytest.approx(0.015, rel=1e-3)


def test_a_stretch_chosen_by_a_thin_margin_is_checked_sooner(ba):
    """A check prices plain steps again `STALE_ROUNDS` steps after the latest priced one when the latest speculative
    step was chosen by a margin of 1 + `THIN_MARGIN` or more over the plain step's price, sooner the thinner the
    margin (down to `STALE_ROUNDS` // `THIN_DIVISOR`): a price from a slow moment decides such a stretch, and it
    prices no plain step (DFlash ran five requests at 0.84-0.93x on a 1-row plain price of 5.7 ms, plain steps taking
    3.7). `choose` keeps the margin of the step it chooses by its mean estimates. Catches: the margin ignored (no
    check before `STALE_ROUNDS`), a check as soon for a wide margin (an option that pays well stopped for nothing)."""
    from glimmer_mlx.speculative.auto.batch import THIN_DIVISOR, THIN_MARGIN, StepChoice
    from glimmer_mlx.speculative.auto.chooser import STALE_ROUNDS

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.8)
    rows = [("greedy", 100, {"dflash": 8})]
    ba.observe(1, 0.010, spec=False, rows=1)
    assert ba.margin is None and ba.stale_after == STALE_ROUNDS
    k, _ = ba.choose(rows, 0, 1, 0.0, 8)
    step = StepChoice(ba, rows, 0, 1, 0.0, 8)
    assert k > 0 and ba.exploring is None and ba.margin == pytest.approx(step.best()[1] / step.plain_rate)
    assert ba.margin > 1 + THIN_MARGIN and ba.stale_after == STALE_ROUNDS  # a wide margin: as before

    def due_after(margin):
        ba.margin, ba._priced_at, ba._check, ba.steps = margin, 0, 0, {"plain": 0, "spec": 0}
        while not ba.check_due:
            ba.elapse(0.01, spec=True)
        ba._check = 0
        return ba.stepped - 1

    assert due_after(1 + THIN_MARGIN) == STALE_ROUNDS
    assert due_after(1 + THIN_MARGIN / 2) == STALE_ROUNDS // 2
    assert due_after(1.02) == STALE_ROUNDS // THIN_DIVISOR


def test_a_check_prices_the_ledger_credits_of_the_stretches_before_it_again(sess, ba):
    """A stretch is credited at the plain price it ran on, and prices no plain step: one run on a price from a slow
    moment (14 ms where plain steps take 10) books savings it never made, which then pay for steps that lose. When a
    check prices plain steps lower, what the ledger was credited since the previous priced plain step is priced
    again at the check's price; a higher one, or a plain step priced outside a check (within the latest
    `stale_after` steps), changes nothing — the solo chooser's rule (`AutoChooser._confirm`). Catches: no re-pricing
    (the stretch's 80 ms of savings kept where it saved 48), a re-pricing upward, one on the check's first step."""
    from glimmer_mlx.speculative.auto.chooser import LEDGER_ROUNDS

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {2: 0.014}, None, {}, 0.0, 0.0
    ba.span_after = 2
    gen = BatchGenerator(sess.model, auto=ba)
    for shape in ((2, 9), (2, 1)):
        ba.first_of(*shape)
    step = stepper(gen)
    f = 1 - 1 / LEDGER_ROUNDS

    def stretch():  # 12 tokens for 2 rows in 12 ms, then its span: two plain steps of 10 ms
        step(9, 0.012, chained=False, queued=False, committed=12)
        step(1, 0.010, chained=False)
        step(1, 0.010)

    step(1, 0.014)  # a plain step priced at a slow moment: 14 ms
    stretch()
    credited = 6 * 0.014 - 0.012 + 2 * (0.014 - 0.010)
    assert ba.saved == pytest.approx(credited, rel=0.01)
    ba._start_check()
    step(1, 0.010)
    assert ba.saved == pytest.approx(credited, rel=0.01)  # the check's first step: not yet its price
    step(1, 0.010)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.010)
    assert ba.saved == pytest.approx(6 * 0.010 - 0.012, rel=0.01)  # as if priced at 10 ms all along
    saved = ba.saved
    stretch()  # on the fresh price; a plain step priced outside a check: the credits stand
    step(1, 0.012)
    assert ba.saved == pytest.approx(saved * f ** 4 + 6 * 0.010 - 0.012, rel=0.01)
    saved = ba.saved
    stretch()
    ba._start_check()
    for _ in range(2):
        step(1, 0.016)  # a check priced higher: nothing changes
    assert ba.saved == pytest.approx(saved * f ** 5 + 6 * 0.010 - 0.012, rel=0.01)


def test_a_plain_step_is_priced_by_the_median_of_the_latest_ones(sess, ba):
    """A batch's plain step is priced as the solo chooser prices a plain token: the median of the latest
    `SCALE_WINDOW` pipelined ones — a few slow steps among them (another process taking the machine for a moment) do
    not make every speculative step look cheap beside it, and steps the pipeline ran through only in part price
    nothing — and never above the median of the latest `PRICE_WINDOW`: a faster machine comes through within half the
    short window, a slower one only within half the long one (a slow moment of 5 of the latest 9 steps must not price
    a speculative stretch that then prices no plain step for hundreds of steps). Catches: an EMA of the plain steps
    (the latest 4 of 9 slow at 2.4x raised it to 1.8x), the slow ones at the window's end deciding, the short
    median alone (5 slow of 9), the long median alone (a faster machine not followed)."""
    from glimmer_mlx.speculative.auto.chooser import PRICE_WINDOW
    from glimmer_mlx.speculative.auto.chooser import SCALE_WINDOW

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {}, None, {}, 0.0, 0.0
    gen = BatchGenerator(sess.model, auto=ba)
    ba.first_of(2, 1)
    step = stepper(gen)
    for i in range(SCALE_WINDOW):
        step(1, 0.005)
    for i in range(SCALE_WINDOW // 2):  # the latest few slow
        step(1, 0.012)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.005)
    step(1, 0.030, chained=False)  # read back short of a step (its next not queued behind it): not a price
    step(1, 0.030, chained=True, queued=False)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.005)
    step(1, 0.012)  # more than half the short window slow: a slow moment, or a slower machine? ...
    assert ba.step_cost(2, rows=2) == pytest.approx(0.005)
    while len(ba._plain[2]) < PRICE_WINDOW // 2 + SCALE_WINDOW // 2 + 1:  # ... more than half the long one: slower
        step(1, 0.012)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.012)
    for i in range(SCALE_WINDOW // 2 + 1):  # faster again: followed within half the short window
        step(1, 0.004)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.004)


def test_a_plain_step_never_priced_is_not_priced_from_the_speculative_steps(ba):
    """Before any plain step of B rows is priced, a plain step of B rows is priced from the plain steps of the nearest
    row count priced (along the calibrated curve), or with none from the calibrated curve at the solo chooser's
    speed scale — never from the speculative steps' times scaled down the curve: a fresh server's first requests
    drafted from their first step and their 1-row plain price, so derived, rose with their slow DFlash steps (4.4 ->
    9.4 ms, where plain steps took ~4.5), each such step looking like a win. Catches: the price moving with
    speculative steps; a priced row count's plain step ignored."""
    ba.curve = {n: 0.01 * (1 + 0.1 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.first_of(1, 9)
    for seconds in (0.02, 0.03, 0.04):  # 1-row verify steps, ever slower
        ba.observe(9, seconds, spec=True, rows=1)
        assert ba.step_cost(1, rows=1) == pytest.approx(ba.calibrated(1) * ba.chooser.scale)
    for _ in range(3):  # plain steps of 2 rows priced: the 1-row step is theirs along the curve
        ba.observe(2, 0.006, spec=False, rows=2)
    assert ba.step_cost(1, rows=1) == pytest.approx(0.006 * ba.calibrated(1) / ba.calibrated(2))
    ba.observe(1, 0.004, spec=False, rows=1)  # its own, once priced
    assert ba.step_cost(1, rows=1) == pytest.approx(0.004)


def test_speculating_on_a_plain_price_never_measured_soon_checks_it(ba):
    """Speculative steps of B rows with no plain step of B rows ever priced (the price a guess: the curve at the solo
    chooser's scale, or another row count's) start a check after `UNPRICED_STEPS` of them — plain steps until priced
    — where `STALE_ROUNDS` never came (no plain step ever priced, none was ever due). Once priced, they do not.
    Catches: no check until STALE_ROUNDS, a check that never ends, checks while the price is measured."""
    from glimmer_mlx.speculative.auto.batch import UNPRICED_STEPS
    from glimmer_mlx.speculative.auto.chooser import CHECK_SAMPLES

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {}, None, {}, 0.0, 0.0
    pin(ba, "dflash", "greedy", 0.8)
    rows = [("greedy", 100, {"dflash": 15})]
    for i in range(UNPRICED_STEPS):
        assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0, i
        ba.elapse(0.02, spec=True)
        ba.observe(16, 0.02, spec=True, rows=1)
    assert ba.check_due and ba.choose(rows, 0, 1, 0.0, 15)[0] == 0
    for _ in range(CHECK_SAMPLES):
        ba.elapse(0.005)
        ba.observe(1, 0.005, spec=False, rows=1)
    assert not ba.check_due and ba.step_cost(1, rows=1) == pytest.approx(0.005)
    for _ in range(2 * UNPRICED_STEPS):  # priced now: speculative steps start no check
        assert ba.choose(rows, 0, 1, 0.0, 15)[0] > 0
        ba.elapse(0.02, spec=True)
        ba.observe(16, 0.02, spec=True, rows=1)
    assert not ba.check_due


def test_a_check_prices_on_its_own_steps_bounded_by_the_long_window(ba):
    """A check's plain steps make the short window on their own (the steps before it may be long stale), but the long
    window still bounds the price: a check's steps come right after a stretch's span, and where the stretch's wake
    outlasts it they run slow — priced on them alone, the batch went on drafting DFlash at a loss. A check faster than
    the long window is followed at once. Catches: a check that raises the price on its own slow steps, a check whose
    faster steps are averaged with the stale ones."""
    from glimmer_mlx.speculative.auto.chooser import CHECK_SAMPLES

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    for _ in range(20):
        ba.observe(2, 0.006, spec=False, rows=2)
    ba._start_check()
    for _ in range(CHECK_SAMPLES):  # in a wake's tail
        ba.observe(2, 0.0075, spec=False, rows=2)
    assert not ba.check_due and ba.step_cost(2, rows=2) == pytest.approx(0.006)
    for _ in range(20):
        ba.observe(2, 0.006, spec=False, rows=2)
    ba._start_check()
    for _ in range(CHECK_SAMPLES):  # the machine is faster now
        ba.observe(2, 0.004, spec=False, rows=2)
    assert ba.step_cost(2, rows=2) == pytest.approx(0.004)


def test_auto_cost_model_observe_and_interpolate(ba):
    """observe: an EMA per n and a measured/calibrated ratio applied to unmeasured n; calibrated extends the curve
    linearly. Catches: a ratio never applied, interpolation between the wrong points."""
    ba.curve = {1: 1.0, 4: 4.0, 8: 6.0}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    assert ba.calibrated(2) == pytest.approx(2.0) and ba.calibrated(6) == pytest.approx(5.0)
    assert ba.calibrated(12) == pytest.approx(8.0)  # the last slope: 0.5 per position
    ba.observe(4, 8.0, spec=True)
    assert ba.measured[4] == 8.0 and ba.ratio == pytest.approx(2.0)
    assert ba.step_cost(8) == pytest.approx(12.0)
    ba.observe(4, 4.0, spec=False)
    assert ba.measured[4] == pytest.approx(0.8 * 8 + 0.2 * 4)
    steps = dict(ba.steps)
    ba.elapse(0.1, spec=True)  # the steps counted are those timed, priced or not
    ba.elapse(0.1)
    assert ba.steps == {"plain": steps["plain"] + 1, "spec": steps["spec"] + 1}


def test_auto_prices_wide_batches_from_the_calibrations_compute_bound_point(ba, monkeypatch):
    """A big batch's speculative step feeds far more positions than the verify curve covers (16 rows x 9 = 144 vs
    16). The curve's end is nearly flat (a verify of 15 drafts cost what 14 did: noise kept monotone), so its last
    slope says 144 positions are nearly free; the calibration's forward over 128 positions says they are not.
    BatchAuto interpolates toward that point and decodes the batch plainly. Catches: the wide point ignored (the
    last slope extrapolated: speculation chosen at N = 16), the point not read from the calibration."""
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    auto = ba.auto
    curve = {L: 0.004 * (1 + 0.07 * (L - 1)) for L in range(1, 16)}
    curve[16] = curve[15]  # flat end
    monkeypatch.setattr(auto.chooser, "costs", curve)
    monkeypatch.setattr(auto, "calibration", {**auto.calibration, "wide_forward_s": {"rows": 128, "seconds": 0.12}})
    b = BatchAuto(auto)
    b.draft_cost = lambda name, k: 1e-5 * k
    pin(b, "dflash", "greedy", 0.7)
    assert b.curve[128] == 0.12 and b.calibrated(72) == pytest.approx(curve[16] + (0.12 - curve[16]) * 56 / 112)
    rows = [("greedy", 100, {"dflash": 15})] * 16
    assert b.choose(rows, 0, 1, 0.0, 15)[0] == 0  # 16 rows: plain
    assert b.choose(rows[:1], 0, 1, 0.0, 15)[0] > 0  # one row: verification is cheap, it speculates
    del b.curve[128]  # what the old extrapolation (the curve's last slope) would have said
    assert b.choose(rows, 0, 1, 0.0, 15)[0] > 0


def test_auto_choice_equals_scoring_every_width_on_random_tables(ba):
    """`choose` (with its early plain bound) against the objective scored at every width by brute force, over random
    acceptance, cost curves (flat to compute-bound), budgets, offers and fixed rows — a row whose drafting is worth
    fewer tokens than the step's rate commits in that time stepping plainly. Catches: a bound that prunes a width
    that would have won (e.g. taken at one draft instead of the widest), a row kept drafting at a loss."""
    import random

    from glimmer_mlx.speculative.auto.chooser import ENTER_GAIN

    rng = random.Random(5)
    names = ["dflash", "mtp"]
    for trial in range(300):
        slope = rng.choice([0.0, 0.02, 0.1, 0.5, 1.0])
        ba.curve = {n: 0.01 * (1 + slope * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
        ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
        ba.draft_cost = (lambda c: lambda name, k: c * (1 + 0.1 * k))(rng.choice([0.0, 1e-4, 2e-3]))
        for name in names:
            for regime in ("greedy", "sampling"):
                ba.acceptance(name, regime).set_alphas([rng.uniform(0.0, 0.95) for _ in range(3)])
        rows = [(rng.choice(["greedy", "sampling"]), rng.choice([1, 2, 3, 50]),
                 {n: rng.randint(1, ba.chooser.options[n].max_k) for n in names if rng.random() < 0.6})
                for _ in range(rng.randint(1, 6))]  # an offer never exceeds its option's widest round
        fixed, fixed_width = rng.choice([(0, 1), (1, 1), (2, 4)])
        fixed_tokens = float(fixed) * (1.0 if fixed_width == 1 else 2.0)
        k_max = 15
        got = ba.choose(rows, fixed, fixed_width, fixed_tokens, k_max)

        def e(name, regime, k):
            t, p = 1.0, 1.0
            for a in ba.acceptance(name, regime).alphas()[:k]:
                p *= a
                t += p
            return t

        B = len(rows) + fixed
        best = (len(rows) + fixed_tokens) / ba.step_cost(B * fixed_width)
        want = (0, [(None, 0)] * len(rows))
        for k in range(1, k_max + 1):
            plan, gain = [], {}  # row -> (its extra tokens, its drafting seconds) while it drafts
            for i, (regime, budget, avail) in enumerate(rows):
                opts = [(e(n, regime, min(k, c, budget - 1)), n, min(k, c, budget - 1))
                        for n, c in avail.items() if min(k, c, budget - 1) >= 1]
                top = max(opts, key=lambda o: o[0], default=None)
                if top is None or top[0] <= 1.0:
                    plan.append((None, 0))
                    continue
                plan.append((top[1], top[2]))
                gain[i] = (top[0] - 1.0, ba.draft_cost(top[1], top[2]))
            rate = 0.0
            while gain:  # the row whose drafting is worth least steps plainly while that raises the rate
                L = max([fixed_width] + [plan[i][1] + 1 for i in gain])
                if L == fixed_width:
                    gain = {}
                    break
                rate = (len(rows) + fixed_tokens + sum(x for x, _ in gain.values())) / (
                    ba.step_cost(B * L) + sum(d for _, d in gain.values()))
                worst = min(gain, key=lambda i: gain[i][0] / gain[i][1] if gain[i][1] > 0 else float("inf"))
                x, d = gain[worst]
                if d == 0 or x / d >= rate:
                    break
                del gain[worst]
                plan[worst], rate = (None, 0), 0.0
            if not gain:
                continue
            if rate > best * (1 + ENTER_GAIN if want[0] == 0 else 1.0):
                best, want = rate, (k, plan)
        assert got[0] == want[0], (trial, got, want)
        assert [g[0] for g in got[1]] == [w[0] for w in want[1]], (trial, got, want)


def test_could_pay_equals_pricing_every_width_on_random_tables(ba):
    """`could_pay` (with its bound first) against its definition scored width by width, over random acceptance, ρ,
    cost curves (flat to compute-bound, measured steps too), drafting costs, batch sizes and budgets; both answers
    occur. Catches: a bound that says no where some width pays (the cheapest drafting or step taken too dear, the
    expected tokens cut short of the widest)."""
    import random

    from glimmer_mlx.speculative.auto.chooser import ENTER_GAIN, scaled_alphas

    rng = random.Random(11)
    said = {True: 0, False: 0}
    for trial in range(400):
        slope = rng.choice([0.0, 0.02, 0.1, 0.5, 1.0])
        ba.curve = {n: 0.01 * (1 + slope * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
        ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
        if rng.random() < 0.5:
            ba.measured = {n: 0.01 * rng.uniform(0.5, 2.0) * (1 + slope * (n - 1)) for n in (2, 4, 8, 16)}
        ba.draft_cost = (lambda c, d: lambda name, k: c + d * k)(rng.choice([0.0, 1e-4, 2e-3]),
                                                               rng.choice([0.0, 1e-4, 5e-4]))
        name = rng.choice(["dflash", "mtp"])
        ba.acceptance(name, "greedy").set_alphas([rng.uniform(0.0, 0.95) for _ in range(3)])
        batch, budget = rng.choice([1, 2, 4, 8]), rng.choice([None, 1, 2, 3, 9, 50])
        rho = rng.choice([None, 0.5, 1.3, 3.0])
        got = ba.could_pay(name, "greedy", batch, budget, rho)

        plain = (1.0 + ENTER_GAIN) / ba.step_cost(batch, rows=batch)
        alphas = scaled_alphas(ba.acceptance(name, "greedy").alphas(), rho)
        top = ba.chooser.options[name].max_k if budget is None else min(ba.chooser.options[name].max_k, budget - 1)
        want, e, p = False, 1.0, 1.0
        for k in range(1, top + 1):
            p *= alphas[k - 1]
            e += p
            want |= e / (ba.step_cost(batch * (k + 1), rows=batch) + batch * ba.draft_cost(name, k)) > plain
        assert got == want, trial
        said[got] += 1
    assert said[True] > 40 and said[False] > 40, said


def test_auto_prices_an_unmeasured_wide_step_from_the_largest_measured_one(ba):
    """Past the largest measured position count, a step costs at least that step's time scaled along the
    calibrated curve. What the server measured: 1-row steps cheaper than calibrated pull the global measured /
    calibrated ratio to ~0.7, while 8-row steps cost ~1.1x; the additive estimate from the global ratio priced
    8 rows x 5 positions at 2/3 of what they cost, and auto drafted n-gram blocks that lost (agg 359 vs 444 tok/s).
    Catches: the proportional floor dropped (the test's choice flips to speculation)."""
    ba.curve = {1: 0.00686, 4: 0.00701, 8: 0.0099, 16: 0.01266, 128: 0.04528}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    for n, t in ((1, 0.0045), (2, 0.0045), (4, 0.0050), (7, 0.0110), (8, 0.0109)):  # 7 vs 8 rows: noise
        ba.observe(n, t, spec=False)
    ba.ratio = 0.69  # the EMA after many more cheap 1-row steps than 8-row ones (the server's figure)
    want = 0.0109 * ba.calibrated(40) / ba.calibrated(8)
    assert ba.step_cost(40) == pytest.approx(want)
    assert ba.step_cost(40) > ba.measured[8] + ba.ratio * (ba.calibrated(40) - ba.calibrated(8))  # the additive one
    pin(ba, "dflash", "greedy", 0.3)
    rows = [("greedy", 100, {"dflash": 4})] * 8
    assert ba.choose(rows, 0, 1, 0.0, 4)[0] == 0  # 8 rows x 2..5 positions: plain
    real = ba._interpolated
    ba._interpolated = lambda n, m, plain=None: (lambda b: m[b] + ba.ratio * (ba.calibrated(n) - ba.calibrated(b)))(
        max(k for k in m if k <= n)) if n > max(m) else real(n, m, plain)
    assert ba.choose(rows, 0, 1, 0.0, 4)[0] > 0  # the additive estimate alone speculates


def test_a_speculative_shape_is_priced_in_its_rows_own_plain_steps_and_its_wake_is_no_slope(ba):
    """A fresh server's first steps: a 1-row speculative step of 2 positions measured before any 1-row plain step
    was priced teaches no price in plain steps (it would be read against the stand-in price, the calibration at the
    solo chooser's scale, and then against the real one); once the plain step is priced, a shape's price is its time
    over that price. Past the widest measured shape a step costs that shape scaled along the calibrated curve (or
    more by the calibrated slope), never the slope from the plain step up to it: a 2-position step's price holds the
    stretch's wake, which does not grow with the positions. Hand-computed numbers. Catches: the stand-in price as the
    divisor (1.6 where the step costs 1.06 plain steps), the plain-to-speculative slope (a 9-position step at 6 plain
    steps: a fresh server's lone auto rows then never carried a model drafter)."""
    ba.curve = {1: 0.006, 2: 0.0064, 8: 0.0077, 9: 0.0085, 16: 0.0108, 128: 0.047}
    ba.measured, ba.ratio, ba.plain_by_rows, ba.relative = {}, None, {}, {}
    ba.chooser.scale = 0.55  # the solo chooser's: the stand-in price 3.3 ms where plain steps take 5.1
    ba.observe(2, 0.0054, spec=True, rows=1)
    assert ba.relative.get(1, {}) == {}  # nothing priced in plain steps yet
    ba.observe(1, 0.0051, spec=False, rows=1)
    assert ba.plain_by_rows[1] == pytest.approx(0.0051)
    ba.observe(2, 0.0054, spec=True, rows=1)
    assert ba.relative[1] == {2: pytest.approx(0.0054 / 0.0051)}
    ba.relative[1][2] = 1.6  # a stretch's wake charged to it (`charge`)
    p2 = 1.6 * 0.0051
    proportional = p2 * ba.calibrated(9) / ba.calibrated(2)
    additive = p2 + ba.ratio * (ba.calibrated(9) - ba.calibrated(2))
    assert ba.step_cost(9, rows=1) == pytest.approx(max(proportional, additive))
    assert ba.step_cost(9, rows=1) < 0.5 * (p2 + 7 * (p2 - 0.0051))  # the plain-to-2 slope: 6.4 plain steps
    # two speculative widths measured: their own slope bounds the steps past them
    ba.relative[1][8] = 3.0
    p8 = 3.0 * 0.0051
    slope = (p8 - p2) / 6
    assert ba.step_cost(16, rows=1) == pytest.approx(max(p8 + 8 * slope, p8 * ba.calibrated(16) / ba.calibrated(8),
                                                         p8 + ba.ratio * (ba.calibrated(16) - ba.calibrated(8))))


@pytest.mark.parametrize("mode, batched", [("dflash", "dflash_propose_batch"), ("mtp", "mtp_propose_batch")])
def test_model_drafter_rows_draft_together_exactly_what_they_would_alone(sess, ids, monkeypatch, mode, batched):
    """DFlash rows draft their blocks in one drafter forward (`dflash.propose_batch`), MTP rows with one
    forward per depth (`mtp.propose_batch`): each row's drafts are its own — the same acceptance, round by round,
    as the request alone (drafts from another row's context, or at another row's positions, would accept
    differently; greedy output alone could not tell)."""
    import glimmer_mlx.speculative.batch as batch_mod

    calls, real = [], getattr(batch_mod, batched)
    monkeypatch.setattr(batch_mod, batched, lambda ds, *a: (calls.append(len(ds)), real(ds, *a))[1])
    gen = BatchGenerator(sess.model, prefill_step=16)
    picks, maxes = [0, 1, 5, 3], [24, 30, 20, 28]
    plan = [(j, request(sess, ids[i], mode, params(), 0, maxes[j])) for j, i in enumerate(picks)]
    out, rows = run(gen, plan)
    assert calls and max(calls) == 4
    for j, i in enumerate(picks):
        d, k = drafter_for(sess, mode)
        st = GenerationStats()
        dec = build_decoder(sess.model, d, Sampler(params(), 0), drafts=k)
        r = collect(stream(dec, ids[i], max_tokens=maxes[j], eos=stop_ids(sess.model, sess.tokenizer), stats=st),
                    st, False)
        assert out[j][0] == r.tokens
        assert {int(n): c for n, c in rows[j].hist.items()} == st.extra["acceptance_histogram"], j


def test_a_fixed_mode_rows_drafting_is_not_priced_as_the_step(sess, ids, ba):
    """`BatchGenerator._launch`: what a step costs the batch chooser is its time without the rows' drafting — a
    fixed-mode row's as well as an auto row's. Counted in, a fixed DFlash row's drafter forward priced every
    1 x 16 step ~1.8x what its forward costs, and auto paid its own drafting twice on that price (its rounds' step
    plus `draft_cost`). Catches: only auto rows' drafting taken out."""
    import time as time_mod

    walls = []
    for _ in range(2):  # the first run's steps are each the first of their shape, which is not priced (`first_of`)
        ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
        req = request(sess, ids[0], "dflash", params(), 0, 6)
        real = req.drafter.propose

        def slow(*a, real=real, **k):
            time_mod.sleep(0.25)
            return real(*a, **k)

        req.drafter.propose = slow
        gen = BatchGenerator(sess.model, auto=ba)
        gen.add(req)
        while len(gen):
            t = time_mod.perf_counter()
            gen.step()
            walls.append(time_mod.perf_counter() - t)
    spec = {n: t for n, t in ba.measured.items() if n > 1}  # (one row: by positions as by shape)
    assert spec and max(walls) > 0.25  # it drafted, slowly
    assert max(spec.values()) < 0.2, spec


def test_a_step_is_priced_by_its_shape_not_only_its_position_count(ba):
    """`BatchAuto.plain_by_rows`: a plain step of 8 rows and a verify of 8 positions in one row both feed 8 positions and
    cost different things (each row attends over its own keys). Priced by the count alone, a server that had batched
    eight requests priced a lone request's verify at the 8-row step and left its drafters out (`could_pay`): auto
    0.91x plain at one client where DFlash rows alone ran 1.29x. A shape's own table is used once it has a plain
    step (before, the position counts'). Catches: step_cost ignoring rows; a shape priced from another's steps."""
    ba.curve = {n: 0.01 * (1 + 0.05 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # verify nearly free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "mtp", "greedy", 0.8)
    ba.draft_cost = lambda name, k: 0.003
    for _ in range(5):
        ba.observe(8, 0.060, spec=False, rows=8)  # 8 rows x 1 position: 60 ms
        ba.observe(1, 0.010, spec=False, rows=1)  # 1 row: 10 ms
    assert ba.step_cost(8, rows=8) == pytest.approx(0.060)
    alone = ba.step_cost(2, rows=1)  # one row, a token and a draft: along the calibrated curve from its plain step
    assert 0.010 < alone < 0.0125
    assert ba.step_cost(2) > 0.016  # by the position count alone: between the 1-row and the 8-row plain steps
    assert ba.could_pay("mtp", "greedy", 1)
    shaped, relative, ba.plain_by_rows, ba.relative = ba.plain_by_rows, ba.relative, {}, {}
    assert not ba.could_pay("mtp", "greedy", 1)  # what it said before
    ba.plain_by_rows, ba.relative = {}, {1: {4: 1.2}}  # a shape measured only speculating: its plain price is not
    assert ba.step_cost(1, rows=1) == ba.step_cost(1)  # extrapolated from that
    ba.plain_by_rows, ba.relative = shaped, relative
    ba.observe(9, 0.050, spec=True, rows=1)  # a verify of 9 positions that measured slow is its own shape's price
    assert ba.step_cost(9, rows=1) == pytest.approx(0.050)
    assert ba.step_cost(8, rows=8) == pytest.approx(0.060)


def test_an_auto_row_is_sized_for_the_batch_it_joins_counting_the_rows_queued_with_it(sess, ids, ba):
    """A model drafter that pays for a request alone but not in a batch of four: four auto requests added at once
    carry only n-gram lookup (each is sized, when its prefill starts, by the rows decoding and those queued with it
    — sized at `add`, the first ones saw an empty batch and carried the drafter, its taps every step); one request
    alone carries it."""
    ba.curve = {n: 0.01 * (1 + 0.4 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # each row +40 %
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.6)
    pin(ba, "mtp", "greedy", 0.6)
    assert ba.could_pay("mtp", "greedy", 1)
    assert not ba.could_pay("mtp", "greedy", 4)
    assert not ba.could_pay("dflash", "greedy", 4)
    gen = BatchGenerator(sess.model, auto=ba)
    rows = [gen.add(request(sess, ids[i], "auto", params(), 0, 8)) for i in range(4)]
    while gen.waiting:
        gen.step()
    assert [set(r.options) for r in rows] == [{"ngram"}] * 4
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}  # what the steps above measured: the curve alone again
    assert ba.could_pay("mtp", "greedy", 1)
    alone = BatchGenerator(sess.model, auto=ba)
    row = alone.add(request(sess, ids[0], "auto", params(), 0, 8))
    alone.step()
    assert {"ngram", "mtp"} <= set(row.options)


def test_the_server_sizes_an_auto_request_for_the_jobs_running_and_queued(sess, ids, monkeypatch):
    """`glimmer serve` chooses an auto request's drafters (with its prompt-cache lookup) when it moves the job into
    the batch: four requests arriving together are each sized for a batch of four, not as if alone."""
    from glimmer_mlx.serve.api import Request
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    sizes, real = [], BatchAuto.options
    monkeypatch.setattr(BatchAuto, "options", lambda self, regime, batch=1, budget=None: (
        sizes.append(batch), real(self, regime, batch, budget))[1])
    worker = Worker(sess, max_queue=8, max_batch=8)
    for i in range(4):
        worker.submit(Request(list(ids[i]), params(), 0, None, 8, DecodeSpec("auto", None)))
    worker._take_jobs(wait=False)
    assert len(worker.running) == 4 and sizes == [4, 4, 4, 4]


def test_the_server_sizes_a_request_for_the_batch_that_just_finished(sess, ids, monkeypatch):
    """Clients whose requests finished in the same step come back one by one: the first request back (nothing
    running, nothing queued) is sized for the rows of that step while it ended less than `RECENT_S` ago — its
    drafters and a prefill again for their state priced for the batch it will join — and for itself alone once it
    is older. Catches: the first request back sized as if alone (at N = 4 in `glimmer bench serve` it prefilled its
    cached prompt again for DFlash's state, which the batch of four then never drafted with)."""
    from glimmer_mlx.serve import worker as W
    from glimmer_mlx.serve.api import Request
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    sizes, real = [], BatchAuto.options
    monkeypatch.setattr(BatchAuto, "options", lambda self, regime, batch=1, budget=None: (
        sizes.append(batch), real(self, regime, batch, budget))[1])
    worker = W.Worker(sess, max_queue=8, max_batch=8)
    for i in range(3):
        worker.submit(Request(list(ids[i]), params(), 0, None, 4, DecodeSpec("ar", None)))
    worker._take_jobs(wait=False)
    worker._step()
    assert worker.last_step[0] == 3  # each step records its rows
    while worker.running:
        worker._step()
    worker.last_step = (3, W.time.monotonic())  # three rows finished together just now
    worker.submit(Request(list(ids[3]), params(), 0, None, 4, DecodeSpec("auto", None)))
    worker._take_jobs(wait=False)
    assert sizes == [3]
    while worker.running:
        worker._step()
    worker.last_step = (5, W.time.monotonic() - W.RECENT_S)  # a step of five rows, long enough ago
    worker.submit(Request(list(ids[0]), params(), 0, None, 4, DecodeSpec("auto", None)))
    worker._take_jobs(wait=False)
    assert sizes == [3, 1]


def unknown(ba, name, regime, alpha, tried=1.0):
    """`name`'s estimates (of `regime`, in every phase) as if it had tried `tried` first drafts, accepting a share
    `alpha`: a wide spread."""
    for key in phase_keys(ba, regime):
        a = ba.acceptance(name, key)
        a.acc, a.tried = [alpha * tried] + [0.0] * (len(a.acc) - 1), [tried] + [0.0] * (len(a.tried) - 1)
        a.shrink = 2.0


def serve_one(worker, prompt: list[int], mode: str, budget: int = 12):
    """Submit one greedy request to a `Worker`, step it to the end; its job (None: it finished at its prefill)."""
    from glimmer_mlx.serve.api import Request

    worker.submit(Request(prompt, params(), 0, None, budget, DecodeSpec(mode, None)))
    worker._take_jobs(wait=False)
    job = worker.running[-1] if worker.running else None
    while worker.running:
        worker._step()
    return job


@pytest.mark.parametrize("pays", [True, False], ids=["refill", "reuse"])
def test_an_auto_request_on_a_prompt_cached_without_drafter_states_prefills_again_where_that_pays(sess, ids,
                                                                                                monkeypatch, pays):
    """A prompt the server answered plainly is cached without a model drafter's state; an auto request for it either
    prefills it again so its drafters get their state (`BatchAuto.refill_pays`: where a drafter is worth more to
    the row than that prefill), or reuses the cache and leaves them out. Greedy output equals plain decoding's both
    ways. Catches: a cached prompt locking auto out of its model drafters for good (the serve benchmark replays
    prompts: every auto request hit a plain request's entry and never drafted with DFlash), a refill that keeps the
    stale cache (positions fed twice: output differs)."""
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    monkeypatch.setattr(BatchAuto, "carries", lambda self, *a, **k: True)  # every model drafter joins
    asked = []
    monkeypatch.setattr(BatchAuto, "refill_pays", lambda self, *a: (asked.append(a), pays)[1])
    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[3])

    serve_one(worker, prompt, "ar")
    job = serve_one(worker, prompt, "auto")
    carried = {kind for kind, d in job.row.options.items() if d.taps}
    assert asked and asked[0][-1] == len(prompt) - 1  # asked once the plain entry was found: its positions
    assert bool(carried) is pays
    extra = job.row.stats.extra
    assert (extra["cached_tokens"] == 0) is pays and (extra["cache"].startswith("fresh: prefilled again")) is pays
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


def test_a_plain_answer_equal_to_an_auto_one_keeps_the_auto_entry_s_drafter_states(sess, ids, monkeypatch):
    """A server serving several modes: an auto request's conversation is cached with its model drafters' states; a
    plain request on the same prompt comes out the same (greedy) and is not stored over it; the next auto request
    continues the cached conversation with those states — neither prefilling it again for them (`refill_pays` is
    not even asked) nor going without them. Catches: the plain entry replacing the auto one (the serve benchmark
    replays each prompt in every mode: auto requests at N = 4 prefilled again ~35 % of their cached prompts)."""
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    monkeypatch.setattr(BatchAuto, "carries", lambda self, *a, **k: True)  # every model drafter joins
    asked = []
    monkeypatch.setattr(BatchAuto, "refill_pays", lambda self, *a: (asked.append(a), True)[1])
    # every step plain: a drafter that drafted in turn 1 holds K/V its sliding window cannot rewind to the prompt's
    # end (a short prompt is then prefilled again from its start, whether the batch drafted being the machine's
    # timing); this test is about which states the cache keeps
    monkeypatch.setattr(BatchAuto, "choose", lambda self, rows, *a: (0, [(None, 0)] * len(rows)))
    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[3])

    first = serve_one(worker, prompt, "auto")
    assert {kind for kind, d in first.row.options.items() if d.taps}  # it carried a model drafter
    plain = serve_one(worker, prompt, "ar")
    assert plain.row.history == first.row.history and plain.row.stats.extra["cached_tokens"] > 0
    job = serve_one(worker, prompt, "auto")
    assert not asked  # the entry it found has the states: nothing to decide
    assert {kind for kind, d in job.row.options.items() if d.taps}
    assert job.row.stats.extra["cached_tokens"] == len(prompt) - 1
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


def test_a_one_token_auto_request_leaves_its_drafters_states_for_the_next_turn(sess, ids, monkeypatch):
    """A request with one token to generate (a client warming the prompt cache) ends at its prefill's token and
    follows no step: it takes every model drafter, and its cache entry keeps their states, so the next auto request
    on that prompt continues it with them — not prefilling it again for them (`refill_pays` is not even asked),
    nor going without them. Catches: a one-token request sized by `carries` like a long one (its entry kept no
    state; `glimmer bench serve`'s warm-up left every later auto request a refill)."""
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    monkeypatch.setattr(BatchAuto, "carries",
                        lambda self, name, regime, batch, budget, generated=0, rho=None: budget > 1)
    asked = []
    monkeypatch.setattr(BatchAuto, "refill_pays", lambda self, *a: (asked.append(a), True)[1])
    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[2])

    serve_one(worker, prompt, "auto", 1)
    entry = worker.prompts.entries()[-1]
    models = {k for k, d in sess.drafters.auto().drafters.items() if d.taps}
    assert models and isinstance(entry.extra, dict) and {k for k, _ in entry.extra} == models
    job = serve_one(worker, prompt, "auto", 12)
    assert not asked
    assert {k for k, d in job.row.options.items() if d.taps} == models
    assert job.row.stats.extra["cached_tokens"] == len(prompt) - 1
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


def test_an_entry_with_some_drafters_states_is_prefilled_again_only_for_the_others(sess, ids, monkeypatch):
    """A cached conversation holds DFlash's state but not MTP's (its request did not carry MTP): the next auto
    request carrying both is asked whether prefilling again pays for MTP only, and where it does not, continues the
    entry with DFlash's state and leaves MTP out. Catches: `refill_pays` asked about DFlash too (the entry was
    prefilled again for a state it held: in `glimmer bench serve` most auto requests at N = 1 and 2 were)."""
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    carried = {"dflash"}
    monkeypatch.setattr(BatchAuto, "carries", lambda self, name, *a, **k: name in carried)
    asked = []
    monkeypatch.setattr(BatchAuto, "refill_pays", lambda self, name, *a: (asked.append(name), name == "dflash")[1])
    # every step plain: a drafter that drafted in turn 1 holds K/V its sliding window cannot rewind to the prompt's
    # end (a short prompt is then prefilled again from its start, whether the batch drafted being the machine's
    # timing); this test is about which states the cache keeps
    monkeypatch.setattr(BatchAuto, "choose", lambda self, rows, *a: (0, [(None, 0)] * len(rows)))
    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[1])

    serve_one(worker, prompt, "auto")
    carried.add("mtp")
    job = serve_one(worker, prompt, "auto")
    assert asked == ["mtp"]
    assert {k for k, d in job.row.options.items() if d.taps} == {"dflash"}
    assert job.row.stats.extra["cached_tokens"] == len(prompt) - 1
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


def test_a_row_keeps_its_drafters_states_to_the_end_of_its_budget(sess, ids, monkeypatch):
    """The batch's prune (every `PRUNE_EVERY` steps; here every step) asks whether a row's model drafters could still
    pay as if its whole budget were ahead: a drafter worth carrying only with more than 8 tokens to go stays to the
    end of a 24-token request, its state lands in the prompt cache, and the conversation's next request continues
    with it — not prefilling it again (`refill_pays` is not even asked), nor going without it. Catches: the prune
    asking with the tokens left (every auto request dropped its drafters in its last tokens; its entry kept no
    state for the next turn)."""
    import glimmer_mlx.speculative.batch as batch_mod
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    monkeypatch.setattr(batch_mod, "PRUNE_EVERY", 1)
    monkeypatch.setattr(BatchAuto, "carries",
                        lambda self, name, regime, batch, budget, generated=0, rho=None: budget > 8)
    asked = []
    monkeypatch.setattr(BatchAuto, "refill_pays", lambda self, *a: (asked.append(a), True)[1])
    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[4])
    models = {k for k, d in sess.drafters.auto().drafters.items() if d.taps}

    first = serve_one(worker, prompt, "auto", 24)
    assert models and {k for k, d in first.row.options.items() if d.taps} == models
    assert first.row.out.n == 24 and first.row.steps > 1  # it stepped: the prune asked
    entry = worker.prompts.entries()[-1]
    assert isinstance(entry.extra, dict) and {k for k, _ in entry.extra} == models
    job = serve_one(worker, prompt, "auto", 12)
    assert not asked
    assert {k for k, d in job.row.options.items() if d.taps} == models
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


@pytest.mark.parametrize("pays", [True, False], ids=["fuller", "longer"])
def test_a_conversation_continued_without_a_drafter_keeps_its_fuller_entry(sess, ids, monkeypatch, pays):
    """Turn 1 of a conversation ran with DFlash and MTP, turn 2 with MTP only (its row did not carry DFlash): the
    prompt cache keeps turn 1's entry beside turn 2's, and turn 3, wanting both, is asked whether prefilling what
    turn 2's entry holds beyond turn 1's pays for DFlash's state (`refill_pays`, those positions only): if it does,
    it continues turn 1's entry with both drafters; if not, turn 2's without DFlash. Greedy output equals plain
    decoding's both ways. Catches: turn 2's entry replacing turn 1's (DFlash's state lost: the whole conversation
    prefilled again for it), or the shorter entry taken unasked, or priced as the whole conversation."""
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    carried = {"dflash", "mtp"}
    monkeypatch.setattr(BatchAuto, "carries", lambda self, name, *a, **k: name in carried)
    asked = []
    monkeypatch.setattr(BatchAuto, "refill_pays",
                        lambda self, name, regime, batch, budget, positions: (asked.append((name, positions)), pays)[1])
    worker = Worker(sess, max_queue=8, max_batch=8)
    turn1 = serve_one(worker, list(ids[0]), "auto")
    carried.discard("dflash")
    turn2 = serve_one(worker, turn1.row.history + list(ids[1][:4]), "auto")
    assert {k for k, d in turn2.row.options.items() if d.taps} == {"mtp"}
    lengths = sorted(len(e.keys) for e in worker.prompts.entries())
    assert lengths == [len(turn1.row.history) - 1, len(turn2.row.history) - 1]  # turn 1's entry kept (each
    # conversation's cache ends before its last token, which the next turn feeds)
    carried.add("dflash")
    prompt = turn2.row.history + list(ids[2][:4])
    job = serve_one(worker, prompt, "auto")
    assert asked == [("dflash", len(turn2.row.history) - len(turn1.row.history))]
    models = {k for k, d in job.row.options.items() if d.taps}
    cached = job.row.stats.extra["cached_tokens"]
    if pays:
        assert models == {"dflash", "mtp"} and 0 < cached <= len(turn1.row.history)
    else:
        assert models == {"mtp"} and len(turn1.row.history) < cached <= len(turn2.row.history)
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


@pytest.mark.parametrize("ordered", [True, False], ids=["warm_order", "plain_first"])
def test_the_serve_bench_s_warm_up_leaves_auto_the_states_it_would_have_alone(sess, ids, monkeypatch, ordered):
    """`glimmer bench serve` warms every prompt once per mode (one token each) on one server: in `warm_order` (the
    plain modes, ar and its control ar-again, last) the auto request that follows continues its prompt's entry with
    its model drafters' states, as on a server running auto alone; warmed plainly first, the entry has none and auto
    goes without them. Catches: the bench warming ar (or ar-again) first (auto's cells measured a server no auto user
    runs)."""
    from glimmer_mlx.bench.serve import warm_order
    from glimmer_mlx.serve.worker import Worker
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    monkeypatch.setattr(BatchAuto, "carries", lambda self, *a, **k: True)
    monkeypatch.setattr(BatchAuto, "refill_pays", lambda self, *a: False)
    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[0])

    modes = ["ar", "ar-again", "auto"]  # (the bench's control: plain decoding sent again as ar)
    order = warm_order(modes) if ordered else modes
    assert order[-2:] in (["ar", "ar-again"], ["ar-again", "ar"]) or not ordered
    for mode in order:
        serve_one(worker, prompt, "ar" if mode == "ar-again" else mode, 1)
    job = serve_one(worker, prompt, "auto")
    models = {k for k, d in sess.drafters.auto().drafters.items() if d.taps}
    assert ({k for k, d in job.row.options.items() if d.taps} == models) is ordered
    assert job.row.history[len(prompt):] == solo(sess, prompt, "ar", params(), 0, 12)[0]


def test_a_cached_conversation_s_drafter_states_count_in_the_prompt_cache_s_bytes(sess, ids):
    """A prompt-cache entry that keeps model drafters' states is priced with their bytes (the budget bounds what the
    server really holds): after a one-token auto request, its entry's bytes are the target cache's plus each
    state's, and DFlash's state then is its pending context — the prompt's positions × its taps × the hidden size.
    Catches: states stored for free (on Glimmer's shapes DFlash's pending taps outweigh the target's K/V)."""
    from glimmer_mlx.serve.worker import Worker

    worker = Worker(sess, max_queue=8, max_batch=8)
    prompt = list(ids[2])
    serve_one(worker, prompt, "auto", 1)
    entry = worker.prompts.entries()[-1]
    states = entry.extra
    assert isinstance(states, dict) and states
    target = sum(c.nbytes for c in entry.cache)
    assert entry.nbytes == target + sum(d.state_nbytes() for d in states.values())
    assert worker.prompts.nbytes == sum(e.nbytes for e in worker.prompts.entries())
    dflash = next(d for (kind, _), d in states.items() if kind == "dflash")
    hidden = sess.model.args.hidden_size
    assert dflash.state_nbytes() == len(prompt) * len(dflash.taps) * hidden * 4  # fp32 taps, nothing drafted yet
    assert all(d.state_nbytes() > 0 for d in states.values())


def test_a_new_auto_row_carries_the_drafters_the_batch_s_choice_could_take(ba):
    """`BatchAuto.options`/`carries`: a model drafter joins a new auto row if it beats plain at the batch's size by
    its mean estimate, or if exploring it would pay over the row's budget (a wide spread, a long request); not one
    that cannot pay in any scenario, nor one only exploring could make pay on a short request (it would never
    draft and would cost the row its taps and bookkeeping every step). n-gram lookup always joins."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: verification is free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.6)
    pin(ba, "mtp", "greedy", 0.6)
    assert set(ba.options("greedy", 4)) == {"ngram", "dflash", "mtp"}
    ba.curve = {n: 0.01 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # compute-bound: nothing pays
    unknown(ba, "dflash", "greedy", 0.5)
    assert set(ba.options("greedy", 4, 256)) == {"ngram"}
    # a weak mean with a wide spread: its optimistic scenario pays, its mean does not
    ba.curve = {n: 0.01 * (1 + 0.15 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # each row +15 %
    pin(ba, "mtp", "greedy", 0.0)
    unknown(ba, "dflash", "greedy", 0.05)
    assert not ba.could_pay("dflash", "greedy", 1)
    ba.decoded = 0
    assert "dflash" in ba.options("greedy", 1, 256)  # a long request: worth exploring
    assert "dflash" not in ba.options("greedy", 1, 2)  # two tokens: nothing learned could pay back a step
    pin(ba, "dflash", "greedy", 0.05)  # the same mean, known well: no scenario pays
    assert "dflash" not in ba.options("greedy", 1, 256)


def test_a_carries_answer_holds_a_few_steps_while_its_estimates_stand(ba, monkeypatch):
    """`BatchAuto.carries` (asked per model drafter at every auto row's join) keeps its answer for `CARRIES_HOLD`
    steps while the drafter's estimates, the batch's size, the row's budget and ρ stand: the rows of a burst join on
    the same question. Catches: no memo (every join scores the phases' scenarios again), a memo that ignores an
    estimate change (a drafter pinned to nothing stays carried) or the batch's size, one that never expires."""
    from glimmer_mlx.speculative.auto.batch import CARRIES_HOLD

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: verification is free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "mtp", "greedy", 0.0)
    pin(ba, "dflash", "greedy", 0.6)
    asked = []
    real = ba._carries
    monkeypatch.setattr(ba, "_carries", lambda *a: asked.append(a) or real(*a))
    assert ba.carries("dflash", "greedy", 4, 64) and len(asked) == 1
    assert ba.carries("dflash", "greedy", 4, 64) and len(asked) == 1  # held
    assert ba.carries("dflash", "greedy", 8, 64) and len(asked) == 2  # another batch size: its own question
    assert ba.carries("dflash", "greedy", 4, 64, rho=0.5) is not None and len(asked) == 3  # another ρ
    pin(ba, "dflash", "greedy", 0.0)  # an estimate changed: asked again, and the answer follows it
    assert not ba.carries("dflash", "greedy", 4, 64) and len(asked) == 4
    ba.curve = {n: 0.01 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # the step costs alone moved ...
    pin(ba, "dflash", "greedy", 0.0)
    assert not ba.carries("dflash", "greedy", 4, 64) and len(asked) == 4  # ... held until CARRIES_HOLD steps
    for _ in range(CARRIES_HOLD - 1):
        ba.elapse(0.01)
    ba.carries("dflash", "greedy", 4, 64)
    assert len(asked) == 4
    ba.elapse(0.01)
    ba.carries("dflash", "greedy", 4, 64)
    assert len(asked) == 5


def test_a_batch_closed_to_speculation_asks_its_rows_nothing(sess, ids, ba, monkeypatch):
    """While the ledger bars speculation (`BatchAuto.closed`) every auto row steps plainly whatever it offers: the
    batch's choice asks the rows nothing (their n-gram offers, phase keys and measures were ~60 µs of every step at
    8 rows here) and lets them step plainly; open again, it asks every row. Catches: the rows asked on a closed
    batch, a closed batch that still lets a row draft."""
    from glimmer_mlx.speculative.batch import Row

    gen = BatchGenerator(sess.model, auto=ba)
    rows = [gen.add(request(sess, ids[i], "auto", params(), 0, 24)) for i in (3, 4)]
    while gen.waiting or any(r.first_pending for r in rows):
        gen.step()
    asked = []
    real = Row.available
    monkeypatch.setattr(Row, "available", lambda self, k: asked.append(self) or real(self, k))
    ba.saved, ba.elapsed, ba.plain_step = -1.0, 1.0, 0.01  # lost a second: barred
    assert ba.closed(1) and gen._choose(gen.rows) == {} and asked == []
    ba.saved = 0.0
    assert not ba.closed(1)
    gen._choose(gen.rows)
    assert sorted(map(id, asked)) == sorted(map(id, gen.rows))


def test_a_batch_that_seldom_speculates_asks_its_choice_every_few_steps(sess, ids, ba, monkeypatch):
    """`BatchAuto.asks`: while fewer than `QUIET_RATE` of its latest answers took a speculative step (`quiet.hits`,
    an EMA from 1 over answers), the batch asks its rows and its choice only every `QUIET_EVERY`th step, the gap
    doubling with each plain answer up to `QUIET_MOST`; right after a speculative answer, and while they often are
    speculative, every step, and quiet again from QUIET_EVERY. Unasked steps are plain for every auto row and the
    output stays plain decoding's. Catches: a quiet batch asking every step (at 8 rows the asks were ~1.4 % of every
    step, auto rows 3.5-4.5 % behind plain ones), a stretch the quiet rule interrupts, a batch that never asks again
    once quiet, a gap that does not grow or does not go back."""
    from glimmer_mlx.speculative.auto.batch import QUIET_MOST
    from glimmer_mlx.speculative.auto.chooser import QUIET_EMA, QUIET_EVERY, QUIET_RATE
    from glimmer_mlx.speculative.batch import Row

    ba.quiet.hits = 1.0
    ba.choose([("greedy", 100, {}), ("greedy", 50, {})], 0, 1, 0.0, 15)  # a plain answer
    assert ba.quiet.hits == pytest.approx(1.0 - QUIET_EMA) and not ba._spec_last
    gen = BatchGenerator(sess.model, auto=ba)
    rows = [gen.add(request(sess, ids[i], "auto", params(), 0, 48)) for i in (3, 4)]
    while gen.waiting or any(r.first_pending for r in rows):
        gen.step()
    monkeypatch.setattr(ba, "closed", lambda fixed_width: False)
    asked = []
    real = Row.available
    monkeypatch.setattr(Row, "available", lambda self, k: asked.append(self) or real(self, k))
    answers = []
    monkeypatch.setattr(ba, "_pick", lambda rows, *a: answers.pop(0))

    def asks(n, answer=(0, None)):
        """Which of the next n choices asked the rows (each answered `answer` when asked)."""
        out = []
        for _ in range(n):
            answers.append((answer[0], answer[1] or [(None, 0)] * len(gen.rows)))
            before = len(asked)
            gen._choose(gen.rows)
            out.append(len(asked) > before)
            if not out[-1]:
                answers.pop()
        return out

    ba.quiet.hits = 0.5  # half the answers speculative: every step
    assert asks(3) == [True] * 3 and ba.quiet.hits == pytest.approx(0.5 * (1 - QUIET_EMA) ** 3)
    ba.quiet.hits, ba.quiet.since = QUIET_RATE, 0  # at the rate: asked; its plain answer takes it under
    assert asks(2) == [True, False] and ba.quiet.hits < QUIET_RATE
    ba.quiet.hits, ba.quiet.since, ba.quiet.every = 0.0, 0, QUIET_EVERY

    def gap(n):
        return [False] * (n - 1) + [True]

    unasked = ba.quiet.unasked
    # quiet: every QUIET_EVERY steps, the gap doubling with each plain answer up to QUIET_MOST
    gaps = [QUIET_EVERY, 2 * QUIET_EVERY] + [QUIET_MOST] * 2
    assert 4 * QUIET_EVERY <= QUIET_MOST  # (the doubling reaches the cap after two asks, as `gaps` says)
    assert asks(sum(gaps)) == [a for n in gaps for a in gap(n)]
    assert ba.quiet.unasked - unasked == sum(gaps) - len(gaps)
    assert ba.counts()["unasked_steps"] == ba.quiet.unasked  # (/health)
    spec = (3, [("ngram@1", 2), (None, 0)])
    assert asks(QUIET_MOST, spec) == gap(QUIET_MOST)  # quiet: the next ask finds a speculative step...
    assert asks(3, spec) == [True] * 3  # ... and the stretch is asked about every step while it goes on
    assert asks(2) == [True, True] and ba.quiet.hits >= QUIET_RATE  # its answers raised the rate: every step still
    assert ba.quiet.every == QUIET_EVERY  # and quiet again, it starts from QUIET_EVERY steps

    monkeypatch.undo()
    ba.quiet.hits, ba.quiet.since = 0.0, 0
    asked_now = []
    monkeypatch.setattr(ba, "_pick", lambda rows, *a: asked_now.append(1) or (0, [(None, 0)] * len(rows)))
    monkeypatch.setattr(ba, "closed", lambda fixed_width: False)
    gen = BatchGenerator(sess.model, auto=ba)
    plan = [(0, request(sess, ids[i], "auto", params(), 0, 40)) for i in (1, 2)]
    out, _ = run(gen, plan)
    for j, i in enumerate((1, 2)):
        assert out[j][0] == solo(sess, ids[i], "ar", params(), 0, 40)[0]
    assert 0 < len(asked_now) <= gen.steps // QUIET_EVERY + 2  # (the prefills' steps ask nothing)


def test_a_drafter_that_pays_only_at_widths_beyond_a_row_s_budget_is_not_carried(ba):
    """`BatchAuto.could_pay`/`carries` price a row's drafts at most at its budget − 1 (what `choose` lets it draft):
    a drafter whose rounds cost a fixed half step pays at 8 drafts but not at 1, so a row with 2 tokens to generate
    does not carry it and one with 64 does. Catches: the widest block priced for every row (a 2-token request
    carried DFlash, computing its taps every step, for drafts it could never make)."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: verification is free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.draft_cost = lambda name, k: 0.005  # a round costs half a step, whatever k
    pin(ba, "mtp", "greedy", 0.0)
    pin(ba, "dflash", "greedy", 0.5)  # 1 draft: 1.5 tokens in 1.5 steps; 8: ~2 tokens in 1.5 steps
    assert ba.could_pay("dflash", "greedy", 1) and ba.could_pay("dflash", "greedy", 1, 9)
    assert not ba.could_pay("dflash", "greedy", 1, 2)
    assert "dflash" in ba.options("greedy", 1, 64)
    assert "dflash" not in ba.options("greedy", 1, 2)


def test_a_refill_for_a_drafter_s_state_pays_only_what_the_drafter_is_worth(ba):
    """`BatchAuto.refill_pays`: prefilling a cached prompt again for a model drafter's state pays where the drafter
    saves more over the row's budget than that prefill costs — by its mean, or by what exploring it is worth — not
    for a drafter that cannot pay, a prompt whose prefill costs more than the drafter saves, or a row with little
    left to generate."""
    ba.curve = {n: 0.01 * (1 + 0.4 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # each position +40 %
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "mtp", "greedy", 0.0)
    pin(ba, "dflash", "greedy", 0.8)
    assert ba.refill_pays("dflash", "greedy", 1, 256, 64)
    assert not ba.refill_pays("dflash", "greedy", 1, 4, 64)  # 4 tokens save less than 64 positions cost
    assert not ba.refill_pays("dflash", "greedy", 1, 256, 100_000)
    pin(ba, "dflash", "greedy", 0.05)
    assert not ba.refill_pays("dflash", "greedy", 1, 256, 64)
    unknown(ba, "dflash", "greedy", 0.3, tried=2.0)  # unknown: worth exploring, so worth a short prefill
    ba.decoded = 0
    assert not ba.could_pay("dflash", ba.key("greedy", 0), 1)
    assert ba.refill_pays("dflash", "greedy", 1, 256, 2)
    assert not ba.refill_pays("dflash", "greedy", 1, 256, 64)


def explore_run(ba, truth: dict, steps: int, rows: int = 1, budget: int = 256, seed: int = 0):
    """`steps` of `BatchAuto.choose` for `rows` auto rows carrying every option in `truth` (option -> its true
    per-position acceptance), each drafting row's round drawn from the truth and told (`update`). Returns
    [(k, plan)] per step."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        k, plan = ba.choose([("greedy", budget, {n: 8 for n in truth})] * rows, 0, 1, 0.0, 8)
        for name, kk in plan:
            if name is not None:
                n = 0
                while n < kk and rng.random() < truth[name]:
                    n += 1
                ba.update(name, "greedy", kk, n)
                ba.decoded += n + 1
            else:
                ba.decoded += 1
        out.append((k, plan))
    return out


@pytest.mark.parametrize("rows, slope", [(1, 0.4), (4, 0.15)])
def test_the_batch_explores_a_drafter_whose_estimate_says_it_does_not_pay(ba, rows, slope):
    """A drafter at its prior (mean α 0.3: below what pays on this curve, wide spread) that truly accepts 0.8: the
    batch explores it, learns, and drafts with it in most steps after (the mean alone never would). One that truly
    accepts 0.05 is explored a few times and then left: few speculative steps. Catches: no exploration (the first
    drafter is never drafted — what the embedded server did with DFlash at its prior), exploration that never stops
    (the weak drafter drafted throughout). (slope: each position's cost over the first's, so that a mean of 0.3
    does not pay at that many rows and 0.8 pays clearly.)"""
    ba.curve = {n: 0.01 * (1 + slope * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "mtp", "greedy", 0.0)
    ba.decoded = 0
    unknown(ba, "dflash", "greedy", 0.3, tried=2.0)
    first, _ = ba.choose([("greedy", 256, {"dflash": 8})] * rows, 0, 1, 0.0, 8)
    assert not ba.could_pay("dflash", "greedy", rows)  # its mean does not pay ...
    assert first > 0 and ba.exploring == "dflash"  # ... exploring it does
    steps = explore_run(ba, {"dflash": 0.8}, 60, rows)
    late = steps[20:]
    assert sum(k > 0 for k, _ in late) >= 0.9 * len(late), [k for k, _ in steps]
    assert ba.could_pay("dflash", "greedy", rows)
    unknown(ba, "dflash", "greedy", 0.3, tried=2.0)
    ba.decoded = 0
    steps = explore_run(ba, {"dflash": 0.05}, 60, rows, seed=1)
    spec = sum(k > 0 for k, _ in steps)
    assert 1 <= spec <= 8, [k for k, _ in steps]
    assert all(k == 0 for k, _ in steps[30:])


def test_a_row_drafts_by_the_estimates_of_its_phase_of_the_response(sess, ids, ba):
    """`BatchAuto.key`: a row's steps are chosen by, and teach, the estimates of the phase of the response it is in
    (`chooser.PHASES`, the solo chooser's): DFlash accepting well in a response's opening (its first 16 tokens) and
    never after drafts in the opening only, and its rounds update the opening's estimates only. Greedy output equals
    plain decoding's. Catches: pooled estimates (drafting throughout, or not at all), rounds counted in the phase
    after the tokens they committed."""
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: verification is free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.observe = lambda n, seconds, spec, rows=None: None  # keep the curve as told
    for name in ba.chooser.options:
        pin(ba, name, "greedy", 0.0)
    opening, after = ba.key("greedy", 0), ba.key("greedy", 16)
    assert opening != after and ba.key("greedy", 15) == opening
    ba.acceptance("dflash", opening).set_alphas([0.9])
    seen, real = [], ba.update
    ba.update = lambda name, key, k, accepted, here=None, expected=None: (
        seen.append((name, key, row.out.n)), real(name, key, k, accepted, here, expected))
    gen = BatchGenerator(sess.model, prefill_step=16, auto=ba)
    row = gen.add(request(sess, ids[3], "auto", params(), 0, 40))
    while len(gen) or gen.waiting:
        gen.step()
    assert seen and {(name, key) for name, key, _ in seen} == {("dflash", opening)}, seen
    assert all(n < 16 for _, _, n in seen)
    assert ba.acceptance("dflash", after).tried[0] == 1000.0  # untouched by the opening's rounds
    assert row.history[len(ids[3]):] == solo(sess, ids[3], "ar", params(), 0, 40)[0]


def test_sampled_auto_rows_teach_what_their_drafts_are_accepted_on_average(sess, ids, ba, monkeypatch):
    """At T > 0 an auto row's round teaches its option what its drafts are accepted on average
    (`verify.expected_acceptance`), recomputed here in float64 numpy from the distributions the verifier saw, row by
    row; a fixed-mode row computes nothing. Catches: the expectation not passed on, or passed with another row's."""
    import glimmer_mlx.speculative.batch as sb

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: verification is free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.observe = lambda n, seconds, spec, rows=None: None
    for name in ba.chooser.options:
        pin(ba, name, "sampling", 0.0)
    for key in phase_keys(ba, "sampling"):
        ba.acceptance("dflash", key).set_alphas([0.9])
    seen, got, real, verify = [], [], ba.update, sb.verify_sampling

    def spy(p, q, drafts, sampler):
        k = len(drafts)
        seen.append((tuple(drafts), np.exp(np.array(p[:k].astype(mx.float32), dtype=np.float64)),
                     np.exp(np.array(q.astype(mx.float32), dtype=np.float64))))
        return verify(p, q, drafts, sampler)

    monkeypatch.setattr(sb, "verify_sampling", spy)
    ba.update = lambda name, key, k, accepted, here=None, expected=None: (
        got.append(expected), real(name, key, k, accepted, here, expected))
    gen = BatchGenerator(sess.model, prefill_step=16, auto=ba)
    for i, mode in enumerate(("auto", "dflash", "auto")):
        gen.add(request(sess, ids[i], mode, params(1.0), i, 24))
    while len(gen) or gen.waiting:
        gen.step()
    assert len(got) >= 4 and all(e is not None for e in got)
    want = {}
    for drafts, P, Q in seen:
        w, rows = 1.0, []
        for j, x in enumerate(drafts):
            rows.append((w, w * np.minimum(P[j], Q[j]).sum()))
            w *= min(1.0, P[j, x] / Q[j, x])
        want.setdefault(len(drafts), []).append(np.array(rows))
    for e in got:  # each matches one verified round of its width (rows of a step are verified in turn)
        assert any(np.allclose(np.array(e), r, rtol=1e-4, atol=1e-6) for r in want[len(e)])
    assert len(seen) > len(got)  # the fixed-mode row's rounds were verified too, and taught nothing


def test_the_batch_does_not_explore_for_a_short_request_or_a_used_option(ba):
    """Exploring pays only over tokens still to come: rows with 3 tokens left in a fresh batch do not explore a
    drafter that rows with 256 would; nor is an option the step's plan drafts with explored (its rounds teach it
    anyway)."""
    from glimmer_mlx.speculative.auto.batch import StepChoice

    ba.curve = {n: 0.01 * (1 + 0.25 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "mtp", "greedy", 0.0)
    unknown(ba, "dflash", "greedy", 0.3, tried=2.0)
    ba.decoded = 0
    assert ba.choose([("greedy", 3, {"dflash": 8})] * 2, 0, 1, 0.0, 8)[0] == 0 and ba.exploring is None
    assert ba.choose([("greedy", 256, {"dflash": 8})] * 2, 0, 1, 0.0, 8)[0] > 0 and ba.exploring == "dflash"
    step = StepChoice(ba, [("greedy", 256, {"dflash": 8})], 0, 1, 0.0, 8)
    assert ba.explore(step, step.plain_rate, [("dflash", 4)]) is None


def test_the_batch_s_answer_not_to_explore_holds_while_only_n_gram_offers_move(ba, monkeypatch):
    """`BatchAuto._explored`: a step's answer not to explore is held for `EXPLORE_EVERY` steps while only the rows'
    n-gram offers change (their sizes move nearly every step; keyed on them, a lone auto request was asked afresh
    in 81 of 90 choices), and asked again at once when a row's model drafters, the plan's options or an estimate
    change. Catches: a memo keyed on the n-gram offers (asked every step), or one that ignores the model drafters."""
    from glimmer_mlx.speculative.auto.batch import EXPLORE_EVERY, BatchAuto

    ba.curve = {n: 0.01 * (1 + 0.4 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # each position +40 %
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "mtp", "greedy", 0.0)
    pin(ba, "dflash", "greedy", 0.05)  # known well and weak: never worth exploring
    ba.decoded = 0
    asked, real = [], BatchAuto.explore
    monkeypatch.setattr(BatchAuto, "explore", lambda self, *a, **k: (asked.append(1), real(self, *a, **k))[1])
    ngram = next(n for n, o in ba.chooser.options.items() if o.shadowed)
    for i in range(EXPLORE_EVERY):  # the n-gram offer moves every step: asked once
        assert ba.choose([("greedy", 256, {"dflash": 8, ngram: i % 3})], 0, 1, 0.0, 8)[0] == 0
    assert len(asked) == 1
    ba.choose([("greedy", 256, {"dflash": 8, ngram: 1})], 0, 1, 0.0, 8)  # held for EXPLORE_EVERY steps only
    assert len(asked) == 2
    ba.choose([("greedy", 256, {"dflash": 4, ngram: 1})], 0, 1, 0.0, 8)  # a model drafter's offer changed
    assert len(asked) == 3
    ba.acceptance("dflash", "greedy").update(4, 0)  # an estimate changed
    ba.choose([("greedy", 256, {"dflash": 4, ngram: 2})], 0, 1, 0.0, 8)
    assert len(asked) == 4


class CountingModel:
    """The target with its forwards counted."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.model(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


JOIN_CASES = [(m, p) for m in ("ar", "ngram") for p in ("greedy", "top_p", "penalty")] + [("auto", "greedy")]
JOIN_PARAMS = {"greedy": params(), "top_p": params(1.0, top_p=0.9), "penalty": params(1.0, repetition_penalty=1.2)}


@pytest.mark.parametrize("mode, regime", JOIN_CASES, ids=[f"{m}-{p}" for m, p in JOIN_CASES])
def test_a_row_cached_to_its_last_prompt_token_joins_without_a_forward_of_its_own(sess, ids, mode, regime):
    """A prompt-cache hit leaves one prompt token to feed (a fetch reuses at most len - 1 positions), and so does a
    prompt one token past a prefill chunk: such a row joins the batch at once with that token as its anchor, and
    the batch's next forward gives its first token — the same tokens as alone (greedy and seeded sampling: its
    first token is a plain sampler call even for a drafting row), with every forward a batch step. Catches: a
    one-token prefill forward per join (one forward more than the steps), a first token drafted (the n-gram index
    matches the repetitive prompt at once: the seeded tokens differ from alone), a cached row fed from the wrong
    position (greedy differs), the first token counted as a round, an empty row left out of the batch's buffers
    (`run` checks their rows after every step). (A sampled auto row's tokens depend on its
    choices: distribution-exact, not seed-identical — greedy only.)"""
    p = JOIN_PARAMS[regime]
    tok = sess.tokenizer
    long = tok.encode(LONG_TEXT)
    cached = long[:60]  # repetitive: n-gram lookup matches its suffix at once
    pre = sess.model.make_cache()
    sess.model(mx.array([cached[:-1]], dtype=mx.int32), pre)
    mx.eval([c.state for c in pre])
    model = CountingModel(sess.model)
    auto = None
    if mode == "auto":  # n-gram lookup only, whatever this machine's timings say a model drafter could pay (one
        # carried would take its taps in a prefill forward: `test_an_auto_row_on_a_reused_prefix_...` covers that)
        auto = sess.drafters.batch_auto()
        auto.carries = lambda *a, **k: False
    gen = BatchGenerator(model, prefill_step=16, auto=auto)
    plan = [(0, request(sess, ids[0], "ar", p, 7, 12)),
            (3, request(sess, cached, mode, p, 8, 10, cache=pre, reuse=len(cached) - 1)),
            (5, request(sess, long[:17], mode, p, 9, 10)),  # 16-token chunk, then one token left
            (6, request(sess, long[:1], mode, p, 10, 8))]  # a one-token prompt: joins on an empty cache
    out, rows = run(gen, plan)
    ref_mode = "ar" if mode == "auto" else mode
    assert out[1][0] == solo(sess, cached, ref_mode, p, 8, 10)[0]
    assert out[2][0] == solo(sess, long[:17], ref_mode, p, 9, 10)[0]
    assert out[3][0] == solo(sess, long[:1], ref_mode, p, 10, 8)[0]
    assert out[0][0] == solo(sess, ids[0], "ar", p, 7, 12)[0]
    # the forwards: row 0's prefill (one chunk), row 2's first chunk, and the batch's steps — none for the joins
    assert model.calls == gen.steps + 2
    for i, n in ((1, len(cached)), (2, 17)):
        r = rows[i]
        assert r.stats.prompt_tokens == n and r.stats.prompt_time > 0 and r.t_first is not None
        if r.drafters:  # its rounds committed every token but the first
            assert sum(n * c for n, c in r.hist.items()) == len(out[i][0]) - 1


def test_an_auto_row_on_a_reused_prefix_leaves_its_model_drafters_out(sess, ids):
    """An auto row given a cache holding a prefix of its prompt but no drafter states (`BatchRequest.options` None)
    takes only the options that need no state for that prefix (n-gram lookup), even where every model drafter could
    pay; a row with a fresh prompt next to it carries them. Greedy output equals plain decoding's. Catches: a model
    drafter forked empty and asked to extend a state it never had (the row's prefill raised: "extend() before
    start()" — seen when this machine's timings made MTP pay), or one started from the taps of the positions fed
    after the prefix only (a state that skips the prefix)."""
    tok = sess.tokenizer
    long = tok.encode(LONG_TEXT)
    cached = long[:60]
    pre = sess.model.make_cache()
    sess.model(mx.array([cached[:40]], dtype=mx.int32), pre)  # 20 prompt tokens left: a prefill chunk and more
    mx.eval([c.state for c in pre])
    auto = sess.drafters.batch_auto()
    auto.carries = lambda *a, **k: True
    assert any(d.taps for d in auto.options("greedy", 2).values())
    gen = BatchGenerator(sess.model, prefill_step=16, auto=auto)
    plan = [(0, request(sess, cached, "auto", params(), 0, 12, cache=pre, reuse=40)),
            (0, request(sess, ids[0], "auto", params(), 0, 12))]
    out, rows = run(gen, plan)
    assert rows[0].options and not any(d.taps for d in rows[0].options.values())
    assert any(d.taps for d in rows[1].options.values())
    assert out[0][0] == solo(sess, cached, "ar", params(), 0, 12)[0]
    assert out[1][0] == solo(sess, ids[0], "ar", params(), 0, 12)[0]


def test_a_burst_of_cached_rows_joins_in_one_step(sess, ids):
    """Four requests arriving together, each with all but its last prompt token cached (a server's prompt-cache
    hits), then two that need a real prefill: the four join at once (no forward each) and the fifth's prefill
    forward follows in the same step (the first step has five rows), the sixth's in the next (one prefill forward
    a step). Greedy output equals alone. Catches: one join per step (the batch ramping 1, 2, 3, ... rows), two
    prefill forwards in a step, a burst that skips the prefill of a row behind it."""
    model = CountingModel(sess.model)
    gen = BatchGenerator(model, prefill_step=16)
    reqs = []
    for i in range(4):
        pre = sess.model.make_cache()
        sess.model(mx.array([ids[i][:-1]], dtype=mx.int32), pre)
        mx.eval([c.state for c in pre])
        reqs.append(request(sess, ids[i], "ar", params(), 0, 6, cache=pre, reuse=len(ids[i]) - 1))
    reqs += [request(sess, ids[4], "ar", params(), 0, 6), request(sess, ids[4], "ar", params(), 0, 6)]
    sizes = []
    out, _ = run(gen, [(0, r) for r in reqs], on_step=lambda t, rows: sizes.append(len(gen.rows)))
    assert sizes[:2] == [5, 6] and model.calls == gen.steps + 2  # the two prefill forwards
    for i in range(6):
        assert out[i][0] == solo(sess, ids[min(i, 4)], "ar", params(), 0, 6)[0], i


class LogitsWidths(CountingModel):
    """The target with the positions of the logits each solo-cache (prefill) forward returned recorded."""

    def __init__(self, model):
        super().__init__(model)
        self.prefill_widths = []

    def __call__(self, x, cache=None, **kw):
        out = super().__call__(x, cache, **kw)
        if cache is not None and not getattr(cache[0], "batched", False):
            logits = out[0] if isinstance(out, tuple) else out
            self.prefill_widths.append((x.shape[1], logits.shape[1]))
        return out


@pytest.mark.parametrize("mode", ["ar", "ngram", "dflash", "auto"])
def test_a_prefill_computes_the_logits_of_its_last_position_only(sess, ids, mode):
    """Every prefill chunk asks the target for the logits of its last position only, whatever the row's drafters
    want as taps (those cover every position). Catches: a row with drafters (n-gram lookup's empty taps included)
    taking the whole chunk's logits — positions × vocabulary of lm-head work for the one token sampled (on Muse
    Glimmer, 202 048 × 6 656 multiply-adds a position) — and outputs changed by it."""
    model = LogitsWidths(sess.model)
    gen = BatchGenerator(model, prefill_step=16, auto=sess.drafters.batch_auto() if mode == "auto" else None)
    picks = [5, 1]  # 40 tokens (chunks of 16, 16, 8) and a short one
    out, _ = run(gen, [(j, request(sess, ids[i], mode, params(), 0, 6)) for j, i in enumerate(picks)])
    assert [w for w in model.prefill_widths if w[0] > 1] and all(n == 1 for _, n in model.prefill_widths)
    ref = "ar" if mode == "auto" else mode
    for j, i in enumerate(picks):
        assert out[j][0] == solo(sess, ids[i], ref, params(), 0, 6)[0], (mode, i)


def test_the_slow_plain_steps_after_a_speculative_step_are_its_cost(sess):
    """The batch's timing (`BatchGenerator._observe`): after a speculative stretch, the plain steps of its span
    (`span_after` of them: the unpipelined one and those it leaves slow) are never measured as plain steps; their
    time beyond a plain step's price, summed, is the stretch's latest speculative step's cost (its estimate,
    `BatchAuto.charge`) and each goes to the ledger, when the span ends. A stretch starting within the span joins it.
    Each step's excess counts at most `SETTLE_TOKEN_CAP` plain steps. The wake is the cost of having speculated, so
    every speculative width of as many rows is charged it, not the latest step's alone. Catches: the wake's steps
    raising the plain step's estimate (speculation priced against a plain step that much dearer), the wake not
    charged (or charged before it is over, or a fast step after it ignored), a stall counted in full, another width
    of the same rows left uncharged (n-gram steps of varying widths each kept choosing lone steps at a loss)."""
    from glimmer_mlx.speculative.auto.chooser import LEDGER_ROUND_CAP, LEDGER_ROUNDS, SETTLE_TOKEN_CAP

    auto = sess.drafters.batch_auto()
    auto.measured, auto.ratio, auto.saved, auto.elapsed = {2: 0.010, 10: 0.020}, 1.0, 0.0, 0.0
    auto.plain_by_rows = {2: 0.010}  # the same steps by shape: 2 rows x 1 (its price), x 5, x 3 positions (in plain
    auto.relative = {2: {5: 2.0, 3: 1.5}}  # steps of 2 rows)
    span_after = auto.span_after
    auto.span_after = 4
    try:
        gen = BatchGenerator(sess.model, prefill_step=16, auto=auto)
        for shape in ((2, 5), (2, 1)):  # steps of these shapes ran before (the first of each is not priced)
            auto.first_of(*shape)
        f = 1 - 1 / LEDGER_ROUNDS  # the ledger fades a step at a time
        step = stepper(gen)

        step(5, 0.020, chained=False, queued=False, committed=6)  # 6 tokens, 30 ms of plain steps: +10 ms
        spec = auto.measured[10]
        step(1, 0.015, chained=False)  # the plain step it kept from being queued: +5 ms
        step(1, 0.019)  # its wake: +9 ms, +8 ms
        step(1, 0.018)
        assert auto.measured[10] == spec and auto.measured[2] == 0.010 and auto.saved == 0.0  # held to the end
        step(1, 0.008)  # the span's last step, 2 ms under the price: it counts too
        assert auto.measured[10] == pytest.approx(spec + 0.2 * (0.005 + 0.009 + 0.008 - 0.002))
        # every width's (in plain steps)
        assert auto.relative[2][3] == pytest.approx(1.5 + 0.2 * (0.005 + 0.009 + 0.008 - 0.002) / 0.010)
        assert auto.saved == pytest.approx(0.010 - 0.005 - 0.009 - 0.008 + 0.002)
        assert auto.measured[2] == 0.010 and auto.plain_by_rows[2] == 0.010
        step(1, 0.019)  # after the span: a slow step is a plain step's measure
        assert auto.measured[2] == pytest.approx(0.8 * 0.010 + 0.2 * 0.019)

        auto.measured[2] = auto.plain_by_rows[2] = 0.010
        saved = auto.saved
        step(5, 0.020, chained=False, queued=False, committed=6)
        step(1, 0.010, chained=False)
        spec = auto.measured[10]
        step(1, 1.0)  # a stall: SETTLE_TOKEN_CAP plain steps at most
        step(5, 0.020, chained=False, queued=False, committed=6)  # the next stretch joins the span
        spec2 = auto.measured[10]
        assert spec2 == pytest.approx(0.8 * spec + 0.2 * 0.020)
        for _ in range(4):
            step(1, 0.010, chained=_ > 0)
        assert auto.measured[10] == pytest.approx(spec2 + 0.2 * SETTLE_TOKEN_CAP * 0.010)
        assert auto.measured[2] == 0.010
        # the stall's credit: at most the ledger's round cap
        assert auto.saved == pytest.approx(saved * f ** 8 + 2 * 0.010 - LEDGER_ROUND_CAP * 0.010)
    finally:
        auto.span_after = span_after


def test_the_first_step_of_each_shape_is_neither_priced_nor_charged(sess, ba):
    """MLX builds kernels on a shape's first use (its CUDA back-end compiles them): on an NVIDIA H200 the batch's
    first 1 x 16 verify took 4.3 s where one costs ~10 ms; priced and charged, it barred speculation for the rest of
    the process. The first step of each (rows, positions) shape leaves the estimates alone, and the span of a stretch
    with such a step (`Span`) goes neither to the ledger nor to an estimate; the shape's next step is priced. A later
    stall moves an estimate by at most a factor 1 + 0.2 x 2 (`chooser.robust_ema`). A generator's first step is timed
    from its launch (the prefills before it are not inside it). Catches: the first step priced (4.3 s in the
    estimate, the ledger barred), a plain EMA (a stall moving the estimate by 20 % of itself), a first step's time
    taken as its launch-to-landing time less the prefills before it (negative: never measured)."""
    from glimmer_mlx.speculative.batch import Launched

    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {2: 0.010}, 1.0, {2: 0.010}, 0.0, 0.0
    ba.first_of(2, 1)  # plain steps of 2 rows ran before
    gen = BatchGenerator(sess.model, auto=ba)
    step = stepper(gen)

    def plain_steps(n):
        step(1, 0.010, chained=False)
        for _ in range(n - 1):
            step(1, 0.010)

    step(5, 4.3, chained=False, queued=False, committed=6)  # the first 2 x 5 step: a kernel build
    step(1, 0.030, chained=False)  # the plain step it kept from being queued
    plain_steps(ba.span_after - 1)  # the rest of its span
    assert 10 not in ba.measured and 5 not in ba.relative.get(2, {}) and ba.measured[2] == 0.010
    assert ba.saved == 0.0 and not ba.barred
    step(5, 0.020, chained=False, queued=False, committed=6)  # the shape's next step: priced, and credited
    assert ba.measured[10] == pytest.approx(0.020) and ba.relative[2][5] == pytest.approx(2.0)
    plain_steps(ba.span_after)
    assert ba.saved == pytest.approx(0.010, rel=0.01)  # 6 tokens x 5 ms - 20 ms
    step(5, 5.0, chained=False, queued=False, committed=6)  # a stall later: the estimate moves by at most 1.4x
    assert ba.measured[10] == pytest.approx(0.8 * 0.020 + 0.2 * 3 * 0.020)
    # a generator's first step (nothing landed before): its launch to its landing, 12 ms, after 0.5 s of prefills
    ba.first_of(3, 1)
    gen = BatchGenerator(sess.model, auto=ba)
    gen._prefilling = 0.5
    st = Launched(rows=[], widths=[], logits=None, tapped=None, want=(), tokens={}, t0=200.0)
    gen._observe(st, 3, 1, 200.012, None, False)
    assert ba.measured[3] == pytest.approx(0.012)


class ShapeStalls(CountingModel):
    """The target, its first batched forward of each input shape taking `stall` seconds more (what MLX's CUDA
    back-end does while it compiles a shape's kernels), and every batched plain step `plain` seconds more (a target
    whose steps cost more than its drafting: speculation pays whatever this machine's noise)."""

    def __init__(self, model, stall, plain):
        super().__init__(model)
        self.stall, self.plain, self.seen, self.stalls = stall, plain, set(), 0

    def __call__(self, x, cache=None, **kw):
        if cache is not None and getattr(cache[0], "batched", False):
            if tuple(x.shape) not in self.seen:
                self.seen.add(tuple(x.shape))
                self.stalls += 1
                time.sleep(self.stall)
            time.sleep(self.plain)
        return super().__call__(x, cache, **kw)


def test_a_kernel_build_on_a_shapes_first_step_does_not_stop_speculation(sess, ids, ba):
    """End to end: a lone auto request whose drafter pays (a flat cost curve, DFlash's estimates at 0.8, every
    batched forward 60 ms more than this CPU's few ms and its drafting), on a target whose first batched forward of
    each shape stalls 0.6 s more (as a CUDA kernel build does on an H200): it goes on drafting after its first
    speculative step, and its tokens are plain decoding's. Before, that step was charged to the ledger (~9 plain
    steps, past its floor) and every later step was plain."""
    ba.curve = {n: 0.07 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # what a step costs this target, about
    ba.measured, ba.ratio, ba.plain_by_rows, ba.saved, ba.elapsed = {}, None, {}, 0.0, 0.0
    pin(ba, "dflash", "greedy", 0.8)
    model = ShapeStalls(sess.model, 0.6, 0.06)
    gen = BatchGenerator(model, auto=ba)
    row = gen.add(request(sess, ids[0], "auto", params(), 0, 32))
    out = []
    while len(gen):
        for r, ch in gen.step():
            out += ch.tokens
    assert model.stalls >= 2 and not ba.barred
    assert row.rounds - row.plain_rounds >= 2, (row.rounds, row.plain_rounds, ba.saved)  # before: 1
    assert out == solo(sess, ids[0], "ar", params(), 0, 32)[0]


def test_an_auto_row_left_without_options_steps_plainly(sess, ids):
    """An `auto` without n-gram lookup (`make_auto(..., ngram=False)`, public API) whose model drafter could not pay
    gives a new row no option at all, and a row's last model drafter can be pruned: such a row steps plainly (its
    output the plain one) next to other rows. Catches: the batch's choice taking the widest draft over no options
    (max() of nothing: the whole step failed, every row of a server with it)."""
    from glimmer_mlx.speculative.auto import make_auto

    auto = make_auto(sess.model, dflash=sess.drafters.dflash, ngram=False)
    ba = BatchAuto(auto)
    ba.curve = {n: 0.01 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # compute-bound: nothing can pay
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    assert ba.options("greedy", 2) == {}
    gen = BatchGenerator(sess.model, prefill_step=16, auto=ba)
    plan = [(0, request(sess, ids[0], "auto", params(), 0, 20)), (0, request(sess, ids[1], "ar", params(), 0, 20)),
            (3, request(sess, ids[2], "auto", params(), 0, 20))]
    out, rows = run(gen, plan)
    for j, i in enumerate([0, 1, 2]):
        assert out[j][0] == solo(sess, ids[i], "ar", params(), 0, 20)[0], j
    assert rows[0].options == {} and gen.steps >= 16  # a prune step came and went
    # a row whose only option, a model drafter, is pruned (it could pay when the row joined, not at the prune)
    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: verification is free
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.draft_cost = lambda name, k: 1e-5 * k
    pin(ba, "dflash", "greedy", 0.6)
    gen = BatchGenerator(sess.model, prefill_step=16, auto=ba)
    row = gen.add(request(sess, ids[3], "auto", params(), 0, 40))
    gen.step()
    assert set(row.options) == {"dflash"}
    ba.curve = {n: 0.01 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    ba.observe = lambda n, seconds, spec, rows=None: None  # keep the compute-bound curve as told
    while len(gen):
        gen.step()
    assert row.options == {} and gen.steps > 16
    assert row.history[len(ids[3]):] == solo(sess, ids[3], "ar", params(), 0, 40)[0]


def test_a_row_carries_a_model_drafter_only_where_the_batch_s_choice_could_take_it(ba):
    """A model drafter whose best rate beats plain by less than the margin `choose` wants (`ENTER_GAIN`) would
    never be chosen: a new row does not carry it (nor does the prune keep it), one that beats plain by more does,
    and `choose` agrees with both. Catches: carrying by "beats plain" alone — on the embedded model MTP at one row
    (1.049x plain by its prior) rode every N = 1 auto request, taps and bookkeeping each step, never drafting."""
    from glimmer_mlx.speculative.auto.chooser import ENTER_GAIN

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}  # flat: only acceptance decides
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    for alpha, carried in ((0.6 * ENTER_GAIN, False), (3 * ENTER_GAIN, True)):
        pin(ba, "mtp", "greedy", alpha)
        pin(ba, "dflash", "greedy", 0.0)
        assert ("mtp" in ba.options("greedy", 1)) is carried, alpha
        assert ba.could_pay("mtp", "greedy", 1) is carried
        k, plan = ba.choose([("greedy", 64, {"mtp": 1})], 0, 1, 0.0, 1)
        assert (k > 0) is carried and (plan[0][0] == "mtp") is carried


def test_a_row_s_drafting_is_priced_with_its_drafter_s_backlog(ba):
    """`StepChoice`: a row whose model drafter has a backlog to take in (`BatchAuto.backlog_cost`, the rows' fifth
    element) pays it in its round's drafting, spread over the tokens a catch-up of that drafter serves
    (`AutoChooser.tenure`, as the solo chooser spreads one): beside a row in step, with every round cheap and good,
    the row in step drafts and one whose catch-up is worth more than its drafts steps plainly; told no backlog, both
    draft; a short catch-up does not hold a row back. Catches: the backlog left out of a row's price (every row's
    round priced as a steady one, a served row's first DFlash draft over its whole prompt among them), or charged
    whole to one round (a row behind would never catch up)."""
    from glimmer_mlx.speculative.auto.batch import StepChoice
    from glimmer_mlx.speculative.auto.chooser import tenure_bucket

    ba.curve = {n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    ba.measured, ba.ratio, ba.plain_by_rows = {}, None, {}
    pin(ba, "dflash", "greedy", 0.8)
    steady = [("greedy", 100, {"dflash": 8}, ()), ("greedy", 100, {"dflash": 8}, ())]
    k, plan = ba.choose(steady, 0, 1, 0.0, 8)
    assert k > 0 and plan == [("dflash", k)] * 2, plan
    held = tenure_bucket(ba.chooser.tenure("dflash", "greedy"))
    far = [steady[0] + ((),), steady[1] + ((("dflash", 0.2 * held),),)]  # 20 plain steps a token of tenure
    k, plan = ba.choose(far, 0, 1, 0.0, 8)
    assert k > 0 and plan[0] == ("dflash", k) and plan[1] == (None, 0), plan
    near = [steady[0] + ((),), steady[1] + ((("dflash", 0.05),),)]  # 5 plain steps, spread over its tenure
    k, plan = ba.choose(near, 0, 1, 0.0, 8)
    assert k > 0 and plan == [("dflash", k)] * 2, plan
    step = StepChoice(ba, near, 0, 1, 0.0, 8)
    e = step.expected("dflash", "greedy", 4)
    tokens, seconds = step.cost([("dflash", 4), ("dflash", 4)])
    assert seconds == pytest.approx(step.step_cost(5) + 2 * ba.draft_cost("dflash", 4) + 0.05 * min(1.0, e / held))


def test_a_model_drafter_counts_its_backlog_and_the_batch_prices_it(sess, ids, ba):
    """`DFlashDrafter.backlog`: the target positions whose taps wait for its next round — a started state's whole
    prompt, plus each position handed over while it does not draft (a batch row carrying it along plain steps), none
    once it drafted. `BatchAuto.backlog_cost` prices nothing up to a steady round's backlog (`Option.steady`) and
    the measured per-position catch-up beyond it, at the speed its batch rounds measure. Catches: a backlog that
    forgets the pieces a carried drafter gathers or survives its round, a price on a steady backlog."""
    d = sess.drafters.dflash.fork()
    prompt = ids[4]
    cache = sess.model.make_cache()
    logits, taps = sess.model(mx.array([prompt]), cache, taps=d.taps)
    first = int(mx.argmax(logits[0, -1]).item())
    d.start(taps, prompt + [first])
    assert d.backlog == len(prompt)
    history = prompt + [first]
    for _ in range(3):  # plain steps: one position each
        logits, taps = sess.model(mx.array([[history[-1]]]), cache, taps=d.taps)
        t = int(mx.argmax(logits[0, -1]).item())
        d.accept(taps, [t])
        history.append(t)
    assert d.backlog == len(prompt) + 3
    d.propose(history[-1], len(history) - 1, 4, Sampler(params(), 0), history)
    assert d.backlog == 0
    opt = ba.chooser.options["dflash"]
    saved = opt.catch_up, opt.catch_quad
    try:
        opt.catch_up, opt.catch_quad = 1e-4, 0.0
        ba.draft_factor["dflash"] = 2.0
        assert ba.backlog_cost("dflash", opt.steady, 100) == 0.0
        assert ba.backlog_cost("dflash", opt.steady + 8, 100) == pytest.approx(2.0 * 1e-4 * 8)
        assert ba.backlog_cost("dflash", 190, 200) > ba.backlog_cost("dflash", 40, 200)
    finally:
        opt.catch_up, opt.catch_quad = saved


def test_the_batch_hands_each_row_s_backlog_to_the_choice_and_keeps_it_out_of_the_draft_price(sess, ids,
                                                                                              monkeypatch):
    """`BatchGenerator._choose` gives the choice each auto row's model drafters' backlog price (`_behind`: a row that
    carries DFlash along plain steps is asked about with its whole backlog priced), and a round that took one in
    teaches `BatchAuto.observe_draft` its time less that price (the steady drafting price is not a catch-up's).
    Greedy output equals plain decoding's. Catches: the rows' backlogs not handed over, a catch-up's time learned as
    what every round of the drafter costs."""
    auto = sess.drafters.batch_auto()
    monkeypatch.setattr(auto, "carries", lambda *a, **k: True)
    monkeypatch.setattr(auto, "backlog_cost", lambda name, lag, at: 1000.0 if lag > 20 else 0.0)  # unmistakable
    asked, drafts = [], []
    real_choose = auto.choose

    def choose(rows, fixed_rows, fixed_width, fixed_tokens, k_max):
        asked.append([row[4] for row in rows])
        k, plan = real_choose(rows, fixed_rows, fixed_width, fixed_tokens, k_max)
        if len(asked) >= 3 and not drafts:  # from the third ask on, DFlash for every row, its backlog and all
            return 2, [("dflash", 2)] * len(rows)
        return 0, [(None, 0)] * len(rows)

    monkeypatch.setattr(auto, "choose", choose)
    monkeypatch.setattr(auto, "asks", lambda: True)
    monkeypatch.setattr(auto, "closed", lambda fixed_width: False)
    monkeypatch.setattr(auto, "observe_draft", lambda name, k, seconds: drafts.append((name, k, seconds)))
    gen = BatchGenerator(sess.model, auto=auto)
    out, rows = run(gen, [(0, request(sess, ids[-1], "auto", params(), 0, 12))])
    assert asked and all(("dflash", 1000.0) in a[0] for a in asked[:3]), asked[:3]
    assert drafts and drafts[0][0] == "dflash" and -1000.0 < drafts[0][2] < -999.0, drafts
    assert out[0][0] == solo(sess, ids[-1], "ar", params(), 0, 12)[0]
