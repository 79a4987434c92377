"""Hugging Face `config.json` → dataclasses for the Muse Glimmer text tower.

Defaults and derived fields follow transformers' `MuseGlimmerTextConfig` exactly (reference doc §1.1): the layer
pattern is counted backward from the last layer, the NoPE pattern is computed independently of `layer_types`, and
an omitted `rope_parameters` means the default rope with theta 10000.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A config.json that cannot describe a model this runtime knows how to run."""


TEXT_MODEL_TYPES = ("muse_glimmer_text",)
MULTIMODAL_MODEL_TYPES = ("muse_glimmer",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")


@dataclass
class TextConfig:
    vocab_size: int = 202_048
    hidden_size: int = 6656
    intermediate_size: int = 19968
    num_hidden_layers: int = 52
    num_attention_heads: int = 32
    num_key_value_heads: int = 2
    head_dim: int = 128
    hidden_activation: str = "silu"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    rope_parameters: dict = field(default_factory=dict)
    attention_bias: bool = False
    sliding_window: int | None = 2048
    layer_types: list[str] = field(default_factory=list)
    layer_rope_theta: list[float] = field(default_factory=list)
    final_logit_softcapping: float | None = 20.0
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 200_000
    eos_token_id: int | list[int] | None = 200_001
    pad_token_id: int | None = None

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    def uses_rope(self, i: int) -> bool:
        return bool(self.layer_rope_theta[i])

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        if e is None:
            return []
        return [int(e)] if isinstance(e, int) else [int(x) for x in e]


@dataclass
class ModelConfig:
    """What the runtime needs from a checkpoint's config.json."""

    model_type: str
    text: TextConfig
    vision: dict | None = None  # kept verbatim; the vision tower is a later issue
    image_token_id: int = 200092
    video_token_id: int = 200091
    raw: dict = field(default_factory=dict, repr=False)
    quantization: dict | None = None

    @property
    def has_vision(self) -> bool:
        return self.vision is not None


_TEXT_FIELDS = {f.name for f in dataclasses.fields(TextConfig)}
_REQUIRED_TEXT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim")


def normalize_rope_parameters(cfg: dict) -> dict:
    """transformers' `standardize_rope_params` for a single global rope dict."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported by Muse Glimmer")
    params.setdefault("rope_type", params.get("type", "default"))
    params.pop("type", None)
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    # MuseGlimmerTextConfig has no `default_theta`: an omitted theta becomes 10000 (reference doc §1.1).
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 131_072))
    return params


MAX_DIM = 2**31 - 1  # a size beyond this is a corrupt config, not a model


def _check_positive_ints(d: dict, where: str) -> None:
    for k in _POSITIVE_INT_FIELDS:
        v = d.get(k)
        if v is None and k not in _REQUIRED_TEXT_FIELDS:
            continue  # optional: the dataclass default (or a derived value) is used
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{where}: {k} must be a positive integer, got {v!r}")
        if v > MAX_DIM:
            raise ConfigError(f"{where}: {k} must be a positive integer up to {MAX_DIM}, got {v!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _token_ids(v) -> bool:
    return v is None or (_is_int(v) and v >= 0) or (isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v))


# optional fields: (check, what it must be); absent or null keeps the default unless the check says otherwise
_FIELD_CHECKS = {
    "max_position_embeddings": (lambda v: _is_int(v) and 0 < v <= MAX_DIM, "a positive integer"),
    "sliding_window": (lambda v: v is None or (_is_int(v) and 0 < v <= MAX_DIM), "a positive integer or null"),
    "rms_norm_eps": (lambda v: _is_num(v) and v > 0, "a positive number"),
    "post_norm_eps": (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    "qk_scale_factor": (_is_num, "a number"),
    "output_multiplier": (_is_num, "a number"),
    "final_logit_softcapping": (lambda v: v is None or (_is_num(v) and v >= 0), "a number >= 0 or null"),
    "attention_bias": (lambda v: isinstance(v, bool), "true or false"),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "hidden_activation": (lambda v: v is None or isinstance(v, str), "a string"),
    "hidden_act": (lambda v: v is None or isinstance(v, str), "a string"),
    "bos_token_id": (lambda v: v is None or (_is_int(v) and v >= 0), "a token id or null"),
    "pad_token_id": (lambda v: v is None or (_is_int(v) and v >= 0), "a token id or null"),
    "eos_token_id": (_token_ids, "a token id, a list of token ids or null"),
    "layer_types": (lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
                    "a list of layer type names"),
    "layer_rope_theta": (lambda v: v is None or (isinstance(v, list) and all(_is_num(x) and x >= 0 for x in v)),
                         "a list of numbers >= 0"),
    "rope_parameters": (lambda v: v is None or isinstance(v, dict), "a JSON object or null"),
    "rope_scaling": (lambda v: v is None or isinstance(v, dict), "a JSON object or null"),
    "rope_theta": (lambda v: v is None or (_is_num(v) and v > 0), "a positive number"),
    "num_mtp_layers": (lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0"),
    "num_nextn_predict_layers": (lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0"),
}
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "partial_rotary_factor")


def _check_fields(d: dict, where: str) -> None:
    for k, (ok, what) in _FIELD_CHECKS.items():
        if k in d and not ok(d[k]):
            raise ConfigError(f"{where}: {k} must be {what}, got {d[k]!r}")
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key) or {}
        for k, v in params.items():
            if k in _ROPE_NUMBERS and v is not None and not (_is_num(v) and v >= 0):
                raise ConfigError(f"{where}: {key}.{k} must be a number >= 0, got {v!r}")
        for k in ("rope_type", "type"):
            if params.get(k) is not None and not isinstance(params[k], str):
                raise ConfigError(f"{where}: {key}.{k} must be a string, got {params[k]!r}")


def parse_text_config(d: dict, *, where: str = "config.json") -> TextConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: the text config must be a JSON object, got {type(d).__name__}")
    missing = [k for k in _REQUIRED_TEXT_FIELDS if k not in d]
    if missing:
        raise ConfigError(f"{where}: text config is missing required field(s) {missing}")
    _check_positive_ints(d, where)
    _check_fields(d, where)
    kwargs = {k: v for k, v in d.items() if k in _TEXT_FIELDS}
    kwargs["rope_parameters"] = normalize_rope_parameters(d)
    if kwargs.get("head_dim") is None:
        kwargs["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    if kwargs.get("hidden_activation") is None:
        kwargs["hidden_activation"] = d.get("hidden_act", "silu")
    cfg = TextConfig(**kwargs)
    L = cfg.num_hidden_layers
    if not cfg.layer_types:
        cfg.layer_types = [
            "full_attention" if (L - 1 - i) % 4 == 0 else "sliding_attention" for i in range(L)
        ]
    if not cfg.layer_rope_theta:
        theta = cfg.rope_parameters["rope_theta"]
        cfg.layer_rope_theta = [0 if (L - 1 - i) % 4 == 0 else theta for i in range(L)]
    _validate_text(cfg, where)
    return cfg


def _validate_text(cfg: TextConfig, where: str) -> None:
    L = cfg.num_hidden_layers
    if len(cfg.layer_types) != L:
        raise ConfigError(f"{where}: layer_types has {len(cfg.layer_types)} entries, expected {L}")
    if len(cfg.layer_rope_theta) != L:
        raise ConfigError(f"{where}: layer_rope_theta has {len(cfg.layer_rope_theta)} entries, expected {L}")
    bad = sorted(set(cfg.layer_types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConfigError(f"{where}: unsupported layer type(s) {bad}")
    if "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    rt = cfg.rope_parameters["rope_type"]
    if rt not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rt!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if cfg.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor != 1 is not supported")
    if cfg.hidden_activation not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"{where}: hidden_activation {cfg.hidden_activation!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
        )


def _check_quantization(q, where: str) -> None:
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be a JSON object (bits, group_size, mode), got {q!r}")
    if not (_is_int(q.get("bits")) and 1 <= q["bits"] <= 8):
        raise ConfigError(f"{where}: bits must be an integer from 1 to 8, got {q.get('bits')!r}")
    if "group_size" in q and not (_is_int(q["group_size"]) and q["group_size"] > 0):
        raise ConfigError(f"{where}: group_size must be a positive integer, got {q['group_size']!r}")
    if "mode" in q and not isinstance(q["mode"], str):
        raise ConfigError(f"{where}: mode must be a string, got {q['mode']!r}")


def parse_config(d: dict, *, where: str = "config.json") -> ModelConfig:
    """Parse a top-level `muse_glimmer` config (with `text_config`) or a bare `muse_glimmer_text` config."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt is None:
        raise ConfigError(f"{where}: missing 'model_type'")
    if "quantization" in d:  # mlx's own key: it must describe the quantization this runtime reads
        _check_quantization(d["quantization"], f"{where}: quantization")
    quant = d.get("quantization") or d.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or "bits" not in quant):
        quant = None  # a foreign quantization_config (bitsandbytes, fp8…) that we do not read
    elif quant is not None:
        _check_quantization(quant, f"{where}: quantization_config")
    for k, (ok, what) in (("tie_word_embeddings", _FIELD_CHECKS["tie_word_embeddings"]),
                          ("image_token_id", (lambda v: _is_int(v) and v >= 0, "a token id")),
                          ("video_token_id", (lambda v: _is_int(v) and v >= 0, "a token id")),
                          ("vision_config", (lambda v: v is None or isinstance(v, dict), "a JSON object or null")),
                          ("num_mtp_layers", _FIELD_CHECKS["num_mtp_layers"])):
        if k in d and not ok(d[k]):
            raise ConfigError(f"{where}: {k} must be {what}, got {d[k]!r}")
    if mt in MULTIMODAL_MODEL_TYPES and "text_config" not in d and "hidden_size" in d:
        mt = "muse_glimmer_text"  # a flat text-only config (as mlx-lm writes it)
    if mt in MULTIMODAL_MODEL_TYPES:
        if "text_config" not in d:
            raise ConfigError(f"{where}: model_type {mt!r} needs a 'text_config'")
        if not isinstance(d["text_config"], dict):
            raise ConfigError(
                f"{where}: 'text_config' must be a JSON object, got {type(d['text_config']).__name__}"
            )
        text = parse_text_config(d["text_config"], where=f"{where} (text_config)")
        # transformers' MuseGlimmerForConditionalGeneration ties lm_head to the embeddings only when the *top-level*
        # config says so (the composite config has no default, so absent means untied); `text_config`'s own flag
        # is not consulted, and such checkpoints store a separate `lm_head.weight`.
        text.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        return ModelConfig(
            model_type=mt,
            text=text,
            vision=d.get("vision_config"),
            image_token_id=d.get("image_token_id", 200092),
            video_token_id=d.get("video_token_id", 200091),
            raw=d,
            quantization=quant,
        )
    if mt in TEXT_MODEL_TYPES:
        return ModelConfig(model_type=d["model_type"], text=parse_text_config(d, where=where), raw=d, quantization=quant)
    known = ", ".join(MULTIMODAL_MODEL_TYPES + TEXT_MODEL_TYPES)
    raise ConfigError(f"{where}: unsupported model_type {mt!r} (this runtime loads: {known})")


