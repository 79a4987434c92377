"""`glimmer train dflash` / `glimmer train dflash2` / `glimmer train mtp`: drafters trained against a frozen target,
MLX-native."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from ..files import write_atomic
from ..loading import load
from ..models.assistant import Assistant
from ..speculative import DFlashDrafter, MTPDrafter, load_drafter
from ..speculative.dflash2 import DFlash2Drafter
from .data import DataError, build_sequences, split
from .loop import TrainConfig
from .recipes import (SELECTOR_WEIGHT, acceptance, dflash2_from_v1, estimate, eval_prompts, new_assistant_config,
                      new_dflash2, new_dflash2_config, new_mtp_head, param_count, train_dflash, train_mtp)

__all__ = ["train", "TrainConfig", "DataError", "SELECTOR_WEIGHT"]


def train(kind: str, target_path, out, *, chats=None, texts=(), regenerate: bool = False, regen_max_tokens: int = 256,
          regen_temperature: float = 0.0, init=None, layers: int = 1, block_size: int = 16, target_layer_ids=None,
          mask_token_id=None, mtp_layers: int = 1, anchors_per_seq: int = 16, gamma=None, max_length: int = 1024,
          val_fraction: float = 0.1, eval_width=None, eval_tokens: int = 64, draft_logits: str = "target",
          resume: bool = False, cfg: TrainConfig | None = None, console=None, dtype=None,
          selector_weight: float = SELECTOR_WEIGHT) -> dict:
    """Train a DFlash drafter (`kind="dflash"`), a DFlash 2 drafter (`kind="dflash2"`; selector_weight: λ of its
    loss) or MTP layers (`kind="mtp"`) for `target_path`; write the result to `out` (DFlash: the official
    `muse_glimmer_assistant` layout; DFlash 2: the published `DFlash2DraftModel` layout; MTP: `mtp.*` + config).
    Returns the summary that is also written to `out/train_summary.json` (data counts, losses, tokens/s, τ
    before/after in `eval.json`)."""
    if kind not in ("dflash", "dflash2", "mtp"):
        raise ValueError(f"unknown recipe {kind!r} (dflash | dflash2 | mtp)")
    cfg = cfg or TrainConfig()
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(f"{out} exists and is not empty; pass --resume to continue it or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    target, tok = load(target_path, dtype=dtype or "fp32")
    mx.random.seed(cfg.seed)  # new drafter / MTP weights depend on the seed only
    regen_cache = out / "regenerated.jsonl" if regenerate else None
    seqs, report = build_sequences(tok, chats=chats, texts=list(texts), max_length=max_length, model=target,
                                   regen_cache=regen_cache,
                                   regen_kwargs={"max_new_tokens": regen_max_tokens, "temperature": regen_temperature})
    train_seqs, val_seqs = split(seqs, val_fraction, cfg.seed)
    if console is not None:
        console.print(f"data: {report.line()} → {len(train_seqs)} train / {len(val_seqs)} validation sequences")

    if kind == "dflash2":
        if init is not None:
            module_drafter = load_drafter(init, target, dtype="fp32")
            if not isinstance(module_drafter, DFlashDrafter):
                raise ValueError(f"{init}: --init must be a DFlash 2 or DFlash v1 drafter for `train dflash2`")
            if not isinstance(module_drafter, DFlash2Drafter):  # v1: DFlash 2 starting as exactly that drafter
                module_drafter = DFlash2Drafter(dflash2_from_v1(module_drafter.assistant, target, cfg.seed), target)
        else:
            module_drafter = DFlash2Drafter(new_dflash2(new_dflash2_config(
                target, tok, layers=layers, block_size=block_size, target_layer_ids=target_layer_ids,
                mask_token_id=mask_token_id), seed=cfg.seed), target)
        module = module_drafter.assistant
        if resume and (out / "checkpoint" / "model.safetensors").exists():
            module.load_weights(list(mx.load(str(out / "checkpoint" / "model.safetensors")).items()))
        width = eval_width or module.config.block_size
        tokens_per_batch = cfg.batch_size * (module.config.block_size + max_length)
    elif kind == "dflash":
        if init is not None:
            module_drafter = load_drafter(init, target, dtype="fp32")
            if not isinstance(module_drafter, DFlashDrafter) or isinstance(module_drafter, DFlash2Drafter):
                raise ValueError(f"{init}: --init must be a DFlash (v1) drafter for `train dflash`")
        else:
            module_drafter = DFlashDrafter(Assistant(new_assistant_config(
                target, tok, layers=layers, block_size=block_size, target_layer_ids=target_layer_ids,
                mask_token_id=mask_token_id)), target)
        module = module_drafter.assistant
        if resume and (out / "checkpoint" / "model.safetensors").exists():
            module.load_weights(list(mx.load(str(out / "checkpoint" / "model.safetensors")).items()))
        module_drafter.draft_logits = draft_logits
        width = eval_width or module.config.block_size
        tokens_per_batch = cfg.batch_size * (module.config.block_size + max_length)
    else:
        if init is not None:
            module_drafter = load_drafter(init, target, dtype="fp32")
            if not isinstance(module_drafter, MTPDrafter):
                raise ValueError(f"{init}: --init must hold MTP layers for `train mtp`")
        else:
            module_drafter = MTPDrafter(new_mtp_head(target, mtp_layers, seed=cfg.seed), target)
        module = module_drafter.head
        if resume and (out / "checkpoint" / "mtp.safetensors").exists():
            w = mx.load(str(out / "checkpoint" / "mtp.safetensors"))
            module.load_weights([(k[len("mtp."):], v) for k, v in w.items()])
        module_drafter.draft_logits = draft_logits
        width = eval_width or module.num_layers
        tokens_per_batch = cfg.batch_size * max_length
    est = estimate(module, target, tokens_per_batch)
    if console is not None:
        console.print(f"{kind}: {param_count(module):,} trainable parameters; estimated peak memory ≈ {est:.2f} GB")
    prompts = eval_prompts(val_seqs or train_seqs)
    target.eos_token_ids = set(getattr(target, "eos_token_ids", set()))
    before = acceptance(target, module_drafter, prompts, width, eval_tokens) if not resume else None

    if kind in ("dflash", "dflash2"):
        summary = train_dflash(target, tok, train_seqs, val_seqs, out, assistant=module, cfg=cfg,
                               anchors_per_seq=anchors_per_seq, gamma=gamma, draft_logits=draft_logits,
                               resume=resume, console=console, selector_weight=selector_weight)
        names = ["config.json", "model.safetensors"]
    else:
        summary = train_mtp(target, train_seqs, val_seqs, out, head=module, cfg=cfg, draft_logits=draft_logits,
                            resume=resume, console=console)
        names = ["config.json", "mtp.safetensors"]
    for n in names:  # the final weights, next to the checkpoint (atomic per file)
        shutil.copyfile(out / "checkpoint" / n, out / (n + ".tmp"))
        (out / (n + ".tmp")).replace(out / n)
    after = acceptance(target, module_drafter, prompts, width, eval_tokens)
    ev = {"width": width, "prompts": len(prompts), "max_tokens": eval_tokens, "before": before, "after": after,
          "draft_logits": draft_logits if kind != "dflash2" else "checkpoint"}
    if kind == "dflash2":
        ev.update(drafter="dflash2", selector_weight=selector_weight)
    write_atomic(out / "eval.json", json.dumps(ev, indent=2))
    summary.update(data=report.__dict__, train_sequences=len(train_seqs), val_sequences=len(val_seqs),
                   memory_estimate_gb=est, eval=ev, recipe=kind)
    write_atomic(out / "train_summary.json", json.dumps(summary, indent=2, default=str))
    return summary
