"""Loader failure modes (each with a specific message) and the loader's positive paths: shards, dtypes, no tokenizer,
MLX-quantized checkpoints in mlx-lm's layout."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

import glimmer_mlx
from glimmer_mlx.config import ConfigError, parse_config
from glimmer_mlx.loading import CheckpointError, read_safetensors_header

IDS = [0, 17, 250, 3, 99, 400, 12, 7, 301, 42, 5, 66]
LAYER0_UP = "model.language_model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    """A private, writable copy of the tiny (unsharded, no tokenizer) checkpoint."""
    src, _ = tiny_checkpoint()
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory) -> Path:
    _, hf = tiny_checkpoint()
    path = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    return path


def logits(model, ids=IDS) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0])


def edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def raises(path, *parts, exc=CheckpointError, **kw) -> str:
    with pytest.raises(exc) as ei:
        glimmer_mlx.load(path, **kw)
    msg = str(ei.value)
    for p in parts:
        assert str(p) in msg, f"{p!r} not in error message: {msg}"
    return msg


# -- weights --------------------------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_and_matches_unsharded(tiny_checkpoint, sharded):
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    single, _ = glimmer_mlx.load(tiny_checkpoint()[0])
    multi, _ = glimmer_mlx.load(sharded)
    np.testing.assert_array_equal(logits(multi), logits(single))


def test_missing_shard(sharded, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(sharded, path)
    victim = sorted(path.glob("*.safetensors"))[1]
    victim.unlink()
    raises(path, "model.safetensors.index.json", "missing", victim.name)


def test_tensor_listed_in_index_but_absent_from_its_shard(sharded, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(sharded, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][LAYER0_UP]
    tensors = load_file(path / shard)
    del tensors[LAYER0_UP]
    save_file(tensors, path / shard)
    raises(path, shard, LAYER0_UP, "absent")


def test_missing_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors[LAYER0_UP]
    save_file(tensors, ckpt / "model.safetensors")
    # names are reported after mapping model.language_model.X -> model.X (the message says so)
    raises(ckpt, "missing tensor", "model.layers.0.mlp.up_proj.weight", "1 missing", "model.language_model.")


def test_missing_lm_head(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    raises(ckpt, "missing tensor", "lm_head.weight")


def test_extra_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.language_model.layers.0.mlp.extra_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    raises(ckpt, "unexpected tensor", "model.layers.0.mlp.extra_proj.weight", "1 extra")


def test_extra_vision_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.vision_tower.bogus.weight"] = np.zeros((4,), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    raises(ckpt, "unexpected vision tensor", "model.vision_tower.bogus.weight")


def test_wrong_shape(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    assert tensors[LAYER0_UP].shape == (128, 64)
    tensors[LAYER0_UP] = np.zeros((128, 32), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    raises(ckpt, "model.layers.0.mlp.up_proj.weight", "(128, 32)", "expected (128, 64)")


def test_wrong_vision_shape(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.vision_projection.weight"] = np.zeros((64, 40), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    raises(ckpt, "model.vision_projection.weight", "(64, 40)", "expected (64, 48)")


def test_tensor_in_two_files(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    save_file({LAYER0_UP: tensors[LAYER0_UP]}, ckpt / "extra.safetensors")
    raises(ckpt, LAYER0_UP, "another shard")


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-1000])
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    header.pop("__metadata__", None)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    msg = raises(ckpt, "model.safetensors", "truncated", last)
    data_bytes = len(data) - 8 - struct.unpack("<Q", data[:8])[0]
    assert str(data_bytes - 1000) in msg and str(data_bytes) in msg  # holds N, needs M


def test_truncated_inside_header(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    raises(ckpt, "model.safetensors", "header claims", "file has 92")


def test_file_shorter_than_length_prefix(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x01\x02\x03")
    raises(ckpt, "model.safetensors", "truncated", "3 bytes")


def test_garbage_file(ckpt):
    rng = np.random.default_rng(0)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 8 + rng.bytes(5000))
    raises(ckpt, "model.safetensors", "corrupt or truncated safetensors header", "file has 5000")


def test_header_not_json(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    f.write_bytes(data[:8] + b"{" + b"x" * (n - 1) + data[8 + n :])
    raises(ckpt, "model.safetensors", "not valid JSON")


def test_header_not_utf8(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    f.write_bytes(data[:8] + b"\xff\xfe" * (n // 2) + b" " * (n % 2) + data[8 + n :])
    raises(ckpt, "model.safetensors", "corrupt safetensors header")


def _rewrite_header(f: Path, fn) -> None:
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_header_entry_size_mismatch(ckpt):
    f = ckpt / "model.safetensors"
    _rewrite_header(f, lambda h: h[LAYER0_UP].__setitem__("shape", [128, 65]))
    raises(ckpt, "model.safetensors", LAYER0_UP, "[128, 65]", str(128 * 65 * 4), str(128 * 64 * 4))


def test_header_entry_malformed(ckpt):
    f = ckpt / "model.safetensors"
    _rewrite_header(f, lambda h: h[LAYER0_UP].pop("data_offsets"))
    raises(ckpt, "model.safetensors", LAYER0_UP, "corrupt safetensors header entry")


def test_header_entry_bad_offsets(ckpt):
    """Offsets that run backwards or start before the data section are corrupt, not a crash in mx.load."""
    f = ckpt / "model.safetensors"
    _rewrite_header(f, lambda h: h[LAYER0_UP].__setitem__("data_offsets", [-4, 128 * 64 * 4 - 4]))
    raises(ckpt, "model.safetensors", LAYER0_UP, "corrupt")


def test_header_parser_accepts_good_file(ckpt):
    header = read_safetensors_header(ckpt / "model.safetensors")
    assert header[LAYER0_UP]["shape"] == [128, 64] and header[LAYER0_UP]["dtype"] == "F32"


# -- config / folder ------------------------------------------------------------------------------------------------


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, lambda c: c.__setitem__("model_type", "llama"))
    raises(ckpt, "config.json", "unsupported model_type 'llama'", "muse_glimmer")


def test_missing_model_type(ckpt):
    edit_config(ckpt, lambda c: c.pop("model_type"))
    raises(ckpt, "config.json", "missing 'model_type'")


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"])
def test_config_missing_required_text_field(ckpt, field):
    edit_config(ckpt, lambda c: c["text_config"].pop(field))
    raises(ckpt, "config.json", "missing required field", field)


def test_config_missing_text_config(ckpt):
    edit_config(ckpt, lambda c: c.pop("text_config"))
    raises(ckpt, "config.json", "text_config")


@pytest.mark.parametrize("bad", [None, [], "x"])
def test_config_text_config_not_an_object(ckpt, bad):
    edit_config(ckpt, lambda c: c.__setitem__("text_config", bad))
    raises(ckpt, "config.json", "text_config", "object")


@pytest.mark.parametrize("field,value", [("hidden_size", "64"), ("num_attention_heads", 0), ("vocab_size", -3),
                                         ("num_key_value_heads", 0), ("num_hidden_layers", 2.5)])
def test_config_bad_field_values(ckpt, field, value):
    edit_config(ckpt, lambda c: c["text_config"].__setitem__(field, value))
    raises(ckpt, "config.json", field, repr(value))


def test_parse_config_raises_config_error_directly():
    """Without the loader around it, parse_config raises ConfigError (a ValueError) naming the source."""
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match=r"my.json: expected a JSON object, got list"):
        parse_config([], where="my.json")
    with pytest.raises(ConfigError, match=r"my.json: 'text_config' must be a JSON object, got NoneType"):
        parse_config({"model_type": "muse_glimmer", "text_config": None}, where="my.json")
    with pytest.raises(ConfigError, match=r"head_dim must be a positive integer, got 0"):
        parse_config({"model_type": "muse_glimmer_text", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                      "num_attention_heads": 1, "head_dim": 0})


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{'model_type': 'muse_glimmer',")
    raises(ckpt, "config.json", "invalid JSON")


def test_config_json_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    raises(ckpt, "config.json", "JSON object")


def test_no_config(ckpt):
    (ckpt / "config.json").unlink()
    raises(ckpt, str(ckpt), "no config.json")


def test_no_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    raises(ckpt, str(ckpt), "no *.safetensors")


def test_index_without_weight_map(sharded, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(sharded, path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    raises(path, "model.safetensors.index.json", "weight_map")


def test_path_does_not_exist(tmp_path):
    raises(tmp_path / "nope", str(tmp_path / "nope"), "no such folder")


def test_path_is_a_file(ckpt):
    raises(ckpt / "config.json", "config.json", "found a file")


def test_hub_id_offline_not_cached_fails_fast(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    hf_home = tmp_path / "hf_home"
    hf_home.mkdir()
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hf_home / "hub"))  # hub reads HF_HOME at import time only
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    msg = raises("some-owner/not-cached-model", "some-owner/not-cached-model", "HF_HUB_OFFLINE", "cache")
    assert time.perf_counter() - t0 < 10
    assert "Traceback" not in msg
    assert not any(hf_home.rglob("*.safetensors"))


def test_hub_offline_env_spelling(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE accepts the same spellings as huggingface-hub ('1', 'true', 'yes', 'on')."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "ON")
    raises("some-owner/not-cached-model", "HF_HUB_OFFLINE")


# -- dtypes, tokenizer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,expected", [("bf16", mx.bfloat16), ("fp16", mx.float16), ("fp32", mx.float32),
                                            ("bfloat16", mx.bfloat16), ("FP16", mx.float16),
                                            (mx.bfloat16, mx.bfloat16)])
def test_dtype(tiny_checkpoint, dtype, expected):
    model, _ = glimmer_mlx.load(tiny_checkpoint()[0], dtype=dtype)
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    assert dtypes == {expected}
    out = model(mx.array([IDS]))
    assert out.dtype == mx.float32 and np.isfinite(np.array(out)).all()


def test_dtype_none_keeps_checkpoint_dtype(tiny_checkpoint):
    model, _ = glimmer_mlx.load(tiny_checkpoint()[0])
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}


def test_bf16_logits_close_to_fp32(tiny_checkpoint):
    path = tiny_checkpoint()[0]
    a = logits(glimmer_mlx.load(path, dtype="fp32")[0])
    b = logits(glimmer_mlx.load(path, dtype="bf16")[0])
    assert not np.array_equal(a, b)
    # bf16 weights (8-bit mantissa) through 6 layers: small, not bitwise, differences
    assert np.abs(a - b).mean() < 0.1 and np.abs(a - b).max() < 1.5
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.7


@pytest.mark.parametrize("bad", ["int8", "float64", "", "q4"])
def test_bad_dtype(tiny_checkpoint, bad):
    with pytest.raises(ValueError, match=rf"unknown dtype {bad!r}.*bf16, fp16, fp32"):
        glimmer_mlx.load(tiny_checkpoint()[0], dtype=bad)


@pytest.mark.parametrize("bad", [mx.int8, mx.uint32, mx.float64])
def test_bad_mx_dtype(tiny_checkpoint, bad):
    with pytest.raises(ValueError, match="unsupported dtype"):
        glimmer_mlx.load(tiny_checkpoint()[0], dtype=bad)


def test_no_tokenizer_files(tiny_checkpoint):
    path = tiny_checkpoint()[0]
    assert not (path / "tokenizer.json").exists()
    model, tok = glimmer_mlx.load(path)
    assert tok is None
    assert model.eos_token_ids == {1}


def test_with_tokenizer_files(tiny_checkpoint):
    model, tok = glimmer_mlx.load(tiny_checkpoint(tokenizer=True)[0])
    assert tok is not None and {1, 2} <= tok.eos_token_ids
    assert tok.decode(tok.encode("Hello, world!", add_special_tokens=False)) == "Hello, world!"


# -- tied embeddings: HF ties only on the top-level config ----------------------------------------------------------


def test_text_config_tie_flag_follows_transformers(tiny_checkpoint):
    """MuseGlimmerForConditionalGeneration ties lm_head only when the *top-level* config says so; a
    `text_config.tie_word_embeddings` alone leaves a separate lm_head (which the checkpoint stores)."""
    from hf_fixtures import hf_logits

    path, hf = tiny_checkpoint(tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() != hf.model.language_model.embed_tokens.weight.data_ptr()
    model, _ = glimmer_mlx.load(path)
    np.testing.assert_allclose(logits(model), hf_logits(hf, IDS).numpy(), atol=1e-3)


def test_top_level_tie_flag(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    embed = tensors["model.language_model.embed_tokens.weight"]
    del tensors["lm_head.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    edit_config(ckpt, lambda c: c.__setitem__("tie_word_embeddings", True))
    model, _ = glimmer_mlx.load(ckpt)
    assert "lm_head" not in model
    h = mx.ones((1, 1, 64))
    np.testing.assert_allclose(np.array(model.lm_head_raw(h))[0, 0], embed.sum(-1), rtol=1e-5, atol=1e-4)


def test_parse_config_flat_mlx_lm_layout_keeps_its_tie_flag():
    cfg = parse_config({"model_type": "muse_glimmer", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 4,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True})
    assert cfg.text.tie_word_embeddings is True


# -- MLX-quantized checkpoints (mlx-lm layout) ----------------------------------------------------------------------


def _quantizable(p, m):
    return hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_quantized_checkpoint_mlx_lm_layout(tiny_checkpoint, tmp_path, layout):
    src, _ = tiny_checkpoint()
    model, _ = glimmer_mlx.load(src)
    nn.quantize(model, group_size=64, bits=4, class_predicate=_quantizable)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    expected = logits(model)

    out = tmp_path / "q4"
    out.mkdir()
    params = dict(tree_flatten(model.parameters()))
    assert "model.layers.0.mlp.up_proj.scales" in params and "lm_head.biases" in params
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    cfg = json.loads((src / "config.json").read_text())
    if layout == "flat":  # what mlx-lm writes for a text-only conversion
        text = cfg.pop("text_config")
        cfg.pop("vision_config")
        cfg.update(text, model_type="muse_glimmer")
    cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    (out / "config.json").write_text(json.dumps(cfg))

    loaded, tok = glimmer_mlx.load(out)
    assert tok is None and loaded.config.quantization["bits"] == 4
    assert type(loaded.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert type(loaded.model.embed_tokens).__name__ == "QuantizedEmbedding"
    np.testing.assert_allclose(logits(loaded), expected, atol=1e-5)
    # and quantization changed something vs. the fp32 checkpoint (the test is not vacuous)
    assert np.abs(expected - logits(glimmer_mlx.load(src)[0])).max() > 1e-3


def test_quantized_checkpoint_with_per_module_override(tiny_checkpoint, tmp_path):
    """mlx-lm's mixed quantization: global bits plus `{"<module path>": {group_size, bits}}` overrides."""
    src, _ = tiny_checkpoint()
    model, _ = glimmer_mlx.load(src)

    def pred(p, m):
        if not _quantizable(p, m):
            return False
        return {"group_size": 64, "bits": 8} if p == "lm_head" else True

    nn.quantize(model, group_size=64, bits=4, class_predicate=pred)
    assert model.lm_head.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
    expected = logits(model)
    out = tmp_path / "mixed"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine", "lm_head": {"group_size": 64, "bits": 8}}
    (out / "config.json").write_text(json.dumps(cfg))
    loaded, _ = glimmer_mlx.load(out)
    assert loaded.lm_head.bits == 8 and loaded.model.layers[0].mlp.up_proj.bits == 4
    np.testing.assert_allclose(logits(loaded), expected, atol=1e-5)


