"""The speculative round loop: draft → verify → commit → rewind.

Per round: one drafter forward over the block [anchor, mask…], one target forward over [anchor, d1..dk] (with the
taps the drafter needs), acceptance by `verify`, then the target caches are rewound to "anchor + accepted drafts"
and those positions' taps become the drafter's new context. With one token of budget left a round is a plain step.
"""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx

from ..cache import rewind_cache
from ..generate import DEFAULT_PREFILL_STEP, prefill
from ..sampling import Sampler
from .adaptive import AdaptiveWidth, measure_verify_costs
from .verify import draft_tokens, target_distribution, verify_greedy, verify_sampling


class DFlashDecoder:
    mode = "dflash"

    def __init__(self, model, drafter, sampler: Sampler, block_size=None, prefill_step: int = DEFAULT_PREFILL_STEP):
        trained = drafter.block_size
        self.adaptive = block_size == "auto"
        if block_size is None or self.adaptive:
            block_size = trained
        if not isinstance(block_size, int) or not 2 <= block_size <= trained:
            raise ValueError(f"block_size must be 'auto' or an int in [2, {trained}] (the drafter's trained block "
                             f"size), got {block_size!r}")
        self.model, self.drafter, self.sampler = model, drafter, sampler
        self.max_k = block_size - 1
        self.prefill_step = prefill_step
        self.cache = model.make_cache(max_rewind=max(64, trained))
        self.dcache = drafter.make_cache()
        self.taps = drafter.taps
        self.history: list[int] = []
        self.ctx = None
        self._first = None
        self.chooser: AdaptiveWidth | None = None
        self.rounds = 0
        self.hist = Counter()  # tokens committed per round -> count
        self.t_draft = self.t_verify = 0.0
        self.last_drafts: list[int] = []  # drafts proposed in the latest round (all block−1 of them)

    def prefill(self, ids: list[int]) -> None:
        self.history = list(ids)
        logits, taps = prefill(self.model, self.cache, ids, self.prefill_step, taps=self.taps)
        self.ctx = mx.concatenate(taps, axis=-1)
        self._first = int(self.sampler(logits, self._hist()).item())
        if self.adaptive:
            costs = measure_verify_costs(self.model, self.cache, self.taps, self.max_k)
            self.chooser = AdaptiveWidth(self.max_k, costs)

    def _hist(self):
        p = self.sampler.params
        if p.repetition_penalty == 1.0:
            return None
        return mx.array(self.history[-p.repetition_context_size:], dtype=mx.int32)

    def _commit(self, new: list[int]) -> list[int]:
        self.history += new
        self.rounds += 1
        self.hist[len(new)] += 1
        return new

    def step(self, budget: int) -> list[int]:
        if self._first is not None:
            t, self._first = self._first, None
            self.history.append(t)
            return [t]
        anchor = self.history[-1]
        pos = self.cache[0].offset  # the anchor's position: the cache holds every committed token but the anchor
        k = min(self.max_k, budget - 1)
        if self.chooser is not None:
            k = min(k, self.chooser.choose())
        t0 = time.perf_counter()
        if k == 0:  # plain step (still producing the taps the drafter needs next round)
            logits, taps = self.model(mx.array([[anchor]], dtype=mx.int32), self.cache, taps=self.taps)
            t = int(self.sampler(logits[:, -1], self._hist()).item())
            self.ctx = mx.concatenate(taps, axis=-1)
            self.t_verify += time.perf_counter() - t0
            return self._commit([t])
        h = self.drafter.draft_hidden(anchor, self.ctx, pos, self.dcache)
        q_logits = self.drafter.logits(h[:k])
        drafts, q = draft_tokens(q_logits, self.sampler, self.history)
        self.last_drafts = drafts
        t1 = time.perf_counter()
        logits, taps = self.model(mx.array([[anchor] + drafts], dtype=mx.int32), self.cache, taps=self.taps)
        if self.sampler.params.greedy:
            n, nxt = verify_greedy(logits[0], drafts, self.sampler, self.history)
        else:
            p = target_distribution(logits[0], self.sampler, self.history, drafts)
            n, nxt = verify_sampling(p, q, drafts, self.sampler)
        rewind_cache(self.cache, k - n)
        self.ctx = mx.concatenate(taps, axis=-1)[:, : n + 1]
        t2 = time.perf_counter()
        self.t_draft += t1 - t0
        self.t_verify += t2 - t1
        if self.chooser is not None:
            self.chooser.update(k, n, t1 - t0)
        return self._commit(drafts[:n] + [nxt])

    def stats(self) -> dict:
        committed = sum(n * c for n, c in self.hist.items())
        total = self.t_draft + self.t_verify
        d = {
            "rounds": self.rounds,
            "tau": committed / self.rounds if self.rounds else 0.0,
            "acceptance_histogram": {int(n): int(c) for n, c in sorted(self.hist.items())},
            "block_size": self.max_k + 1,
            "adaptive": self.adaptive,
            "draft_share": self.t_draft / total if total else 0.0,
            "verify_share": self.t_verify / total if total else 0.0,
        }
        if self.chooser is not None:
            d["verify_cost_ratio"] = {int(k): round(v, 3) for k, v in self.chooser.cost_ratio().items()}
            d["chosen_k_histogram"] = dict(sorted(self.chooser.chosen.items()))
        return d


def make_decoder(model, drafter, sampler: Sampler, *, block_size=None, prefill_step: int = DEFAULT_PREFILL_STEP):
    if getattr(drafter, "kind", None) == "dflash":
        return DFlashDecoder(model, drafter, sampler, block_size, prefill_step)
    raise TypeError(f"unsupported drafter {type(drafter).__name__}")
