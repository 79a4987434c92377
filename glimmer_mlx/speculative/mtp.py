"""MTP drafting: chain the MTP layers to propose k tokens per round, with per-depth KV caches that only ever hold
rows computed from committed tokens.

Depth d's row at position p combines the token at p with depth d−1's output at p−1 (depth −1 = the target's
final-normed hidden state) and predicts the token at p+1 — transformers' `MtpModel` chain. Each round, every depth
first processes the newly committed positions (those rows are final and stay cached), then depths 0..k−1 extend
the chain over the drafted tokens: depth d's row at T+d (T = the anchor's position… see `propose`) yields draft d+1.
Draft rows are rewound right away, so a rejected draft never leaves state behind and nothing needs recomputing.

Trees (`propose_tree`): the chain, plus at each depth the next most likely tokens of that depth's distribution as
extra leaves (siblings of the chain's node there), within a node budget, shallow depths first. The state only ever
holds committed rows, so any accepted path is committed as the chain's accepted prefix is. For lossless sampling
the chain's node at a depth was sampled from q (its q row) and the alternatives are chosen deterministically given
it (the most likely others), so each alternative's q is a point mass (verify.verify_tree_sampling).
"""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx

from ..prompt_cache import copy_cache
from ..cache import CacheRewindError, RowsCache
from ..config import ConfigError
from ..loading import CheckpointError, check_weights, load_weights, parse_dtype, quantize_like, read_json, resolve_path
from ..models.mtp import MTPHead, mtp_text_config
from ..sampling import apply_repetition_penalty, history_window
from .protocol import MeasuredTau, read_measured_tau
from .tree import TokenTree
from .verify import draft_tokens

MAX_ALTERNATIVES = 3  # extra leaves per depth in a tree

MAX_DEPTH = 16


