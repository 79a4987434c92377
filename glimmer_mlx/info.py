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


def _tensor_bytes(shapes: dict[str, tuple], quantizable: set[str], q: dict | None, recipe: str | None,
                  num_layers: int, dense_bytes: int = 2) -> dict[str, int]:
    """Bytes of each tensor in `shapes` with the module weights in `quantizable` quantized as convert does."""
    loc = None
    for p in sorted(quantizable):
        if "down_proj" in p:
            loc = next(i for i, s in enumerate(p.split(".")) if s.isdigit())
            break
    out = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        p = name[: -len(".weight")] if name.endswith(".weight") else None
        if q is None or p not in quantizable or len(shape) != 2 or shape[-1] % q["group_size"]:
            out[name] = n * dense_bytes
            continue
        bits = recipe_bits(recipe, p, layer_index(p, loc or 0), num_layers) if recipe else q["bits"]
        groups = n // q["group_size"]
        out[name] = n * bits // 8 + groups * (2 * dense_bytes if q["mode"] == "affine" else 1)
    return out


def _weights_bytes(shapes: dict[str, tuple], quantizable: set[str], q: dict | None, recipe: str | None,
                   num_layers: int, dense_bytes: int = 2) -> tuple[int, int]:
    """(bytes, parameters) of tensors `shapes` with the module weights in `quantizable` quantized as convert does."""
    per = _tensor_bytes(shapes, quantizable, q, recipe, num_layers, dense_bytes)
    return sum(per.values()), sum(math.prod(s) for s in shapes.values())


def _plan_config(model, bits, group_size, mode, recipe):
    """(raw config dict, ModelConfig, quantization dict or None) for a plan's `model` and settings."""
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
    return raw, config, q


def _drafter_config(drafter, config):
    if drafter is None:
        return None
    if drafter == "default":
        return AssistantConfig.from_dict({"model_type": "muse_glimmer_assistant",
                                          "hidden_size": config.text.hidden_size})
    if isinstance(drafter, dict):
        return AssistantConfig.from_dict(drafter)
    return AssistantConfig.from_dict(read_json(resolve_path(drafter) / "config.json"))


def _drafter_cache_bytes(dcfg, context: int) -> int:
    if dcfg is None:
        return 0
    rows_kept = min(context, (dcfg.sliding_window or context) + 1)
    return dcfg.num_hidden_layers * rows_kept * 2 * dcfg.num_key_value_heads * dcfg.head_dim * 2


def memory_plan(model: str | dict = "muse-glimmer-30b", drafter: str | dict | None = "default", *,
                bits: int | None = 4, group_size: int | None = None, mode: str = "affine", recipe: str | None = None,
                quantize_vision: bool = False, text_only: bool = False, contexts=(4096, 32768, 131072),
                mem_sizes=MAC_MEMORY_GB, drafter_bits: int | None = "same") -> dict:
    """Memory needed to run `model` (+ `drafter`) converted by `glimmer convert` with these settings, and whether it
    fits each Mac memory size. `model`: a preset name, a checkpoint folder / Hub id, or a config dict; `drafter`:
    "default" (the released assistant's config), None, a folder / Hub id, or a config dict. bits None: bf16."""
    raw, config, q = _plan_config(model, bits, group_size, mode, recipe)
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
    dcfg = _drafter_config(drafter, config)
    if dcfg is not None:
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
        dkv = _drafter_cache_bytes(dcfg, c)
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


# ---------------------------------------------------------------------------------------------------------------------
# Distributed plan: the target (+ drafter) split over N Macs (`glimmer info --plan --hosts N`), from configs only.