def test_quantized_checkpoint_without_quantization_config(tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint()
    model, _ = glimmer_mlx.load(src)
    nn.quantize(model, group_size=64, bits=4, class_predicate=_quantizable)
    out = tmp_path / "q"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    shutil.copy(src / "config.json", out / "config.json")
    raises(out, "unexpected tensor", ".scales", "looks quantized", "'quantization'")


def test_quantized_checkpoint_with_wrong_bits_in_config(tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint()
    model, _ = glimmer_mlx.load(src)
    nn.quantize(model, group_size=64, bits=4, class_predicate=_quantizable)
    out = tmp_path / "q"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 8}
    (out / "config.json").write_text(json.dumps(cfg))
    raises(out, "model.embed_tokens.weight", "(512, 8)", "expected (512, 16)", "bits=8")


# -- every command on broken checkpoints: one line naming the file (and field), exit 1, no traceback -----------------


def _replace_with_folder(name):
    def fn(p: Path):
        (p / name).unlink()
        (p / name).mkdir()
        (p / name / "x").write_text("a folder where a file belongs")
    return fn


def _write(name, data):
    def fn(p: Path):
        (p / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return fn


def _json(name, value):
    return _write(name, json.dumps(value))


def _symlink_loop(name):
    def fn(p: Path):
        (p / name).unlink()
        (p / name).symlink_to(p / name)
    return fn


def _dangling(name):
    def fn(p: Path):
        (p / name).unlink()
        (p / name).symlink_to(p / "gone.bin")
    return fn


def _header(fn_header):
    def fn(p: Path):
        _rewrite_header(p / "model.safetensors", fn_header)
    return fn


def _config(fn_cfg):
    def fn(p: Path):
        edit_config(p, fn_cfg)
    return fn


def _shard_index(p: Path):
    (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {LAYER0_UP: "../model.safetensors"}}))


