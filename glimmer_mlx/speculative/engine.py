"""The speculative round loop: draft → verify → commit → rewind, the same for every drafter.

A drafter implements `taps` (target layers it needs), `max_drafts`, `start(taps, ids)` after the prefill,
`propose(anchor, pos, k, sampler, history) -> (drafts, q_logprobs | None)`, and `accept(taps, new_tokens)` with the
target's taps of the newly committed positions. Per round: the drafter proposes k drafts; one target forward over
[anchor, d1..dk] (with the drafter's taps) is verified by `verify`; the target caches are rewound to
"anchor + accepted drafts". With one token of budget left a round is a plain target step. Choosing the width per round
(and plain steps where drafting does not pay) is `auto`'s job (`speculative.auto`, also behind block_size="auto").
"""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx

from ..cache import rewind_cache
from ..generate import DEFAULT_PREFILL_STEP, prefill
from ..sampling import Sampler
from .verify import target_distribution, verify_greedy, verify_sampling
from ..kernels import install_block_kernels


class SpeculativeDecoder:
    def __init__(self, model, drafter, sampler: Sampler, width=None, prefill_step: int = DEFAULT_PREFILL_STEP,
                 cache=None):
        trained = drafter.max_drafts
        if width is None:
            width = trained
        if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= trained:
            raise ValueError(f"{drafter.width_name} must be an int in [1, {trained}], got {width!r}")
        self.model, self.drafter, self.sampler = model, drafter, sampler
        self.mode = drafter.kind
        self.max_k = width
        self.prefill_step = prefill_step
        self.cache = cache if cache is not None else model.make_cache(max_rewind=max(64, trained))
        install_block_kernels(model)  # Metal only: small-row quantized matmuls for verification (no-op on CPU)
        self.taps = drafter.taps
        self.history: list[int] = []
        self._first = None
        self.rounds = 0
        self.hist = Counter()  # tokens committed per round -> count
        self.t_draft = self.t_verify = 0.0
        self.last_drafts: list[int] = []  # drafts proposed in the latest round

    def prefill(self, ids: list[int], input_embeddings=None, reuse: int = 0) -> None:
        """input_embeddings: the prompt's embeddings (images in place); the target's taps over image positions then
        reach the drafter like any other context. reuse: the cache holds ids[:reuse] already and the drafter's state
        covers exactly those positions (`drafter.rewind_context`); only the rest is prefilled, and its taps extend
        the drafter's state (`drafter.extend`) instead of restarting it."""
        self.history = list(ids)
        emb = None if input_embeddings is None else input_embeddings[:, reuse:]
        logits, taps = prefill(self.model, self.cache, ids[reuse:], self.prefill_step, taps=self.taps,
                               input_embeddings=emb)
        self._first = int(self.sampler(logits, self._hist()).item())
        if reuse:
            self.drafter.extend(taps, self.history + [self._first])
        else:
            self.drafter.start(taps, self.history + [self._first])

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
        t0 = time.perf_counter()
        if k == 0:  # plain step (still producing the taps the drafter needs)
            logits, taps = self.model(mx.array([[anchor]], dtype=mx.int32), self.cache, taps=self.taps)
            t = int(self.sampler(logits[:, -1], self._hist()).item())
            self.drafter.accept(taps, [t])
            self.t_verify += time.perf_counter() - t0
            return self._commit([t])
        drafts, q = self.drafter.propose(anchor, pos, k, self.sampler, self.history)
        self.last_drafts = drafts
        k = len(drafts)  # a drafter may propose fewer than asked
        t1 = time.perf_counter()
        logits, taps = self.model(mx.array([[anchor] + drafts], dtype=mx.int32), self.cache, taps=self.taps)
        if self.sampler.params.greedy:
            n, nxt = verify_greedy(logits[0], drafts, self.sampler, self.history)
        else:
            p = target_distribution(logits[0], self.sampler, self.history, drafts)
            n, nxt = verify_sampling(p, q, drafts, self.sampler)
        rewind_cache(self.cache, k - n)
        new = drafts[:n] + [nxt]
        self.drafter.accept([t[:, : n + 1] for t in taps], new)
        t2 = time.perf_counter()
        self.t_draft += t1 - t0
        self.t_verify += t2 - t1
        return self._commit(new)

    def stats(self) -> dict:
        committed = sum(n * c for n, c in self.hist.items())
        total = self.t_draft + self.t_verify
        d = {
            "rounds": self.rounds,
            "tau": committed / self.rounds if self.rounds else 0.0,
            "acceptance_histogram": {int(n): int(c) for n, c in sorted(self.hist.items())},
            "max_drafts": self.max_k,
            "draft_share": self.t_draft / total if total else 0.0,
            "verify_share": self.t_verify / total if total else 0.0,
        }
        if self.mode == "dflash":
            d["block_size"] = self.max_k + 1
        elif self.mode == "mtp":
            d["depth"] = self.max_k
        if hasattr(self.drafter, "stats"):  # auto: its choices, acceptance and cost curve
            d.update(self.drafter.stats())
        return d


def make_decoder(model, drafter, sampler: Sampler, *, block_size=None, prefill_step: int = DEFAULT_PREFILL_STEP,
                 cache=None):
    """block_size: DFlash's block width (drafts + 1) or MTP's depth (drafts); None = as trained; "auto" = per round,
    plain steps included (`auto.width_auto`: auto's choice over this one drafter)."""
    kind = getattr(drafter, "kind", None)
    if kind in ("dflash", "mtp") and block_size == "auto":
        from .auto import AutoDecoder, width_auto

        return AutoDecoder(model, width_auto(model, drafter), sampler, None, prefill_step, cache)
    if kind == "dflash":
        if block_size not in (None, "auto") and not (
                isinstance(block_size, int) and not isinstance(block_size, bool) and 2 <= block_size <= drafter.block_size):
            raise ValueError(f"block_size must be 'auto' or an int in [2, {drafter.block_size}] (the drafter's trained "
                             f"block size), got {block_size!r}")
        width = block_size - 1 if block_size is not None else None
        return SpeculativeDecoder(model, drafter, sampler, width, prefill_step, cache)
    if kind == "mtp":
        if isinstance(block_size, int) and not isinstance(block_size, bool):
            drafter.set_depth(block_size)  # beyond the trained layers the last one is reused recursively
        return SpeculativeDecoder(model, drafter, sampler, block_size, prefill_step, cache)
    if kind in ("auto", "ngram"):  # auto chooses its own widths; n-gram lookup drafts what it finds
        if block_size is not None:
            raise ValueError(f"block_size does not apply to the {kind} drafter (it chooses its own widths)")
        if kind == "auto":
            from .auto import AutoDecoder  # plain stretches pipelined like PlainDecoder

            return AutoDecoder(model, drafter, sampler, None, prefill_step, cache)
        return SpeculativeDecoder(model, drafter, sampler, None, prefill_step, cache)
    raise TypeError(f"unsupported drafter {type(drafter).__name__}")
