"""The DFlash 2 drafter: v1's block drafter (`dflash.DFlashDrafter`: one parallel forward per round, the same context
cache, rewind and extend) whose drafts come from the pairwise path selector instead of independent per-position
argmaxes / samples.

Per round: the block's final hidden states h_1..h_k and draft logits (the checkpoint's own multiplier + softcap);
per position the selector's top-k candidates; then left to right from the anchor, the scores S_j(d_{j−1}, ·) of
`models.dflash2.CandidateSelector` on those candidates (−inf elsewhere) go through the request's own processing
(`sampling.process`: repetition penalty over history + earlier drafts, temperature, top-k / top-p / min-p), and
d_j is their argmax (greedy) or a sample. At T > 0 the processed row j is returned as q_j: exactly the distribution
d_j was drawn from given d_{j−1}, which is all lossless rejection sampling needs (a rejected d_j ends the round, so
later rows are only ever read after their predecessors were accepted).

Trees (`propose_tree`): the selector's structure fits a tree better than v1's: its score S_j(a, b) is a proper
first-order conditional over position j's top-k list given the predecessor a, so every node (not only the chain's)
gets its own children's distribution — the softmax of S_{d+1}(its token, ·) over the next position's candidates —
from one batched table of the pairwise scores (every candidate of position j as the predecessor of every candidate
of position j+1, the anchor before position 1). How the tree is grown is v1's (`dflash` module docstring,
`tree_scoring`): "calibrated" — best first by the rank statistics blended with the selector's probability (greedy),
at T > 0 each node's first child drawn from the selector's processed row given the node's token, the likeliest
others point masses; "draft" — the chain (exactly `propose`'s path) plus the best other nodes by cumulative
selector probability (`dflash.grow_tree`), at T > 0 the chain's nodes carrying their q rows (sampled as in
`propose`), every other node a point mass. The approximation left is v1's: the block's hidden states h_j (hence
the candidate lists and unary scores) do not depend on the tokens before j. Scores that only shape the tree are the
selector's at temperature 1 without the request's processing (greedy) or the processed rows (T > 0, calibrated).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import ConfigError
from ..loading import CheckpointError, load_weights
from ..models.dflash2 import DFlash2, DFlash2Config
from ..sampling import NEG_INF, greedy_token, history_window, process
from .dflash import (DFlashDrafter, check_fit, finish_loading, grow_tree, load_module, sampled_children, tree_q,
                     tree_rng)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 drafter bound to its target. Serves `--mode dflash` (kind "dflash"); labelled "dflash2".

    Its draft logits are always the checkpoint's (`output_multiplier`, `final_logit_softcapping` of its config):
    the selector was trained on those as its unary scores, so `draft_logits` does not apply."""

    variant = "dflash2"
    default_tree_scoring = "draft"  # "calibrated" measured no better on the embedded head (BENCHMARKS.md)

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        return self.select(anchor, h[:k], sampler, history)

    def propose_hidden(self, h: mx.array, k: int, sampler, history: list[int]):
        return self.select(history[-1], h[:k], sampler, history)

    def logits(self, h: mx.array) -> mx.array:
        return self.assistant.draft_logits(self.target.lm_head_raw(h))

    def selector_parts(self, h: mx.array):
        """(V, cand [k, top_k], unary [k, top_k], hp [k, R], succ [k, top_k, R]) of the k rows h [k, D]."""
        sel = self.assistant.candidate_selector
        logits = self.logits(h)
        cand, unary = sel.candidates(logits)
        return logits.shape[-1], cand, unary, sel.project(h), sel.successors(cand)

    def select(self, anchor: int, h: mx.array, sampler, history: list[int], parts=None, tables=None):
        """The selector's path through the top-k candidates of the k rows h [k, D] after `anchor`:
        (drafts, q [k, V] processed log-probs with −inf outside each row's candidates; None at greedy).
        parts: `selector_parts(h)`, tables: `pair_tables` of them, when already computed."""
        sel = self.assistant.candidate_selector
        params = sampler.params
        V, cand, unary, hp, succ = parts if parts is not None else self.selector_parts(h)
        if params.greedy and params.repetition_penalty == 1.0 and h.shape[0]:
            s = tables if tables is not None else self.pair_tables(anchor, cand, unary, hp, succ)
            return self.greedy_walk(anchor, cand, s), None
        prev = mx.array([anchor], dtype=mx.int32)
        picks, rows = [], []
        for j in range(h.shape[0]):
            s = sel.scores(unary[j : j + 1], hp[j : j + 1], succ[j : j + 1], prev)  # [1, top_k]
            dense = mx.put_along_axis(mx.full((1, V), NEG_INF, dtype=mx.float32), cand[j : j + 1], s, axis=-1)
            hist = history_window(params, history, mx.concatenate(picks) if picks else None)
            if params.greedy:
                prev = greedy_token(dense, params, hist).astype(mx.int32)
            else:
                q = process(dense, params, hist)
                rows.append(q)
                prev = mx.random.categorical(q, axis=-1, key=sampler.next_key()).astype(mx.int32)
            picks.append(prev)
        if not picks:
            return [], None
        drafts = mx.concatenate(picks)
        q = mx.concatenate(rows) if rows else None
        mx.eval([drafts] + ([q] if q is not None else []))
        return drafts.tolist(), q

    def pair_tables(self, anchor: int, cand: mx.array, unary: mx.array, hp: mx.array, succ: mx.array) -> mx.array:
        """Every pairwise score of the block in one batched op: [1 + (k−1)·top_k, top_k] (fp32), row 0 the scores
        S_1(anchor, ·) of position 1's candidates, row 1 + (j−1)·top_k + a the scores S_{j+1}(cand[j−1][a], ·) of
        position j+1's candidates after position j's candidate a."""
        sel = self.assistant.candidate_selector
        tables = [sel.scores(unary[:1], hp[:1], succ[:1], mx.array([anchor], dtype=mx.int32))]  # [1, top_k]
        if cand.shape[0] > 1:  # [k−1, top_k (predecessor: position j's candidates), top_k (position j+1's)]
            pairs = sel.scores(unary[1:, None, :], hp[1:, None, :], succ[1:, None], cand[:-1])
            tables.append(pairs.reshape(-1, cand.shape[-1]))
        return mx.concatenate(tables)

    @staticmethod
    def greedy_walk(anchor: int, cand: mx.array, s: mx.array) -> list[int]:
        """The greedy path through `pair_tables`' scores s: at each position the best-scoring candidate after the
        previous pick (ties: the lowest token id, as an argmax over the dense vocabulary row picks). One read-back;
        the walk itself is k look-ups on the host. The same drafts as the dense walk of `select` without penalties."""
        mx.eval(s, cand)
        rows, cl = np.asarray(s), np.asarray(cand)
        top_k = cl.shape[1]
        out, r = [], 0
        for j in range(cl.shape[0]):
            row = rows[r]
            if np.isnan(row).any():  # (a broken checkpoint) the first NaN, as mx.argmax picks it
                a = int(np.flatnonzero(np.isnan(row))[0])
            else:
                best = row == row.max()
                a = int(np.flatnonzero(best)[np.argmin(cl[j][best])])
            out.append(int(cl[j][a]))
            r = 1 + j * top_k + a
        return out

    def propose_tree(self, anchor: int, pos: int, depth: int, budget: int, sampler, history: list[int]):
        """As v1's (`DFlashDrafter.propose_tree`), the children of every node scored by the selector given that
        node's token (module docstring). Returns (tree, q): q None at greedy; at T > 0 q[c] the q row node c's
        token was drawn from (None for a point mass)."""
        k = max(1, min(depth, budget, self.max_drafts))
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)[:k]
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        parts = self.selector_parts(h)
        _, cand, unary, hp, succ = parts
        s = self.pair_tables(anchor, cand, unary, hp, succ)
        params = sampler.params
        calibrated = self.calibrated_trees(k, budget, sampler)
        cl = np.asarray(cand)
        top_k = cl.shape[1]
        index = [{int(t): a for a, t in enumerate(row)} for row in cl]  # position j's candidate -> its index

        def row(d: int, token: int) -> int | None:
            """The table row of the children of a node of depth d holding `token` (None: not a candidate)."""
            if d == 0:
                return 0
            a = index[d - 1].get(token)
            return None if a is None else 1 + (d - 1) * top_k + a

        if calibrated and not params.greedy:  # a drawn first child per node, then point masses (module docstring)
            lq = process(s, params)
            mx.eval(lq)
            lqn = np.asarray(lq).astype(np.float64)
            order = np.argsort(-lqn, axis=-1, kind="stable")[:, : self.tree_top_k + 1]
            rng, rows, V = tree_rng(sampler), {}, self.target.args.vocab_size

            def sampled(node: int, d: int, token: int):
                r = row(d, token)
                if r is None or d >= cl.shape[0]:
                    return []
                dense = mx.put_along_axis(mx.full((V,), NEG_INF, dtype=mx.float32), cand[d], lq[r], axis=-1)
                rows[node] = dense
                return sampled_children(lqn[r], cl[d], order[r], self.tree_top_k, rng)

            return self.grow_calibrated(anchor, k, budget, sampled, rows, False)
        lp = s - mx.logsumexp(s, axis=-1, keepdims=True)
        order = mx.argsort(-lp, axis=-1)
        rows_pos = mx.array([0] + [j for j in range(1, k) for _ in range(cand.shape[-1])], dtype=mx.int32)
        toks = mx.take_along_axis(cand[rows_pos], order, axis=-1)
        vals = mx.take_along_axis(lp, order, axis=-1)
        mx.eval(toks, vals)
        toks, vals = toks.tolist(), vals.tolist()

        def children(d: int, token: int):
            r = row(d, token)
            return [] if r is None else list(zip(toks[r], vals[r]))

        if calibrated:
            return self.grow_calibrated(anchor, k, budget, lambda node, d, token: children(d, token), None, True)
        drafts, q = self.select(anchor, h, sampler, history, parts, s)
        chain_lp, prev = [], anchor
        for d, t in enumerate(drafts):
            r = row(d, prev)
            chain_lp.append(dict(zip(toks[r], vals[r])).get(t, -float("inf")) if r is not None else -float("inf"))
            prev = t
        tree = grow_tree(anchor, drafts, chain_lp, k, budget, children)
        return tree, tree_q(tree, q, len(drafts))

    def stats(self) -> dict:
        return {"drafter": self.variant}


def check_fit_v2(cfg: DFlash2Config, target, where) -> None:
    check_fit(cfg, target, where)
    if cfg.vocab_size != target.args.vocab_size:
        raise CheckpointError(f"{where}: drafter does not fit the target: vocab_size {cfg.vocab_size} != target "
                              f"vocab_size {target.args.vocab_size} (the selector's codebooks index the target's "
                              "vocabulary)")


def load_dflash2(path: Path, raw: dict, target, *, dtype=None, draft_logits: str = "target") -> DFlash2Drafter:
    """The DFlash 2 drafter in folder `path` (config.json already read: `raw`, `architectures:
    ["DFlash2DraftModel"]` / selector fields in `dflash_config`), bound to `target`. dtype None = the target's."""
    try:
        cfg = DFlash2Config.from_dict(raw, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_fit_v2(cfg, target, path)
    model = DFlash2(cfg)
    load_module(model, DFlash2.sanitize(load_weights(path)), path, raw, target, dtype)
    return finish_loading(DFlash2Drafter(model, target, draft_logits), path)
