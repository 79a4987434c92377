"""DFlash v1 drafting for several batch rows in one drafter forward (`dflash.draft_hidden_batch`, issue 24): each
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
    out = {}
    for layers in (["sliding_attention", "sliding_attention"], ["full_attention", "sliding_attention"]):
        d = tmp_path_factory.mktemp("dflash_batch")
        build_hf_drafter({"layer_types": layers}, seed=7).save_pretrained(d)
        out[layers[0]] = glimmer_mlx.load_drafter(d, model)
    return model, out


def _started(model, drafter, ids):
    """A fork of `drafter` started on prompt `ids` as the engine starts it: the prefill's taps of every position."""
    d = drafter.fork()
    _, taps = model(mx.array([ids[:-1]], dtype=mx.int32), model.make_cache(), taps=d.taps)
    d.start(list(taps), ids)
    return d


@pytest.mark.parametrize("first_layer", ["sliding_attention", "full_attention"])
def test_batched_blocks_equal_each_rows_own(pair, first_layer):
    model, drafters = pair
    base = drafters[first_layer]
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
