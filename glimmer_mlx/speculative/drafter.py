"""Loading a DFlash drafter next to its target and checking that the two fit."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..config import ConfigError
from ..loading import CheckpointError, load_weights, parse_dtype, read_json, resolve_path
from ..models.assistant import Assistant, AssistantConfig

DRAFT_LOGITS = ("raw", "target")


class DFlashDrafter:
    """A DFlash assistant bound to its target: proposes blocks, never accepts them.

    draft_logits: "target" (default) — the target's multiplier + softcap, so q lives on the same scale as p;
    "raw" — the bare `lm_head`, as transformers does. Greedy output is the same either way (monotone transform);
    at temperature 1 "target" measured τ 2.24 vs 1.13 for "raw" on our trained tiny pair (BENCHMARKS.md).
    """

    kind = "dflash"

    def __init__(self, assistant: Assistant, target, draft_logits: str = "target"):
        if draft_logits not in DRAFT_LOGITS:
            raise ValueError(f"draft_logits must be one of {DRAFT_LOGITS}, got {draft_logits!r}")
        self.assistant, self.target, self.draft_logits = assistant, target, draft_logits
        self.config = assistant.config
        self.block_size = self.config.block_size
        self.taps = tuple(self.config.target_layer_ids)

    def make_cache(self):
        return self.assistant.make_cache()

    def draft_hidden(self, anchor: int, ctx_taps: mx.array, pos: int, cache, block: int | None = None) -> mx.array:
        """Final hidden states of the block [anchor, mask × (block−1)] at positions pos.. → [block−1, D] (rows 1..)."""
        B = block or self.block_size
        ids = mx.array([[anchor] + [self.config.mask_token_id] * (B - 1)], dtype=mx.int32)
        noise = self.target.embed_raw(ids)
        return self.assistant(noise, ctx_taps, pos, cache)[0, 1:]

    def logits(self, h: mx.array) -> mx.array:
        if self.draft_logits == "raw":
            return self.target.lm_head_raw(h).astype(mx.float32)
        return self.target.logits(h)


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


def load_drafter(path_or_repo, target, *, dtype=None, draft_logits: str = "target") -> DFlashDrafter:
    """Load a `muse_glimmer_assistant` checkpoint for `target` (weights with or without a `model.` prefix).

    dtype: None = the target's dtype."""
    path = Path(resolve_path(path_or_repo))
    try:
        cfg = AssistantConfig.from_dict(read_json(path / "config.json"), where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_fit(cfg, target, path)
    weights = Assistant.sanitize(load_weights(path))
    assistant = Assistant(cfg)
    expected = dict(tree_flatten(assistant.parameters()))
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing:
        raise CheckpointError(f"{path}: drafter checkpoint is missing tensor(s) {missing[:8]}")
    if extra:
        raise CheckpointError(f"{path}: drafter checkpoint has unexpected tensor(s) {extra[:8]}")
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{path}: drafter tensor '{k}' has shape {tuple(weights[k].shape)}, "
                                  f"expected {tuple(v.shape)} from config.json")
    dt = parse_dtype(dtype) or target.model.embed_tokens.weight.dtype
    if not mx.issubdtype(dt, mx.floating):
        dt = mx.float32 if target.model.norm.weight.dtype == mx.float32 else target.model.norm.weight.dtype
    assistant.load_weights([(k, v.astype(dt)) for k, v in weights.items()], strict=True)
    mx.eval(assistant.parameters())
    assistant.eval()
    return DFlashDrafter(assistant, target, draft_logits)
