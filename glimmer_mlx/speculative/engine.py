"""The speculative round loop: draft → verify → commit → rewind, the same for every drafter.

Per round the drafter proposes k drafts (`protocol.Drafter.propose`); one target forward over [anchor, d1..dk] with
the drafter's taps is verified by `verify`; the target cache is rewound to "anchor + accepted drafts" and the
drafter gets the taps of the committed positions. Plain rounds — the prefill's token, a round with one token of
budget left, a round whose drafter drafted nothing, and `auto`'s plain stretches — run through the one plain loop
(`runtime.plain.PlainDecoder`, with the drafter's taps), pipelined: when the next round is known to be plain, its
forward is queued before the current token is read back.

`SpeculativeDecoder` drafts every round it can at a fixed width. `TreeDecoder` verifies a token tree per round
(`tree.TokenTree`: several candidate continuations in one target forward) and keeps the accepted path in the
caches (`cache.keep_path`). `AutoDecoder` lets an `auto.AutoDrafter` decide
round by round between a plain step and which drafter at which width, and times every round for it.
"""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx

from ..cache import CacheRewindError, keep_path, rewind_cache
from ..kernels import install_block_kernels, kernel_stats
from ..runtime.plain import PlainDecoder
from ..runtime.prefill import DEFAULT_PREFILL_STEP
from ..sampling import Sampler
from .protocol import Drafter
from .tree import TokenTree
from .verify import (expected_acceptance, target_distribution, tree_target_distribution, verify_greedy,
                     verify_sampling, verify_tree_greedy, verify_tree_sampling)


