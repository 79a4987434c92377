"""Figures for BENCHMARKS.md "Conversion (issue 7)".

  python benchmarks/convert_bench.py throughput [--layers 8]   # MB/s and peak RSS vs shard size, vs mlx_lm.convert
  python benchmarks/convert_bench.py quality                   # KL / top-1 / τ per mode on trained tiny models
  python benchmarks/convert_bench.py recipes                   # candidate Glimmer recipes: KL vs bits (30B sizes)
  python benchmarks/convert_bench.py vision                    # vision vs text sensitivity to 4-bit weights

Results are printed as JSON lines and written to benchmarks/results/convert-*.json.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "benchmarks" / "results"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def machine() -> dict:
    import mlx.core as mx

    from glimmer_mlx.convert import _versions

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx_device": str(mx.default_device()),
            "preload": os.environ.get("LD_PRELOAD", ""), **_versions()}


def run(cmd: list[str]) -> dict:
    """Wall time and peak RSS of one command (GNU time's %M: a forked child's own ru_maxrss would include this
    process' RSS at fork time)."""
    t = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {err[-2000:]}")
    rss = int(err.rsplit("MAXRSS ", 1)[1].split()[0]) * 1024
    return {"cmd": " ".join(cmd), "seconds": time.perf_counter() - t, "max_rss_bytes": rss}


# -- throughput --------------------------------------------------------------------------------------------------------


def make_checkpoint(path: Path, layers: int, shard_mb: int = 64) -> dict:
    """A text-only Glimmer checkpoint (flat config, HF tensor names `model.language_model.*`), random bf16 weights,
    in `shard_mb` MB safetensors shards with an index, plus a tiny tokenizer (mlx-lm needs one)."""
    import torch
    from conftest import save_tiny_tokenizer
    from mlx.utils import tree_flatten
    from safetensors.torch import save_file

    from glimmer_mlx.config import parse_config
    from glimmer_mlx.models.glimmer import Model

    cfg = {"model_type": "muse_glimmer", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2816,
           "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 64,
           "sliding_window": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "bos_token_id": 0, "eos_token_id": 1, "dtype": "bfloat16", "tie_word_embeddings": False}
    model = Model(parse_config(cfg))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    g = torch.Generator().manual_seed(0)
    path.mkdir(parents=True)
    shard, size, k, wm = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, k
        if shard:
            k += 1
            name = f"model-{k:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            wm.update({n: name for n in shard})
            shard, size = {}, 0

    for n, s in shapes.items():
        t = (torch.randn(s, generator=g) * (0.02 if len(s) == 2 else 0.1)).to(torch.bfloat16)
        name = n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n
        if size + t.numel() * 2 > shard_mb << 20:
            flush()
        shard[name] = t
        size += t.numel() * 2
    flush()
    n = len(list(path.glob("model-*.safetensors")))
    for i in range(1, n + 1):
        (path / f"model-{i:05d}.safetensors").rename(path / f"model-{i:05d}-of-{n:05d}.safetensors")
    wm = {k: v.replace(".safetensors", f"-of-{n:05d}.safetensors") for k, v in wm.items()}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_tiny_tokenizer(path)
    sizes = [f.stat().st_size for f in path.glob("model-*.safetensors")]
    return {"params": int(sum(np.prod(s) for s in shapes.values())), "bytes": sum(sizes), "shards": len(sizes),
            "largest_source_shard": max(sizes)}


def throughput(layers: int = 8) -> dict:
    work = Path(tempfile.mkdtemp(prefix="cvbench-"))
    try:
        src = work / "src"
        info = make_checkpoint(src, layers)
        run([sys.executable, "-c", f"import pathlib; [p.read_bytes() for p in pathlib.Path('{src}').iterdir()]"])
        print(json.dumps({"checkpoint": info}), flush=True)
        glimmer = [sys.executable, "-m", "glimmer_mlx.cli", "convert"]
        cases = [
            ("glimmer -q (affine 4-bit), 5 GB shards, no eval", glimmer + [str(src), str(work / "a"), "-q", "--no-eval"]),
            ("glimmer -q, 16 MB shards, no eval", glimmer + [str(src), str(work / "b"), "-q", "--no-eval",
                                                          "--max-shard-size", "16MB"]),
            ("glimmer bf16 → bf16 (re-shard only), no eval", glimmer + [str(src), str(work / "c"), "--no-eval"]),
            ("glimmer -q with quality check (64 tokens)", glimmer + [str(src), str(work / "d"), "-q", "--eval-tokens",
                                                                     "64"]),
            ("mlx_lm.convert -q (same source)", [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src),
                                                 "--mlx-path", str(work / "e"), "-q"]),
        ]
        rows = []
        for name, cmd in cases:
            out = Path(cmd[cmd.index("--mlx-path") + 1] if "--mlx-path" in cmd else cmd[5])
            runs = []
            for _ in range(1 if "quality" in name else 2):  # best of 2: the machine is shared
                shutil.rmtree(out, ignore_errors=True)
                runs.append(run(cmd))
            r = min(runs, key=lambda x: x["seconds"])
            r["load_avg"] = os.getloadavg()
            shards = [f.stat().st_size for f in out.glob("model*.safetensors")]
            r.update(name=name, out_bytes=sum(shards), out_shards=len(shards), largest_out_shard=max(shards),
                     mb_per_s=info["bytes"] / 1e6 / r["seconds"])
            q = out / "quality.json"
            if q.exists():
                c = json.loads(q.read_text())["conversion"]
                r["glimmer_summary"] = {k: c[k] for k in ("throughput_mb_s", "seconds_convert", "seconds_eval",
                                                          "peak_rss_convert_bytes", "rss_start_bytes",
                                                          "peak_mlx_convert_bytes", "peak_rss_eval_bytes",
                                                          "peak_mlx_eval_bytes", "bits_per_weight")}
                if "logits" in json.loads(q.read_text()):
                    r["logits"] = json.loads(q.read_text())["logits"]
            rows.append(r)
            print(json.dumps(r), flush=True)
        return {"checkpoint": info, "rows": rows, "machine": machine()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- quality ------------------------------------------------------------------------------------------------------------

MODES = {
    "bf16": dict(dtype="bf16"),
    "affine 8-bit": dict(quantize=True, q_bits=8),
    "mxfp8": dict(quantize=True, q_mode="mxfp8"),
    "affine 6-bit": dict(quantize=True, q_bits=6),
    "affine 4-bit": dict(quantize=True),
    "affine 4-bit g32": dict(quantize=True, q_group_size=32),
    "nvfp4": dict(quantize=True, q_mode="nvfp4"),
    "mxfp4": dict(quantize=True, q_mode="mxfp4"),
    "affine 3-bit g32": dict(quantize=True, q_bits=3, q_group_size=32),
    "mixed_4_6": dict(recipe="mixed_4_6"),
    "glimmer_4_6": dict(recipe="glimmer_4_6"),
    "mixed_3_6": dict(recipe="mixed_3_6"),
    "mixed_3_4": dict(recipe="mixed_3_4"),
    "mixed_2_6": dict(recipe="mixed_2_6"),
}


def trained_models(work: Path):
    """(name, folder, eval ids, drafter folder | None, held-out prompts | None) for the two trained tiny targets.
    Trained once and kept in $CV_MODELS (default /tmp/cv-models): training takes minutes on a shared CPU."""
    import mlx.core as mx
    import torch
    from dflash_training import progressions, train_target_torch, trained_pair
    from hf_fixtures import build_hf_model, save_hf_model
    from mlx.utils import tree_flatten

    torch.set_num_threads(1)
    keep = Path(os.environ.get("CV_MODELS", "/tmp/cv-models"))
    keep.mkdir(parents=True, exist_ok=True)
    tmp = keep / "pair"
    rng = np.random.RandomState(999)  # trained_pair's held-out prompts
    held = [[int(x) for x in rng.randint(10, 48, size=8)] for _ in range(6)]
    d = tmp / "drafter_trained"
    if not (d / "model.safetensors").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model, drafter, held2, _ = trained_pair(tmp)
        assert held2 == held
        d.mkdir()
        shutil.copy(tmp / "drafter" / "config.json", d / "config.json")
        mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(drafter.assistant.parameters())))
    out = []
    ids = [int(x) for x in np.random.RandomState(5).randint(10, 48, size=128)]
    out.append(("token-map target (trained_pair, vocab 48) + trained DFlash drafter", tmp / "target", ids, d, held))
    prog = keep / "prog"
    if not (prog / "loss.txt").exists():
        hf = build_hf_model({"vocab_size": 256}, seed=2)
        loss = train_target_torch(hf, steps=300)
        save_hf_model(hf, prog)
        (prog / "loss.txt").write_text(f"{loss:.2f}")
    loss = (prog / "loss.txt").read_text()
    seq = progressions(4, 32, 256, seed=123).reshape(-1).tolist()
    out.append((f"progressions target (torch-trained 300 steps, loss {loss}, vocab 256)", prog, seq, None, None))
    return out


