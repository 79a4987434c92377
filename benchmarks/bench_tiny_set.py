"""Build a trained tiny model set for `glimmer bench` on a machine without the embedded model (BENCHMARKS.md):

    python benchmarks/bench_tiny_set.py OUT   # OUT/target (+ MTP layer folder OUT/mtp), OUT/dflash

Target: the token-map tiny Muse Glimmer of the DFlash tests (6 layers, width 64, vocab 48; its greedy dynamics
fall into short cycles). DFlash: a 2-layer block-8 drafter trained 300 AdamW steps on the target's greedy
continuations (tests/dflash_training.py). MTP: one layer trained 200 steps on the same data (tests/mtp_training.py).
Each drafter's folder gets the eval.json `glimmer train` writes (τ after training, greedy and T = 1, on 8 held-out
prompts of the training data's kind: another seed's random openings, 64 tokens), which `auto` takes as its prior.
No tokenizer: `glimmer bench` maps the prompt sets' bytes into the vocabulary (byte fallback), which keeps their
repetitions but not their meaning.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers it trains with

import glimmer_mlx  # noqa: E402
import numpy as np  # noqa: E402
from dflash_training import greedy_sequences, token_map_target, train_drafter  # noqa: E402
from glimmer_mlx.files import write_atomic  # noqa: E402
from glimmer_mlx.speculative import load_drafter  # noqa: E402
from glimmer_mlx.train.recipes import acceptance, save_assistant, save_mtp  # noqa: E402
from hf_fixtures import build_hf_drafter  # noqa: E402
from mtp_training import add_random_mtp, train_mtp  # noqa: E402


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    token_map_target(work)
    add_random_mtp(work)
    model, _ = glimmer_mlx.load(work)
    model.eos_token_ids = set()
    build_hf_drafter({"sliding_window": 100, "mask_token_id": 8, "block_size": 8}).save_pretrained(out / "dflash0")
    dflash = load_drafter(out / "dflash0", model)
    mtp = glimmer_mlx.load_drafter(work, model)
    seqs = greedy_sequences(model, 24, 8, 40, seed=0)
    train_drafter(model, dflash, seqs, prompt_len=8, steps=300)
    train_mtp(model, mtp, seqs, steps=200)
    save_assistant(dflash.assistant, out / "dflash")
    save_mtp(mtp.head, model, out / "mtp")
    rng = np.random.RandomState(1)  # the training data's openings came from seed 0
    held_out = [[int(t) for t in rng.randint(10, model.args.vocab_size, size=8)] for _ in range(8)]
    for folder, drafter, width in ((out / "dflash", dflash, dflash.block_size), (out / "mtp", mtp, 1)):
        ev = {"width": width, "prompts": len(held_out), "max_tokens": 64,
              "after": acceptance(model, drafter, held_out, width, 64)}
        write_atomic(folder / "eval.json", json.dumps(ev, indent=2))
        print(f"{folder.name}: held-out tau {ev['after']}")
    target = out / "target"  # the target without MTP weights (they live in out/mtp)
    target.mkdir(exist_ok=True)
    for f in work.iterdir():
        if f.name != "mtp.safetensors" and f.is_file():
            shutil.copy(f, target / f.name)
    cfg = json.loads((target / "config.json").read_text())
    for k in ("num_mtp_layers", "mtp_layer_types"):
        cfg.get("text_config", cfg).pop(k, None)
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(work)
    shutil.rmtree(out / "dflash0")
    print(f"wrote {target}, {out / 'dflash'}, {out / 'mtp'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/bench_tiny_set.py OUT")
    build(Path(sys.argv[1]))
