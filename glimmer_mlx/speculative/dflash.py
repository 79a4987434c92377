"""The DFlash drafter: a block-diffusion assistant that drafts a whole block in one forward from the target's taps;
loading it next to its target and checking that the two fit.

Trees (`propose_tree`, EAGLE-2 style dynamic trees, Li et al. 2024; Sequoia-style rank statistics, Chen et al.
2024): the block's one forward gives a distribution at every position pos+1..pos+k. A node's children are
candidates for the next position: greedy, the likeliest tokens best first (rank r = the r-th likeliest); at T > 0,
rank 0 is drawn from the node's q row and ranks 1.. are the likeliest others (below). The tree is grown best first
from the root (`grow_slots`): slot (node n, rank r) scores score(n) + log P̂(rank r accepted | n accepted), where
P̂ comes from conditional rates c[d][r] = P(the target's token is rank r | node of depth d accepted, not ranks
< r) learned online (`RankCalibration`: `accept` walks the last tree along the committed tokens and counts which
rank each depth's committed token was; a prior before data), so every kept node's parent is kept, the chain is not
forced to full depth, and shallow / wide or deep / narrow shapes follow what the target actually accepts.
Deterministic candidates also blend in their own draft log-probability (`tree_blend`: log P̂ · blend + log q ·
(1 − blend)), which the token-independent rate cannot see.

The approximation: a block's position j is conditioned on the anchor and the context only, not on the tokens at
positions before j (block diffusion drafts them in parallel), so in v1 a node's children come from the next
position's distribution whatever the node's token is. That only shapes the tree; whether anything is accepted is
decided by `verify`, so output stays exactly the target's whatever the tree holds: greedy accepts only paths equal
to the target's argmax, and sampling is lossless for any tree whose q rows say how each node's token was drawn.

Sampling (T > 0): a node's first child is drawn from the node's processed q row (v1: its position's row; v2: the
selector's row given the node's token) and carries that row; its other children are the likeliest other tokens of
the row, deterministic candidates (point masses, q None) — SpecInfer's recursive rejection in `verify`
(`verify_tree_sampling`): the drawn child is accepted with min(1, p/q), then each point mass with exactly its
residual target probability. (Drawing the siblings without replacement, Recursive Speculative Decoding (Jeon et
al. 2024) with q_c = q minus the earlier siblings renormalized, and all-point-mass trees were both measured below
this on the embedded v1 drafter at T = 1 — BENCHMARKS.md "Token trees" — and are not implemented.) What keeps it
exact: a drawn child's slot is scored by its rank rate alone, never by its own token (a slot kept or not because of
the token drawn into it would bias that token's distribution); everything else — the point masses' scores, the
children of a kept node given its token — may use any drafter value, since each step is exact for any candidate
chosen independently of the verifier's uniforms, and every node's draw is fresh (`tree_rng`, one seed per round
from the request's sampler). With no more nodes than the depth (`budget <= k`) or a repetition penalty (a
path-dependent q) the tree is the chain of `propose` and its alternatives (`propose_tree_chain`): a tree of the
chain's budget *is* the chain round. At T > 0 calibrated trees are opt-in (`tree_calibrated_sampling`): at T = 1
over three seeds and 16 rows they measured no clear gain over the "draft" scheme — trained tiny set τ 2.32 vs 2.50
(depth 4), 2.42 vs 2.40 (depth 6); embedded v1 1.60 vs 1.56 (depth 4), 1.57 vs 1.56 (depth 8) — so by default a
T > 0 round grows the "draft" tree. `tree_scoring = "draft"` keeps the earlier scheme throughout (the chain of
`propose` forced to full depth, alternatives best first by cumulative draft log-probability: `grow_tree`,
`tree_q`).
"""

from __future__ import annotations

