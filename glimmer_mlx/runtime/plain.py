"""The one plain decode loop: one target step per token, the next step queued (`mx.async_eval`) before the current
token is read back, so the host's bookkeeping overlaps the model's work.

`PlainDecoder` is `ar` decoding itself, and the speculative engine runs every plain round through one (the prefill's
token, a round with one token of budget left, `auto`'s plain stretches): with `taps` it also returns the target's
taps of each plain token, which the drafters need to stay in sync. `plain_token_seconds` measures this loop.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..cache import rewind_cache
from ..sampling import Sampler, SamplingParams, history_window
from .prefill import DEFAULT_PREFILL_STEP, prefill


class PlainDecoder:
    """history: every committed token (prompt included). The token after it is either queued (`queued`: its sample
    is being computed) or not yet asked for (`queue`)."""

    mode = "ar"

    def __init__(self, model, sampler: Sampler, prefill_step: int = DEFAULT_PREFILL_STEP, cache=None,
                 taps: tuple | None = None):
        self.model, self.sampler, self.prefill_step = model, sampler, prefill_step
        self.cache = cache if cache is not None else model.make_cache()
        self.taps = taps  # target layers whose outputs each step also returns (None: logits only)
        self.history: list[int] = []
        self._next = None  # (sampled token [1], its forward's taps or None), not read back yet

    def prefill(self, ids: list[int], input_embeddings=None, reuse: int = 0):
        """Prefill ids[reuse:] (the cache already holds ids[:reuse]: a session's prompt cache) and queue the first
        generated token. Returns the taps of the prefilled positions when this decoder has taps, else None."""
        self.history = list(ids)
        emb = None if input_embeddings is None else input_embeddings[:, reuse:]
        out = prefill(self.model, self.cache, ids[reuse:], self.prefill_step, taps=self.taps, input_embeddings=emb)
        logits, taps = out if self.taps is not None else (out, None)
        y = self.sampler(logits, history_window(self.sampler.params, self.history))
        mx.async_eval(y)
        self._next = (y, None)
        return taps

    @property
    def queued(self) -> bool:
        return self._next is not None

    def queue(self, token: mx.array | None = None) -> None:
        """Queue the step after `token` (a sampled id not read back yet, [1]; None: the last committed token)."""
        if token is None:
            x, hist = mx.array([[self.history[-1]]], dtype=mx.int32), history_window(self.sampler.params, self.history)
        else:  # the sampler's id, as it came out
            x, hist = token.reshape(1, 1), history_window(self.sampler.params, self.history, pending=token)
        if self.taps is None:
            logits, taps = self.model(x, self.cache), None
        else:
            logits, taps = self.model(x, self.cache, taps=self.taps)
        y = self.sampler(logits[:, -1], hist)
        mx.async_eval(y)  # the taps are inputs of y's graph: computed with it
        self._next = (y, taps)

    def take(self, queue_next: bool) -> tuple[int, list | None]:
        """Commit the queued token: (token, the taps of the position before it — the step that sampled it — or None
        for the prefill's token). queue_next: queue the following step before blocking on this token."""
        y, taps = self._next
        self._next = None
        if queue_next:
            self.queue(y)
        t = int(y.item())
        self.history.append(t)
        return t, taps

    def step(self, budget: int) -> list[int]:
        return [self.take(queue_next=budget > 1)[0]]

    def stats(self) -> dict:
        return {}


def plain_token_seconds(model, cache, n: int = 16, taps: tuple | None = None) -> float:
    """Median seconds per token of the plain loop (greedy, pipelined) continuing the context in `cache`, with the
    forward producing `taps` as the speculative engine's plain rounds do; the cache is rewound afterwards."""
    start = cache[0].offset
    dec = PlainDecoder(model, Sampler(SamplingParams()), cache=cache, taps=taps)
    dec.history = [0]
    dec.queue()
    times = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        dec.take(queue_next=i < n)
        times.append(time.perf_counter() - t0)
    rewind_cache(cache, cache[0].offset - start)
    return sorted(times[1:])[n // 2]  # the median: the first step had nothing to overlap with