def _huge_header_length(p: Path):
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _tokenizer_config_template(p: Path):
    tc = json.loads((p / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    (p / "tokenizer_config.json").write_text(json.dumps(tc))


# case -> (break the checkpoint, strings the one error line must hold)
BROKEN = {
    "config_is_folder": (_replace_with_folder("config.json"), ["config.json", "is a folder"]),
    "weights_is_folder": (_replace_with_folder("model.safetensors"), ["model.safetensors", "is a folder"]),
    "config_not_utf8": (_write("config.json", b'{"model_type": "muse_glimmer\xff"}'), ["config.json", "UTF-8"]),
    "config_is_a_list": (_json("config.json", [1, 2]), ["config.json", "JSON object"]),
    "config_wrong_typed_field": (_config(lambda c: c["text_config"].__setitem__("num_hidden_layers", "6")),
                                 ["config.json", "num_hidden_layers"]),
    "config_symlink_loop": (_symlink_loop("config.json"), ["config.json", "symbolic link loop"]),
    "config_dangling_link": (_dangling("config.json"), ["config.json", "dangling symbolic link"]),
    "weights_symlink_loop": (_symlink_loop("model.safetensors"), ["model.safetensors", "symbolic link loop"]),
    "weights_truncated": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-999]),
                          ["model.safetensors", "truncated"]),
    "header_length_beyond_file": (_huge_header_length, ["model.safetensors", "header claims 1099511627776 bytes"]),
    "unknown_dtype": (_header(lambda h: h[LAYER0_UP].__setitem__("dtype", "Q7")),
                      ["model.safetensors", LAYER0_UP, "'Q7'", "not a safetensors dtype"]),
    "shape_not_matching_config": (_config(lambda c: c["text_config"].__setitem__("intermediate_size", 96)),
                                  ["model.layers.0.mlp.gate_proj.weight", "(128, 64)", "expected (96, 64)", "config.json"]),
    "index_shard_outside_folder": (_shard_index, ["model.safetensors.index.json", "'../model.safetensors'"]),
    "tokenizer_not_json": (_write("tokenizer.json", "{not json"), ["tokenizer.json", "not a valid tokenizer file",
                                                                   "line 1 column 2"]),
    "tokenizer_not_a_tokenizer": (_json("tokenizer.json", {"version": "1.0", "model": 42}),
                                  ["tokenizer.json", "not a valid tokenizer file"]),
    "tokenizer_symlink_loop": (_symlink_loop("tokenizer.json"), ["tokenizer.json", "symbolic link loop"]),
    "tokenizer_config_not_json": (_write("tokenizer_config.json", '{"bos_token": '), ["tokenizer_config.json",
                                                                                     "invalid JSON"]),
    "tokenizer_config_a_list": (_json("tokenizer_config.json", ["x"]), ["tokenizer_config.json", "JSON object"]),
    "tokenizer_config_bad_template": (_tokenizer_config_template, ["tokenizer_config.json", "'chat_template'",
                                                                   "invalid chat template", "line 1"]),
    "chat_template_broken": (_write("chat_template.jinja", "{% for m in messages %}\n{{ m['content'] }}\n"),
                             ["chat_template.jinja", "invalid chat template", "line 2", "endfor"]),
    "chat_template_is_folder": (lambda p: (p / "chat_template.jinja").mkdir(), ["chat_template.jinja", "folder"]),
    "generation_config_not_json": (_write("generation_config.json", "{"), ["generation_config.json", "invalid JSON"]),
    "generation_config_a_list": (_json("generation_config.json", [1]), ["generation_config.json", "JSON object"]),
    "generation_config_bad_eos": (_json("generation_config.json", {"eos_token_id": "</s>"}),
                                  ["generation_config.json", "'eos_token_id'", "'</s>'"]),
    # wrong-typed config fields that used to crash (TypeError) or load as nonsense
    "config_layer_types_not_a_list": (_config(lambda c: c["text_config"].__setitem__("layer_types", 5)),
                                      ["config.json", "layer_types must be a list"]),
    "config_sliding_window_a_string": (_config(lambda c: c["text_config"].__setitem__("sliding_window", "2k")),
                                       ["config.json", "sliding_window must be a positive integer", "'2k'"]),
    "config_rms_norm_eps_a_string": (_config(lambda c: c["text_config"].__setitem__("rms_norm_eps", "1e-6")),
                                     ["config.json", "rms_norm_eps must be a positive number"]),
    "config_rope_theta_a_string": (_config(lambda c: c["text_config"].__setitem__(
        "rope_parameters", {"rope_type": "default", "rope_theta": "1e6"})), ["config.json", "rope_parameters.rope_theta"]),
    "config_rope_parameters_a_string": (_config(lambda c: c["text_config"].__setitem__("rope_parameters", "yarn")),
                                        ["config.json", "rope_parameters must be a JSON object"]),
    "config_eos_a_string": (_config(lambda c: c["text_config"].__setitem__("eos_token_id", "</s>")),
                            ["config.json", "eos_token_id must be a token id"]),
    "config_tie_flag_a_string": (_config(lambda c: c.__setitem__("tie_word_embeddings", "yes")),
                                 ["config.json", "tie_word_embeddings must be true or false", "'yes'"]),
    "config_vision_config_a_string": (_config(lambda c: c.__setitem__("vision_config", "siglip")),
                                      ["config.json", "vision_config must be a JSON object"]),
    "config_vocab_size_absurd": (_config(lambda c: c["text_config"].__setitem__("vocab_size", 10**30)),
                                 ["config.json", "vocab_size must be a positive integer up to"]),
    "config_quantization_a_string": (_config(lambda c: c.__setitem__("quantization", "4bit")),
                                     ["config.json", "quantization"]),
    "config_num_mtp_layers_a_string": (_config(lambda c: c["text_config"].__setitem__("num_mtp_layers", "one")),
                                       ["config.json", "num_mtp_layers must be an integer"]),
    # safetensors headers that mx.load rejects with an unnamed error, or loads as nonsense
    "header_metadata_not_strings": (_header(lambda h: h.__setitem__("__metadata__", {"format": 1})),
                                    ["model.safetensors", "'__metadata__'"]),
    "header_tensors_overlap": (_header(lambda h: h[LAYER0_UP].__setitem__("data_offsets", [0, 128 * 64 * 4])),
                               ["model.safetensors", LAYER0_UP, "share bytes"]),
    "integer_dtype_for_a_float_weight": (_header(lambda h: h[LAYER0_UP].__setitem__("dtype", "I32")),
                                         ["model.layers.0.mlp.up_proj.weight", "I32", "floating-point"]),
    "chat_template_unknown_filter": (_write("chat_template.jinja", "{{ messages | nosuchfilter }}"),
                                     ["chat_template.jinja", "No filter named 'nosuchfilter'"]),
}
COMMANDS = {
    "info": lambda p, tmp: ["info", p],
    "generate": lambda p, tmp: ["generate", "--model", p, "--prompt", "hi", "-m", "2"],
    "chat": lambda p, tmp: ["chat", "--model", p, "--no-calibrate"],
    "serve": lambda p, tmp: ["serve", "--model", p, "--port", "0"],
    "convert": lambda p, tmp: ["convert", p, tmp / "out", "--no-eval"],
}


