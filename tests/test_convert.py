"""`glimmer convert` (issue 7): round trips per quantization mode, exact mlx layout, mlx-lm interop, vision / MTP
tensors kept, drafter τ kept, every failure path leaves no partial output, bounded memory on multi-shard sources."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import glimmer_mlx
from glimmer_mlx import convert as cv
from glimmer_mlx.convert import ConvertError, build_plan, convert, eval_target
from glimmer_mlx.loading import CheckpointError

IDS = [5, 20, 100, 7, 300, 42, 17, 9, 250, 11, 3, 77, 401, 2, 99, 123]

# mode -> (convert kwargs, (min, max) relative weight error of the quantized tensors, max relative logit error vs the
# unquantized model). The tiny random checkpoint (weights N(0, 0.08), D=64) amplifies weight error ~8x into the
# logits; measured values are ~2/3 of the bounds (BENCHMARKS.md "Conversion (issue 7)").
MODES = {
    "bf16": (dict(dtype="bf16"), None, 0.08),
    "affine8": (dict(quantize=True, q_bits=8), (0.004, 0.007), 0.16),
    "affine4": (dict(quantize=True), (0.07, 0.11), 1.05),
    "affine3_g32": (dict(quantize=True, q_bits=3, q_group_size=32), (0.12, 0.2), 1.6),
    "mxfp4": (dict(quantize=True, q_mode="mxfp4"), (0.09, 0.14), 1.4),
    "nvfp4": (dict(quantize=True, q_mode="nvfp4"), (0.07, 0.12), 1.2),
    "mxfp8": (dict(quantize=True, q_mode="mxfp8"), (0.02, 0.035), 0.5),
    "mixed_2_6": (dict(recipe="mixed_2_6"), (0.015, 0.45), 1.9),
    "mixed_3_4": (dict(recipe="mixed_3_4"), (0.07, 0.22), 1.6),
    "mixed_3_6": (dict(recipe="mixed_3_6"), (0.015, 0.22), 1.6),
    "mixed_4_6": (dict(recipe="mixed_4_6"), (0.015, 0.11), 1.05),
    "glimmer_4_6": (dict(recipe="glimmer_4_6"), (0.003, 0.11), 0.9),
}


@pytest.fixture(scope="module")
def src(tiny_checkpoint):
    path, _ = tiny_checkpoint(tokenizer=True)
    return path


@pytest.fixture(scope="module")
def ref(src):
    model, _ = glimmer_mlx.load(src)
    return model, model(mx.array([IDS]))[0]


def rel(a, b) -> float:
    return float(mx.linalg.norm(a.astype(mx.float32) - b) / mx.linalg.norm(b))


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".glimmer-" in p.name]


# -- round trips ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip(src, ref, tmp_path, mode):
    """Each mode: loads with glimmer_mlx.load; every quantized module holds exactly mx.quantize(source weight);
    logits within the mode's expected error of the unquantized model; errors grow as bits shrink."""
    kw, werr, lerr = MODES[mode]
    out = tmp_path / "out"
    res = convert(src, out, evaluate=False, **kw)
    model, tok = glimmer_mlx.load(out)
    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert tok is not None and sum(k.startswith("vision_") for k in wm) == 41
    base, z0 = ref
    assert rel(model(mx.array([IDS]))[0], z0) < lerr
    q = res.quality["tensors"]
    if werr is None:
        assert not any(t["quant"] for t in q.values())
        return
    errs = [t["rel_error"] for t in q.values() if t["quant"]]
    assert werr[0] <= min(errs) and max(errs) <= werr[1], (min(errs), max(errs))
    src_w = dict(tree_flatten(base.parameters()))
    n = 0
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            p = q[f"{path}.weight"]["quant"]
            assert (m.bits, m.group_size, m.mode) == (p["bits"], p["group_size"], p["mode"])
            expect = mx.quantize(src_w[f"{path}.weight"], group_size=m.group_size, bits=m.bits, mode=m.mode)
            assert mx.array_equal(m.weight, expect[0]) and mx.array_equal(m.scales, expect[1])
            n += 1
    assert n == res.summary["tensors_quantized"] == 50  # 6 layers x 8 linears + embedding + lm_head


