"""`glimmer_mlx.cache.KVCache`: full and sliding-window caches, rewinding (also after the window has wrapped), bounded
memory, and the attention mask the cache hands out.

Model-level checks compare against transformers (the oracle) with full forwards of the edited sequence; the mask
checks compare against a numpy attention reference with absolute positions.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx.cache import CacheRewindError, KVCache, cache_offset, make_cache, rewind_cache
from hf_fixtures import TINY_TEXT, hf_logits

TOL = 1e-4
W = TINY_TEXT["sliding_window"]  # 8
V = TINY_TEXT["vocab_size"]


@pytest.fixture(scope="module")
def model_hf(tiny_checkpoint):
    folder, hf = tiny_checkpoint()
    model, _ = glimmer_mlx.load(folder)
    assert model.args.sliding_window == W
    assert "sliding_attention" in model.args.layer_types and "full_attention" in model.args.layer_types
    return model, hf


def ids_for(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def different(tokens: list[int], salt: int = 1) -> list[int]:
    """Tokens that differ position-wise from `tokens`."""
    return [(t + 1 + 37 * salt + 11 * j) % V or 5 for j, t in enumerate(tokens)]


def tight_cache(model, max_rewind: int = 16, step: int = 8) -> list[KVCache]:
    """A cache that compacts early (small allocation step, small max_rewind), so a 40-token run really evicts."""
    cache = model.make_cache(max_rewind=max_rewind)
    for c in cache:
        c.step = step
    return cache


def feed(model, cache, tokens: list[int], chunks: list[int] | None = None) -> np.ndarray:
    chunks = chunks or [len(tokens)]
    assert sum(chunks) == len(tokens)
    out, pos = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([tokens[pos : pos + n]]), cache)[0]))
        pos += n
    return np.concatenate(out, axis=0)


def sliding(cache):
    return [c for c in cache if c.window is not None]


def full(cache):
    return [c for c in cache if c.window is None]


PREFILL_CHUNKS = {40: [25, 1, 1, 6, 7], 47: [5, 20, 1, 1, 20], 56: [31, 25]}


# ---------------------------------------------------------------------------------------------------------------
# rewinding after the window has wrapped, against transformers


@pytest.mark.parametrize("length", sorted(PREFILL_CHUNKS))
def test_rewind_and_edit_after_wrap(model_hf, length):
    """For n = 1..16: prefill `length` tokens (5-7x the window, sliding rows already evicted), rewind every layer
    by n, feed n different tokens (one at a time for odd n, as one chunk for even n), and compare with
    transformers' full forward of the edited sequence."""
    model, hf = model_hf
    base = ids_for(length, seed=length)
    for n in range(1, 17):
        cache = tight_cache(model)
        feed(model, cache, base, PREFILL_CHUNKS[length])
        assert all(c.start > 0 for c in sliding(cache)), "the sliding caches should have evicted rows"
        assert all(c.start == 0 for c in full(cache))
        rewind_cache(cache, n)
        assert cache_offset(cache) == length - n and all(c.offset == length - n for c in cache)
        new = different(base[length - n :], salt=n)
        assert all(a != b for a, b in zip(new, base[length - n :]))
        edited = base[: length - n] + new
        out = feed(model, cache, new, [1] * n if n % 2 else None)
        ref = hf_logits(hf, edited).numpy()[length - n :]
        d = float(np.abs(out - ref).max())
        assert d <= TOL, f"length {length}, rewind {n}: max diff {d:.3g}"


@pytest.mark.parametrize("rewind,feed_n", [(3, 5), (1, 16), (16, 1), (10, 4), (7, 7), (16, 16), (2, 11)])
def test_rewind_then_multi_token_feed(model_hf, rewind, feed_n):
    model, hf = model_hf
    base = ids_for(44, seed=7)
    cache = tight_cache(model)
    feed(model, cache, base, [20, 3, 1, 20])
    assert all(c.start > 0 for c in sliding(cache))
    rewind_cache(cache, rewind)
    new = different(ids_for(feed_n, seed=rewind * 100 + feed_n), salt=rewind)
    edited = base[: 44 - rewind] + new
    out = feed(model, cache, new)
    ref = hf_logits(hf, edited).numpy()[44 - rewind :]
    assert float(np.abs(out - ref).max()) <= TOL
    # and decoding continues correctly afterwards
    more = ids_for(9, seed=99)
    out2 = feed(model, cache, more, [1, 1, 7])
    ref2 = hf_logits(hf, edited + more).numpy()[-9:]
    assert float(np.abs(out2 - ref2).max()) <= TOL


