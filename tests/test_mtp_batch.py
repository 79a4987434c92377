"""MTP drafting for several batch rows with one MTP-layer forward per depth (`mtp.propose_batch`, issue 24): each
row's drafts and q equal its own `propose` (its own per-depth caches, positions, windows, a prompt shorter than the
chain), round after round, and a batch of MTP rows accepts exactly as each request alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative.mtp import batches_with, propose_batch


@pytest.fixture(scope="module")
def mtp_rows(tiny_checkpoint):
    from hf_fixtures import tiny_mtp_pair

    return tiny_mtp_pair(tiny_checkpoint)


def _started(model, drafter, ids):
    d = drafter.fork()
    _, taps = model(mx.array([ids[:-1]], dtype=mx.int32), model.make_cache(), taps=d.taps)
    d.start(list(taps), ids)
    return d


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_batched_rounds_equal_each_rows_own(mtp_rows, temp):
    model, base = mtp_rows
    base.set_depth(3)  # the last trained layer reused for depth 3
    rng = np.random.default_rng(2)
    prompts = [rng.integers(10, 500, n).tolist() for n in (2, 3, 9, 14)]  # 2-3: shorter than the chain
    rows = [_started(model, base, p) for p in prompts]
    hist = [list(p) for p in prompts]
    for rnd in range(6):
        ks = [3, 2, 3, 1] if rnd % 2 else [3, 3, 3, 3]
        solo = [r.copy_state() for r in rows]
        want = [s.propose(h[-1], len(h) - 1, k, Sampler(SamplingParams(temperature=temp), 10 * rnd + i), h)
                for i, (s, h, k) in enumerate(zip(solo, hist, ks))]
        got = propose_batch(rows, [h[-1] for h in hist], [len(h) - 1 for h in hist], ks,
                            [Sampler(SamplingParams(temperature=temp), 10 * rnd + i) for i in range(len(rows))], hist)
        for i, ((gd, gq), (wd, wq)) in enumerate(zip(got, want)):
            assert gd == wd, (rnd, i)
            if wq is not None:
                np.testing.assert_allclose(np.array(gq), np.array(wq), rtol=1e-5, atol=1e-5)
        for s, r in zip(solo, rows):
            assert [c.offset for c in s.caches] == [c.offset for c in r.caches]
        for i, r in enumerate(rows):  # commit 1..k+1 tokens (the anchor's row included), random target rows
            n = int(rng.integers(1, ks[i] + 2))
            new = rng.integers(10, 500, n).tolist()
            r.accept([mx.array(rng.normal(size=(1, n, model.args.hidden_size)).astype(np.float32))], new)
            hist[i] += new
    assert batches_with(rows[0], rows[1]) and not batches_with(rows[0], base)
    base.set_depth(2)


def test_a_just_joined_row_does_not_keep_the_others_from_batching(mtp_rows, monkeypatch):
    """`batch.batch_drafts`: an MTP row still catching up on its prompt (backlog > BATCH_BACKLOG) drafts alone, and
    the caught-up rows still share their forwards — also when the just-joined row comes first."""
    from types import SimpleNamespace

    import glimmer_mlx.speculative.batch as batch_mod
    from glimmer_mlx.speculative.mtp import BATCH_BACKLOG

    model, base = mtp_rows
    rng = np.random.default_rng(5)
    fresh = _started(model, base, rng.integers(10, 500, BATCH_BACKLOG + 10).tolist())  # nothing caught up yet
    ready = []
    for n in (5, 8):
        ids = rng.integers(10, 500, n).tolist()
        d = _started(model, base, ids)
        d.propose(ids[-1], len(ids) - 1, base.depth, Sampler(SamplingParams()), ids)  # its prompt caught up
        d.accept([mx.array(rng.normal(size=(1, 1, model.args.hidden_size)).astype(np.float32))], [11])
        ready.append((d, ids + [11]))
    assert fresh.backlog > BATCH_BACKLOG and all(d.backlog <= BATCH_BACKLOG for d, _ in ready)
    rows = [SimpleNamespace(history=list(fresh.tokens), sampler=Sampler(SamplingParams()))]
    rows += [SimpleNamespace(history=h, sampler=Sampler(SamplingParams())) for _, h in ready]
    calls, real = [], batch_mod.mtp_propose_batch
    monkeypatch.setattr(batch_mod, "mtp_propose_batch", lambda ds, *a: (calls.append(len(ds)), real(ds, *a))[1])
    out = batch_mod.batch_drafts(rows, {0: (fresh, 1), 1: (ready[0][0], 1), 2: (ready[1][0], 1)})
    assert calls == [2] and set(out) == {1, 2}


def test_hidden_rows_handed_over_step_by_step_are_joined_once_when_read(mtp_rows, monkeypatch):
    """A batch row carrying MTP layers along plain steps hands them one hidden row a step (`accept`); the rows are
    joined when read (`main`: one concatenation), equal to the rows concatenated one by one, and a copy of the state
    does not see what the original takes after it. Catches: a concatenation per step (a chain evaluated in O(n²)
    copies when the drafter next drafts) or pieces shared between a state and its copy."""
    import glimmer_mlx.speculative.mtp as mtp_mod

    model, base = mtp_rows
    d = _started(model, base, list(range(10, 19)))
    rng = np.random.default_rng(4)
    rows = [mx.array(rng.normal(size=(1, 1, model.args.hidden_size)).astype(np.float32)) for _ in range(25)]
    want = mx.concatenate([d.main] + rows, axis=1)
    calls = []
    real = mx.concatenate
    monkeypatch.setattr(mtp_mod.mx, "concatenate", lambda xs, **kw: (calls.append(len(xs)), real(xs, **kw))[1])
    for i, r in enumerate(rows):
        d.accept([r], [100 + i])
        if i == 9:
            kept = d.copy_state()
    assert calls == []
    got = d.main
    assert len(calls) == 1
    np.testing.assert_array_equal(np.array(got), np.array(want))
    np.testing.assert_array_equal(np.array(kept.main), np.array(want[:, : want.shape[1] - 15]))  # 10 rows taken
