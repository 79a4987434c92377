"""What a checkpoint is and what it needs, from its config.json and the safetensors headers (no tensor data is read:
the headers are checked as `load` checks them, so a corrupt or mismatched checkpoint fails here too)."""

from __future__ import annotations

import math

from mlx.utils import tree_flatten

from .cache import DEFAULT_MAX_REWIND
from .config import ModelConfig, TextConfig, parse_config, text_param_counts
from .loading import check_checkpoint, load_config, read_json, resolve_path
from .models.assistant import Assistant, AssistantConfig
from .models.glimmer import Model, expected_vision_shapes
from .quantization import MODE_DEFAULTS, VISION_LINEAR_RE, layer_index, recipe_bits

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
    weights = check_checkpoint(path, config, require_weights=False)
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
    checked = ("no weight files (config.json only): nothing else was checked" if weights is None else
               f"{weights['tensors']} tensors in {weights['files']} file(s), {weights['bytes'] / 1e9:.3f} GB; "
               "safetensors headers, tensor names and shapes and the tokenizer files checked (tensor data not read)")
    return {"path": str(path), "model_type": config.model_type, "architecture": arch, "weights": weights,
            "checked": checked,
            "parameters": dict(counts, total=total), "contexts": list(contexts), "memory": memory}


# ---------------------------------------------------------------------------------------------------------------------
# Memory plan: model + drafter + quantization + context vs Mac memory sizes (`glimmer info --plan`), from configs only.

PRESETS = {"muse-glimmer-30b"}  # the released 30B configuration (transformers' defaults, reference doc §1)
MAC_MEMORY_GB = (24, 32, 36, 48, 64, 128)
RUNTIME_OVERHEAD_GB = 1.5  # activations of a 512-token prefill chunk, verify logits, MLX / Metal buffers (estimate)