@pytest.mark.parametrize("max_rewind,step", [(16, 8), (6, 1), (64, 256)])
def test_speculative_style_verify_and_rewind(model_hf, max_rewind, step):
    """Repeated feed-block / rewind-rejected cycles (as speculative decoding does) well past the window: every
    verified block's logits equal transformers' full forward of the committed sequence plus the block."""
    model, hf = model_hf
    rng = np.random.default_rng(max_rewind + step)
    cache = tight_cache(model, max_rewind=max_rewind, step=step)
    committed = ids_for(11, seed=3)
    feed(model, cache, committed[:-1])
    block_len = min(6, max_rewind)
    while len(committed) < 75:
        drafts = rng.integers(0, V, block_len - 1).tolist()
        block = [committed[-1]] + drafts
        out = feed(model, cache, block)
        ref = hf_logits(hf, committed[:-1] + block).numpy()[-block_len:]
        assert float(np.abs(out - ref).max()) <= TOL, f"at length {len(committed)}"
        accepted = int(rng.integers(0, block_len))  # drafts accepted
        rewind_cache(cache, block_len - 1 - accepted)
        committed = committed + drafts[:accepted] + [int(rng.integers(0, V))]
        assert cache_offset(cache) == len(committed) - 1
    if step < 256:
        assert all(c.start > 0 for c in sliding(cache))


def test_rewind_before_wrap_any_amount(model_hf):
    """Before anything was evicted, any rewind <= offset works (down to an empty cache)."""
    model, hf = model_hf
    base = ids_for(30, seed=11)
    for n in (0, 1, 9, 22, 29, 30):
        cache = model.make_cache()  # default step 256: nothing evicted at 30 tokens
        feed(model, cache, base, [12, 18])
        assert all(c.start == 0 for c in cache)
        rewind_cache(cache, n)
        assert cache_offset(cache) == 30 - n
        new = different(base[30 - n :] or [0], salt=3)[: max(n, 1)]
        edited = base[: 30 - n] + new
        out = feed(model, cache, new)
        ref = hf_logits(hf, edited).numpy()[30 - n :]
        assert float(np.abs(out - ref).max()) <= TOL, f"rewind {n}"
    cache = model.make_cache()
    feed(model, cache, base)
    with pytest.raises(CacheRewindError, match="cannot rewind 31 tokens"):
        rewind_cache(cache, 31)
    with pytest.raises(CacheRewindError):
        rewind_cache(cache, -1)
    assert all(c.offset == 30 for c in cache)


# ---------------------------------------------------------------------------------------------------------------
# rewind limits after wrap


def _random_kv(rng, L, H=2, D=4):
    k = mx.array(rng.standard_normal((1, H, L, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, H, L, D)).astype(np.float32))
    return k, v


@pytest.mark.parametrize("step", [1, 8, 256])
def test_rewind_past_max_rewind_after_wrap_raises(step):
    """After eviction a sliding cache keeps W-1+max_rewind rows before the latest chunk: rewinding max_rewind plus
    that chunk works, one more raises a clear CacheRewindError and leaves the cache untouched."""
    rng = np.random.default_rng(step)
    max_rewind = 16
    c2 = KVCache(window=W, max_rewind=max_rewind)
    c2.step = step
    for _ in range(100):
        c2.update(*_random_kv(rng, 1))
    # a chunk one row larger than the free space forces a compaction now, whatever the step
    chunk = c2.keys.shape[2] - c2.rows + 1
    c2.update(*_random_kv(rng, chunk))
    assert c2.start > 0
    assert c2.rows == W - 1 + max_rewind + chunk
    offset = c2.offset
    with pytest.raises(CacheRewindError) as exc:
        c2.rewind(max_rewind + chunk + 1)
    msg = str(exc.value)
    assert "max_rewind" in msg and f"window {W}" in msg and str(max_rewind + chunk + 1) in msg
    assert c2.offset == offset  # untouched
    c2.rewind(max_rewind + chunk)  # the guaranteed amount still works
    assert c2.offset == offset - max_rewind - chunk


