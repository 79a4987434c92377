"""Multi-token prediction (MTP) layers for Glimmer-class targets, in transformers' generic layout
(`modeling_layers.MtpLayer` / `MtpModel`): per layer `h' = post_norm(block(eh_proj([enorm(e), hnorm(h)])))` with
`e` the target's raw embedding of the next token, `h` the previous depth's output (depth 0: the target's final-normed
hidden state), `block` a decoder layer of the target's own type, and the target's `lm_head` for logits.

Checkpoint names: `mtp.layers.{k}.{enorm,hnorm,eh_proj,mtp_block.…,post_norm}` (+ `mtp.shared_post_norm`), with
`num_mtp_layers` (alias `num_nextn_predict_layers`) and `mtp_layer_types` in the text config.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..cache import DEFAULT_MAX_REWIND, KVCache
from ..config import ConfigError, TextConfig
from .glimmer import DecoderLayer, RMSNorm, Rope


def mtp_text_config(text: TextConfig, raw_text: dict, where: str = "config.json") -> tuple[TextConfig, dict]:
    """The config MTP blocks are built from: the target's, with MTP layer types and RoPE on every layer (transformers'
    MtpModel always passes position embeddings). Returns (config, options)."""
    n = raw_text.get("num_mtp_layers", raw_text.get("num_nextn_predict_layers"))
    if not n:
        raise ConfigError(f"{where}: no num_mtp_layers (or num_nextn_predict_layers): this checkpoint has no MTP layers")
    types = raw_text.get("mtp_layer_types")
    if types is None:
        raise ConfigError(f"{where}: num_mtp_layers is set but mtp_layer_types is missing (transformers requires it "
                          "for configs with layer_types)")
    if len(types) != n:
        raise ConfigError(f"{where}: mtp_layer_types has {len(types)} entries, expected num_mtp_layers = {n}")
    theta = text.rope_parameters["rope_theta"]
    cfg = dataclasses.replace(text, num_hidden_layers=n, layer_types=list(types), layer_rope_theta=[theta] * n)
    opts = {
        "use_post_norm": "chain_hidden_post_norm" not in raw_text,
        "shared_post_norm": bool(raw_text.get("chain_hidden_post_norm", False)),
        "hidden_first": bool(raw_text.get("mtp_hidden_states_first", False)),
    }
    return cfg, opts


class MTPLayer(nn.Module):
    def __init__(self, cfg: TextConfig, k: int, use_post_norm: bool, hidden_first: bool):
        super().__init__()
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.mtp_block = DecoderLayer(cfg, k)
        if use_post_norm:
            self.post_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hidden_first = hidden_first

    def __call__(self, e: mx.array, h: mx.array, rope: Rope, cache: KVCache | None) -> mx.array:
        parts = [self.hnorm(h), self.enorm(e)] if self.hidden_first else [self.enorm(e), self.hnorm(h)]
        x = self.mtp_block(self.eh_proj(mx.concatenate(parts, axis=-1)), rope, cache)
        return self.post_norm(x) if "post_norm" in self else x


class MTPHead(nn.Module):
    """The stack of MTP layers (weights only; the chaining lives in `speculative.mtp`)."""

    def __init__(self, cfg: TextConfig, opts: dict):
        super().__init__()
        self.config, self.opts = cfg, opts
        self.layers = [MTPLayer(cfg, k, opts["use_post_norm"], opts["hidden_first"])
                       for k in range(cfg.num_hidden_layers)]
        if opts["shared_post_norm"]:
            self.shared_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rope(cfg)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_for_depth(self, d: int) -> int:
        """Depth d uses layer d; beyond the trained layers the last one is reused recursively."""
        return min(d, self.num_layers - 1)

    def forward_depth(self, d: int, e, h, cache) -> mx.array:
        out = self.layers[self.layer_for_depth(d)](e, h, self.rope, cache)
        return self.shared_post_norm(out) if "shared_post_norm" in self else out

    def make_cache(self, depth: int, max_rewind: int = DEFAULT_MAX_REWIND) -> list[KVCache]:
        """One cache per depth; depth d's first row is at position d+1 (it runs d+1 tokens ahead of the target)."""
        caches = []
        for d in range(depth):
            i = self.layer_for_depth(d)
            caches.append(KVCache(window=self.config.sliding_window if self.config.is_sliding(i) else None,
                                  max_rewind=max_rewind, first_position=d + 1))
        return caches

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Keep `mtp.*` tensors (with or without a `model.` prefix), named relative to this module."""
        out = {}
        for k, v in weights.items():
            for prefix in ("mtp.", "model.mtp."):
                if k.startswith(prefix):
                    out[k[len(prefix):]] = v
        return out