import copy
import heapq
import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..cache import CacheRewindError, KVCache, rewind_cache
from ..config import ConfigError
from ..prompt_cache import copy_cache
from ..loading import CheckpointError, check_weights, load_weights, parse_dtype, quantize_like
from ..models.assistant import Assistant, AssistantConfig
from ..sampling import process
from .protocol import MeasuredTau, read_measured_tau
from .tree import TokenTree
from .verify import draft_tokens, sample_row

DRAFT_LOGITS = ("raw", "target")

TREE_TOP_K = 8  # candidates per block position a tree node may have as children
TREE_SCORINGS = ("calibrated", "draft")
CAL_PRIOR = (0.5, 0.2)  # prior conditional acceptance of rank 0 / of each later rank, before data
CAL_WEIGHT = 2.0  # the prior's weight in observations
TREE_BLEND = 0.5  # the rank statistic's share of a (deterministic) slot's log-score; the rest: the draft log-prob


class DFlashDrafter:
    """A DFlash assistant bound to its target: proposes blocks, never accepts them.

    draft_logits: "target" (default) — the target's multiplier + softcap, so q lives on the same scale as p;
    "raw" — the bare `lm_head`, as transformers does. Greedy output is the same either way (monotone transform);
    at temperature 1 "target" measured τ 2.24 vs 1.13 for "raw" on our trained tiny pair (BENCHMARKS.md).
    """

    kind = "dflash"
    variant = "dflash"  # what stats and benchmark labels call it (`dflash2.DFlash2Drafter`: "dflash2")
    default_tree_scoring = "calibrated"  # v1 measured >= "draft" (BENCHMARKS.md "Token trees"); DFlash 2: "draft"

    def __init__(self, assistant: Assistant, target, draft_logits: str = "target"):
        if draft_logits not in DRAFT_LOGITS:
            raise ValueError(f"draft_logits must be one of {DRAFT_LOGITS}, got {draft_logits!r}")
        self.assistant, self.target, self.draft_logits = assistant, target, draft_logits
        self.config = assistant.config
        self.block_size = self.config.block_size
        self.taps = tuple(self.config.target_layer_ids)
        self.measured_tau: MeasuredTau | None = None  # from the folder's eval.json
        self.cache = None  # the drafter's context K/V (None before `start`)
        self.ctx = None  # target taps of committed positions not yet in `cache`
        self.source: str | None = None  # the folder it was loaded from (`load_dflash`)
        self.tree_scoring = self.default_tree_scoring  # "calibrated" or "draft" (module docstring)
        self.tree_blend = TREE_BLEND
        self.tree_calibrated_sampling = False  # calibrated trees at T > 0 too (module docstring: off by default)
        self.tree_calibration: dict[bool, RankCalibration] = {}  # greedy? -> its rank statistics
        self.tree_pending = None  # the last calibrated tree, its candidate lists, drawn ranks, greedy?: for `accept`

    @property
    def ctx(self) -> mx.array | None:
        """The target's taps of committed positions not yet in `cache` ([1, n, taps · D]), or None — joined when read:
        `accept` only adds each round's taps to `_rows`, so a batch row that follows plain steps spends no MLX op a
        step on them (a concatenation a step left a lazy chain that, read after 1 000 plain steps, took 3.2 s to
        evaluate on the 2-core CPU; joined once, 0.014 s)."""
        rows = self._rows
        if len(rows) > 1 or (rows and isinstance(rows[0], tuple)):
            head = [] if isinstance(rows[0], tuple) else [rows[0]]  # a joined array first, then per-tap pieces
            rest = rows[len(head):]
            pieces = [mx.concatenate([r[i] for r in rest], axis=1) if len(rest) > 1 else rest[0][i]
                      for i in range(len(rest[0]))]
            self._rows = (mx.concatenate(head + [mx.concatenate(pieces, axis=-1)], axis=1),)
        return self._rows[0] if rows else None

    @ctx.setter
    def ctx(self, value: mx.array | None) -> None:
        self._rows = () if value is None else (value,)
        self._backlog = 0 if value is None else value.shape[1]

    @property
    def backlog(self) -> int:
        """Target positions whose taps wait in `ctx` for the next round to take in (what its next round catches up
        on; counted as they come: a batch row carrying the drafter along plain steps holds one piece a step)."""
        return self._backlog

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    width_name = "block_size - 1"

    def make_cache(self):
        return self.assistant.make_cache()

    def fork(self) -> "DFlashDrafter":
        """The same drafter (shared weights) with its own, empty state (a batch row's)."""
        d = copy.copy(self)
        d.cache = d.ctx = d.tree_pending = None  # the rank statistics (tree_calibration) stay shared
        return d

    def copy_state(self) -> "DFlashDrafter":
        """The same drafter with an independent copy of its current state (a prompt-cache entry's, handed to the
        row that continues it while the entry keeps its own)."""
        d = copy.copy(self)
        d.cache = None if self.cache is None else copy_cache(self.cache)
        d.tree_pending = None
        return d  # ctx (its pieces: a tuple of arrays, never written in place) is shared

    def state_nbytes(self) -> int:
        """Bytes of its state (context K/V and pending context rows): what a prompt-cache entry keeping it holds
        beyond the target's cache."""
        return sum(c.nbytes for c in self.cache or ()) + (0 if self.ctx is None else self.ctx.nbytes)

    # -- the drafter protocol (speculative.protocol.Drafter) -----------------------------------------------------
    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        """After the prefill: `taps` cover every prompt position; `ids` = prompt + the first generated token."""
        self.cache = self.make_cache()
        self.ctx = mx.concatenate(taps, axis=-1)

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        """k drafts for positions pos+1..pos+k (the anchor sits at `pos`); returns (drafts, q_logprobs | None)."""
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        return draft_tokens(self.logits(h[:k]), sampler, history)

    # -- token trees (speculative.engine.TreeDecoder; module docstring) ------------------------------------------
    def enable_trees(self) -> None:
        """Trees keep no state but their rank statistics (module docstring), learned across requests."""
        if self.tree_scoring not in TREE_SCORINGS:
            raise ValueError(f"tree_scoring must be one of {TREE_SCORINGS}, got {self.tree_scoring!r}")

    def calibration(self, greedy: bool) -> "RankCalibration":
        c = self.tree_calibration.get(greedy)
        if c is None:
            c = self.tree_calibration[greedy] = RankCalibration(self.max_drafts, self.tree_top_k)
        return c

    def calibrated_trees(self, k: int, budget: int, sampler) -> bool:
        """Whether this round's tree is grown by rank statistics (module docstring) rather than the chain's."""
        params = sampler.params
        return (self.tree_scoring == "calibrated" and budget > k and params.repetition_penalty == 1.0
                and (params.greedy or self.tree_calibrated_sampling))

    def propose_tree(self, anchor: int, pos: int, depth: int, budget: int, sampler, history: list[int]):
        """A tree of at most `budget` draft nodes, at most `depth` deep (module docstring). Returns (tree, q): q None
        at greedy; at T > 0 q[c] the q row node c's token was drawn from (None for a point mass)."""
        k = max(1, min(depth, budget, self.max_drafts))
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        logits = self.logits(h[:k])
        if not self.calibrated_trees(k, budget, sampler):
            return self.propose_tree_chain(anchor, k, budget, logits, sampler, history)
        params = sampler.params
        if params.greedy:
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            top = mx.argsort(-lp, axis=-1)[:, : min(self.tree_top_k, lp.shape[-1])]
            vals = mx.take_along_axis(lp, top, axis=-1)
            mx.eval(top, vals)
            cands = [list(zip(t, v)) for t, v in zip(top.tolist(), vals.tolist())]
            return self.grow_calibrated(anchor, k, budget, lambda node, d, token: cands[d], None, True)
        q = process(logits, params)
        mx.eval(q)
        qn = np.asarray(q).astype(np.float64)
        top = np.argsort(-qn, axis=-1, kind="stable")[:, : self.tree_top_k + 1]
        rng, rows = tree_rng(sampler), {}

        def children(node: int, d: int, token: int):
            rows[node] = q[d]
            return sampled_children(qn[d], None, top[d], self.tree_top_k, rng)

        return self.grow_calibrated(anchor, k, budget, children, rows, False)

    def grow_calibrated(self, anchor: int, k: int, budget: int, children, rows: dict | None, greedy: bool):
        """`grow_slots` with this drafter's rank statistics (kept apart for greedy and T > 0). children(node, d,
        token): the candidates [(token, log-prob)] after node `node` of depth d holding `token`, in rank order:
        greedy, the likeliest first; T > 0 (rows given), one drawn from the node's q row first, then the likeliest
        others (`sampled_children`), rows[node] that q row [V] once asked. Returns (tree, q): q None at greedy; at
        T > 0 the drawn first children's q rows (their parent's row), None for every other node (point masses)."""
        cal = self.calibration(greedy)
        drawn = 0 if rows is None else 1
        tree, lists = grow_slots(anchor, k, budget, children, cal.slot_logp(), self.tree_blend, drawn)
        self.tree_pending = (tree, {n: [t for t, _ in cl] for n, cl in lists.items()}, drawn, greedy)
        if rows is None:
            return tree, None
        q = [None] * len(tree)
        for par, kids in enumerate(tree.children):
            if kids:
                q[kids[0]] = rows[par]
        return tree, q

    def propose_tree_chain(self, anchor: int, k: int, budget: int, logits, sampler, history: list[int]):
        """The "draft" scheme: the chain of up to k drafts (exactly `propose`'s), and with the rest of `budget` the
        best other nodes by cumulative draft probability (`grow_tree`); at T > 0 q[c] the q row chain node c was
        sampled from, None for the other nodes (point masses)."""
        drafts, q = draft_tokens(logits, sampler, history)
        # scores: the rows the chain was drawn from (T > 0), the draft distribution at temperature 1 (greedy)
        lp = q if q is not None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        K = min(self.tree_top_k, lp.shape[-1])
        top = mx.argsort(-lp, axis=-1)[:, :K]
        vals = mx.take_along_axis(lp, top, axis=-1)
        chain_lp = mx.take_along_axis(lp, mx.array(drafts, dtype=mx.int32)[:, None], axis=-1)[:, 0]
        mx.eval(top, vals, chain_lp)
        cands = [list(zip(t, v)) for t, v in zip(top.tolist(), vals.tolist())]
        tree = grow_tree(anchor, drafts, chain_lp.tolist(), k, budget, lambda d, token: cands[d])
        return tree, tree_q(tree, q, len(drafts))

    tree_top_k = TREE_TOP_K

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        """The target's taps of the newly committed positions (anchor + accepted drafts) become the next context."""
        self._rows = self._rows + (tuple(taps),)  # joined when `ctx` is read
        self._backlog += taps[0].shape[1]
        if self.tree_pending is not None:  # the round verified a calibrated tree: count its ranks
            tree, lists, drawn, greedy = self.tree_pending
            self.tree_pending = None
            self.calibration(greedy).observe(tree, lists, new_tokens, drawn)

    # -- prompt-cache reuse (session.Session): continue the state on a new prompt instead of restarting -------------
    def context_length(self) -> int:
        """Target positions the drafter's state covers (its context cache + the pending context rows)."""
        if self.cache is None:
            return 0
        return self.cache[0].offset + (0 if self.ctx is None else self.ctx.shape[1])

    def rewind_context(self, keep: int) -> int:
        """Forget the context at positions >= `keep`. Returns the position p <= keep from which the target's taps
        must be handed over again with `extend` (the target cache must then hold exactly positions < p).

        Full-attention layers rewind freely. A sliding layer's cache keeps no spare rows (max_rewind 0), so when it
        cannot rewind it is replaced by an empty cache starting at keep − window: the rows its window still needs
        are recomputed from the target's taps (p = keep − window). Changes nothing and raises `CacheRewindError`
        when no state exists."""
        have = self.context_length()
        if self.cache is None:
            raise CacheRewindError("the DFlash drafter has no state to rewind (start() was never called)")
        keep = max(0, min(keep, have))
        stored = self.cache[0].offset
        if keep >= stored:  # only pending rows (not yet in the drafter cache) are dropped
            n = keep - stored
            self.ctx = None if n == 0 or self.ctx is None else self.ctx[:, :n]
            return keep
        self.ctx = None
        try:
            rewind_cache(self.cache, stored - keep)
            return keep
        except CacheRewindError:
            pass
        windows = [self.config.window(i) for i in range(len(self.cache))]
        start = max(0, keep - max(w for w in windows if w is not None))
        for i, c in enumerate(self.cache):
            if windows[i] is None:
                c.rewind(c.offset - start)
            else:
                self.cache[i] = KVCache(window=c.window, max_rewind=c.max_rewind, first_position=start)
        return start

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        """Continue after `rewind_context`: `taps` are the target's taps of the positions from the rewind point on
        (up to the new prompt's end); `ids` = the whole new prompt + its first generated token."""
        if self.cache is None:
            raise RuntimeError("DFlash drafter: extend() before start()")
        if self.context_length() + taps[0].shape[1] != len(ids) - 1:
            raise RuntimeError(f"DFlash drafter out of sync: its context covers {self.context_length()} positions, "
                               f"{taps[0].shape[1]} new tap rows do not reach the prompt end ({len(ids) - 1})")
        self.accept(taps, [])

    def parts(self) -> tuple:
        return (self,)

    def stats(self) -> dict:
        return {}

    def draft_hidden(self, anchor: int, ctx_taps: mx.array, pos: int, cache, block: int | None = None) -> mx.array:
        """Final hidden states of the block [anchor, mask × (block−1)] at positions pos.. → [block−1, D] (rows 1..)."""
        B = block or self.block_size
        ids = mx.array([[anchor] + [self.config.mask_token_id] * (B - 1)], dtype=mx.int32)
        noise = self.target.embed_raw(ids)
        return self.assistant(noise, ctx_taps, pos, cache)[0, 1:]

    def propose_hidden(self, h: mx.array, k: int, sampler, history: list[int]):
        """`propose` from the block's hidden states already computed (`draft_hidden_batch`); the anchor is
        history[-1]."""
        return draft_tokens(self.logits(h[:k]), sampler, history)

    def logits(self, h: mx.array) -> mx.array:
        if self.draft_logits == "raw":
            return self.target.lm_head_raw(h).astype(mx.float32)
        return self.target.logits(h)


