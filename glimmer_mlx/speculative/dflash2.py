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
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..config import ConfigError
from ..loading import CheckpointError, load_weights
from ..models.dflash2 import DFlash2, DFlash2Config
from ..sampling import NEG_INF, greedy_token, history_window, process
from .dflash import DFlashDrafter, check_fit, finish_loading, load_module


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 drafter bound to its target. Serves `--mode dflash` (kind "dflash"); labelled "dflash2".

    Its draft logits are always the checkpoint's (`output_multiplier`, `final_logit_softcapping` of its config):
    the selector was trained on those as its unary scores, so `draft_logits` does not apply."""

    variant = "dflash2"

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        return self.select(anchor, h[:k], sampler, history)

    def logits(self, h: mx.array) -> mx.array:
        return self.assistant.draft_logits(self.target.lm_head_raw(h))

    def select(self, anchor: int, h: mx.array, sampler, history: list[int]):
        """The selector's path through the top-k candidates of the k rows h [k, D] after `anchor`:
        (drafts, q [k, V] processed log-probs with −inf outside each row's candidates; None at greedy)."""
        sel = self.assistant.candidate_selector
        params = sampler.params
        logits = self.logits(h)
        V = logits.shape[-1]
        cand, unary = sel.candidates(logits)
        hp, succ = sel.project(h), sel.successors(cand)
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
