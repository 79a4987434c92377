"""A random-weight Glimmer-architecture, text-only checkpoint written **with mlx-lm's own model class and save
utilities** (`mlx_lm.models.muse_glimmer.Model`, `mlx_lm.utils.quantize_model / save_model / save_config`), so one
folder loads with both `mlx_lm.load` and `glimmer_mlx.load` (what `plain` compares)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..loading import parse_dtype

# 213M parameters: 12 × 12.2M (layers) + 2 × 32.8M (embedding, untied lm_head).
DEFAULT_ARCH = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    intermediate_size=2816,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=32000,
    sliding_window=512,
)


def glimmer_config(**overrides) -> dict:
    """A flat, mlx-lm-style `muse_glimmer` config with explicit per-layer lists, counted backward from the last
    layer as transformers does (every 4th layer from the end is global attention without RoPE)."""
    cfg = dict(
        model_type="muse_glimmer",
        **DEFAULT_ARCH,
        rms_norm_eps=1e-5,
        post_norm_eps=1e-8,
        qk_scale_factor=3.87,
        hidden_activation="silu",
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        final_logit_softcapping=20.0,
        output_multiplier=0.19611613513818404,
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg.update(overrides)
    L = cfg["num_hidden_layers"]
    theta = cfg["rope_parameters"]["rope_theta"]
    glob = [(L - 1 - i) % 4 == 0 for i in range(L)]
    cfg.setdefault("layer_types", ["full_attention" if g else "sliding_attention" for g in glob])
    cfg.setdefault("layer_rope_theta", [0 if g else theta for g in glob])
    return cfg


def _init_std(name: str, shape) -> float:
    if name.endswith("embed_tokens.weight"):
        return 1.0  # the embedding is RMS-normed right away; scale is irrelevant
    if name == "lm_head.weight":
        return 0.5  # logits std ≈ 0.5·√D·output_multiplier ≈ 3: a real spread below the softcap
    return shape[-1] ** -0.5


def _write_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """A tiny byte-level BPE (ids 0/1 = BOS/EOS): enough for both loaders; benchmarks feed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. def f(x):\n    return x\n"] * 8, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special[0], "eos_token": special[1]}, indent=2))


def make_random_checkpoint(path, *, dtype: str = "bf16", q_bits: int | None = None, group_size: int = 64,
                           seed: int = 0, **config_overrides) -> dict:
    """Write a random-weight Glimmer text-only checkpoint in mlx-lm's saved layout; returns its config.

    dtype: weights (and, when quantized, affine scales/biases) dtype: "bf16" (mlx-lm's default), "fp16", "fp32".
    q_bits: quantize every Linear/Embedding whose input dim divides by `group_size` (mlx-lm's `quantize_model`).
    """
    from mlx_lm.models.muse_glimmer import Model, ModelArgs
    from mlx_lm.utils import quantize_model, save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = glimmer_config(**config_overrides)
    model = Model(ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        if p.ndim == 2:
            w = mx.random.normal(p.shape, key=sub) * _init_std(name, p.shape)
        elif name == "model.norm.weight":  # standard RMSNorm gain ~ 1
            w = 1.0 + 0.1 * mx.random.normal(p.shape, key=sub)
        else:  # centered RMSNorm gains (1 + w), w ~ 0
            w = 0.1 * mx.random.normal(p.shape, key=sub)
        new.append((name, w.astype(parse_dtype(dtype))))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    if q_bits:
        model, config = quantize_model(model, config, group_size, q_bits, mode="affine")
    save_model(path, model, donate_model=True)
    save_config(dict(config), path / "config.json")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))
    _write_tokenizer(path)
    return config