def batches_with(a: "DFlashDrafter", b: "DFlashDrafter") -> bool:
    """Whether two drafters' blocks can be drafted in one forward (`draft_hidden_batch`): DFlash drafters (v1 or
    v2) of the same assistant model (forks of one drafter: batch rows), each with its own started state."""
    return (isinstance(a, DFlashDrafter) and type(a) is type(b) and a.assistant is b.assistant
            and a.target is b.target and a.cache is not None and b.cache is not None)


def draft_hidden_batch(drafters: list["DFlashDrafter"], anchors: list[int], positions: list[int]) -> list[mx.array]:
    """The blocks of several DFlash drafters (rows of a batch, `batches_with` each other) in one drafter model
    forward (`models.assistant.batch_forward`): row r's block [anchors[r], mask…] at positions[r], its pending
    context into its own cache. Returns each row's hidden states [block−1, D], as its own `draft_hidden` gives them;
    their pending contexts are consumed."""
    first = drafters[0]
    B = first.block_size
    ids = mx.array([[a] + [first.config.mask_token_id] * (B - 1) for a in anchors], dtype=mx.int32)
    h = first.assistant.batch(first.target.embed_raw(ids), [d.ctx for d in drafters], positions,
                              [d.cache for d in drafters])
    for d in drafters:
        d.ctx = None  # consumed: its K/V now live in the drafter's cache
    return [h[r, 1:] for r in range(len(drafters))]