def preset_config(name: str) -> dict:
    if name != "muse-glimmer-30b":
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")

    t = TextConfig()
    text = {k: getattr(t, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window")}
    return {"model_type": "muse_glimmer", "text_config": text, "vision_config": {}}


def gpu_working_set_gb(mem_gb: float) -> float:
    """macOS' default GPU working-set limit (Metal's recommendedMaxWorkingSetSize): about 2/3 of RAM below 36 GB
    and 3/4 from 36 GB up; `sudo sysctl iogpu.wired_limit_mb=…` raises it."""
    return mem_gb * (0.75 if mem_gb >= 36 else 2 / 3)


def _weights_bytes(shapes: dict[str, tuple], quantizable: set[str], q: dict | None, recipe: str | None,
                   num_layers: int, dense_bytes: int = 2) -> tuple[int, int]:
    """(bytes, parameters) of tensors `shapes` with the module weights in `quantizable` quantized as convert does."""
    loc = None
    for p in sorted(quantizable):
        if "down_proj" in p:
            loc = next(i for i, s in enumerate(p.split(".")) if s.isdigit())
            break
    total = params = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        params += n
        p = name[: -len(".weight")] if name.endswith(".weight") else None
        if q is None or p not in quantizable or len(shape) != 2 or shape[-1] % q["group_size"]:
            total += n * dense_bytes
            continue
        bits = recipe_bits(recipe, p, layer_index(p, loc or 0), num_layers) if recipe else q["bits"]
        groups = n // q["group_size"]
        total += n * bits // 8 + groups * (2 * dense_bytes if q["mode"] == "affine" else 1)
    return total, params


def memory_plan(model: str | dict = "muse-glimmer-30b", drafter: str | dict | None = "default", *,
                bits: int | None = 4, group_size: int | None = None, mode: str = "affine", recipe: str | None = None,
                quantize_vision: bool = False, text_only: bool = False, contexts=(4096, 32768, 131072),
                mem_sizes=MAC_MEMORY_GB, drafter_bits: int | None = "same") -> dict:
    """Memory needed to run `model` (+ `drafter`) converted by `glimmer convert` with these settings, and whether it
    fits each Mac memory size. `model`: a preset name, a checkpoint folder / Hub id, or a config dict; `drafter`:
    "default" (the released assistant's config), None, a folder / Hub id, or a config dict. bits None: bf16."""
    if isinstance(model, dict):
        raw = model
    elif model in PRESETS:
        raw = preset_config(model)
    else:
        raw = load_config(resolve_path(model)).raw
    config = parse_config(raw)
    q = None
    if bits is not None or recipe is not None:
        gs, b = MODE_DEFAULTS[mode]
        q = {"group_size": group_size or gs, "bits": bits or b, "mode": mode}
    m = Model(config)  # lazy: shapes only, nothing is allocated
    qmods = {p for p, mod in m.named_modules() if hasattr(mod, "to_quantized")}
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(m.parameters())}
    text_b, text_p = _weights_bytes(shapes, qmods, q, recipe, config.text.num_hidden_layers)
    parts = {"text tower": {"params": text_p, "bytes": text_b}}
    if config.has_vision and not text_only:
        vs = expected_vision_shapes(config)
        vq = {k[: -len(".weight")] for k in vs if VISION_LINEAR_RE.match(k)} if quantize_vision else set()
        vb, vp = _weights_bytes(vs, vq, q, None, 1)
        parts["vision (tower + projector)"] = {"params": vp, "bytes": vb}
    dcfg = None
    if drafter is not None:
        if drafter == "default":
            dcfg = AssistantConfig.from_dict({"model_type": "muse_glimmer_assistant",
                                              "hidden_size": config.text.hidden_size})
        elif isinstance(drafter, dict):
            dcfg = AssistantConfig.from_dict(drafter)
        else:
            dcfg = AssistantConfig.from_dict(read_json(resolve_path(drafter) / "config.json"))
        a = Assistant(dcfg)
        dq = q if drafter_bits == "same" else (None if drafter_bits is None else dict(q or {"group_size": 64,
                                                                                           "mode": "affine"},
                                                                                      bits=drafter_bits))
        aq = {p for p, mod in a.named_modules() if hasattr(mod, "to_quantized")}
        ash = {k: tuple(v.shape) for k, v in tree_flatten(a.parameters())}
        db, dp = _weights_bytes(ash, aq, dq, recipe if dq is q else None, dcfg.num_hidden_layers)
        parts["DFlash drafter"] = {"params": dp, "bytes": db}
    weights = sum(p["bytes"] for p in parts.values())
    rows = []
    for c in contexts:
        kv = kv_cache_bytes(config, c)
        dkv = 0
        if dcfg is not None:
            rows_kept = min(c, (dcfg.sliding_window or c) + 1)
            dkv = dcfg.num_hidden_layers * rows_kept * 2 * dcfg.num_key_value_heads * dcfg.head_dim * 2
        total = weights + kv + dkv + RUNTIME_OVERHEAD_GB * 1e9
        fits = {}
        for mem in mem_sizes:
            limit = gpu_working_set_gb(mem) * 1e9
            fits[mem] = ("yes" if total <= limit else
                         "with wired limit raised" if total <= (mem - 6) * 1e9 else "no")
        rows.append({"context": c, "kv_cache_bytes": kv, "drafter_cache_bytes": dkv, "total_bytes": total,
                     "fits": fits})
    qdesc = "bf16" if q is None else (f"{recipe} (affine g{q['group_size']})" if recipe else
                                      f"{q['mode']} {q['bits']}-bit g{q['group_size']}")
    return {"model": model if isinstance(model, str) else raw.get("model_type"), "quantization": qdesc,
            "vision": ("dropped (--text-only)" if text_only else "quantized" if quantize_vision else "bf16")
            if config.has_vision else "none",
            "parts": parts, "weights_bytes": weights, "overhead_bytes": RUNTIME_OVERHEAD_GB * 1e9, "rows": rows,
            "mem_sizes": list(mem_sizes),
            "working_set_gb": {m: gpu_working_set_gb(m) for m in mem_sizes}}
