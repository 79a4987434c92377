"""A drafter checkpoint → the drafter it holds: a DFlash assistant (v1 or DFlash 2) or MTP layers, told apart by their
config."""

from __future__ import annotations

from pathlib import Path

from ..loading import CheckpointError, read_json, resolve_path
from ..models.dflash2 import is_dflash2_config
from .dflash import DFlashDrafter, load_dflash
from .dflash2 import load_dflash2
from .mtp import MTPDrafter, load_mtp


def load_drafter(path_or_repo, target, *, dtype=None, draft_logits: str = "target",
                 depth=None) -> DFlashDrafter | MTPDrafter:
    """A drafter for `target`: a DFlash assistant (`model_type: muse_glimmer_assistant`, weights with or without a
    `model.` prefix), a DFlash 2 drafter (`architectures: ["DFlash2DraftModel"]` or the selector fields in its
    `dflash_config`: a `dflash2.DFlash2Drafter`, also kind "dflash") or MTP layers (a checkpoint whose config has `num_mtp_layers` and whose weights hold `mtp.*`;
    the target's own folder included). dtype None = the target's; depth: MTP chain depth (None = trained layers)."""
    path = Path(resolve_path(path_or_repo))
    raw = read_json(path / "config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / 'config.json'}: expected a JSON object")
    text = raw.get("text_config", raw)
    text = text if isinstance(text, dict) else {}
    kind = raw.get("model_type")
    if is_dflash2_config(raw):
        return load_dflash2(path, raw, target, dtype=dtype, draft_logits=draft_logits)
    if kind != "muse_glimmer_assistant" and (text.get("num_mtp_layers") or text.get("num_nextn_predict_layers")):
        return load_mtp(path, target, depth=depth, dtype=dtype, draft_logits=draft_logits)
    if str(kind or "").startswith("muse_glimmer") and kind != "muse_glimmer_assistant":
        raise CheckpointError(f"{path}: a target checkpoint without MTP layers (no num_mtp_layers in its config) "
                              "cannot serve as a drafter")
    return load_dflash(path, raw, target, dtype=dtype, draft_logits=draft_logits)
