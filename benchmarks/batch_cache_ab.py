"""The batch's KV cache, before and after the thirty-eighth session, A/B in one process (issue 24): plain rows of the
embedded model (the shipped prompts under the chat template, 64 greedy tokens each) through `BatchGenerator`, at
each batch size N, RUNS runs, the two caches' order alternated from run to run; and the same requests decoded solo
(`glimmer_mlx.generate`'s plain loop) at N = 1. ms per token, medians over the runs, and each run's ratio.

  now:    `BatchKVCache.update` writes rows of one length as one slice, rows of several lengths a slice each, and
          returns keys from the first position any query sees (`BatchLayout.first_key`), with no mask where a step
          of one token a row and rows of one length need none (`BatchLayout.mask`);
  before: one scatter over the flattened buffer (index arithmetic and a scatter per layer), every key from
          position 0 and a [B, 1, L, N] mask always.

    python benchmarks/batch_cache_ab.py RUNS [N,N,...]        e.g. 12 1,2,4,8
"""
import statistics
import sys
import time

import mlx.core as mx
from ab_setup import batch_prompts, timed_steps

import glimmer_mlx
from glimmer_mlx import cache as cache_mod
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
SIZES = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 8]
TOKENS = 64


def before_mask(self, L, window):
    key = ("before", L, window)
    m = self._memo.get(key)
    if m is None:
        N = max(self.lengths) + L
        q = self.offsets()[:, None] + mx.arange(L, dtype=mx.int32)[None, :]
        k = mx.arange(N, dtype=mx.int32)[None, None, :]
        m = k <= q[:, :, None]
        if window is not None:
            m = m & (k > q[:, :, None] - window)
        m = self._memo[key] = m[:, None]
    return m


def before_update(self, k, v, tree=None):
    B, H, L, Dk = k.shape
    N = max(self.layout.lengths) + L
    self._grow(N, B, H, Dk, v.shape[3], k.dtype)
    self.scatter(k, v)
    return self.keys[:, :, :N], self.values[:, :, :N], before_mask(self.layout, L, self.window)


NOW = cache_mod.BatchKVCache.update
s = load_session(None)
m, tok = s.model, s.tokenizer
ids = batch_prompts(tok)


def batched(n: int, r: int, how: str) -> float:
    cache_mod.BatchKVCache.update = NOW if how == "now" else before_update
    g = BatchGenerator(m)
    for j in range(n):
        g.add(BatchRequest(ids[(r + j) % len(ids)], Sampler(SamplingParams(temperature=0), 100 * r + j), TOKENS,
                           set(), tok, auto=False))
    return timed_steps(g)


def solo(r: int) -> float:
    first, count = None, 0
    for _ in glimmer_mlx.stream_generate(m, ids[r % len(ids)], max_tokens=TOKENS, temperature=0):
        if first is None:
            first = time.perf_counter()  # from the first token, as the batch's steps after its prefill
        count += 1
    return 1e3 * (time.perf_counter() - first) / max(1, count - 1)


m.eos_token_ids = set()
for n in SIZES:
    modes = ["now", "before"] + (["solo"] if n == 1 else [])
    got = {k: [] for k in modes}
    for r in range(RUNS):
        for how in modes if r % 2 == 0 else modes[::-1]:
            got[how].append(solo(r) if how == "solo" else batched(n, r, how))
    cache_mod.BatchKVCache.update = NOW
    ratios = [b / a for a, b in zip(got["now"], got["before"])]
    line = (f"N={n}: ms/token now {statistics.median(got['now']):.3f}, before {statistics.median(got['before']):.3f}; "
            f"before ÷ now median {statistics.median(ratios):.3f} (runs {min(ratios):.3f}–{max(ratios):.3f})")
    if n == 1:
        solo_ratio = [a / b for a, b in zip(got["now"], got["solo"])]
        line += (f"; solo plain loop {statistics.median(got['solo']):.3f}, now ÷ solo median "
                 f"{statistics.median(solo_ratio):.3f}")
    print(line, flush=True)
