"""What a benchmark result says about what it measured: the model (`model_desc`) and a repeated measurement
(`summary`). Shared by `plain` (bench-plain) and `runner` (glimmer bench)."""

from __future__ import annotations

import statistics
from typing import Iterable

from mlx.utils import tree_flatten

from ..config import text_param_counts
from ..models.glimmer import param_count


def summary(xs: Iterable[float]) -> dict:
    """median, min, max, spread_pct (max − min over the median) and the values themselves (None when empty)."""
    xs = list(xs)
    if not xs:
        return {"median": None, "min": None, "max": None, "spread_pct": None, "values": []}
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs),
            "spread_pct": 100.0 * (max(xs) - min(xs)) / med if med else 0.0, "values": xs}


def model_desc(model) -> dict:
    """A loaded target: parameter count, stored elements and bytes, dtypes, quantization, shape."""
    q = model.config.quantization
    a = model.args
    params = tree_flatten(model.parameters())
    return {
        "parameters": sum(text_param_counts(a).values()),
        "stored_elements": param_count(model),
        "weight_gb": sum(v.nbytes for _, v in params) / 1e9,
        "dtypes": sorted({str(v.dtype) for _, v in params}),
        "quantization": {k: v for k, v in (q or {}).items() if not isinstance(v, dict)} or None,
        "hidden_size": a.hidden_size, "layers": a.num_hidden_layers, "heads": a.num_attention_heads,
        "kv_heads": a.num_key_value_heads, "head_dim": a.head_dim, "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size, "sliding_window": a.sliding_window,
    }