def test_recipe_bits_follow_mlx_lm(src, tmp_path):
    """mixed_3_6 on 6 layers: mlx-lm's rule puts v_proj/down_proj of layers 0 and 5 (first/last eighth: 6//8 = 0, so
    index < 0 never; index >= 42//8 = 5) and 2 ((2 − 0) % 3 == 2), and lm_head, at 6 bits; the rest at 3.
    glimmer_4_6: k/v_proj at 8 bits everywhere, embedding and lm_head at 6, the rest 4. Per-module entries are
    written to config.json."""
    res = convert(src, tmp_path / "m", recipe="mixed_3_6", evaluate=False)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"]
    bits = {k: v["bits"] for k, v in cfg["quantization"].items() if isinstance(v, dict)}
    six = {k for k, b in bits.items() if b == 6}
    assert six == {"lm_head"} | {f"model.layers.{i}.{m}" for i in (2, 5) for m in ("self_attn.v_proj", "mlp.down_proj")}
    assert set(bits.values()) == {3, 6} and len(bits) == res.summary["tensors_quantized"]
    convert(src, tmp_path / "g", recipe="glimmer_4_6", evaluate=False)
    g = json.loads((tmp_path / "g" / "config.json").read_text())["quantization"]
    assert all(g[f"model.layers.{i}.self_attn.{p}"]["bits"] == 8 for i in range(6) for p in ("k_proj", "v_proj"))
    assert g["lm_head"]["bits"] == g["model.embed_tokens"]["bits"] == 6
    assert {v["bits"] for k, v in g.items() if isinstance(v, dict) and "_proj" in k and "k_proj" not in k
            and "v_proj" not in k} == {4}
    with pytest.raises(ConvertError, match="affine-only"):
        convert(src, tmp_path / "x", recipe="mixed_4_6", q_mode="mxfp4")
    with pytest.raises(ConvertError, match="invalid quantization"):
        convert(src, tmp_path / "x", quantize=True, q_mode="mxfp4", q_group_size=64)
    assert not (tmp_path / "x").exists()


