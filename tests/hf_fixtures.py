"""Tiny random Muse Glimmer checkpoints built with transformers (the oracle) and saved in HF format."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
)
TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
    pos_emb_height=4, pos_emb_width=4,
)


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every (zero/one-initialised) norm weight random values so centered vs standard gains matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def build_hf_model(text_overrides: dict | None = None, *, seed: int = 0, with_vision: bool = True,
                   dtype=torch.float32):
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(TINY_TEXT, **(text_overrides or {}))
    vision = dict(TINY_VISION)
    cfg = MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=vision["hidden_size"] * 4,
                            projector_hidden_size=48)
    model = MuseGlimmerForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger-than-init weights give logits with real spread (init std 0.02 is nearly flat)
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.5 if name == "lm_head.weight" else 0.08)
    randomize_norms(model, seed)
    return model.to(dtype)


def save_hf_model(model, path: Path, *, drop_layer_lists: bool = False) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    if drop_layer_lists:  # a hand-written config without layer_types / layer_rope_theta
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["text_config"].pop("layer_types", None)
        cfg["text_config"].pop("layer_rope_theta", None)
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_hidden(model, ids: list[int], layers: list[int]) -> list[torch.Tensor]:
    """Residual-stream outputs of decoder layers `layers` (hidden_states[i+1])."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [out.hidden_states[i + 1][0].float() for i in layers]


TINY_DRAFTER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=6,
    block_size=4,
    mask_token_id=8,
    target_layer_ids=[1, 3],
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)


def build_hf_drafter(overrides: dict | None = None, *, seed: int = 0, dtype=torch.float32):
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    cfg = MuseGlimmerAssistantConfig(**dict(TINY_DRAFTER, **(overrides or {})))
    model = MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.3)
    return model.to(dtype)


def build_hf_mtp(hf_model, num_layers: int = 2, *, seed: int = 0):
    """transformers' generic `MtpModel` on a Muse Glimmer built with `num_mtp_layers`/`mtp_layer_types` in its text
    config, with random weights. Returns the torch module (shares embedding / lm_head with `hf_model`)."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    mtp = MtpModel(hf_model, num_layers).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith(("embed_tokens", "shared_head")):
                continue
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.add_(torch.randn(p.shape) * 0.3)
    return mtp


def save_mtp_weights(mtp, path: Path, filename: str = "mtp.safetensors") -> None:
    """Write the MTP layers as `mtp.*` tensors (embedding / head are the target's and are not stored)."""
    from safetensors.torch import save_file

    sd = {f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()
          if not k.startswith(("embed_tokens", "shared_head"))}
    save_file(sd, str(path / filename))


def tiny_mtp_pair(tiny_checkpoint):
    """A tiny target with two MTP layers (sliding, full) of its own, loaded: (model without EOS, its MTP drafter)."""
    import glimmer_mlx

    path, hf = tiny_checkpoint(seed=4, num_mtp_layers=2, mtp_layer_types=["sliding_attention", "full_attention"])
    save_mtp_weights(build_hf_mtp(hf, 2, seed=1), path)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    return model, glimmer_mlx.load_drafter(path, model)
