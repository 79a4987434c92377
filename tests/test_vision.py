"""Vision tower, image pre-processing and multimodal generation (issue 10).

Oracles: transformers' `MuseGlimmerForConditionalGeneration` (features, logits, greedy generation) and its
`MuseGlimmerProcessor` (pixel values, grids, expanded ids: run in a subprocess, see hf_processor_oracle.py),
torch's uint8 Lanczos resize, and plain decoding (speculative decoding with images).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

import glimmer_mlx
from glimmer_mlx.image_processing import (ImageError, expand_image_placeholders, load_image, preprocess_array,
                                          preprocess_image, preprocess_video, resize_lanczos, sample_frame_indices,
                                          smart_resize, video_placeholder_text)
from glimmer_mlx.models.vision import position_taps
from glimmer_mlx.multimodal import prepare_prompt
from glimmer_mlx.tokenizer import load_tokenizer

HERE = Path(__file__).parent
VIDEO_TOKENS = ["<|video|>", "<|vid_start|>", "<|vid_end|>", "<|vid_frame_separator|>"]
IMAGE_ID, VIDEO_ID = 5, 9  # <|patch|>, <|video|> in the tiny tokenizer
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, patch_size=14,
              pos_emb_height=4, pos_emb_width=4,
              layer_types=["window_attention", "full_attention", "window_attention"])


def save_tokenizer(path: Path) -> Path:
    import conftest

    saved = conftest.SPECIAL_TOKENS
    conftest.SPECIAL_TOKENS = saved + VIDEO_TOKENS  # ids 9..12
    try:
        conftest.save_tiny_tokenizer(path)
    finally:
        conftest.SPECIAL_TOKENS = saved
    return path


def build_hf_mm(seed: int = 0):
    from hf_fixtures import TINY_TEXT, randomize_norms
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    cfg = MuseGlimmerConfig(text_config=dict(TINY_TEXT), vision_config=dict(VISION), image_token_id=IMAGE_ID,
                            video_token_id=VIDEO_ID, out_hidden_size=VISION["hidden_size"] * 4,
                            projector_hidden_size=48)
    model = MuseGlimmerForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.5 if name == "lm_head.weight" else 0.08)
            elif "vision_tower" in name and name.endswith("bias"):
                p.normal_(0.0, 0.05)
        # a position table on the scale of the patch embeddings, so the resampling rule shows in the outputs
        model.model.vision_tower.patch_embedder.position_embedding_table.weight.mul_(30.0)
    randomize_norms(model, seed)
    return model


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """(model, tokenizer, hf_model, folder) for a tiny multimodal checkpoint with image / video token ids that the
    tiny tokenizer knows."""
    path = tmp_path_factory.mktemp("mm")
    hf = build_hf_mm()
    hf.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    model, tok = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    return model, tok, hf, path


def rand_image(h, w, seed=0, channels=3):
    """Smooth-ish random image (a noise field plus gradients): realistic enough for resampling."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256], -1)[..., :channels]
    noise = rng.integers(-40, 40, (h, w, channels))
    if channels == 4:
        base = np.concatenate([base, rng.integers(0, 256, (h, w, 1))], -1)[..., :4]
        noise = rng.integers(-40, 40, (h, w, 4))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------------------------------------------------------
# vision tower vs transformers


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 6, 10), (1, 10, 4), (1, 12, 14), (2, 6, 8)],
                         ids=["square-2x2-windows", "non-square", "tall", "larger-than-table", "2-frame-video"])