def test_rewind_limit_over_long_run_with_default_step(model_hf):
    """Over a long run with the default allocation step, a rewind of max_rewind always works, and a rewind that
    would need evicted rows (more than max_rewind + the latest chunk) always raises."""
    model, _ = model_hf
    rng = np.random.default_rng(0)
    cache = model.make_cache(max_rewind=8)
    sizes = [1, 3, 1, 1, 7, 2, 1, 16, 1, 5]
    pos = 0
    raised = 0
    for i in range(70):
        L = sizes[i % len(sizes)]
        model(mx.array([rng.integers(0, V, L).tolist()]), cache)
        pos += L
        if any(c.start > 0 for c in cache):
            with pytest.raises(CacheRewindError):
                rewind_cache(cache, 8 + L + KVCache.step)
            raised += 1
        assert cache_offset(cache) == pos
        rewind_cache(cache, min(8, pos))
        pos -= min(8, pos)
        model(mx.array([rng.integers(0, V, 8).tolist()]), cache)
        pos += 8
    assert raised > 0


def test_rewind_cache_is_atomic():
    """A rewind that one layer cannot do must not rewind the others (layer 0 may be a full layer: L=9, 13, …)."""
    rng = np.random.default_rng(1)
    cache = [KVCache(window=None, max_rewind=4), KVCache(window=W, max_rewind=4), KVCache(window=None, max_rewind=4)]
    for c in cache:
        c.step = 4
    for _ in range(40):
        k, v = _random_kv(rng, 1)
        for c in cache:
            c.update(k, v)
    assert cache[1].start > 0
    with pytest.raises(CacheRewindError):
        rewind_cache(cache, 30)
    assert [c.offset for c in cache] == [40, 40, 40]
    rewind_cache(cache, 4)
    assert [c.offset for c in cache] == [36, 36, 36]


def test_rewind_error_for_nine_layer_model(tiny_checkpoint):
    """L=9: layer 0 is a global layer. A failed rewind leaves every layer consistent and decoding exact."""
    folder, hf = tiny_checkpoint(num_hidden_layers=9)
    model, _ = glimmer_mlx.load(folder)
    assert model.args.layer_types[0] == "full_attention" and model.args.layer_types[1] == "sliding_attention"
    cache = tight_cache(model, max_rewind=4, step=4)
    base = ids_for(40, seed=21)
    feed(model, cache, base, [10] * 4)
    with pytest.raises(CacheRewindError):
        rewind_cache(cache, 25)
    assert all(c.offset == 40 for c in cache)
    more = ids_for(3, seed=22)
    out = feed(model, cache, more)
    assert float(np.abs(out - hf_logits(hf, base + more).numpy()[-3:]).max()) <= TOL


# ---------------------------------------------------------------------------------------------------------------
# bounded memory


def test_memory_bounded_over_long_run(model_hf):
    """600 tokens in mixed chunk sizes (all <= the allocation step) with the default cache: sliding layers' buffers
    never hold more than W-1+max_rewind+step rows (step = KVCache.step, the allocation granularity), while global
    layers keep everything. The logits at the end still equal transformers'."""
    model, hf = model_hf
    cache = model.make_cache()  # max_rewind: cache.DEFAULT_MAX_REWIND
    max_rewind = cache[0].max_rewind
    rng = np.random.default_rng(5)
    ids = rng.integers(0, V, 600).tolist()
    sizes = [1, 1, 17, 3, 1, 40, 2, 1, 1, 9, 64, 1, 5]
    pos, i, max_rows, max_cap = 0, 0, 0, 0
    last_out = None
    while pos < len(ids):
        L = min(sizes[i % len(sizes)], len(ids) - pos)
        i += 1
        last_out = np.array(model(mx.array([ids[pos : pos + L]]), cache)[0])
        pos += L
        for c in sliding(cache):
            cap = c.keys.shape[2]
            assert c.rows <= cap
            assert c.rows <= W - 1 + max_rewind + KVCache.step, (pos, c.rows)
            assert cap <= W - 1 + max_rewind + KVCache.step, (pos, cap)
            max_rows, max_cap = max(max_rows, c.rows), max(max_cap, cap)
        for c in full(cache):
            assert c.start == 0 and c.rows == pos and c.keys.shape[2] >= pos
    assert pos == 600
    s, f = sliding(cache)[0], full(cache)[0]
    assert s.start > 0 and max_cap == KVCache.step  # rows were evicted and the one buffer was reused
    assert max_rows > W - 1 + max_rewind
    assert f.keys.shape[2] >= 600 and s.keys.shape[2] < f.keys.shape[2]
    assert s.nbytes < f.nbytes
    ref = hf_logits(hf, ids).numpy()[-L:]
    assert float(np.abs(last_out - ref).max()) <= TOL


# ---------------------------------------------------------------------------------------------------------------
# the mask / key window the cache hands out, against numpy