def test_layout_and_report(src, tmp_path):
    """mlx-lm's layout: numbered shards ≤ the limit with {"format": "mlx"}, an index naming every tensor, config with
    explicit layer lists, tokenizer / chat template / generation_config copied, model card and quality.json."""
    out = tmp_path / "out"
    res = convert(src, out, quantize=True, max_shard_bytes=64 << 10)
    shards = sorted(out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and [s.name for s in shards] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    seen = {}
    for s in shards:
        with safe_open(str(s), "np") as f:
            assert f.metadata() == {"format": "mlx"}
            seen.update({k: s.name for k in f.keys()})
        tensors = load_file(str(s))
        big = max(v.nbytes for v in tensors.values())
        assert sum(v.nbytes for v in tensors.values()) <= max(64 << 10, big * 3)
    assert index["weight_map"] == seen and index["metadata"]["total_size"] == res.summary["bytes_out"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"} == cfg["quantization_config"]
    assert len(cfg["text_config"]["layer_types"]) == 6 and cfg["text_config"]["layer_rope_theta"][1] == 0
    assert cfg["vision_config"] and cfg["tie_word_embeddings"] is False
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md", "quality.json"):
        assert (out / f).exists(), f
    q = json.loads((out / "quality.json").read_text())
    assert {"kl_mean", "top1_agreement", "sample"} <= set(q["logits"]) and q["logits"]["positions"] > 8
    assert [r["group"] for r in q["layers"]][:3] and any(r["group"] == "model.layers.5" for r in q["layers"])
    card = (out / "README.md").read_text()
    assert "library_name: mlx" in card and str(src) in card and "affine 4-bit" in card and "KL" in card
    assert res.summary["peak_rss_convert_bytes"] > 0 and res.summary["throughput_mb_s"] > 0


def test_streamed_quality_check_matches_loaded_models(src, ref, tmp_path):
    """The layer-by-layer quality check computes exactly the logits of the two loaded models."""
    convert(src, tmp_path / "o", recipe="mixed_3_4", evaluate=False)
    plan = build_plan(src, None, cv.QuantSettings(recipe="mixed_3_4"))
    metrics, (z, zq) = eval_target(plan, tmp_path / "o", IDS, return_logits=True)
    q, _ = glimmer_mlx.load(tmp_path / "o")
    assert mx.allclose(z, ref[1], atol=1e-5) and mx.allclose(zq, q(mx.array([IDS]))[0], atol=1e-5)
    assert 0 < metrics["kl_mean"] and 0 <= metrics["top1_agreement"] <= 1


def output_tensors(out: Path, prefix: str = "") -> dict[str, mx.array]:
    w = {}
    for f in sorted(out.glob("model-*.safetensors")):
        w.update({k: v for k, v in mx.load(str(f)).items() if k.startswith(prefix)})
    return w


def test_vision_tensors_kept_or_quantized(src, tmp_path):
    """Kept bit-exact by default (named as the vision tower module expects); with quantize_vision the linear weights
    of tower / adapter / projection are quantized (not norms, biases, patch or position embeddings)."""
    raw = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k.startswith("model.vision")}
    convert(src, tmp_path / "keep", quantize=True, evaluate=False)
    vw = output_tensors(tmp_path / "keep", "vision_")
    assert set(vw) == {k[len("model."):] for k in raw}
    assert all(np.array_equal(np.array(vw[k[len("model."):]]), v) for k, v in raw.items())
    glimmer_mlx.load(tmp_path / "keep")
    res = convert(src, tmp_path / "q", quantize=True, quantize_vision=True, q_group_size=32, evaluate=False)
    vq = output_tensors(tmp_path / "q", "vision_")
    glimmer_mlx.load(tmp_path / "q")  # the text path loads whatever the vision loader makes of quantized tensors
    quantized = sorted(k[: -len(".scales")] for k in vq if k.endswith(".scales"))
    assert "vision_tower.layers.0.attn.q_proj" in quantized and "vision_adapter.fc1" in quantized  # (48 % 32: no)
    assert not any("norm" in k or "patch_embedder" in k for k in quantized)
    w = raw["model.vision_tower.layers.0.mlp.fc1.weight"]
    deq = mx.dequantize(vq["vision_tower.layers.0.mlp.fc1.weight"], vq["vision_tower.layers.0.mlp.fc1.scales"],
                        vq["vision_tower.layers.0.mlp.fc1.biases"], group_size=32, bits=4)
    assert 0 < rel(deq, mx.array(w)) < 0.12
    assert res.quality["tensors"]["vision_tower.layers.0.mlp.fc1.weight"]["quant"]["bits"] == 4


# -- mlx-lm interop -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(text_only=True, quantize=True), dict(recipe="mixed_4_6"), dict()],
                         ids=["text-only-q4", "full-mixed_4_6", "full-fp32"])
def test_mlx_lm_loads_converted_checkpoint(tiny_checkpoint, tmp_path, kw):
    """A config without layer_types / layer_rope_theta: mlx-lm would derive another pattern (§6 row 1); the
    converted config spells both out, so mlx-lm and glimmer give the same logits."""
    import mlx_lm

    path, _ = tiny_checkpoint(tokenizer=True, drop_layer_lists=True)
    out = tmp_path / "out"
    convert(path, out, evaluate=False, **kw)
    cfg = json.loads((out / "config.json").read_text())
    text = cfg if kw.get("text_only") else cfg["text_config"]
    assert "layer_types" in text and "layer_rope_theta" in text
    if kw.get("text_only"):
        assert cfg["model_type"] == "muse_glimmer" and "vision_config" not in cfg and "text_config" not in cfg
    ours, _ = glimmer_mlx.load(out)
    theirs, _ = mlx_lm.load(str(out))
    x = mx.array([IDS])
    assert mx.allclose(ours(x), theirs(x).astype(mx.float32), atol=1e-4)


