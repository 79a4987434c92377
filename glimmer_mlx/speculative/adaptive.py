"""Adaptive draft width: per round, verify the number of drafts k that maximises expected tokens per second.

Expected tokens for k drafts: E(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j, with α_j the running conditional acceptance rate of
draft position j (exponentially decayed counts, Beta(1,1) prior). Cost: the measured time of a target forward over
k+1 tokens on this machine plus the drafter's measured time (k = 0 is a plain step with no drafting). Choosing k = 0
whenever drafting does not pay keeps speculation from running slower than plain decoding; every `probe_every`
plain rounds one full-width round refreshes the acceptance estimates.
"""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx

from ..cache import rewind_cache


def measure_verify_costs(model, cache, taps, max_k: int, repeats: int = 3) -> dict[int, float]:
    """Seconds for a target forward over L = 1..max_k+1 tokens at the cache's current length (rewound after)."""
    costs = {}
    for L in range(1, max_k + 2):
        x = mx.zeros((1, L), dtype=mx.int32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            logits, tapped = model(x, cache, taps=taps)
            mx.eval(logits, tapped)
            best = min(best, time.perf_counter() - t0)
            rewind_cache(cache, L)
        costs[L] = best
    return costs


class AdaptiveWidth:
    def __init__(self, max_k: int, verify_costs: dict[int, float], decay: float = 0.97, probe_every: int = 16):
        self.max_k, self.costs, self.decay, self.probe_every = max_k, dict(verify_costs), decay, probe_every
        self.acc = [1.0] * max_k  # decayed accepted counts per draft position (prior: 1 of 2)
        self.tried = [2.0] * max_k
        self.draft_cost = 0.5 * verify_costs[1]  # replaced by the measured drafter time after the first round
        self._plain_run = 0
        self.chosen = Counter()

    def expected_tokens(self, k: int) -> float:
        e, p = 1.0, 1.0
        for j in range(k):
            p *= self.acc[j] / self.tried[j]
            e += p
        return e

    def choose(self) -> int:
        best_k, best = 0, 1.0 / self.costs[1]
        for k in range(1, self.max_k + 1):
            rate = self.expected_tokens(k) / (self.draft_cost + self.costs[k + 1])
            if rate > best:
                best_k, best = k, rate
        if best_k == 0:
            self._plain_run += 1
            if self._plain_run >= self.probe_every:
                best_k, self._plain_run = self.max_k, 0
        else:
            self._plain_run = 0
        self.chosen[best_k] += 1
        return best_k

    def update(self, k: int, n_accepted: int, draft_time: float | None = None) -> None:
        if k == 0:
            return
        for j in range(self.max_k):
            self.acc[j] *= self.decay
            self.tried[j] *= self.decay
        for j in range(min(n_accepted + 1, k)):
            self.tried[j] += 1
            if j < n_accepted:
                self.acc[j] += 1
        if draft_time is not None:
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * draft_time

    def cost_ratio(self) -> dict[int, float]:
        return {L - 1: c / self.costs[1] for L, c in self.costs.items()}