def propose_batch(drafters: list["DFlashDrafter"], anchors: list[int], positions: list[int], ks: list[int], samplers,
                  histories) -> list[tuple]:
    """Several rows' `propose` (`batches_with` each other), their blocks in one drafter forward
    (`draft_hidden_batch`) and, for DFlash v1, their draft logits in one lm_head call; each row draws its drafts with
    its own sampler and history, as alone. Returns each row's (drafts, q)."""
    hs = draft_hidden_batch(drafters, anchors, positions)
    if type(drafters[0]) is not DFlashDrafter:  # DFlash 2: each row's selector walk from its block
        return [d.propose_hidden(h, k, s, hist) for d, h, k, s, hist in zip(drafters, hs, ks, samplers, histories)]
    z = drafters[0].logits(mx.stack([h[: max(ks)] for h in hs]))
    return [draft_tokens(z[r, :k], s, hist) for r, (k, s, hist) in enumerate(zip(ks, samplers, histories))]


def grow_tree(anchor: int, chain: list[int], chain_lp: list[float], depth: int, budget: int, children) -> TokenTree:
    """The chain (its first min(len, budget, depth) drafts; chain_lp[j]: draft j's log-probability given its parent),
    then best first by cumulative log-probability (the sum along the path) the frontier's nodes until `budget` draft
    nodes, at most `depth` deep. children(d, token): the candidates [(token, log-prob), …], best first, that may
    follow a node of depth d holding `token` (row d of the block). Every kept node's parent is kept (a child is only
    offered once its parent is in the tree, and never scores above it); the chain's nodes come first (indices
    1..n), so each is its parent's first child; a chain node's other children skip the chain's token."""
    n = max(0, min(len(chain), budget, depth))
    tokens, parents, depths, scores = [int(anchor)] + [int(t) for t in chain[:n]], list(range(-1, n)), \
        list(range(n + 1)), [0.0]
    for x in chain_lp[:n]:
        scores.append(scores[-1] + float(x))
    lists: dict[int, list] = {}
    skip: dict[int, int | None] = {i: (tokens[i + 1] if i < n else None) for i in range(n + 1)}
    heap: list = []
    order = itertools.count()  # ties: offered first, kept first

    def offer(node: int, r: int) -> None:
        cl = lists[node]
        while r < len(cl) and cl[r][0] == skip[node]:
            r += 1
        if r < len(cl) and cl[r][1] > -float("inf"):
            heapq.heappush(heap, (-(scores[node] + cl[r][1]), next(order), node, r))

    def open_node(node: int) -> None:
        if depths[node] < depth:
            lists[node] = children(depths[node], tokens[node])
            offer(node, 0)

    for i in range(n + 1):
        open_node(i)
    while len(tokens) - 1 < budget and heap:
        _, _, par, r = heapq.heappop(heap)
        token, lp = lists[par][r]
        i = len(tokens)
        tokens.append(int(token))
        parents.append(par)
        depths.append(depths[par] + 1)
        scores.append(scores[par] + float(lp))
        skip[i] = None
        offer(par, r + 1)  # the parent's next candidate
        open_node(i)
    return TokenTree(tokens, parents)