# Published line rates; the per-message latencies are assumptions (stated in the docs), not measurements.
LINKS = {
    "tb5": {"name": "Thunderbolt 5, IP over the Thunderbolt bridge (ring backend, TCP)", "gbps": 80.0,
            "latency_us": 100.0},
    "tb5-rdma": {"name": "Thunderbolt 5, RDMA (JACCL backend, macOS 26.2+)", "gbps": 80.0, "latency_us": 10.0},
    "tb4": {"name": "Thunderbolt 4, IP over the Thunderbolt bridge (ring backend, TCP)", "gbps": 40.0,
            "latency_us": 100.0},
    "10gbe": {"name": "10 Gigabit Ethernet (ring backend, TCP)", "gbps": 10.0, "latency_us": 50.0},
    "1gbe": {"name": "Gigabit Ethernet (ring backend, TCP)", "gbps": 1.0, "latency_us": 100.0},
}
VERIFY_LENGTHS = (8, 16)  # L = 1 + drafts: a verify round's positions
ACTIVATION_BYTES = 2  # bf16 activations (a bf16 or affine-quantized checkpoint with bf16 scales)


def parse_memory_gb(value: str | None, hosts: int) -> list[float] | None:
    """`--memory-gb M` (every host) or `M1,M2,...` (one per host) -> one size per rank; None: None."""
    if value is None or not str(value).strip():
        return None
    try:
        sizes = [float(v) for v in str(value).split(",")]
    except ValueError:
        raise ValueError(f"--memory-gb {value!r}: give GB as numbers, e.g. 48 or 64,32") from None
    if any(v <= 0 for v in sizes):
        raise ValueError(f"--memory-gb {value!r}: sizes must be positive")
    if len(sizes) == 1:
        return sizes * hosts
    if len(sizes) != hosts:
        raise ValueError(f"--memory-gb {value!r}: give one size (every host) or {hosts} sizes (one per host), "
                         f"not {len(sizes)}")
    return sizes


def _fit(total: float, mem: float) -> str:
    return ("yes" if total <= gpu_working_set_gb(mem) * 1e9 else
            "with wired limit raised" if total <= (mem - 6) * 1e9 else "no")


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _tp_share(name: str, n: int, kv_local: int, n_kv: int) -> tuple[int, int] | None:
    """(numerator, denominator) of tensor `name` one TP rank holds, as `distributed.shard_model` splits it; None:
    replicated."""
    leaf = name.rsplit(".", 1)[-1]
    mod = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return 1, n  # vocab rows
    if ".self_attn." in name and mod in ("q_proj", "gate_proj"):
        return 1, n  # column-split (weight and bias)
    if ".self_attn." in name and mod in ("k_proj", "v_proj"):
        return kv_local, n_kv  # KV heads split, or one replicated head per rank
    if mod in ("o_proj", "down_proj") and leaf != "bias":
        return 1, n  # row-split (the bias is added after the all_sum: whole on every rank)
    if ".mlp." in name and mod in ("gate_proj", "up_proj"):
        return 1, n
    return None


def _collective_time(allreduce_bytes: float, gather_bytes: float, n_allreduce: int, n_gather: int, n: int,
                     link: dict) -> dict:
    """Ring-algorithm cost of `n_allreduce` all_sums moving `allreduce_bytes` in all (payload, every rank's size) and
    `n_gather` all_gathers of `gather_bytes` in all (the gathered result): an all-reduce is 2(N-1) sequential
    messages sending 2(N-1)/N of the payload per rank, an all-gather N-1 messages sending (N-1)/N of the result."""
    if n == 1:
        return {"sent_bytes_per_rank": 0.0, "messages": 0, "latency_s": 0.0, "transfer_s": 0.0, "seconds": 0.0}
    sent = allreduce_bytes * 2 * (n - 1) / n + gather_bytes * (n - 1) / n
    messages = n_allreduce * 2 * (n - 1) + n_gather * (n - 1)
    lat = messages * link["latency_us"] * 1e-6
    xfer = sent / (link["gbps"] * 1e9 / 8)
    return {"sent_bytes_per_rank": sent, "messages": messages, "latency_s": lat, "transfer_s": xfer,
            "seconds": lat + xfer}


