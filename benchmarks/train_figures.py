"""Training throughput and τ before/after for BENCHMARKS.md: python benchmarks/train_figures.py

1. Throughput: a 25M-parameter random Muse Glimmer (width 512, 8 layers, vocab 4096, window 128) — a DFlash drafter
   (1 layer, block 16) and one MTP layer trained on sequences of 256 tokens.
2. τ before/after: the tiny token-map target of tests/dflash_training.py, through the same recipe functions the
   `glimmer train` commands call.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers it trains with

import glimmer_mlx  # noqa: E402
from glimmer_mlx.models.assistant import Assistant  # noqa: E402
from glimmer_mlx.speculative import DFlashDrafter, MTPDrafter  # noqa: E402
from glimmer_mlx.train.data import Sequence  # noqa: E402
from glimmer_mlx.train.loop import TrainConfig  # noqa: E402
from glimmer_mlx.train.recipes import (acceptance, new_assistant_config, new_mtp_head, param_count,  # noqa: E402
                                       train_dflash, train_mtp)
from dflash_training import greedy_sequences, token_map_target  # noqa: E402
from hf_fixtures import build_hf_model, save_hf_model  # noqa: E402


def main():
    tmp = Path(tempfile.mkdtemp())
    hf = build_hf_model({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
                         "sliding_window": 128}, with_vision=True)
    save_hf_model(hf, tmp / "big")
    model, _ = glimmer_mlx.load(tmp / "big")
    rng = np.random.RandomState(0)
    seqs = [Sequence([int(x) for x in rng.randint(10, 4096, size=256)], [False] * 16 + [True] * 240)
            for _ in range(40)]
    cfg = TrainConfig(epochs=1, batch_size=8, lr=6e-4, save_every=0, max_steps=10)
    a = Assistant(new_assistant_config(model, None, layers=1, block_size=16, mask_token_id=8))
    s = train_dflash(model, None, seqs, [], tmp / "d", assistant=a, cfg=cfg, anchors_per_seq=16)
    print(json.dumps({"what": "throughput", "recipe": "dflash", "target_params": param_count(model),
                      "drafter_params": param_count(a), "tokens_per_s": round(s["tokens_per_s"], 1),
                      "steps": s["steps"], "batch": "8 anchors x 15 block tokens"}), flush=True)
    head = new_mtp_head(model, 1)
    s = train_mtp(model, seqs, [], tmp / "m", head=head, cfg=cfg)
    print(json.dumps({"what": "throughput", "recipe": "mtp", "mtp_params": param_count(head),
                      "tokens_per_s": round(s["tokens_per_s"], 1), "steps": s["steps"],
                      "batch": "8 sequences x 256 tokens"}), flush=True)

    token_map_target(tmp / "t")
    model, _ = glimmer_mlx.load(tmp / "t")
    model.eos_token_ids = set()
    seqs = [Sequence(list(map(int, x)), [False] * 8 + [True] * (len(x) - 8))
            for x in greedy_sequences(model, 24, 8, 40, seed=0)]
    held = [[int(x) for x in np.random.RandomState(999).randint(10, 48, size=8)] for _ in range(6)]
    a = Assistant(new_assistant_config(model, None, layers=2, block_size=4, target_layer_ids=[1, 3], mask_token_id=8))
    d = DFlashDrafter(a, model)
    before = acceptance(model, d, held, None, max_tokens=40)
    s = train_dflash(model, None, seqs, [], tmp / "td", assistant=a,
                     cfg=TrainConfig(epochs=6, batch_size=16, lr=3e-3, save_every=0), anchors_per_seq=16)
    print(json.dumps({"what": "tau", "recipe": "dflash (2 layers, block 4)", "before": before,
                      "after": acceptance(model, d, held, None, max_tokens=40), "steps": s["steps"],
                      "tokens_per_s": round(s["tokens_per_s"], 1)}), flush=True)
    head = new_mtp_head(model, 1)
    m = MTPDrafter(head, model)
    before = acceptance(model, m, held, None, max_tokens=40)
    s = train_mtp(model, seqs, [], tmp / "tm", head=head, cfg=TrainConfig(epochs=40, batch_size=8, lr=3e-3,
                                                                          save_every=0))
    print(json.dumps({"what": "tau", "recipe": "mtp (1 layer, depth 1)", "before": before,
                      "after": acceptance(model, m, held, None, max_tokens=40), "steps": s["steps"],
                      "tokens_per_s": round(s["tokens_per_s"], 1)}), flush=True)


if __name__ == "__main__":
    main()