def test_vision_features_match_transformers(mm, grid):
    model, _, hf, _ = mm
    t, h, w = grid
    pv = np.random.default_rng(sum(grid)).standard_normal((t * h * w, 2 * 3 * 14 * 14)).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(pv), torch.tensor([grid])).pooler_output[0].numpy()
    got = np.array(model.vision(mx.array(pv), grid))
    assert got.shape == ref.shape == (t * h * w // 4, 64)
    assert diff(got, ref) < 2e-5, diff(got, ref)
    if t == 1:  # a still image: one copy of each patch, the temporal duplication folded into the weights
        one = pv.reshape(h * w, 2, -1)[:, 0]
        with torch.no_grad():
            ref1 = hf.model.get_image_features(torch.tensor(np.concatenate([one, one], -1)),
                                               torch.tensor([grid])).pooler_output[0].numpy()
        assert diff(np.array(model.vision(mx.array(one), grid)), ref1) < 2e-5


def test_position_rule_is_the_transposed_one():
    """Non-square grids read the table transposed (reference doc §4.1); square grids naturally; zero padding."""
    def natural(gh, gw, side):
        out = []
        for r in range(gh):
            for c in range(gw):
                sr, sc = (r + 0.5) * side / gh - 0.5, (c + 0.5) * side / gw - 0.5
                taps = {}
                for tr in (int(np.floor(sr)), int(np.floor(sr)) + 1):
                    for tc in (int(np.floor(sc)), int(np.floor(sc)) + 1):
                        if 0 <= tr < side and 0 <= tc < side:
                            taps[tr * side + tc] = (1 - abs(sr - tr)) * (1 - abs(sc - tc))
                out.append(taps)
        return out

    def as_dicts(idx, w):
        res = []
        for i, ww in zip(idx, w):
            d = {}
            for k, v in zip(i, ww):
                if v:
                    d[int(k)] = d.get(int(k), 0) + float(v)
            res.append(d)
        return res

    def close(a, b):
        return all(set(x) == set(y) and all(abs(x[k] - y[k]) < 1e-6 for k in x) for x, y in zip(a, b))

    assert close(as_dicts(*position_taps(8, 8, 4)), natural(8, 8, 4))
    assert not close(as_dicts(*position_taps(6, 10, 4)), natural(6, 10, 4))
    _, w = position_taps(12, 12, 4)  # upsampling: edge rows lose weight (zero padding, not clamping)
    assert w.sum(1).min() < 0.9 and abs(w.sum(1).max() - 1) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# full multimodal forward vs transformers


def test_multimodal_logits_match_transformers(mm):
    model, tok, hf, _ = mm
    images = [rand_image(150, 200, 1), rand_image(60, 61, 2), rand_image(40, 90, 3)]  # 12x16 grid > 4x4 table
    prompt = "Compare <|patch|> with <|patch|>, then <|patch|>."
    ids, emb = prepare_prompt(model, tok, tok.encode(prompt), images)
    items = [preprocess_array(im) for im in images]
    assert [it.grid for it in items] == [(1, 12, 16), (1, 6, 6), (1, 4, 8)]
    assert sum(t == IMAGE_ID for t in ids) == sum(it.num_tokens for it in items) == 48 + 9 + 8
    pv = np.concatenate([it.hf_pixel_values() for it in items])
    grid = torch.tensor([it.grid for it in items])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pv), image_grid_thw=grid).logits[0].numpy()
    got = np.array(model(mx.array([ids]), input_embeddings=emb)[0])
    assert diff(got, ref) < 1e-4, diff(got, ref)
    # the images matter: another first image of the same size gives the same ids but other logits
    ids2, emb2 = prepare_prompt(model, tok, tok.encode(prompt), [rand_image(150, 200, 21)] + images[1:])
    assert ids2 == ids and diff(np.array(model(mx.array([ids]), input_embeddings=emb2)[0]), ref) > 1e-2


def test_video_logits_match_transformers(mm):
    model, tok, hf, _ = mm
    frames = [rand_image(40, 70, s) for s in range(3)]  # 3 frames: the last is repeated to make 2 groups
    item = preprocess_video(frames)
    assert item.grid == (2, 2, 4)
    text = "Watch " + video_placeholder_text(item.grid, [0.0, 0.5, 1.0]) + " now"
    ids = tok.encode(text)
    assert sum(t == VIDEO_ID for t in ids) == item.num_tokens == 4
    feats = model.vision(mx.array(item.pixels), item.grid)
    emb = model.embed_multimodal(ids, {VIDEO_ID: [feats]})
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values_videos=torch.tensor(item.hf_pixel_values()),
                 video_grid_thw=torch.tensor([item.grid])).logits[0].numpy()
    assert diff(np.array(model(mx.array([ids]), input_embeddings=emb)[0]), ref) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# pre-processing vs transformers' processor


def test_resize_equals_torch_uint8_lanczos():
    import torch.nn.functional as F

    for (h, w, H, W) in [(37, 53, 28, 56), (61, 29, 56, 28), (5, 9, 28, 28), (300, 201, 140, 84), (50, 33, 50, 28),
                         (50, 33, 28, 33), (768, 1024, 756, 1008)]:
        a = rand_image(h, w, h + w)
        ref = F.interpolate(torch.from_numpy(a).permute(2, 0, 1)[None].contiguous(), size=[H, W], mode="lanczos",
                            align_corners=False, antialias=True)[0].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(resize_lanczos(a, H, W), ref, err_msg=str((h, w, H, W)))