def tree_q(tree: TokenTree, q, n_chain: int):
    """The q rows `verify.verify_tree_sampling` takes for a `grow_tree` tree: the chain's nodes 1..n_chain their
    sampled rows, every other node None (a deterministic candidate); None at greedy (q None)."""
    if q is None:
        return None
    return [None] + [q[j] for j in range(n_chain)] + [None] * (len(tree) - 1 - n_chain)


class RankCalibration:
    """Online rank statistics of a drafter's trees (module docstring): for a node of depth d (0 = the root) that
    the target accepted, tried[d][r] counts the times its rank-r candidate was there to be compared with the
    target's next token and no earlier rank matched, hit[d][r] the times it matched. c[d][r] = (hit + w·prior) /
    (tried + w) (prior CAL_PRIOR, weight CAL_WEIGHT) and P̂(rank r accepted | node accepted) = c_r · Π_{j<r}
    (1 − c_j)."""

    def __init__(self, depth: int, top_k: int):
        self.tried = np.zeros((max(1, depth), max(1, top_k)))
        self.hit = np.zeros_like(self.tried)

    def conditional(self) -> np.ndarray:
        prior = np.full(self.tried.shape[1], CAL_PRIOR[1])
        prior[0] = CAL_PRIOR[0]
        return (self.hit + CAL_WEIGHT * prior) / (self.tried + CAL_WEIGHT)

    def slot_logp(self) -> np.ndarray:
        """[depth, top_k] log P̂(rank r accepted | a node of depth d accepted)."""
        c = np.clip(self.conditional(), 1e-6, 1 - 1e-6)
        miss = np.concatenate([np.zeros((c.shape[0], 1)), np.cumsum(np.log1p(-c), axis=1)[:, :-1]], axis=1)
        return np.log(c) + miss

    def observe(self, tree: TokenTree, lists: dict, committed: list[int], drawn: int = 0) -> None:
        """Count one verified tree: lists[n] node n's whole candidate list in rank order (ranks < `drawn` were
        drawn from q, the others are deterministic); committed = the accepted path's tokens + the token after it.
        A deterministic rank r (greedy; a point mass at T > 0, accepted with exactly its residual target probability
        and removed from the residual when rejected) is counted whether or not it was in the tree: the committed
        token is rank r exactly when rank r was (or would have been) accepted. A drawn rank counts only when it was
        in the tree, and matches only an accepted token, never the last one (a residual's or the bonus row's)."""
        node = 0
        K = self.tried.shape[1]
        for j, tok in enumerate(committed):
            d, cl = tree.depths[node], lists.get(node)
            if not cl or d >= self.tried.shape[0] or (drawn and not tree.children[node]):
                return
            last, kept = j == len(committed) - 1, len(tree.children[node])
            r = next((a for a, t in enumerate(cl) if t == tok), None)
            if r is not None and r < drawn and last:
                r = None  # a drawn child equal to the residual's token was rejected, not accepted
            for a in range(min(len(cl) if r is None else r + 1, K)):
                if a >= drawn or a < kept:
                    self.tried[d, a] += 1
            if r is None or r >= K:
                return
            self.hit[d, r] += 1
            node = next((c for c in tree.children[node] if tree.tokens[c] == tok), None)
            if node is None or last:
                return