def _np_attention(q, k, v, allowed, scale):
    s = np.einsum("hqd,hkd->hqk", q, k) * scale
    s = np.where(allowed[None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", p, v)


@pytest.mark.parametrize("window", [W, 3, None])
@pytest.mark.parametrize("max_rewind,step", [(4, 2), (64, 256), (16, 8)])
def test_mask_against_numpy_reference(window, max_rewind, step):
    """Feed random q/k/v in mixed chunks (with rewinds) and check, for every update:
    * the set of absolute key positions each query may see is exactly q-W+1 .. q (W keys incl. itself), or 0..q for
      a full cache (the values carry their absolute position in channel 0, so this is read off the returned rows);
    * attention over the returned (keys, values, mask) equals a numpy reference over the whole history, both with
      numpy softmax and with `mx.fast.scaled_dot_product_attention` (mask polarity: True = attend)."""
    rng = np.random.default_rng(0 if window is None else window)
    H, D = 2, 8
    c = KVCache(window=window, max_rewind=max_rewind)
    c.step = step
    hist_k = np.zeros((H, 0, D), np.float32)
    hist_v = np.zeros((H, 0, D), np.float32)
    plan = [5, 1, 1, 3, ("rw", 2), 1, 12, 1, ("rw", 4), 2, 1, 1, 7, 1, ("rw", 1), 4, 1, 30, 1, 1, 2, ("rw", 3), 1, 9]
    scale = D**-0.5
    evicted = False
    for item in plan * 2:
        if isinstance(item, tuple):
            n = min(item[1], max_rewind)
            c.rewind(n)
            hist_k, hist_v = hist_k[:, : c.offset], hist_v[:, : c.offset]
            continue
        L = item
        q0 = c.offset
        q = rng.standard_normal((H, L, D)).astype(np.float32)
        k = rng.standard_normal((H, L, D)).astype(np.float32)
        v = rng.standard_normal((H, L, D)).astype(np.float32)
        v[:, :, 0] = np.arange(q0, q0 + L)  # absolute positions, to read off which rows were returned
        hist_k = np.concatenate([hist_k, k], axis=1)
        hist_v = np.concatenate([hist_v, v], axis=1)
        keys, values, mask = c.update(mx.array(k[None]), mx.array(v[None]))
        keys_np, values_np = np.array(keys[0]), np.array(values[0])
        N = keys_np.shape[1]
        mask_np = np.ones((L, N), bool) if mask is None else np.array(mask)
        assert mask_np.shape == (L, N)
        kpos = values_np[0, :, 0].astype(int)
        np.testing.assert_array_equal(keys_np, hist_k[:, kpos])  # returned rows are the right keys
        for j in range(L):
            qp = q0 + j
            lo = 0 if window is None else max(0, qp - window + 1)
            assert sorted(kpos[mask_np[j]].tolist()) == list(range(lo, qp + 1)), (qp, kpos[mask_np[j]])
        # reference over the whole history with absolute positions
        qpos = np.arange(q0, q0 + L)[:, None]
        apos = np.arange(hist_k.shape[1])[None, :]
        allowed = apos <= qpos
        if window is not None:
            allowed &= apos > qpos - window
        ref = _np_attention(q, hist_k, hist_v, allowed, scale)
        got_np = _np_attention(q, keys_np, values_np, mask_np, scale)
        np.testing.assert_allclose(got_np, ref, rtol=1e-5, atol=1e-5)
        got_mx = mx.fast.scaled_dot_product_attention(mx.array(q[None]), keys, values, scale=scale, mask=mask)
        np.testing.assert_allclose(np.array(got_mx[0]), ref, rtol=1e-4, atol=1e-5)
        evicted |= c.start > 0
    if window is not None and step < 256:
        assert evicted  # the run really exercised eviction


def test_single_token_update_returns_exactly_the_window():
    """For one new query the cache returns no mask, so it must return exactly the W most recent rows."""
    rng = np.random.default_rng(3)
    c = KVCache(window=W, max_rewind=5)
    c.step = 4
    for t in range(50):
        k, v = _random_kv(rng, 1)
        keys, values, mask = c.update(k, v)
        assert mask is None
        assert keys.shape[2] == min(t + 1, W)
        np.testing.assert_array_equal(np.array(keys[..., -1, :]), np.array(k[..., 0, :]))


def test_make_cache_layer_types(model_hf):
    model, _ = model_hf
    cache = make_cache(model.args)
    assert len(cache) == model.args.num_hidden_layers
    for i, c in enumerate(cache):
        assert c.window == (W if model.args.layer_types[i] == "sliding_attention" else None)
