"""DFlash (v1 and v2) drafting for several batch rows in one drafter forward (`dflash.draft_hidden_batch`, issue 24): each
row's hidden states equal what its own `draft_hidden` gives (its own context cache, positions, sliding window),
and a batch of DFlash rows decodes exactly as each request alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx.speculative.dflash import batches_with, draft_hidden_batch


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    from hf_fixtures import build_hf_drafter

    path, _ = tiny_checkpoint(seed=4)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    from test_dflash2 import tiny_config, write_checkpoint

    out = {}
    for layers in (["sliding_attention", "sliding_attention"], ["full_attention", "sliding_attention"]):
        d = tmp_path_factory.mktemp("dflash_batch")
        build_hf_drafter({"layer_types": layers}, seed=7).save_pretrained(d)
        out[layers[0]] = glimmer_mlx.load_drafter(d, model)
    raw = tiny_config()
    raw["sliding_window"] = 3  # < the block of 4: the strict rule (every block key seen) matters
    d2 = write_checkpoint(tmp_path_factory.mktemp("dflash2_batch"), raw, seed=3, code_scale=1.2)
    out["dflash2"] = glimmer_mlx.load_drafter(d2, model)
    assert out["dflash2"].variant == "dflash2"
    return model, out


def _started(model, drafter, ids):
    """A fork of `drafter` started on prompt `ids` as the engine starts it: the prefill's taps of every position."""
    d = drafter.fork()
    _, taps = model(mx.array([ids[:-1]], dtype=mx.int32), model.make_cache(), taps=d.taps)
    d.start(list(taps), ids)
    return d


@pytest.mark.parametrize("variant", ["sliding_attention", "full_attention", "dflash2"])
def test_batched_blocks_equal_each_rows_own(pair, variant):
    """DFlash v1 with sliding and full context layers, and DFlash 2 (its block-local convolutions, strict window
    rule)."""
    model, drafters = pair
    base = drafters[variant]
    rng = np.random.default_rng(1)
    lengths = [3, 9, 14, 5]  # windows of 6: some rows' contexts reach past it, others not
    rows = [_started(model, base, rng.integers(10, 200, n).tolist()) for n in lengths]
    for step in range(4):
        positions = [n - 1 + step * 3 for n in lengths]
        anchors = rng.integers(10, 200, len(rows)).tolist()
        solo = [r.copy_state() for r in rows]
        for s, r in zip(solo, rows):
            s.ctx = r.ctx
        want = [s.draft_hidden(a, s.ctx, p, s.cache) for s, a, p in zip(solo, anchors, positions)]
        got = draft_hidden_batch(rows, anchors, positions)
        for w, g in zip(want, got):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
        for s, r in zip(solo, rows):  # the caches took the same context rows
            assert [c.offset for c in s.cache] == [c.offset for c in r.cache]
        # each row commits 3 positions (anchor + 2 drafts): their taps become its next context
        for r in rows:
            r.accept([mx.array(rng.normal(size=(1, 3, model.args.hidden_size)).astype(np.float32))
                      for _ in r.taps], [1, 2, 3])
    assert batches_with(rows[0], rows[1]) and not batches_with(rows[0], base)  # base has no state
    other = [d for name, d in drafters.items() if name != variant][0]
    assert not batches_with(rows[0], _started(model, other, [20, 21, 22]))  # another drafter model


def test_dflash2_rows_propose_from_batched_blocks_what_they_would_alone(pair):
    """DFlash 2's selector walk from a batched block (`propose_hidden`, anchor = the history's last token) gives
    the drafts and q of its own `propose`, greedy and sampled."""
    from glimmer_mlx.sampling import Sampler, SamplingParams

    model, drafters = pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 200, n).tolist() for n in (4, 11, 7)]
    for temp in (0.0, 1.0):
        rows = [_started(model, drafters["dflash2"], p) for p in prompts]
        solo = [r.copy_state() for r in rows]
        for sl, r in zip(solo, rows):
            sl.ctx = r.ctx
        hs = draft_hidden_batch(rows, [p[-1] for p in prompts], [len(p) - 1 for p in prompts])
        for i, (p, h) in enumerate(zip(prompts, hs)):
            got = rows[i].propose_hidden(h, 3, Sampler(SamplingParams(temperature=temp), 5), p)
            want = solo[i].propose(p[-1], len(p) - 1, 3, Sampler(SamplingParams(temperature=temp), 5), p)
            assert got[0] == want[0]
            if temp:
                np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_propose_batch_draws_what_each_row_would_alone(pair, temp):
    """`dflash.propose_batch` (one forward, DFlash v1's logits in one call, each row's own sampler): the drafts and
    q of each row's own `propose`, rows of different budgets k."""
    from glimmer_mlx.sampling import Sampler, SamplingParams
    from glimmer_mlx.speculative.dflash import propose_batch

    model, drafters = pair
    rng = np.random.default_rng(4)
    prompts = [rng.integers(10, 200, n).tolist() for n in (4, 11, 7)]
    rows = [_started(model, drafters["sliding_attention"], p) for p in prompts]
    solo = [r.copy_state() for r in rows]
    for sl, r in zip(solo, rows):
        sl.ctx = r.ctx
    ks = [3, 1, 2]
    got = propose_batch(rows, [p[-1] for p in prompts], [len(p) - 1 for p in prompts], ks,
                        [Sampler(SamplingParams(temperature=temp), i) for i in range(3)], prompts)
    for i, (p, k) in enumerate(zip(prompts, ks)):
        want = solo[i].propose(p[-1], len(p) - 1, k, Sampler(SamplingParams(temperature=temp), i), p)
        assert got[i][0] == want[0] and len(want[0]) == k
        if temp:
            np.testing.assert_allclose(np.array(got[i][1]), np.array(want[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["full_attention", "dflash2"])
def test_a_context_handed_over_step_by_step_is_joined_once_when_read(pair, variant, monkeypatch):
    """A batch row carrying a DFlash drafter along plain steps hands it one position's taps a step (`accept`); its
    context is joined when read (`ctx`: a concatenation per tap and one across them), equal to the positions
    concatenated one by one, and a copy of its state (a prompt-cache entry's) does not see what the original takes
    after it. Catches: a concatenation per step — a chain that, read after 1 000 plain steps, took 3.2 s to evaluate
    on this CPU (0.014 s joined once) — or pieces shared between a state and its copy."""
    import glimmer_mlx.speculative.dflash as dflash_mod

    model, drafters = pair
    d = _started(model, drafters[variant], list(range(10, 22)))
    rng = np.random.default_rng(3)
    steps = [[mx.array(rng.normal(size=(1, 1, model.args.hidden_size)).astype(np.float32)) for _ in d.taps]
             for _ in range(40)]
    want = mx.concatenate([d.ctx] + [mx.concatenate(t, axis=-1) for t in steps[:30]], axis=1)
    calls = []
    real = mx.concatenate
    monkeypatch.setattr(dflash_mod.mx, "concatenate", lambda xs, **kw: (calls.append(len(xs)), real(xs, **kw))[1])
    for i, t in enumerate(steps[:30]):
        d.accept(t, [100 + i])
        if i == 19:
            kept = d.copy_state()
    assert calls == []  # nothing joined while the steps come
    got = d.ctx
    assert len(calls) <= len(d.taps) + 2 and d.context_length() == 12 - 1 + 30
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert kept.context_length() == 12 - 1 + 20  # the copy took its 20 positions and no more
    np.testing.assert_array_equal(np.array(kept.ctx), np.array(want[:, : 12 - 1 + 20]))
