"""What a checkpoint is and what it needs, from its config.json alone (no weights are read)."""

from __future__ import annotations

import math

from .cache import DEFAULT_MAX_REWIND
from .config import ModelConfig, text_param_counts
from .loading import load_config, resolve_path
from .models.glimmer import expected_vision_shapes

# bytes per parameter: dense formats, and mlx affine quantization (packed bits + bf16 scale and bias per group)
WEIGHT_FORMATS = {
    "fp32": 4.0,
    "bf16": 2.0,
    "8-bit (g64)": 1.0 + 4.0 / 64,
    "4-bit (g64)": 0.5 + 4.0 / 64,
}


def param_counts(config: ModelConfig) -> dict[str, int]:
    counts = dict(text_param_counts(config.text))
    if config.has_vision:
        counts["vision"] = sum(math.prod(s) for s in expected_vision_shapes(config).values())
    return counts


def kv_cache_bytes(config: ModelConfig, context: int, bytes_per_elem: int = 2) -> int:
    t = config.text
    row = 2 * t.num_key_value_heads * t.head_dim * bytes_per_elem
    total = 0
    for i in range(t.num_hidden_layers):
        rows = min(context, t.sliding_window - 1 + DEFAULT_MAX_REWIND) if t.is_sliding(i) else context
        total += rows * row
    return total


def model_info(path_or_repo, contexts=(4096, 32768, 131072)) -> dict:
    path = resolve_path(path_or_repo)
    config = load_config(path)
    t = config.text
    counts = param_counts(config)
    total = sum(counts.values())
    arch = {
        "layers": t.num_hidden_layers,
        "hidden / intermediate": f"{t.hidden_size} / {t.intermediate_size}",
        "heads q / kv / head_dim": f"{t.num_attention_heads} / {t.num_key_value_heads} / {t.head_dim}",
        "vocab": t.vocab_size,
        "global (NoPE) layers": [i for i in range(t.num_hidden_layers) if not t.is_sliding(i)],
        "sliding window": t.sliding_window,
        "rope": f"{t.rope_parameters['rope_type']}, theta {t.rope_parameters['rope_theta']:g}",
        "softcap / output multiplier": f"{t.final_logit_softcapping} / {t.output_multiplier:.6f}",
        "vision tower": "yes" if config.has_vision else "no",
        "quantization": config.quantization or "none",
    }
    memory = []
    for fmt, bpp in WEIGHT_FORMATS.items():
        w = total * bpp / 1e9
        memory.append({"format": fmt, "weights_gb": w,
                       "total_gb": [w + kv_cache_bytes(config, c) / 1e9 for c in contexts]})
    return {"path": str(path), "model_type": config.model_type, "architecture": arch,
            "parameters": dict(counts, total=total), "contexts": list(contexts), "memory": memory}