def test_smart_resize_examples():
    # reference doc §5.1 examples (tokens = (H/28)·(W/28))
    assert smart_resize(224, 224) == (224, 224) and smart_resize(448, 448) == (448, 448)
    assert smart_resize(768, 1024) == (756, 1008)
    assert smart_resize(1080, 1920) == (1092, 1932)
    assert smart_resize(3000, 4000) == (1540, 2044)
    assert smart_resize(10, 10) == (28, 28)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """transformers' processor outputs for the files written here (one subprocess)."""
    from PIL import Image

    d = tmp_path_factory.mktemp("proc")
    tokdir = save_tokenizer(d / "tok")
    files = {}

    def save(name, arr, mode=None, **kw):
        im = Image.fromarray(arr, mode) if mode else Image.fromarray(arr)
        im.save(d / name, **kw)
        files[name] = str(d / name)

    save("rgb.png", rand_image(37, 53, 1))
    save("rgba.png", rand_image(61, 29, 2, channels=4), "RGBA")
    save("gray.png", rand_image(333, 251, 3)[..., 0], "L")
    pal = Image.fromarray(rand_image(50, 77, 4)).convert("P", palette=Image.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    pal.save(d / "pal.png", transparency=3)
    files["pal.png"] = str(d / "pal.png")
    save("big.png", rand_image(300, 200, 5))
    save("tiny.png", rand_image(5, 9, 6))
    for i in range(3):
        save(f"f{i}.png", rand_image(40, 70, 10 + i))
    spec = {
        "tokenizer": str(tokdir),
        "cases": [
            {"text": "Hi <|patch|> and <|patch|> ok", "images": [files["rgb.png"], files["rgba.png"]]},
            {"text": "<|patch|><|patch|> two", "images": [files["gray.png"], files["pal.png"]]},
            {"text": "budget <|patch|>", "images": [files["big.png"]], "images_kwargs": {"max_image_tokens": 12}},
            {"text": "tiny <|patch|>", "images": [files["tiny.png"]]},
        ],
        "videos": [{"text": "look <|video|> now", "frames": [files[f"f{i}.png"] for i in range(3)], "fps": 2.0}],
        "sampling": [[100, 30.0], [7, None], [1000, 24.0], [5, 2.0], [3000, 29.97]],
    }
    (d / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, str(HERE / "hf_processor_oracle.py"), str(d / "spec.json"),
                          str(d / "out.npz")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return spec, dict(np.load(d / "out.npz")), load_tokenizer(tokdir)


def test_processor_matches_transformers(oracle):
    spec, out, tok = oracle
    for i, case in enumerate(spec["cases"]):
        budget = case.get("images_kwargs", {}).get("max_image_tokens", 4096)
        items = [preprocess_image(p, max_tokens=budget) for p in case["images"]]
        np.testing.assert_array_equal(np.array([it.grid for it in items]), out[f"case{i}_grid"])
        np.testing.assert_array_equal(np.concatenate([it.hf_pixel_values() for it in items]),
                                      out[f"case{i}_pixel_values"], err_msg=f"case {i}")
        ids = expand_image_placeholders(tok.encode(case["text"]), items, image_token_id=IMAGE_ID,
                                        image_start_id=tok.token_to_id("<|image_start|>"),
                                        image_end_id=tok.token_to_id("<|image_end|>"))
        assert ids == out[f"case{i}_ids"].tolist(), f"case {i}"


def test_video_processor_matches_transformers(oracle):
    spec, out, tok = oracle
    vid = spec["videos"][0]
    item = preprocess_video(vid["frames"])
    np.testing.assert_array_equal(np.array([item.grid]), out["video0_grid"])
    np.testing.assert_array_equal(item.hf_pixel_values(), out["video0_pixel_values"])
    ts = [i / vid["fps"] for i in range(len(vid["frames"]))]
    ids = tok.encode(vid["text"].replace("<|video|>", video_placeholder_text(item.grid, ts)))
    assert ids == out["video0_ids"].tolist()
    for i, (total, fps) in enumerate(spec["sampling"]):
        assert sample_frame_indices(total, fps) == out[f"sampling{i}"].tolist(), (total, fps)


# ---------------------------------------------------------------------------------------------------------------
# generation with images


def test_generate_with_images_matches_transformers_greedy(mm, tmp_path):
    model, tok, hf, _ = mm
    from PIL import Image

    p = tmp_path / "img.png"
    Image.fromarray(rand_image(90, 130, 7)).save(p)
    pil = Image.fromarray(rand_image(64, 40, 8))
    prompt = "Describe <|patch|> and <|patch|>:"
    out = glimmer_mlx.generate(model, prompt, tokenizer=tok, images=[str(p), pil], max_tokens=10)
    ids, _ = prepare_prompt(model, tok, tok.encode(prompt), [str(p), pil])
    items = [preprocess_image(str(p)), preprocess_image(pil)]
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids]),
                          pixel_values=torch.tensor(np.concatenate([it.hf_pixel_values() for it in items])),
                          image_grid_thw=torch.tensor([it.grid for it in items]), max_new_tokens=10,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.tokens == ref
    assert out.stats.extra["image_tokens"] == sum(it.num_tokens for it in items)
    assert out.stats.prompt_tokens == len(ids)