def grow_slots(anchor: int, depth: int, budget: int, children, slot_logp: np.ndarray, blend: float,
               drawn: int = 0):
    """Best first from the root by cumulative slot score until `budget` draft nodes, at most `depth` deep. Slot
    (node n of depth d, rank r) scores score(n) + inc with inc = blend · log P̂ + (1 − blend) · (the candidate's
    log-probability), log P̂ = slot_logp[d][r]; for ranks r < drawn (tokens drawn from q) inc = log P̂ alone: whether
    a drawn token's slot is kept must not depend on the token (module docstring).
    children(node, d, token): node's candidates [(token, log-prob)] in rank order, asked once, when the node is
    kept. inc <= 0, so a node never scores above its parent and is offered only once its parent is kept; a node's
    rank r is offered once its rank r − 1 is kept. Returns (tree, {node: its candidate list})."""
    tokens, parents, depths, scores = [int(anchor)], [-1], [0], [0.0]
    lists: dict[int, list] = {}
    heap: list = []
    order = itertools.count()  # ties: offered first, kept first
    K = slot_logp.shape[1]

    def offer(node: int, r: int) -> None:
        cl, d = lists[node], min(depths[node], slot_logp.shape[0] - 1)
        if r < min(len(cl), K) and cl[r][1] > -float("inf"):
            inc = float(slot_logp[d, r]) if r < drawn else \
                blend * float(slot_logp[d, r]) + (1.0 - blend) * float(cl[r][1])
            heapq.heappush(heap, (-(scores[node] + inc), next(order), node, r, inc))

    def open_node(node: int) -> None:
        if depths[node] < depth:
            lists[node] = children(node, depths[node], tokens[node])
            offer(node, 0)

    open_node(0)
    while len(tokens) - 1 < budget and heap:
        _, _, par, r, inc = heapq.heappop(heap)
        i = len(tokens)
        tokens.append(int(lists[par][r][0]))
        parents.append(par)
        depths.append(depths[par] + 1)
        scores.append(scores[par] + inc)
        offer(par, r + 1)
        open_node(i)
    return TokenTree(tokens, parents), lists


