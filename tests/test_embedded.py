"""The embedded default model set (glimmer_mlx/embedded/glimmer-tiny*): loads by default, matches transformers, and its drafters
speed up decoding losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from glimmer_mlx import generate, load
from glimmer_mlx.cli import app
from glimmer_mlx.embedded import DEFAULT_DFLASH, default_dflash, embedded_path, models_dir, resolve_model
from glimmer_mlx.speculative import DFlashDrafter, MTPDrafter, load_drafter
from glimmer_mlx.speculative.dflash2 import DFlash2Drafter

MODELS = models_dir()
pytestmark = pytest.mark.skipif(not (MODELS / "glimmer-tiny" / "config.json").exists(),
                                reason="the embedded model is not built (python embedded/build_embedded.py)")


@pytest.fixture(scope="module")
def embedded():
    model, tok = load(str(embedded_path()))
    return model, tok


def test_embedded_set_is_small_and_complete():
    total = sum(f.stat().st_size for d in MODELS.iterdir() if d.is_dir() and d.name.startswith("glimmer-tiny")
                for f in d.iterdir())
    assert total < 100e6, f"embedded model set is {total / 1e6:.1f} MB"
    for part in ("target", "dflash", "mtp"):
        assert (embedded_path(part) / "config.json").exists()
    assert resolve_model("elsewhere") == "elsewhere"
    assert resolve_model(None) == str(embedded_path())


def test_embedded_architecture_is_the_30b_code_path(embedded):
    model, tok = embedded
    a = model.args
    assert a.layer_types[-1] == "full_attention" and "sliding_attention" in a.layer_types  # pattern from the end
    cfg = json.loads((embedded_path() / "config.json").read_text())["text_config"]
    assert [t for t, r in zip(cfg["layer_types"], cfg["layer_rope_theta"]) if r == 0] == \
        [t for t in cfg["layer_types"] if t == "full_attention"]  # NoPE global layers
    assert cfg["final_logit_softcapping"] > 0 and cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    for s in ("<|eot|>", "<|mask|>", "<|patch|>", "<|begin_of_text|>"):
        assert tok.token_to_id(s) is not None, s
    assert tok.token_to_id("<|eot|>") in tok.eos_token_ids


def test_embedded_logits_match_transformers(embedded):
    """The shipped HF checkpoint through transformers' reference implementation vs our MLX model."""
    from safetensors.torch import load_file
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    model, tok = embedded
    raw = json.loads((embedded_path() / "config.json").read_text())
    cfg = MuseGlimmerConfig(text_config=raw["text_config"], vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
        pos_emb_height=4, pos_emb_width=4), out_hidden_size=128, projector_hidden_size=48)
    hf = MuseGlimmerForConditionalGeneration(cfg).eval()
    missing, unexpected = hf.load_state_dict(load_file(embedded_path() / "model.safetensors"), strict=False)
    assert not unexpected and all("vision" in k or "projector" in k for k in missing)
    ids = tok.apply_chat_template([{"role": "user", "content": "What does `os.path.join` do?"}], tokenize=True)
    ids += tok.encode("def f(x):\n    return x + 1\n" * 20, add_special_tokens=False)  # past the 128-token window
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    ours = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    assert len(ids) > 128
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


SHIPPED = [k for k in ("dflash", "dflash2", "mtp") if (MODELS / f"glimmer-tiny-{k}" / "config.json").exists()]


@pytest.mark.parametrize("kind,width", [(k, 2 if k == "mtp" else 16) for k in SHIPPED])
def test_embedded_drafters_are_lossless_and_accept(embedded, kind, width):
    model, tok = embedded
    drafter = load_drafter(str(embedded_path(kind)), model)
    assert isinstance(drafter, {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter, "mtp": MTPDrafter}[kind])
    prompt = tok.apply_chat_template([{"role": "user", "content": "Show me the source of `textwrap.dedent`."}],
                                     tokenize=True)
    plain = generate(model, prompt, tokenizer=tok, max_tokens=64)
    spec = generate(model, prompt, tokenizer=tok, max_tokens=64, drafter=drafter, block_size=width)
    assert spec.tokens == plain.tokens
    # trained drafters accept (the small budget shows: see the model card for τ on held-out prompts)
    assert spec.stats.extra["tau"] > (1.3 if kind == "mtp" else 1.05), spec.stats.extra


def test_default_dflash_drafter_is_the_shipped_best():
    """Commands without --draft-model take `DEFAULT_DFLASH`: a shipped folder whose measured held-out τ (the measure
    stage's figures) is the best DFlash one."""
    assert default_dflash() == embedded_path(DEFAULT_DFLASH) and DEFAULT_DFLASH in SHIPPED
    figures = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "embedded_figures.json"
    if not figures.exists():
        pytest.skip("no measured figures")
    runs = json.loads(figures.read_text())["runs"]
    taus = {k: sum(runs[f"{c}/T=0"][f"{k}-16"]["tau"] for c in ("code", "chat"))
            for k in ("dflash", "dflash2") if f"{k}-16" in runs["code/T=0"]}
    assert max(taus, key=taus.get) == DEFAULT_DFLASH, taus


def test_strategy_takes_the_default_dflash_drafter():
    from glimmer_mlx.strategy import load_drafters

    model, _ = load(str(embedded_path()))
    d = load_drafters(model, embedded=True, want=("dflash",))
    assert isinstance(d.dflash, DFlash2Drafter if DEFAULT_DFLASH == "dflash2" else DFlashDrafter)


def test_cli_defaults_to_embedded_model_and_says_so(monkeypatch):
    import glimmer_mlx.embedded as embedded_module

    monkeypatch.setattr(embedded_module, "_announced", set())
    r = CliRunner().invoke(app, ["generate", "-p", "What is 12 + 30?", "-m", "12", "--mtp"])
    assert r.exit_code == 0, r.output
    assert r.output.count("no --model given: using the embedded") == 2  # target + MTP layer, each once
    assert "τ" in r.output


def test_package_data_carries_every_shipped_folder():
    """A wheel carries what ships: every glimmer-tiny* folder is named in pyproject's package-data."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["glimmer_mlx"]
    shipped = {d.name for d in MODELS.iterdir() if d.is_dir() and (d / "config.json").exists()}
    assert shipped and {f"embedded/{name}/*" for name in shipped} <= set(data), (shipped, data)
