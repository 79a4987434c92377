"""Vision encoding time and token counts (issue 10) on a random-weight encoder of the released width.

    python benchmarks/bench_vision.py [--layers 2] [--dtype fp32] [--repeats 2] [--sizes 448x448,1024x768,1920x1080]
                                      [--out results.json]

Encoder: vision hidden 1536, MLP 8960, 16 heads, window 32x32 patches, merge 2, projector 6144 → 4096 → 4096 →
text hidden 6656 (the released widths), with `--layers` tower layers in the checkpoint's pattern (the last is a
full-attention layer, the others windowed). The released tower has 50 (37 windowed, 13 full); the script also
reports the per-layer cost so the reader can scale. Images are synthetic (smooth gradients + noise), encoded one
at a time; pre-processing (resize + normalise + patchify, no file decoding) is timed separately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import mlx.core as mx
import numpy as np

from glimmer_mlx.image_processing import preprocess_array
from glimmer_mlx.models.vision import VisionConfig, VisionEncoder



def make_encoder(layers: int, dtype) -> VisionEncoder:
    types = ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "window_attention" for i in range(layers)]
    cfg = VisionConfig(num_hidden_layers=layers, layer_types=types, text_hidden_size=6656)
    enc = VisionEncoder(cfg)
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, (mx.random.normal(v.shape) * 0.02).astype(dtype)) for k, v in tree_flatten(enc.parameters())]
    enc.update(tree_unflatten(params))
    mx.eval(enc.parameters())
    return enc


def image(h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + y) % 256], -1)
    return np.clip(base + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", default="448x448,1024x768,1920x1080", help="WIDTHxHEIGHT list")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x"))[::-1] for s in a.sizes.split(",")]
    dtype = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[a.dtype]
    enc = make_encoder(a.layers, dtype)
    enc0 = make_encoder(0, dtype) if a.layers else None  # fixed cost: patch/pos embedding, shuffle, projector
    rows = []
    for h, w in sizes:
        img = image(h, w)
        t = time.perf_counter()
        item = preprocess_array(img)
        t_pre = time.perf_counter() - t
        x = mx.array(item.pixels).astype(dtype)
        res = {}
        for name, e in (("encode", enc), ("fixed", enc0)):
            if e is None:
                continue
            mx.eval(e(x, item.grid))  # warm-up (also builds the cached index tables)
            ts = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                mx.eval(e(x, item.grid))
                ts.append(time.perf_counter() - t)
            res[name] = min(ts)
        _, gh, gw = item.grid
        per_layer = (res["encode"] - res.get("fixed", 0.0)) / max(a.layers, 1)
        rows.append({"image": f"{w}x{h}", "resized": f"{gw * 14}x{gh * 14}", "patches": gh * gw,
                     "tokens": item.num_tokens, "preprocess_s": t_pre, "encode_s": res["encode"],
                     "fixed_s": res.get("fixed"), "per_layer_s": per_layer,
                     "est_50_layers_s": res.get("fixed", 0.0) + 50 * per_layer})
        print(json.dumps(rows[-1]), flush=True)
    out = {"config": {"vision_hidden": 1536, "mlp": 8960, "heads": 16, "layers": a.layers, "dtype": a.dtype,
                      "projector": "6144-4096-4096-6656"},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__,
                       "device": str(mx.default_device()), "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")},
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