class MTPDrafter:
    kind = "mtp"
    width_name = "MTP depth"

    def __init__(self, head: MTPHead, target, depth: int | None = None, draft_logits: str = "target"):
        if draft_logits not in ("raw", "target"):
            raise ValueError(f"draft_logits must be 'raw' or 'target', got {draft_logits!r}")
        self.head, self.target, self.draft_logits = head, target, draft_logits
        self.set_depth(depth or head.num_layers)
        self.taps = (target.args.num_hidden_layers - 1,)  # the final-normed hidden state
        self.measured_tau: MeasuredTau | None = None  # from the folder's eval.json
        self.caches = None  # per-depth KV caches (None before `start`)
        self.main = None
        self.source: str | None = None  # where the layers were loaded from (`load_mtp`)

    @property
    def main(self) -> mx.array | None:
        """Target hidden rows not yet consumed by depth 0 (positions main_pos..), or None — joined when read: `accept`
        only adds each round's rows to `_main` (a batch row that follows plain steps spends no MLX op a step on them)."""
        if len(self._main) > 1:
            self._main = (mx.concatenate(list(self._main), axis=1),)
        return self._main[0] if self._main else None

    @main.setter
    def main(self, value: mx.array | None) -> None:
        self._main = () if value is None else (value,)

    @property
    def max_drafts(self) -> int:
        return self.depth

    def set_depth(self, depth: int) -> None:
        """Chain depth = drafts per round; depths past the trained layers reuse the last layer recursively."""
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"MTP depth must be 'auto' or an int in [1, {MAX_DEPTH}], got {depth!r}")
        self.depth = depth

    def logits(self, h: mx.array) -> mx.array:
        if self.draft_logits == "raw":
            return self.target.lm_head_raw(h).astype(mx.float32)
        return self.target.logits(h)

    def fork(self) -> "MTPDrafter":
        """The same drafter (shared weights, this depth) with its own, empty state (a batch row's)."""
        d = copy.copy(self)
        d.caches = d.main = None
        return d

    def copy_state(self) -> "MTPDrafter":
        """The same drafter with an independent copy of its current state (a prompt-cache entry's, handed to the
        row that continues it while the entry keeps its own)."""
        d = copy.copy(self)
        if self.caches is not None:
            d.caches = copy_cache(self.caches)  # (each depth copied at its own position)
            d.saved, d.tokens = list(self.saved), list(self.tokens)
        return d  # main (its pieces: a tuple of arrays, never written in place) is shared

    def state_nbytes(self) -> int:
        """Bytes of its state (per-depth K/V, saved outputs, target rows not consumed yet): what a prompt-cache
        entry keeping it holds beyond the target's cache."""
        if self.caches is None:
            return 0
        return (sum(c.nbytes for c in self.caches) + sum(s.nbytes for s in self.saved if s is not None)
                + (0 if self.main is None else self.main.nbytes))

    @property
    def backlog(self) -> int:
        """Committed positions depth 0 has not run on yet (what its next round catches up on)."""
        return len(self.tokens) - self.caches[0].offset if self.caches else 0

    # -- the drafter protocol (speculative.protocol.Drafter) -----------------------------------------------------
    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        self.caches = self.head.make_cache(self.depth)
        self.saved: list[mx.array | None] = [None] * self.depth  # depth d's output at its last committed row
        self.tokens = list(ids)  # every committed token so far (position = index)
        self.main = taps[0]  # target hidden rows not yet consumed by depth 0, positions main_pos..
        self.main_pos = 0

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        self._main = self._main + (taps[0],)  # joined when `main` is read
        self.tokens += new_tokens

    # -- prompt-cache reuse (session.Session): continue the state on a new prompt instead of restarting -------------
    def context_length(self) -> int:
        """Target positions the state covers: every committed token but the last (the anchor)."""
        return len(self.tokens) - 1 if self.caches is not None else 0

    def rewind_context(self, keep: int) -> int:
        """Forget everything computed from tokens at positions >= `keep`. Returns the position p <= keep from which
        the target's final hidden rows must be handed over again with `extend` (the target cache must then hold
        exactly positions < p).

        Depth d's rows at positions < keep stay valid, but only its *last* output is kept (`saved`), and depth d's
        next row at position r needs depth d−1's output at r−1. So a depth whose cache is cut loses its saved output
        and must restart at least one row after the depth below: the kept lengths form a staircase, and depth 0's
        first recomputed row needs the target's hidden state one position earlier (p). Checks every cache before
        changing anything; raises `CacheRewindError` when one cannot go back that far."""
        if self.caches is None or len(self.caches) != self.depth:
            raise CacheRewindError("the MTP drafter has no state for its current depth to rewind")
        keep = max(0, min(keep, self.context_length()))
        D = self.depth
        R = [max(min(c.offset, keep), c.origin) for c in self.caches]
        cut = [R[d] < self.caches[d].offset for d in range(D)]
        for d in range(D - 1, 0, -1):  # staircase: depth d−1 must end before depth d's first new row's input
            if R[d - 1] > (R[d] - 1 if cut[d - 1] else R[d]):
                R[d - 1], cut[d - 1] = R[d] - 1, True
        need = R[0] - 1  # depth 0's next row at R[0] reads the target's hidden state at R[0] − 1 (need < keep)
        for d, c in enumerate(self.caches):
            c.check_rewind(c.offset - R[d])
        for d, c in enumerate(self.caches):
            c.rewind(c.offset - R[d])
            if cut[d]:
                self.saved[d] = None
        if self.main is not None and self.main_pos <= need:  # the hidden rows from `need` on are still here
            self.main = self.main[:, need - self.main_pos : keep - self.main_pos]
            self.main_pos, p = need, keep
        else:  # they were consumed: the target recomputes them
            self.main, self.main_pos, p = None, need, need
        self.tokens = self.tokens[: p + 1]  # context_length() == p until `extend`
        return p

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        """Continue after `rewind_context`: `taps` = the target's final hidden rows from the rewind point to the new
        prompt's end; `ids` = the whole new prompt + its first generated token."""
        if self.caches is None:
            raise RuntimeError("MTP drafter: extend() before start()")
        have = self.main_pos + (0 if self.main is None else self.main.shape[1])
        if have + taps[0].shape[1] != len(ids) - 1:
            raise RuntimeError(f"MTP drafter out of sync: its hidden rows reach position {have}, {taps[0].shape[1]} "
                               f"new rows do not reach the prompt end ({len(ids) - 1})")
        self._main = self._main + (taps[0],)
        self.tokens = list(ids)

    def parts(self) -> tuple:
        return (self,)

    def stats(self) -> dict:
        return {}

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        """Drafts for positions T+1..T+k, the anchor (last committed token) being at T = `pos`."""
        drafts, q_rows, _ = self.draft_chain(anchor, pos, k, sampler, history)
        return drafts, (mx.concatenate(q_rows) if q_rows else None)

    def enable_trees(self) -> None:
        """Nothing to keep: trees come from the chain's own distributions."""

    def propose_tree(self, anchor: int, pos: int, depth: int, budget: int, sampler, history: list[int]):
        """The chain of up to `depth` drafts (fewer when the budget is smaller), and with the rest of `budget` the
        next most likely tokens at each depth as leaves beside the chain's node (at most MAX_ALTERNATIVES per
        depth, shallow depths first). Returns (tree, q): q[c] the q row node c was sampled from (chain nodes at
        T > 0), None for a deterministic node (a point mass); q None at greedy."""
        depth = min(depth, budget)
        drafts, q_rows, logit_rows = self.draft_chain(anchor, pos, depth, sampler, history)
        k = len(drafts)
        params = sampler.params
        ranked = []  # per depth: the other tokens, most likely first
        for d in range(k):
            if params.greedy:
                x = apply_repetition_penalty(logit_rows[d].astype(mx.float32),
                                             history_window(params, history + drafts[:d]), params.repetition_penalty)
            else:
                x = q_rows[d]
            order = mx.argsort(-x[0])[:MAX_ALTERNATIVES + 1].tolist()
            vals = x[0][mx.array(order, dtype=mx.int32)].tolist()
            ranked.append([t for t, v in zip(order, vals) if t != drafts[d] and v > -float("inf")][:MAX_ALTERNATIVES])
        tokens, parents = [anchor] + drafts, list(range(-1, k))
        left = budget - k
        for r in range(MAX_ALTERNATIVES):
            for d in range(k):
                if left > 0 and r < len(ranked[d]):
                    tokens.append(ranked[d][r])
                    parents.append(d)  # the chain's node at depth d (the root for d = 0)
                    left -= 1
        tree = TokenTree(tokens, parents)
        if params.greedy:
            return tree, None
        return tree, [None] + list(q_rows) + [None] * (len(tree) - 1 - k)

    def draft_chain(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        """(drafts, their q rows [1, V] each (none at greedy), the raw draft logits [1, V] at each depth)."""
        chain = ChainRound(self, anchor, pos, k)
        for d in range(self.depth):
            step = chain.inputs(d)
            out = None
            if step is not None:
                toks, h_in = step
                out = self.head.forward_depth(d, self.target.embed_raw(mx.array([toks], dtype=mx.int32)), h_in,
                                              self.caches[d])
            chain.finish(d, out, sampler, history)
        return chain.result()


class ChainRound:
    """One round of an MTP drafter's chain, depth by depth (`MTPDrafter.draft_chain`; `propose_batch` runs several
    rows' rounds with one forward per depth): `inputs(d)` says what depth d runs on (its committed rows not yet
    cached, then the drafted tokens), `finish(d, out, …)` takes its output, rewinds the draft rows and draws the
    next draft."""

    def __init__(self, drafter: MTPDrafter, anchor: int, pos: int, k: int):
        if drafter.tokens[-1] != anchor or len(drafter.tokens) != pos + 1:
            raise RuntimeError("MTP drafter out of sync with the target (tokens and positions disagree)")
        self.drafter, self.T, self.k = drafter, pos, k
        # depth −1: target hidden rows from position main_pos
        self.prev, self.prev_start = drafter.main, drafter.main_pos
        self.drafts, self.q_rows, self.logit_rows = [], [], []

    def inputs(self, d: int):
        """(tokens, depth d−1's outputs [1, n, D] at the positions before them) that depth d runs on, or None."""
        first = self.drafter.caches[d].offset  # committed rows first..T, then n_draft rows over d_1..d_n_draft
        n_draft = d if d < self.k else 0
        skip = max(0, first - self.T - 1)  # a short prompt: this depth's first row lies beyond the anchor
        toks = self.drafter.tokens[first:] + self.drafts[skip:n_draft]
        self.first, self.n_tok = first, len(toks)
        self.n_draft = max(0, n_draft - skip)  # draft rows actually computed (rewound right after)
        if not toks:
            return None
        lo = first - 1 - self.prev_start
        return toks, self.prev[:, lo : lo + len(toks)]

    def drafts_at(self, d: int, out: mx.array | None) -> bool:
        """Whether depth d draws a draft from its output `out`."""
        return out is not None and d < self.k

    def finish(self, d: int, out: mx.array | None, sampler, history: list[int], z: mx.array | None = None) -> None:
        """Depth d's output rows [1, n, D] (None: it had nothing to run on); z: the draft logits of its last row,
        when already computed (`propose_batch`: every row's in one call)."""
        drafter, first, n_draft, n_tok = self.drafter, self.first, self.n_draft, self.n_tok
        if out is not None and n_draft:
            drafter.caches[d].rewind(n_draft)
        old_saved, old_start = drafter.saved[d], first - 1
        if out is not None and n_tok > n_draft:  # depth d's last committed row (position T), for next round
            drafter.saved[d] = out[:, n_tok - n_draft - 1 : n_tok - n_draft]
        if d < self.k and out is None:
            self.k = d  # nothing to draft from at this depth yet (prompt shorter than the chain)
        if d < self.k:
            z = drafter.logits(out[0, -1:]) if z is None else z
            self.logit_rows.append(z)
            dt, q = draft_tokens(z, sampler, history + self.drafts)
            self.drafts.append(dt[0])
            if q is not None:
                self.q_rows.append(q)
        # depth d's outputs by position, for depth d+1: its old last committed row, then this round's rows
        if out is None:
            self.prev, self.prev_start = old_saved, old_start
        elif old_saved is not None:
            self.prev, self.prev_start = mx.concatenate([old_saved, out], axis=1), old_start
        else:
            self.prev, self.prev_start = out, first

    def result(self):
        self.drafter.main, self.drafter.main_pos = None, self.T  # consumed; the next accept brings rows from T on
        return self.drafts, self.q_rows, self.logit_rows


BATCH_BACKLOG = 16  # a row whose depth 0 is further behind (it just joined: its prompt) drafts on its own


def batches_with(a, b) -> bool:
    """Whether two MTP drafters' rounds can share their forwards (`propose_batch`): the same layers at the same
    depth (forks of one drafter: batch rows), each with its own started state, neither catching up on more than
    `BATCH_BACKLOG` positions (the batch's inputs are padded to the longest: a row that just joined, with its whole
    prompt to run through depth 0, would make every row pay for it)."""
    return (isinstance(a, MTPDrafter) and isinstance(b, MTPDrafter) and a.head is b.head and a.target is b.target
            and a.depth == b.depth and a.caches is not None and b.caches is not None
            and max(a.backlog, b.backlog) <= BATCH_BACKLOG)


def propose_batch(drafters: list[MTPDrafter], anchors: list[int], positions: list[int], ks: list[int], samplers,
                  histories) -> list[tuple]:
    """Several rows' `propose` (each with its own state, sampler and history) with one MTP-layer forward per depth
    for all of them: the rows' inputs right-padded to the longest, each row's keys into its own per-depth cache
    (`cache.RowsCache`). Returns each row's (drafts, q), as its own `propose` gives them."""
    first = drafters[0]
    chains = [ChainRound(dr, a, p, k) for dr, a, p, k in zip(drafters, anchors, positions, ks)]
    for d in range(first.depth):
        steps = [c.inputs(d) for c in chains]
        active = [i for i, st in enumerate(steps) if st is not None]
        outs = [None] * len(chains)
        if active:
            L = max(len(steps[i][0]) for i in active)
            ids = mx.array([steps[i][0] + [0] * (L - len(steps[i][0])) for i in active], dtype=mx.int32)
            h = mx.concatenate([mx.pad(steps[i][1], [(0, 0), (0, L - steps[i][1].shape[1]), (0, 0)])
                                if steps[i][1].shape[1] < L else steps[i][1] for i in active], axis=0)
            cache = RowsCache([drafters[i].caches[d] for i in active], [len(steps[i][0]) for i in active])
            out = first.head.forward_depth(d, first.target.embed_raw(ids), h, cache)
            for j, i in enumerate(active):
                outs[i] = out[j : j + 1, : len(steps[i][0])]
        drawing = [i for i, (c, o) in enumerate(zip(chains, outs)) if c.drafts_at(d, o)]
        zs = [None] * len(chains)
        if drawing:  # every drafting row's logits in one lm_head call
            z = first.logits(mx.concatenate([outs[i][0, -1:] for i in drawing]))
            for j, i in enumerate(drawing):
                zs[i] = z[j : j + 1]
        for c, o, smp, hist, zz in zip(chains, outs, samplers, histories, zs):
            c.finish(d, o, smp, hist, zz)
    res = []
    for c in chains:
        drafts, q_rows, _ = c.result()
        res.append((drafts, mx.concatenate(q_rows) if q_rows else None))
    return res


def load_mtp(path_or_repo, target, *, depth=None, dtype=None, draft_logits: str = "target") -> MTPDrafter:
    """MTP layers from the target's own checkpoint (`mtp.*`) or from a separate folder holding `mtp.*` weights and a
    config with `num_mtp_layers` / `mtp_layer_types`."""
    own = getattr(target, "path", None)
    if path_or_repo is None or (own is not None and Path(str(path_or_repo)).resolve() == Path(own).resolve()):
        weights, raw, where = dict(target.mtp_weights.weights), target.config.raw, getattr(target, "path", "target")
        folder = None  # part of the target's checkpoint: no eval.json of its own
    else:
        folder = where = Path(resolve_path(path_or_repo))
        raw = read_json(folder / "config.json")
        weights = {k: v for k, v in load_weights(folder).items() if k.startswith(("mtp.", "model.mtp."))}
    raw_text = raw.get("text_config", raw)
    try:
        cfg, opts = mtp_text_config(target.args, raw_text, where=str(where))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if cfg.hidden_size != raw_text.get("hidden_size", cfg.hidden_size):
        raise CheckpointError(f"{where}: MTP hidden_size {raw_text.get('hidden_size')} != target hidden_size "
                              f"{cfg.hidden_size}")
    head = MTPHead(cfg, opts)
    weights = MTPHead.sanitize(weights)
    if isinstance(raw.get("quantization"), dict):  # converted by `glimmer convert -q` (mlx-lm layout)
        quantize_like(head, raw["quantization"], weights, prefix="mtp.")
    check_weights(head, weights, where, raw.get("quantization"), kind="MTP ", prefix="mtp.", names_hint=None)
    dt = parse_dtype(dtype) or target.model.norm.weight.dtype
    head.load_weights([(k, v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v)
                       for k, v in weights.items()], strict=True)
    mx.eval(head.parameters())
    head.eval()
    d = MTPDrafter(head, target, depth, draft_logits)
    d.source = str(where) if folder is not None else f"{where} (own MTP layers)"
    if folder is not None:  # a folder of its own: τ measured when it was trained
        d.measured_tau = read_measured_tau(folder, "mtp")
    return d