# -- MTP ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_src(src, tmp_path_factory):
    """The tiny checkpoint plus one MTP layer (`mtp.*`, transformers' generic layout) and num_mtp_layers."""
    path = tmp_path_factory.mktemp("mtp_src")
    for f in src.iterdir():
        shutil.copy(f, path / f.name)
    w = load_file(str(src / "model.safetensors"))
    rng = np.random.RandomState(0)
    mtp = {}
    for k, v in w.items():
        if k.startswith("model.language_model.layers.0."):
            mtp["mtp.layers.0.mtp_block." + k[len("model.language_model.layers.0."):]] = (
                v + rng.normal(0, 0.02, v.shape).astype(np.float32))
    D = 64
    mtp["mtp.layers.0.eh_proj.weight"] = rng.normal(0, 0.08, (D, 2 * D)).astype(np.float32)
    for n in ("enorm", "hnorm", "post_norm"):
        mtp[f"mtp.layers.0.{n}.weight"] = (1 + rng.normal(0, 0.1, D)).astype(np.float32)
    save_file(mtp, str(path / "mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"].update(num_mtp_layers=1, mtp_layer_types=["full_attention"])
    (path / "config.json").write_text(json.dumps(cfg))
    return path, mtp


def test_mtp_tensors_survive_conversion(mtp_src, tmp_path):
    path, mtp = mtp_src
    out = tmp_path / "out"
    res = convert(path, out, quantize=True, q_group_size=32)
    assert res.summary["parts"]["mtp"] == len(mtp) == 16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["num_mtp_layers"] == 1 and cfg["text_config"]["mtp_layer_types"] == ["full_attention"]
    model, _ = glimmer_mlx.load(out)
    carried = model.mtp_weights.weights
    for k, v in mtp.items():
        if v.ndim == 2:  # quantized like the text tower, values within 4-bit error
            base = k[: -len(".weight")]
            assert carried[k].dtype == mx.uint32 and base + ".scales" in carried
            deq = mx.dequantize(carried[k], carried[base + ".scales"], carried[base + ".biases"], 32, 4)
            assert rel(deq, mx.array(v)) < 0.1
        else:
            assert np.array_equal(np.array(carried[k]), v)
    assert len(carried) == len(mtp) + 2 * sum(v.ndim == 2 for v in mtp.values())
    # the MTP drafter loads from the converted (quantized) checkpoint and decoding stays lossless
    from glimmer_mlx.speculative import load_drafter

    d = load_drafter(out, model)
    a = glimmer_mlx.generate(model, IDS[:6], max_tokens=12, drafter=d)
    assert a.tokens == glimmer_mlx.generate(model, IDS[:6], max_tokens=12).tokens


# -- DFlash drafter -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tests/dflash_training.trained_pair, with the trained drafter saved as a checkpoint folder."""
    from dflash_training import trained_pair

    tmp = tmp_path_factory.mktemp("pair")
    model, drafter, held, _ = trained_pair(tmp, steps=150)
    d = tmp / "drafter_trained"
    d.mkdir()
    shutil.copy(tmp / "drafter" / "config.json", d / "config.json")
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(drafter.assistant.parameters())))
    return tmp, model, drafter, held