class SpeculativeDecoder:
    """drafter: a `protocol.Drafter`; width: drafts per round (1..drafter.max_drafts; None: the most it gives)."""

    def __init__(self, model, drafter: Drafter, sampler: Sampler, width: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, cache=None):
        trained = drafter.max_drafts
        width = trained if width is None else width
        if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= trained:
            raise ValueError(f"{drafter.width_name} must be an int in [1, {trained}], got {width!r}")
        self.model, self.drafter, self.sampler = model, drafter, sampler
        self.mode = drafter.kind
        self.max_k = width
        self.plain = PlainDecoder(model, sampler, prefill_step,
                                  cache if cache is not None else model.make_cache(), taps=drafter.taps)
        self.cache = self.plain.cache
        self.taps = drafter.taps
        install_block_kernels(model)  # Metal only: small-row quantized matmuls for verification (no-op on CPU)
        self._start = None  # (prefill taps, "start" | "extend"): the drafter starts once the first token is known
        self._spec_next = False  # the next round was decided speculative (no plain forward queued for it)
        self.last_round = None  # what the latest step was: "first" (the prefill's token), "plain" or "spec"
        self.rounds = self.plain_rounds = 0
        self.hist = Counter()  # tokens committed per round -> count
        self.t_draft = self.t_verify = 0.0
        self.last_drafts: list[int] = []  # drafts proposed in the latest round
        self.last_tree = None  # the latest tree round's token tree
        self.tree_rounds = self.tree_rows = 0  # token-tree rounds and the rows (root included) they verified

    @property
    def history(self) -> list[int]:
        return self.plain.history

    def prefill(self, ids: list[int], input_embeddings=None, reuse: int = 0) -> None:
        """input_embeddings: the prompt's embeddings (images in place); the target's taps over image positions then
        reach the drafter like any other context. reuse: the cache holds ids[:reuse] already and the drafter's state
        covers exactly those positions (`Drafter.rewind_context`); only the rest is prefilled, and its taps extend
        the drafter's state (`Drafter.extend`) instead of restarting it."""
        taps = self.plain.prefill(ids, input_embeddings=input_embeddings, reuse=reuse)
        self._start = (taps, "extend" if reuse else "start")

    def plain_next(self, k: int, budget: int) -> bool:
        """Whether a round that could draft up to k (>= 1) drafts, with `budget` tokens of the request left, is plain
        instead: never, at a fixed width."""
        return False

    def _queue_next(self, left: int) -> bool:
        """`left` tokens of budget remain after this round: decide whether the next round is plain (then its forward
        is queued before this round's token is read back)."""
        if left <= 1:
            return left == 1  # the last token is a plain step
        plain = self.plain_next(min(self.max_k, left - 1), left)
        self._spec_next = not plain
        return plain

    def step(self, budget: int) -> list[int]:
        self._spec_next, spec_next = False, self._spec_next
        if self._start is not None:  # the prefill's token: now the drafter can start (the prompt's taps + it)
            (taps, how), self._start = self._start, None
            t, _ = self.plain.take(queue_next=self._queue_next(budget - 1))
            (self.drafter.start if how == "start" else self.drafter.extend)(taps, self.history)
            self.last_round = "first"
            return [t]
        k = min(self.max_k, budget - 1)
        if self.plain.queued or k == 0 or (not spec_next and self.plain_next(k, budget)):
            return self._plain_round(budget)
        return self._spec_round(k, budget)

    def _plain_round(self, budget: int) -> list[int]:
        """A plain step through the one plain loop (its forward queued by the round before, or now)."""
        t0 = time.perf_counter()
        if not self.plain.queued:
            self.plain.queue()
        t, taps = self.plain.take(queue_next=self._queue_next(budget - 1))
        self.drafter.accept(taps, [t])
        self.t_verify += time.perf_counter() - t0
        self.plain_rounds += 1
        self.last_round = "plain"
        return self._commit([t])

    def _spec_round(self, k: int, budget: int) -> list[int]:
        anchor = self.history[-1]
        pos = self.cache[0].offset  # the anchor's position: the cache holds every committed token but the anchor
        t0 = time.perf_counter()
        drafts, q = self.drafter.propose(anchor, pos, k, self.sampler, self.history)
        t1 = time.perf_counter()
        if isinstance(drafts, TokenTree):  # auto chose a token-tree round
            return self._tree_round(drafts, q, pos, t0, t1)
        self.last_drafts = drafts
        if not drafts:
            # nothing drafted (n-gram lookup found no match; auto, choosing with the token its plan had not seen,
            # chose a plain step): a plain round through the plain loop, whose next forward is queued behind it
            # where that one is plain — a verify of the anchor alone was a plain step that queued nothing, so the
            # round after it started cold as well (auto: two unpipelined steps, ~+1.2 and +2.2 ms on the trained
            # tiny set, at each such turn)
            self.plain.taps = self.verify_taps()
            self.t_draft += t1 - t0
            return self._plain_round(budget)
        k = len(drafts)  # a drafter may propose fewer than asked
        want = self.verify_taps()
        out = self.model(mx.array([[anchor] + drafts], dtype=mx.int32), self.cache, taps=want)
        logits, taps = out if want is not None else (out, None)
        if self.sampler.params.greedy:
            n, nxt = verify_greedy(logits[0], drafts, self.sampler, self.history)
        else:
            p = target_distribution(logits[0], self.sampler, self.history, drafts)
            self.sampled(p, q, drafts)
            n, nxt = verify_sampling(p, q, drafts, self.sampler)
        rewind_cache(self.cache, k - n)
        return self._close_round(drafts[:n] + [nxt], None if taps is None else [t[:, : n + 1] for t in taps], t0, t1)

    def sampled(self, p, q, drafts: list[int]) -> None:
        """A chain round at T > 0 is about to be verified: p the target's processed log-probabilities, q the
        drafter's (None: deterministic drafts). Nothing to do at a fixed width (`AutoDecoder` measures what they
        accept on average; one that reads p after the verify must have it evaluated with it: `mx.async_eval`)."""

    def _tree_round(self, tree: TokenTree, q, pos: int, t0: float, t1: float) -> list[int]:
        """Verify token tree `tree` (root = the anchor at position `pos`; q: `propose_tree`'s) in one target forward
        (a tree that is a chain runs exactly the chain round's forward), accept through `verify`, keep the accepted
        path's rows in the caches (`keep_path`) and hand the drafter their taps; drafted between t0 and t1."""
        self.last_tree, self.last_drafts = tree, tree.tokens[1:]
        want = self.verify_taps()
        ids = mx.array([tree.tokens], dtype=mx.int32)
        out = self.model(ids, self.cache, taps=want, tree=None if tree.is_chain else tree.attention_inputs())
        logits, taps = out if want is not None else (out, None)
        if self.sampler.params.greedy:
            path, nxt = verify_tree_greedy(logits[0], tree, self.sampler, self.history)
        else:
            p = tree_target_distribution(logits[0], self.sampler, self.history, tree)
            path, nxt = verify_tree_sampling(p, tree, q, self.sampler)
        rows = [0] + path
        keep_path(self.cache, pos, rows)
        if taps:
            idx = mx.array(rows, dtype=mx.int32)
            taps = [mx.take(t, idx, axis=1) for t in taps]
        self.tree_rows += len(tree)
        self.tree_rounds += 1
        return self._close_round([tree.tokens[i] for i in path] + [nxt], taps, t0, t1)

    def _close_round(self, new: list[int], taps, t0: float, t1: float) -> list[int]:
        """Commit a speculative round's tokens (the caches already hold exactly them): the drafter gets their taps;
        drafted between t0 and t1, verified since."""
        self.history.extend(new)
        self.drafter.accept(taps, new)
        self.t_draft += t1 - t0
        self.t_verify += time.perf_counter() - t1
        self.last_round = "spec"
        return self._commit(new)

    def verify_taps(self) -> tuple | None:
        """The taps a verify forward returns for the drafter (None: logits only)."""
        return self.taps

    def _commit(self, new: list[int]) -> list[int]:
        self.rounds += 1
        self.hist[len(new)] += 1
        return new

    def stats(self) -> dict:
        committed = sum(n * c for n, c in self.hist.items())
        total = self.t_draft + self.t_verify
        d = {
            "rounds": self.rounds,
            "plain_rounds": self.plain_rounds,
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
        if self.tree_rounds:
            d.update(tree_rounds=self.tree_rounds, mean_tree_rows=self.tree_rows / self.tree_rounds)
        d.update(self.drafter.stats())
        kernels = kernel_stats()  # which Metal kernels ran and why any did not (their self-test, `glimmer doctor`)
        if kernels:
            d["kernels"] = kernels
        return d


class TreeDecoder(SpeculativeDecoder):
    """Token-tree rounds: the drafter proposes a tree (`propose_tree`) of at most `nodes` draft nodes, each path at
    most `width` drafts deep; one target forward over the flattened tree (tree mask, per-node positions), acceptance
    by `verify_tree_greedy` / `verify_tree_sampling`, and `cache.keep_path` keeps the accepted path's rows. A tree that
    is a chain runs exactly the chain round's forward. Drafters with `propose_tree`: n-gram lookup, MTP, DFlash (v1 and
    v2: the block's per-position candidates, best first by cumulative draft probability)."""

    def __init__(self, model, drafter: Drafter, sampler: Sampler, nodes: int, width: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, cache=None):
        if not hasattr(drafter, "propose_tree") or not hasattr(drafter, "enable_trees"):
            raise ValueError(f"token trees are implemented for n-gram lookup, MTP and DFlash only, not for a "
                             f"{drafter.kind} drafter")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= 64:
            raise ValueError(f"tree nodes must be an int in [1, 64], got {nodes!r}")
        super().__init__(model, drafter, sampler, width, prefill_step, cache)
        drafter.enable_trees()
        self.nodes = nodes

    def _spec_round(self, k: int, budget: int) -> list[int]:
        pos = self.cache[0].offset  # the anchor's position (its KV is not cached yet)
        t0 = time.perf_counter()
        tree, q = self.drafter.propose_tree(self.history[-1], pos, k, self.nodes, self.sampler, self.history)
        return self._tree_round(tree, q, pos, t0, time.perf_counter())

    def stats(self) -> dict:
        d = super().stats()
        d["tree_nodes"] = self.nodes
        return d


class AutoDecoder(SpeculativeDecoder):
    """The engine for an `auto.AutoDrafter`: each round a plain step or a drafter at a width, chosen by the drafter's
    chooser. Whether the next round is plain is decided one token early (`AutoDrafter.plan`, on the n-gram index one
    token behind), so a plain stretch is pipelined exactly like plain decoding; a speculative round is chosen afresh
    when it starts (`AutoDrafter.propose`). Plain forwards (the prefill's included) compute the drafters' taps only
    while a model drafter pays by its mean estimate; one that fell behind has them recomputed when it next drafts
    (`_fill`).

    Timing is commit to commit (everything between two rounds' results, the consumer's work included): a plain
    token inside a plain stretch is what plain decoding costs now; a speculative round is charged what its draft and
    verify windows missed; a speculative stretch, what the plain tokens on either side of it cost beyond pipelined
    ones (`AutoChooser.switch_cost`); a drafter's catch-up on rounds it sat out, that drafter
    (`AutoChooser.observe_catch_up`)."""

    def __init__(self, model, drafter, sampler: Sampler, width: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, cache=None):
        if drafter.kind != "auto":
            raise TypeError("AutoDecoder drives an AutoDrafter")
        super().__init__(model, drafter, sampler, width, prefill_step, cache)
        self.mode = drafter.mode
        self._regime = "greedy" if sampler.params.greedy else "sampling"
        self.plain.taps = None  # a plain round computes no taps: a drafter catches up when it is next asked
        drafter.fill, drafter.can_fill = self._fill, self._can_fill
        self._t_commit = None  # when the previous round's tokens were committed (None before the first)
        self._after = None  # what that round was: "plain", "spec" (a measured speculative round) or None
        self._expect = None  # (p, q, drafts) of a chain round at T > 0 until it is read (`sampled`)

    def plain_next(self, k: int, budget: int) -> bool:
        plain = self.drafter.plan(k, self._regime, budget)
        self.plain.taps = self.taps if plain and self.drafter.needs_taps else None
        return plain

    def prefill(self, ids: list[int], input_embeddings=None, reuse: int = 0) -> None:
        """The prompt's taps only when a model drafter could pay (`AutoDrafter.wants_taps`; or the prompt has images,
        whose positions a later recomputation from the ids could not reproduce)."""
        wants = self.drafter.wants_taps(self._regime)  # (a new context for the drafter either way)
        if input_embeddings is not None or wants:
            self.plain.taps = self.taps
        try:
            super().prefill(ids, input_embeddings, reuse)
        finally:
            self.plain.taps = None

    def verify_taps(self) -> tuple | None:
        return self.taps if self.drafter.needs_taps else None

    def sampled(self, p, q, drafts: list[int]) -> None:
        """What the round's drafts are accepted on average (`verify.expected_acceptance`): the drafter's chooser
        learns from that rather than from the round's coins (`AutoDrafter.accept`). Read after the verify
        (`_close_round`) from p and q evaluated with it: queued here (`mx.async_eval`), they are outputs of an
        evaluation, kept for the read, and the verify's own evaluation waits on them instead of computing them again.
        Read before the verify, as it was until the fifty-first session, p's evaluation was a wait of its own on
        the model's forward, the verify's arithmetic queued only after it: auto's 7-draft DFlash rounds on the trained
        tiny set at T = 1 verified in 5.05-5.45 ms against 4.90 for the fixed DFlash mode's, 4.91-4.94 this way
        (medians, one process, /tmp script); throughput level over 16 A/B sittings (`readfirst`): the wait moved out
        of the verify window, which prices the option's verify factor, rather than out of the round."""
        mx.async_eval([a for a in (p, q) if a is not None])
        self._expect = (p, q, drafts)

    def _close_round(self, new: list[int], taps, t0: float, t1: float) -> list[int]:
        if self._expect is not None:  # a chain round at T > 0 (`sampled`): before the drafter's accept reads it
            self.drafter.expected = expected_acceptance(*self._expect)
            self._expect = None
        return super()._close_round(new, taps, t0, t1)

    def _can_fill(self, n: int) -> bool:
        try:
            for c in self.cache:
                c.check_rewind(n)
        except CacheRewindError:
            return False
        return True

    def _fill(self, a: int) -> list[mx.array] | None:
        """The target's taps of positions [a, now), recomputed: the cache is rewound to `a` and those tokens run
        again (in prefill-sized chunks); None when the cache cannot rewind that far."""
        pos = self.cache[0].offset
        n = pos - a
        if n <= 0 or not self._can_fill(n):
            return None
        rewind_cache(self.cache, n)
        ids, step, parts = self.history[a:pos], self.plain.prefill_step, []
        for s in range(0, n, step):
            _, taps = self.model(mx.array([ids[s:s + step]], dtype=mx.int32), self.cache, taps=self.taps, last=1)
            parts.append(taps)
        if len(parts) == 1:
            return parts[0]
        return [mx.concatenate([p[i] for p in parts], axis=1) for i in range(len(self.taps))]

    def step(self, budget: int) -> list[int]:
        auto, t_prev = self.drafter, self._t_commit
        auto.remaining = budget  # what a speculative round chosen now can still earn back
        final = budget <= 1 and not self.plain.queued  # the last token, its forward not queued: not a plain stretch's
        planned = self._spec_next  # planned speculative: no forward queued for it
        out = super().step(budget)
        now = time.perf_counter()
        if t_prev is not None and self.last_round != "first":
            auto.chooser.elapse(now - t_prev)  # the ledger's budget (`AutoChooser.credit`)
        if self.last_round == "first":  # the prefill's token: the next token's forward queued behind it (`plan`)
            self._after = "plain"
        elif final and self.last_round == "plain":
            self._after = None
        elif self.last_round == "spec" or planned:
            # (planned speculative and chosen plain with the token the plan had not seen: a step queued behind
            # nothing — no plain token's price — and no stretch after the lead before it: `end_round` drops that)
            spec = t_prev is not None and auto.end_round(now - t_prev, len(out))
            self._after = "spec" if spec else None
        elif self.last_round == "plain":
            if t_prev is not None:
                excess = now - t_prev - auto.chooser.plain_cost
                if self._after == "spec":  # the first plain token after a speculative stretch
                    auto.restart(excess)
                elif self._after == "plain" and self.plain.queued:  # inside a plain stretch
                    auto.plain_token(now - t_prev)
                elif self._after == "plain" and budget > 1:  # the last plain token before a speculative round
                    auto.lead(excess)  # (not the request's last token: no round follows it)
            self._after = "plain"
        self._t_commit = now
        return out