def quality(modes=None, recipes_only: bool = False) -> dict:
    from glimmer_mlx.convert import convert

    work = Path(tempfile.mkdtemp(prefix="cvq-"))
    rows = []
    try:
        for name, path, ids, drafter, held in trained_models(work):
            for mode, kw in (modes or MODES).items():
                t = time.perf_counter()
                r = convert(path, work / "o", force=True, eval_ids=ids, **kw)
                row = {"model": name, "mode": mode, "kl_mean": r.quality["logits"]["kl_mean"],
                       "kl_max": r.quality["logits"]["kl_max"], "top1": r.quality["logits"]["top1_agreement"],
                       "nll_ref": r.quality["logits"].get("nll_ref"), "nll_q": r.quality["logits"].get("nll_quantized"),
                       "bpw_text": text_bpw(r), "seconds": time.perf_counter() - t}
                if drafter is not None:
                    dr = convert(drafter, work / "od", force=True, target=path, eval_prompts=held, **kw)
                    q = dr.quality["drafter"]
                    row.update(tau_before=q["tau_source"], tau_after=q["tau_converted"],
                               draft_top1=q["draft_logits"]["top1_agreement"], lossless=q["greedy_identical_to_plain"])
                rows.append(row)
                print(json.dumps(row), flush=True)
        return {"rows": rows, "machine": machine()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def text_bpw(r) -> float:
    t = [v for v in r.quality["tensors"].values() if v["part"] == "text"]
    bits = 0
    for v in t:
        n = int(np.prod(v["shape"]))
        if v["quant"]:
            q = v["quant"]
            bits += n * q["bits"] + n // q["group_size"] * (32 if q["mode"] == "affine" else 8)  # bf16 scale+bias
        else:
            bits += n * 16
    return bits / sum(int(np.prod(v["shape"])) for v in t)


# -- candidate recipes ---------------------------------------------------------------------------------------------------


def candidate_rules():
    """Candidates for our recipe; each maps (path, layer index, layers, mlx-lm's 'more bits' layer?) → bits."""
    import re

    def kv(p):
        return re.search(r"(^|\.)(k_proj|v_proj)$", p) is not None

    def mixed(p, more):
        return ("v_proj" in p or "down_proj" in p) and more

    return {
        "mixed_4_6 (mlx-lm)": lambda p, i, n, more: 6 if mixed(p, more) or "lm_head" in p else 4,
        "4 + k/v 8": lambda p, i, n, more: 8 if kv(p) else 6 if "lm_head" in p else 4,
        "mixed_4_6 + k/v 8": lambda p, i, n, more: 8 if kv(p) else 6 if mixed(p, more) or "lm_head" in p else 4,
        "mixed_4_6 + global attn 6": lambda p, i, n, more: (
            6 if mixed(p, more) or "lm_head" in p or ("self_attn" in p and (n - 1 - i) % 4 == 0) else 4),
        "mixed_4_6 + embed/lm_head 8": lambda p, i, n, more: (
            8 if "lm_head" in p or "embed_tokens" in p else 6 if mixed(p, more) else 4),
        "mixed_4_6 + down_proj 6 everywhere": lambda p, i, n, more: (
            6 if "down_proj" in p or mixed(p, more) or "lm_head" in p else 4),
        "4 + k/v 8 + embed/lm_head 6": lambda p, i, n, more: (
            8 if kv(p) else 6 if "lm_head" in p or "embed_tokens" in p else 4),
        "4 + k/v 8 + lm_head 8": lambda p, i, n, more: 8 if kv(p) or "lm_head" in p else 4,
        "4 + k/v 8 + embed/lm_head 8": lambda p, i, n, more: (
            8 if kv(p) or "lm_head" in p or "embed_tokens" in p else 4),
    }


def recipes() -> dict:
    """KL / top-1 of each candidate on the trained tiny targets, and its size on the 30B config."""
    import glimmer_mlx.convert as cv
    from glimmer_mlx import info

    rules = candidate_rules()
    if os.environ.get("CV_CANDIDATES"):
        rules = {k: v for k, v in rules.items() if k in os.environ["CV_CANDIDATES"].split(";")}
    real = cv._recipe_bits
    rows = []
    work = Path(tempfile.mkdtemp(prefix="cvr-"))
    try:
        models = trained_models(work)
        for cand, rule in rules.items():
            def bits(recipe, path, index, n, rule=rule):
                more = index < n // 8 or index >= 7 * n // 8 or (index - n // 8) % 3 == 2
                return rule(path, index, n, more)

            cv._recipe_bits = bits
            try:
                size = info.memory_plan("muse-glimmer-30b", None, recipe="glimmer_4_6", text_only=True)
                row = {"candidate": cand, "gb_30b_text": size["parts"]["text tower"]["bytes"] / 1e9,
                       "bpw_30b_text": size["parts"]["text tower"]["bytes"] * 8 / size["parts"]["text tower"]["params"]}
                for name, path, ids, drafter, held in models:
                    r = cv.convert(path, work / "o", force=True, eval_ids=ids, recipe="glimmer_4_6")
                    row[name.split(" (")[0] + " KL"] = r.quality["logits"]["kl_mean"]
                    row[name.split(" (")[0] + " top1"] = r.quality["logits"]["top1_agreement"]
            finally:
                cv._recipe_bits = real
            rows.append(row)
            print(json.dumps(row), flush=True)
        return {"rows": rows, "machine": machine()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- vision ---------------------------------------------------------------------------------------------------------------


def vision() -> dict:
    """Relative error of the projected image features when the vision linears are 4-bit (transformers on CPU, tiny
    model with a vision tower wide enough for group size 64), next to the relative error of the text tower's final
    hidden state when the text linears are 4-bit — same model, same weight scale (N(0, 0.08))."""
    import mlx.core as mx
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    from glimmer_mlx.convert import _VISION_LINEAR_RE

    rows = []
    for bits, gs in ((4, 64), (8, 64), (4, 32)):
        torch.manual_seed(0)
        text = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, sliding_window=8, bos_token_id=0, eos_token_id=1)
        vis = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2, patch_size=14,
                   pos_emb_height=4, pos_emb_width=4)
        cfg = MuseGlimmerConfig(text_config=text, vision_config=vis, out_hidden_size=512, projector_hidden_size=128)
        m = MuseGlimmerForConditionalGeneration(cfg).eval()
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 1.0 if "embed_tokens" in n else 0.08)
        sd = {k: v.clone() for k, v in m.state_dict().items()}

        def qdq(w):
            a = mx.array(w.numpy())
            q = mx.quantize(a, group_size=gs, bits=bits)
            return torch.tensor(np.array(mx.dequantize(*q, group_size=gs, bits=bits)))

        pix = torch.randn(64, 2 * 3 * 14 * 14)
        grid = torch.tensor([[1, 8, 8]])
        ids = torch.tensor([[int(x) for x in np.random.RandomState(0).randint(10, 512, 64)]])

        def feats():
            with torch.no_grad():
                img = m.model.get_image_features(pixel_values=pix, image_grid_thw=grid).pooler_output[0]
                h = m.model.language_model(input_ids=ids).last_hidden_state[0]
            return img, h

        img0, h0 = feats()
        out = {"bits": bits, "group_size": gs}
        for part in ("vision", "text"):
            m.load_state_dict(sd)
            with torch.no_grad():
                for n, p in m.named_parameters():
                    name = n.replace("model.", "", 1)
                    if part == "vision" and _VISION_LINEAR_RE.match(name) and p.shape[-1] % gs == 0:
                        p.copy_(qdq(p))
                    if part == "text" and "language_model.layers" in n and p.ndim == 2 and p.shape[-1] % gs == 0:
                        p.copy_(qdq(p))
            img, h = feats()
            out[f"{part}-quantized: image feature rel err"] = float((img - img0).norm() / img0.norm())
            out[f"{part}-quantized: text hidden rel err"] = float((h - h0).norm() / h0.norm())
        rows.append(out)
        print(json.dumps(out), flush=True)
    return {"rows": rows, "machine": machine()}


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "quality"
    RESULTS.mkdir(parents=True, exist_ok=True)
    if what == "throughput":
        layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else 8
        res = throughput(layers)
    elif what == "quality":
        res = quality()
    elif what == "recipes":
        res = recipes()
    elif what == "vision":
        res = vision()
    else:
        raise SystemExit(__doc__)
    (RESULTS / f"convert-{what}.json").write_text(json.dumps(res, indent=2, default=str))