def tree_rng(sampler) -> np.random.Generator:
    """A host generator seeded from the request's sampler (one key per round)."""
    return np.random.default_rng([int(x) for x in np.asarray(sampler.next_key()).reshape(-1)])


def sampled_children(lq: np.ndarray, toks: np.ndarray | None, top: np.ndarray, n: int,
                     rng: np.random.Generator) -> list:
    """A node's candidates at T > 0: one token drawn from its q row (log-probabilities lq, float64; toks[a] the
    token of entry a, None: a itself), then the n − 1 likeliest others (`top`: entries by decreasing lq, at least
    n of them) as point masses: [(token, log-prob)], the drawn one first. The draw is `verify.sample_row`'s inverse
    CDF at a fresh uniform: never a token of zero probability."""
    p = np.exp(lq - lq.max())
    a = sample_row(p / p.sum(), float(rng.random()))
    rest = [b for b in top if b != a and np.isfinite(lq[b]) and lq[b] > -1e30][: n - 1]
    name = (lambda b: int(b)) if toks is None else (lambda b: int(toks[b]))
    return [(name(a), float(lq[a]))] + [(name(b), float(lq[b])) for b in rest]


def check_fit(cfg: AssistantConfig, target, where) -> None:
    t = target.args
    problems = []
    if cfg.hidden_size != t.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {t.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {t.num_hidden_layers} layers")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary ({t.vocab_size})")
    if problems:
        raise CheckpointError(f"{where}: drafter does not fit the target: " + "; ".join(problems))