@pytest.fixture(scope="module")
def broken(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    src, _ = tiny_checkpoint(tokenizer=True)
    out = {}
    for case, (fn, _) in BROKEN.items():
        p = tmp_path_factory.mktemp(case) / "ckpt"
        shutil.copytree(src, p)
        (p / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
        fn(p)
        out[case] = p
    return out


def test_the_unbroken_checkpoint_passes_every_command_used_below(tiny_checkpoint, tmp_path):
    """The base of every broken case loads, so each case below fails for its one defect."""
    src, _ = tiny_checkpoint(tokenizer=True)
    p = tmp_path / "ok"
    shutil.copytree(src, p)
    (p / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    model, tok = glimmer_mlx.load(p)
    assert tok is not None and {1, 2} <= model.eos_token_ids
    from glimmer_mlx.info import model_info

    assert "tensor names and shapes and the tokenizer files checked" in model_info(p)["checked"]


def one_error_line(res, *parts) -> str:
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)  # not an exception escaping the command
    assert "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, res.stderr
    for part in parts:
        assert str(part) in errors[0], f"{part!r} not in {errors[0]!r}"
    return errors[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BROKEN))
def test_cli_broken_checkpoint(broken, tmp_path, monkeypatch, case, command):
    from typer.testing import CliRunner

    import glimmer_mlx.cli.sessions as sessions
    from glimmer_mlx.cli import app

    def no_server(*a, **k):
        raise AssertionError("the broken checkpoint loaded")

    monkeypatch.setattr(sessions, "GlimmerServer", no_server)
    path = broken[case]
    res = CliRunner().invoke(app, [str(a) for a in COMMANDS[command](path, tmp_path)], input="")
    one_error_line(res, *BROKEN[case][1])
    if command == "convert":
        assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # no OUT, no temp folder, no lock


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_cli_permission_denied(broken, tiny_checkpoint, tmp_path, monkeypatch, name):
    """A file that cannot be opened (EACCES; simulated: the tests may run as root, which file modes do not stop)."""
    import builtins

    from typer.testing import CliRunner

    from glimmer_mlx.cli import app

    src, _ = tiny_checkpoint(tokenizer=True)
    p = tmp_path / "ckpt"
    shutil.copytree(src, p)
    real_open = builtins.open

    def guarded(file, *a, **k):
        if str(file) == str(p / name):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    for args in (["info", p], ["generate", "--model", p, "--prompt", "hi"], ["convert", p, tmp_path / "o"]):
        res = CliRunner().invoke(app, [str(a) for a in args])
        one_error_line(res, name, "permission denied")
    assert not (tmp_path / "o").exists()


def test_info_checks_the_weights_not_only_config(ckpt):
    """`glimmer info` used to read config.json alone and exit 0 on corrupt weights; now it checks every safetensors
    header (length, offsets vs file size, dtypes) and the names / shapes against config.json, without reading data."""
    from typer.testing import CliRunner

    from glimmer_mlx.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["info", str(ckpt)])
    assert res.exit_code == 0 and "safetensors headers, tensor names and shapes" in res.stdout, res.output
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    one_error_line(runner.invoke(app, ["info", str(ckpt)]), "model.safetensors", "truncated")
    # a config-only folder is still described, and says plainly that there was nothing else to check
    f.unlink()
    res = runner.invoke(app, ["info", str(ckpt)])
    assert res.exit_code == 0 and "config.json only" in res.stdout, res.output