def test_images_without_placeholders_go_first(mm):
    model, tok, _, _ = mm
    img = rand_image(30, 30, 9)
    ids, _ = prepare_prompt(model, tok, tok.encode("what is this"), [img, img])
    assert ids[0] == tok.token_to_id("<|image_start|>") and ids.count(tok.token_to_id("<|image_end|>")) == 2
    assert ids[ids.index(tok.token_to_id("<|image_end|>")) + 1] == tok.token_to_id("<|image_start|>")
    bos = model.args.bos_token_id
    ids2, _ = prepare_prompt(model, tok, [bos] + tok.encode("what"), [img])
    assert ids2[:2] == [bos, tok.token_to_id("<|image_start|>")]


def test_feature_cache_reuses_encodings(mm):
    model, tok, _, _ = mm
    model.feature_cache.clear()
    img = rand_image(50, 50, 11)
    h0, m0 = model.feature_cache.hits, model.feature_cache.misses
    _, e1 = prepare_prompt(model, tok, tok.encode("a <|patch|>"), [img])
    _, e2 = prepare_prompt(model, tok, tok.encode("b <|patch|> c"), [img.copy()])
    assert model.feature_cache.misses - m0 == 1 and model.feature_cache.hits - h0 == 1
    other = img.copy()
    other[0, 0, 0] ^= 1
    prepare_prompt(model, tok, tok.encode("a <|patch|>"), [other])
    assert model.feature_cache.misses - m0 == 2


def test_speculative_greedy_identity_with_image(mm, tmp_path):
    from hf_fixtures import build_hf_drafter
    from glimmer_mlx.speculative import load_drafter

    model, tok, _, _ = mm
    dr = build_hf_drafter()
    dr.save_pretrained(tmp_path / "drafter")
    drafter = load_drafter(tmp_path / "drafter", model)
    images = [rand_image(100, 70, 12), rand_image(45, 45, 13)]
    prompt = "First <|patch|> then <|patch|> so"
    plain = glimmer_mlx.generate(model, prompt, tokenizer=tok, images=images, max_tokens=40)
    for bs in (None, 2, "auto"):
        spec = glimmer_mlx.generate(model, prompt, tokenizer=tok, images=images, max_tokens=40, drafter=drafter,
                                    block_size=bs)
        assert spec.tokens == plain.tokens, bs
        assert spec.stats.extra["rounds"] > 0
    # the drafter saw the image positions through the target's taps: without images its drafts differ
    text_only = glimmer_mlx.generate(model, prompt.replace("<|patch|>", "x"), tokenizer=tok, max_tokens=40)
    assert text_only.tokens != plain.tokens