# ---------------------------------------------------------------------------------------------------------------
# RoPE frequencies, identical to transformers' ROPE_INIT_FUNCTIONS for the supported types.


def rope_inv_freq(cfg: TextConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [head_dim/2] float32, attention_scaling)."""
    p = cfg.rope_parameters
    base = p["rope_theta"]
    dim = cfg.head_dim
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv = inv.astype(np.float32)
    rt = p["rope_type"]
    if rt == "default":
        return inv, 1.0
    if rt == "linear":
        return (inv / np.float32(p["factor"])).astype(np.float32), 1.0
    if rt == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if rt == "yarn":
        factor = p.get("factor")
        orig = p["original_max_position_embeddings"]
        if factor is None:
            factor = cfg.max_position_embeddings / orig
        attn = p.get("attention_factor")
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attn is None:
            attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if (mscale and mscale_all) else get_mscale(factor)
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        inv_ex, inv_in = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        return (inv_in * (1 - extra) + inv_ex * extra).astype(np.float32), float(attn)
    raise ConfigError(f"rope_type {rt!r} is not supported")


def text_param_counts(cfg: TextConfig) -> dict[str, int]:
    D, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attn = D * q * 2 + D * kv * 2 + q * D  # q, gate, k, v, o
    if cfg.attention_bias:
        attn += q + 2 * kv + D
    per_layer = attn + 3 * D * I + 4 * D
    return {
        "embedding": V * D,
        "layers": L * per_layer,
        "final_norm": D,
        "lm_head": 0 if cfg.tie_word_embeddings else V * D,
    }


def as_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