def test_drafter_conversion_keeps_tau(trained, tmp_path):
    from dflash_training import mean_tau

    from glimmer_mlx.speculative import load_drafter

    tmp, model, drafter, held = trained
    res = convert(tmp / "drafter_trained", tmp_path / "d4", quantize=True, target=tmp / "target",
                  eval_prompts=held[:3], eval_max_tokens=32)
    d = res.quality["drafter"]
    assert d["tau_source"] == pytest.approx(mean_tau(model, drafter, held[:3], max_tokens=32), abs=1e-9)
    assert d["tau_source"] > 2.3 and d["tau_converted"] >= d["tau_source"] - 0.15
    assert d["greedy_identical_to_plain"] and d["draft_logits"]["top1_agreement"] > 0.85
    cfg = json.loads((tmp_path / "d4" / "config.json").read_text())
    assert cfg["model_type"] == "muse_glimmer_assistant" and cfg["quantization"]["bits"] == 4
    q = load_drafter(tmp_path / "d4", model)
    assert isinstance(q.assistant.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(q.assistant.encoder.fc, nn.QuantizedLinear)
    assert "τ" in (tmp_path / "d4" / "README.md").read_text()
    # without --target the drafter converts and the report says why τ is missing
    res = convert(tmp / "drafter_trained", tmp_path / "d8", quantize=True, q_bits=8)
    assert "drafter" not in res.quality and any("--target" in n for n in res.summary["notes"])


# -- failure paths ------------------------------------------------------------------------------------------------------


def test_bad_sources(src, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="no such folder"):
        convert(tmp_path / "nope", out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        convert(tmp_path / "empty", out)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        convert(bad, out)
    w = load_file(str(src / "model.safetensors"))
    w.pop("model.language_model.layers.3.mlp.up_proj.weight")
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.3\.mlp\.up_proj"):
        convert(bad, out)
    convert(src, tmp_path / "q", quantize=True, evaluate=False)
    with pytest.raises(ConvertError, match="already quantized"):
        convert(tmp_path / "q", out, quantize=True)
    with pytest.raises(ConvertError, match="must not be the source"):
        convert(tmp_path / "q", tmp_path / "q" / "sub", force=True)
    assert not out.exists() and not leftovers(tmp_path)


def test_existing_out_needs_force(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="already exists.*--force"):
        convert(src, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert(src, out, quantize=True, force=True, evaluate=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("existing", [False, True])
def test_failure_mid_way_leaves_no_partial_output(src, tmp_path, monkeypatch, exc, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    calls = []
    real = cv._write_item

    def flaky(*a):
        calls.append(1)
        if len(calls) == 30:
            raise exc
        return real(*a)

    monkeypatch.setattr(cv, "_write_item", flaky)
    expected = ConvertError if isinstance(exc, Exception) else KeyboardInterrupt
    with pytest.raises(expected) as ei:
        convert(src, out, quantize=True, force=existing, max_shard_bytes=64 << 10)
    assert "nothing was written" in str(ei.value) and "writing shards" in str(ei.value)
    assert not leftovers(tmp_path)
    assert (sorted(os.listdir(out)) == ["keep.txt"]) if existing else not out.exists()


def test_failure_in_quality_check_and_disk_space(src, tmp_path, monkeypatch):
    out = tmp_path / "sub" / "out"
    monkeypatch.setattr(cv, "eval_target", lambda *a, **k: 1 / 0)
    with pytest.raises(ConvertError, match="quality check: ZeroDivisionError"):
        convert(src, out)
    assert not (tmp_path / "sub").exists()  # the parent it created is removed too
    monkeypatch.setattr(cv, "_free_bytes", lambda p: 1000)
    with pytest.raises(ConvertError, match="not enough free disk space.*0.00 GB are free"):
        convert(src, out, evaluate=False)
    assert not leftovers(tmp_path)


def test_stale_temp_folder_of_a_killed_run_is_removed(src, tmp_path):
    stale = tmp_path / f".out.glimmer-convert-{2**22 + 12345}-deadbeef"  # no such pid
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    convert(src, tmp_path / "out", evaluate=False)
    assert not stale.exists() and (tmp_path / "out" / "config.json").exists()


def test_cli(src, tmp_path):
    from glimmer_mlx.cli import app

    runner = CliRunner()
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(src), str(out), "-q", "--q-bits", "8", "--max-shard-size", "100KB"])
    assert r.exit_code == 0, r.output
    assert "KL mean" in r.output and "bits/weight" in r.output and len(list(out.glob("model-*"))) > 1
    r = runner.invoke(app, ["convert", str(src), str(out), "-q"])
    assert r.exit_code == 1 and "already exists" in r.output
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o2"), "--recipe", "mixed_9_9"])
    assert r.exit_code == 1 and "unknown quantization recipe" in r.output
    r = runner.invoke(app, ["info", "muse-glimmer-30b", "--plan", "--context", "32768"])
    assert r.exit_code == 0 and "DFlash drafter" in r.output and "128GB" in r.output and "sysctl" in r.output


# -- memory -------------------------------------------------------------------------------------------------------------


def test_peak_memory_bounded_on_multi_shard_source(tmp_path, monkeypatch):
    """A ~19 MB checkpoint in 5 source shards → 4-bit in many output shards: MLX's peak memory while writing stays
    near one row chunk (set to 64K elements here), far below one source shard, the largest tensor, or the model."""
    from hf_fixtures import build_hf_model

    hf = build_hf_model({"hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096, "num_hidden_layers": 4,
                         "head_dim": 64}, seed=3)
    srcp = tmp_path / "src"
    hf.save_pretrained(srcp, safe_serialization=True, max_shard_size="4MB")
    assert len(list(srcp.glob("*.safetensors"))) >= 5
    monkeypatch.setattr(cv, "CHUNK_ELEMS", 1 << 16)
    res = convert(srcp, tmp_path / "q", quantize=True, max_shard_bytes=1 << 20, evaluate=False)
    s = res.summary
    largest_tensor = 4096 * 256 * 4
    assert s["bytes_in"] > 18e6 and len(s["shards"]) >= 4
    assert s["peak_mlx_convert_bytes"] < largest_tensor / 2, s["peak_mlx_convert_bytes"]
    # exact round trip through both shardings (dtype-only conversion)
    convert(srcp, tmp_path / "f", evaluate=False, max_shard_bytes=3 << 20)
    a, _ = glimmer_mlx.load(srcp)
    b, _ = glimmer_mlx.load(tmp_path / "f")
    x = mx.array([[1, 2, 3, 4000, 17]])
    assert mx.array_equal(a(x), b(x))


# -- OUT: reservation, concurrent conversions, --force recovery ------------------------------------------------------


def during_first_write(monkeypatch, action):
    """Run `action()` once, while the conversion writes its first tensor."""
    real, done = cv._write_item, []

    def hook(*a):
        if not done:
            done.append(1)
            action()
        return real(*a)

    monkeypatch.setattr(cv, "_write_item", hook)
    return done


def cli_error_line(res) -> str:
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit) and "Traceback" not in res.output, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.stderr
    return errors[0]


def _fill_reserved(out: Path):
    out.mkdir(exist_ok=True)  # `mkdir -p OUT && cp … OUT/`: somebody else's files land in OUT
    (out / "theirs.txt").write_text("not yours")


def _replace_reserved(out: Path):
    shutil.rmtree(out, ignore_errors=True)  # somebody else's folder in its place
    out.mkdir()
    (out / "theirs.txt").write_text("not yours")


@pytest.mark.parametrize("intruder", [_fill_reserved, _replace_reserved], ids=["files_put_in_out", "out_replaced"])
def test_out_created_by_someone_else_while_converting_is_left_alone(src, tmp_path, monkeypatch, intruder):
    """OUT is reserved (an empty folder of our own) when the conversion starts; whatever someone else puts at OUT
    meanwhile is never replaced nor deleted: the conversion fails naming OUT (the old code moved it aside and deleted
    it, exit 0)."""
    out = tmp_path / "out"
    done = during_first_write(monkeypatch, lambda: intruder(out))
    with pytest.raises(ConvertError, match=r"out was changed by someone else while converting.*left as it is"):
        convert(src, out, evaluate=False)
    assert done and sorted(os.listdir(out)) == ["theirs.txt"] and (out / "theirs.txt").read_text() == "not yours"
    assert not leftovers(tmp_path)


def test_two_conversions_to_one_out(src, tmp_path, monkeypatch):
    """A second conversion to the same OUT (with or without --force) fails with one line while the first runs, and
    never touches the first's output; the first completes."""
    from glimmer_mlx.cli import app

    out = tmp_path / "out"
    second = []

    def run_second():
        for extra in ([], ["--force"]):
            second.append(CliRunner().invoke(app, ["convert", str(src), str(out), "--no-eval", *extra]))

    during_first_write(monkeypatch, run_second)
    res = convert(src, out, evaluate=False)
    assert len(second) == 2
    for r in second:
        line = cli_error_line(r)
        assert f"another conversion (pid {os.getpid()}) is writing it right now" in line and str(out) in line
    assert res.out == out and glimmer_mlx.load(out)[0] is not None and not leftovers(tmp_path)


def test_stale_reservation_of_a_killed_conversion_is_reclaimed(src, tmp_path):
    """A conversion killed outright leaves its empty reserved OUT (only the marker in it): the rerun reuses it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / cv.RESERVED_MARKER).write_text(str(2**22 + 12345))
    convert(src, out, evaluate=False)
    assert (out / "config.json").exists() and not (out / cv.RESERVED_MARKER).exists() and not leftovers(tmp_path)
    # a folder that holds anything else is not ours: refused without --force
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / cv.RESERVED_MARKER).write_text("1")
    (tmp_path / "o2" / "mine.txt").write_text("mine")
    with pytest.raises(ConvertError, match="already exists"):
        convert(src, tmp_path / "o2", evaluate=False)
    assert sorted(os.listdir(tmp_path / "o2")) == [cv.RESERVED_MARKER, "mine.txt"]


KILL = """
import os, shutil, sys
real_rename, real_rmtree = os.rename, shutil.rmtree
def rename(a, b, *k, **kw):
    if sys.argv[1] == "between-renames" and os.path.basename(str(a)).startswith(".out.glimmer-convert-"):
        os._exit(137)  # killed after moving the old OUT aside, before moving the new one in
    return real_rename(a, b, *k, **kw)
def rmtree(p, *k, **kw):
    if sys.argv[1] == "before-delete" and ".glimmer-old-" in os.path.basename(str(p)):
        os._exit(137)  # killed after the swap, before deleting the old OUT
    return real_rmtree(p, *k, **kw)
os.rename, shutil.rmtree = rename, rmtree
from glimmer_mlx.cli import app
app(["convert", sys.argv[2], sys.argv[3], "--force", "--no-eval"])
"""


def killed_force_conversion(src, out, where) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", KILL, where, str(src), str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 137, r.stdout + r.stderr


def test_force_killed_between_its_two_renames(src, tmp_path):
    """--force moves the old OUT to OUT.glimmer-old-<pid>, then the new folder in. Killed in between, OUT is missing:
    the next conversion to OUT restores the user's folder and says where it came from (the old code converted
    anew, exit 0, and left the old folder hidden as .OUT.glimmer-old-…)."""
    from glimmer_mlx.cli import app

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    killed_force_conversion(src, out, "between-renames")
    backups = [p.name for p in tmp_path.iterdir() if p.name.startswith("out.glimmer-old-")]
    assert not out.exists() and len(backups) == 1 and (tmp_path / backups[0] / "keep.txt").read_text() == "mine"
    res = CliRunner().invoke(app, ["convert", str(src), str(out), "--no-eval"])
    assert f"your previous folder was restored from {tmp_path / backups[0]}" in res.stderr.replace("\n", " ")
    assert "already exists; pass --force" in cli_error_line(res)  # restored; replacing it again needs --force
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert not leftovers(tmp_path)  # the killed run's temp folder is gone too


def test_force_killed_before_deleting_the_old_folder(src, tmp_path):
    """Killed after the swap: OUT is the new conversion; the old folder stays as OUT.glimmer-old-<pid> and every
    later conversion to OUT says where it is; nothing deletes it silently."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    killed_force_conversion(src, out, "before-delete")
    backup = next(p for p in tmp_path.iterdir() if p.name.startswith("out.glimmer-old-"))
    assert (out / "config.json").exists() and (backup / "keep.txt").read_text() == "mine"
    notes = []
    convert(src, out, force=True, evaluate=False, log=notes.append)
    assert any(f"{backup} holds what {out} held before" in n and "it is kept" in n for n in notes), notes
    assert (backup / "keep.txt").read_text() == "mine" and (out / "config.json").exists()


def test_force_second_rename_failing_puts_the_old_folder_back(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    real = os.rename

    def rename(a, b):
        if os.path.basename(str(a)).startswith(".out.glimmer-convert-"):
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(ConvertError, match="moving the result into place.*the existing folder is unchanged"):
        convert(src, out, force=True, evaluate=False)
    assert sorted(os.listdir(out)) == ["keep.txt"] and not leftovers(tmp_path)


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
@pytest.mark.parametrize("force", [False, True])
def test_out_is_the_source_inside_it_or_above_it(src, tmp_path, where, force):
    """Refused up front with one line, with or without --force (the old code answered `OUT == SRC` without --force
    with "pass --force"), and the source is untouched."""
    from glimmer_mlx.cli import app

    s = tmp_path / "src"
    shutil.copytree(src, s)
    before = sorted(os.listdir(s))
    args = {"same": (s, s), "inside": (s, s / "sub"), "parent": (s, tmp_path)}[where]
    res = CliRunner().invoke(app, ["convert", *map(str, args), "--no-eval"] + (["--force"] if force else []))
    assert "must not be the source folder, inside it, or contain it" in cli_error_line(res)
    assert sorted(os.listdir(s)) == before and not leftovers(tmp_path)


def test_unknown_safetensors_dtype_fails_convert_naming_file_and_tensor(src, tmp_path):
    import struct

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8: 8 + n])
    name = "model.language_model.layers.1.self_attn.q_proj.weight"
    header[name]["dtype"] = "F12"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{name}' has dtype 'F12'"):
        convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