def distributed_plan(model: str | dict = "muse-glimmer-30b", drafter: str | dict | None = "default", *,
                     hosts: int = 2, strategy: str = "tp", memory_gb: list[float] | None = None, link: str = "tb5",
                     latency_us: float | None = None, bits: int | None = 4, group_size: int | None = None,
                     mode: str = "affine", recipe: str | None = None, quantize_vision: bool = False,
                     text_only: bool = False, contexts=(4096, 32768, 131072), verify_lengths=VERIFY_LENGTHS) -> dict:
    """How `model` (+ `drafter`) splits over `hosts` Macs with `--distributed strategy` (distributed.py's sharding:
    TP per layer by heads / MLP columns, KV heads replicated when fewer than the ranks, vocabulary split; PP layers
    by `stage_of`, vocabulary split; drafter, vision tower and norms whole on every rank), per-rank memory and fit
    at each context, and the bytes and time communicated per decoded token and per verify round over `link`.
    `memory_gb`: one size per rank (None: the fit for each of MAC_MEMORY_GB)."""
    from .distributed import STRATEGIES, kv_heads_per_rank, shard_problems, stage_of

    n = int(hosts)
    if n < 1:
        raise ValueError(f"--hosts {hosts}: needs at least 1 host")
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if link not in LINKS:
        raise ValueError(f"--link {link!r}: unknown link (known: {', '.join(LINKS)})")
    lk = dict(LINKS[link], key=link)
    if latency_us is not None:
        if latency_us < 0:
            raise ValueError(f"--latency-us {latency_us}: must be >= 0")
        lk["latency_us"] = float(latency_us)
    if memory_gb is not None and len(memory_gb) != n:
        raise ValueError(f"--memory-gb: {len(memory_gb)} sizes for {n} hosts")
    raw, config, q = _plan_config(model, bits, group_size, mode, recipe)
    t = config.text
    L, D, V = t.num_hidden_layers, t.hidden_size, t.vocab_size
    if strategy == "tp":
        problems = shard_problems(t, n, q)
        if problems:
            raise ValueError(f"tensor parallelism over {n} ranks: " + "; ".join(problems))
        kv_local, share = kv_heads_per_rank(t.num_attention_heads, t.num_key_value_heads, n)
    else:
        if L < n:
            raise ValueError(f"pipeline parallelism over {n} ranks: the model has only {L} layers")
        if V % n:
            raise ValueError(f"pipeline parallelism over {n} ranks: vocab_size {V} is not divisible by {n}")
        kv_local, share = t.num_key_value_heads, 1
    # the vision tower is never read with --distributed (images are refused; it stays a lazy, unevaluated aside)
    whole = memory_plan(raw, drafter, bits=bits, group_size=group_size, mode=mode, recipe=recipe,
                        quantize_vision=quantize_vision, text_only=True, contexts=contexts, mem_sizes=())
    dcfg = _drafter_config(drafter, config)
    m = Model(config)
    qmods = {p for p, mod in m.named_modules() if hasattr(mod, "to_quantized")}
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(m.parameters())}
    per = _tensor_bytes(shapes, qmods, q, recipe, L)
    replicated_parts = {k: v["bytes"] for k, v in whole["parts"].items() if k != "text tower"}
    sizes = memory_gb if memory_gb is not None else None
    ranks = []
    for r in range(n):
        split = repl = 0
        if strategy == "tp" or n == 1:
            layers = list(range(L))
            for name, b in per.items():
                share_of = _tp_share(name, n, kv_local, t.num_key_value_heads) if n > 1 else None
                if share_of is None:
                    repl += b
                else:
                    split += b * share_of[0] // share_of[1]
        else:
            layers = [i for i in range(L) if stage_of(i, L, n) == r]
            for name, b in per.items():
                i = _layer_of(name)
                if i is not None:
                    split += b if i in layers else 0
                elif name.startswith(("model.embed_tokens.", "lm_head.")):
                    split += b // n
                else:
                    repl += b  # the final norm
        kv_row = 2 * (kv_local if strategy == "tp" else t.num_key_value_heads) * t.head_dim * 2
        weights = split + repl + sum(replicated_parts.values())
        rows = []
        for c in contexts:
            kv = sum((min(c, t.sliding_window - 1 + DEFAULT_MAX_REWIND) if t.is_sliding(i) else c) * kv_row
                     for i in layers)
            dkv = _drafter_cache_bytes(dcfg, c)
            total = weights + kv + dkv + RUNTIME_OVERHEAD_GB * 1e9
            mems = [sizes[r]] if sizes is not None else list(MAC_MEMORY_GB)
            rows.append({"context": c, "kv_cache_bytes": kv, "drafter_cache_bytes": dkv, "total_bytes": total,
                         "fits": {mem: _fit(total, mem) for mem in mems}})
        ranks.append({"rank": r, "memory_gb": None if sizes is None else sizes[r],
                      "layers": [layers[0], layers[-1]] if layers else [],
                      "target_split_bytes": split, "target_replicated_bytes": repl,
                      "replicated_parts_bytes": replicated_parts, "weights_bytes": weights,
                      "kv_heads": kv_local if strategy == "tp" else t.num_key_value_heads, "rows": rows})
    # communication per forward of T positions (bf16 activations)
    row_b, logit_b = D * ACTIVATION_BYTES, V * ACTIVATION_BYTES
    taps = sorted({int(i) for i in (dcfg.target_layer_ids if dcfg is not None else ()) if 0 <= int(i) < L})
    if strategy == "tp":
        n_allsum, what = 2 * L + 1, (f"{2 * L} all_sums (attention and MLP outputs of {L} layers) + 1 (embedding "
                                     f"lookup) of {D} values per position, 1 all_gather of the logits ({V} per "
                                     f"position)")
        boundaries = plain_boundaries = []
        n_plain = n_allsum
    else:
        plain_boundaries = sorted(i for i in range(L) if i == L - 1 or stage_of(i, L, n) != stage_of(i + 1, L, n))
        boundaries = sorted(set(plain_boundaries) | set(taps))
        n_plain, n_allsum = 1 + len(plain_boundaries), 1 + len(boundaries)
        what = (f"1 all_sum (embedding lookup) + {len(plain_boundaries)} stage hand-overs (after layers "
                f"{plain_boundaries}: {n - 1} between stages, the last stage's output to every rank)"
                + (f" + {len(boundaries) - len(plain_boundaries)} more with the drafter loaded (its taps {taps})"
                   if len(boundaries) > len(plain_boundaries) else "")
                + f" of {D} values per position, 1 all_gather of the logits ({V} per position)")

    def forward(T: int, drafter_round: bool = False) -> dict:
        k = n_allsum if drafter_round else n_plain
        ar, ga, nar, nga = k * row_b * T, logit_b * T, k, 1
        if drafter_round and dcfg is not None:  # DFlash: its block's embedding lookup + its draft logits' gather
            ar, ga, nar, nga = ar + row_b * T, ga + logit_b * T, nar + 1, nga + 1
        cost = _collective_time(ar, ga, nar, nga, n, lk)
        return dict(cost, positions=T, allreduce_payload_bytes=ar, gather_bytes=ga, collectives=nar + nga)

    token = forward(1)
    comm = {"what": what, "stage_boundaries": plain_boundaries, "stage_boundaries_with_drafter": boundaries,
            "per_token": dict(token, tok_s_bound=(
        1 / token["seconds"] if token["seconds"] else None)), "per_round": []}
    for Lv in verify_lengths:
        f = forward(Lv, drafter_round=True)
        f["rounds_s_bound"] = 1 / f["seconds"] if f["seconds"] else None
        f["tok_s_bound_all_accepted"] = Lv / f["seconds"] if f["seconds"] else None
        comm["per_round"].append(f)
    return {"model": model if isinstance(model, str) else raw.get("model_type"), "quantization": whole["quantization"],
            "vision": "not loaded (--distributed refuses images)" if config.has_vision else "none",
            "strategy": strategy, "hosts": n, "link": lk, "contexts": list(contexts),
            "kv_replication": share, "total_weights_bytes": whole["weights_bytes"],
            "overhead_bytes_per_rank": RUNTIME_OVERHEAD_GB * 1e9, "ranks": ranks, "communication": comm,
            "drafter": None if dcfg is None else {"layers": dcfg.num_hidden_layers, "taps": taps,
                                                  "bytes": replicated_parts.get("DFlash drafter", 0)}}