def test_cli_generate_with_image(mm, tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from glimmer_mlx.cli import app

    _, _, _, path = mm
    p = tmp_path / "x.png"
    Image.fromarray(rand_image(40, 60, 14)).save(p)
    r = CliRunner().invoke(app, ["generate", "--model", str(path), "--image", str(p), "--image", str(p),
                                 "--prompt", "look", "-m", "3", "--raw"])
    assert r.exit_code == 0, r.output
    assert "images: 12 tok" in r.output  # 40x60 px → 56x84 px → 4x6 patches → 6 tokens, twice
    bad = tmp_path / "nope.png"
    r = CliRunner().invoke(app, ["generate", "--model", str(path), "--image", str(bad), "--prompt", "x", "-m", "2"])
    assert r.exit_code == 1 and "nope.png" in r.output and "no such file" in r.output


# ---------------------------------------------------------------------------------------------------------------
# bad inputs


def _png_bytes(h=8, w=8):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rand_image(h, w, 0)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images(tmp_path, mm):
    model, tok, _, _ = mm
    with pytest.raises(ImageError, match=r"missing\.png: no such file"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ImageError, match=r"empty\.png: empty file"):
        load_image(str(tmp_path / "empty.png"))
    (tmp_path / "junk.jpg").write_bytes(b"this is not an image at all" * 10)
    with pytest.raises(ImageError, match=r"junk\.jpg: unreadable"):
        load_image(str(tmp_path / "junk.jpg"))
    good = _png_bytes(64, 64)
    (tmp_path / "trunc.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(ImageError, match=r"trunc\.png: unreadable or truncated"):
        load_image(str(tmp_path / "trunc.png"))
    # a decompression bomb: a valid PNG whose header claims 40000 x 40000 pixels
    ihdr = bytearray(good[8:33])
    ihdr[8:16] = (40000).to_bytes(4, "big") * 2
    ihdr[21:25] = zlib.crc32(bytes(ihdr[4:21])).to_bytes(4, "big")
    (tmp_path / "bomb.png").write_bytes(good[:8] + bytes(ihdr) + good[33:])
    with pytest.raises(ImageError, match=r"bomb\.png: (image too large|refused as a possible decompression bomb)"):
        load_image(str(tmp_path / "bomb.png"))
    (tmp_path / "ok.png").write_bytes(good)  # our own pixel limit is checked from the header, before decoding
    with pytest.raises(ImageError, match=r"ok\.png: image too large \(64x64 = 4,096 pixels; the limit is 1,000\)"):
        load_image(str(tmp_path / "ok.png"), max_pixels=1000)
    with pytest.raises(ImageError, match="uint8"):
        load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ImageError, match="image 0: empty image"):
        preprocess_image(np.zeros((0, 4, 3), np.uint8), index=0)
    with pytest.raises(ImageError, match="unsupported image input"):
        load_image(12)
    assert issubclass(ImageError, ValueError)
    # placeholder count mismatch, and the generate API surfaces the file name
    img = rand_image(30, 30)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\).*1 image\(s\)"):
        glimmer_mlx.generate(model, "<|patch|> <|patch|>", tokenizer=tok, images=[img], max_tokens=2)
    with pytest.raises(ImageError, match="missing.png"):
        glimmer_mlx.generate(model, "<|patch|>", tokenizer=tok, images=[tmp_path / "missing.png"], max_tokens=2)
    with pytest.raises(ValueError, match="tokenizer"):
        glimmer_mlx.generate(model, [3, 5, 4], images=[img], max_tokens=2)


def test_text_only_and_quantized_vision_checkpoints(mm, tmp_path):
    from safetensors.numpy import load_file, save_file

    from glimmer_mlx.loading import _attach_vision

    model, tok, _, path = mm
    dst = tmp_path / "textonly"
    shutil.copytree(path, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: v for k, v in t.items() if "vision" not in k}, f, metadata={"format": "pt"})
    m2, tok2 = glimmer_mlx.load(dst)
    assert m2.vision is None and len(m2.vision_weights) == 0
    ids = tok2.encode("hello there")
    np.testing.assert_allclose(np.array(m2(mx.array([ids]))), np.array(model(mx.array([ids]))), atol=1e-5)
    with pytest.raises(ValueError, match="cannot encode them: the checkpoint has a vision_config but no vision"):
        glimmer_mlx.generate(m2, "<|patch|>", tokenizer=tok2, images=[rand_image(30, 30)], max_tokens=2)
    _attach_vision(m2, m2.config, {"vision_projection.weight": mx.zeros((4, 4)),
                                   "vision_projection.scales": mx.zeros((4, 1))}, None, True)
    with pytest.raises(ValueError, match="quantized vision tower weights are not supported yet"):
        glimmer_mlx.generate(m2, "<|patch|>", tokenizer=tok2, images=[rand_image(30, 30)], max_tokens=2)


def test_vision_weights_are_the_checkpoint_tensors(mm):
    from mlx.utils import tree_flatten

    model, _, hf, _ = mm
    sd = {k[len("model."):]: v for k, v in hf.state_dict().items() if k.startswith("model.vision_")}
    vw = model.vision_weights.weights
    assert set(vw) == set(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(np.array(vw[k]), v.numpy())
    assert not any("vision" in k for k, _ in tree_flatten(model.parameters()))