def load_dflash(path: Path, raw: dict, target, *, dtype=None, draft_logits: str = "target") -> DFlashDrafter:
    """The DFlash assistant in folder `path` (config.json already read: `raw`; `model_type: muse_glimmer_assistant`,
    weights with or without a `model.` prefix), bound to `target`. dtype None = the target's."""
    try:
        cfg = AssistantConfig.from_dict(raw, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_fit(cfg, target, path)
    assistant = Assistant(cfg)
    load_module(assistant, Assistant.sanitize(load_weights(path)), path, raw, target, dtype)
    return finish_loading(DFlashDrafter(assistant, target, draft_logits), path)


def load_module(module, weights: dict, path, raw: dict, target, dtype=None) -> None:
    """A drafter module's weights from its checkpoint (quantized like `glimmer convert -q` wrote them, when its
    config says so), checked name by name and shape by shape, cast to `dtype` (None: the target's), evaluated."""
    if isinstance(raw.get("quantization"), dict):  # converted by `glimmer convert -q` (mlx-lm layout)
        quantize_like(module, raw["quantization"], weights)
    check_weights(module, weights, path, raw.get("quantization"), kind="drafter ", names_hint=None)
    dt = parse_dtype(dtype) or target.model.norm.weight.dtype
    module.load_weights([(k, v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v)
                         for k, v in weights.items()], strict=True)
    mx.eval(module.parameters())
    module.eval()


def finish_loading(drafter: DFlashDrafter, path) -> DFlashDrafter:
    drafter.source = str(path)
    drafter.measured_tau = read_measured_tau(path, "dflash")  # τ measured when it was trained (auto's estimate)
    return drafter
