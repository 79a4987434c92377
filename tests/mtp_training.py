"""A tiny MTP layer trained against a tiny target inside the test fixtures: loss on token t+2 from the target's
final-normed hidden state at t and the token at t+1 (teacher-forced on the target's own greedy outputs), target,
embedding and lm_head frozen. Depth d > 0 would be trained the same way on its own shifted targets."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np


def add_random_mtp(path, num_layers: int = 1, layer_types=("sliding_attention",), seed: int = 0) -> None:
    """Give a saved tiny Muse Glimmer checkpoint `num_mtp_layers` random MTP layers built by transformers."""
    import torch

    from hf_fixtures import build_hf_mtp, save_mtp_weights
    from transformers import MuseGlimmerForConditionalGeneration

    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["num_mtp_layers"] = num_layers
    cfg["text_config"]["mtp_layer_types"] = list(layer_types)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    hf = MuseGlimmerForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    save_mtp_weights(build_hf_mtp(hf, num_layers, seed=seed), path)


def train_mtp(model, drafter, seqs: np.ndarray, *, steps: int = 200, lr: float = 3e-3) -> list[float]:
    head = drafter.head
    ids = mx.array(seqs)
    L = model.args.num_hidden_layers
    _, (h,) = model(ids, taps=(L - 1,))  # final-normed hidden states
    mx.eval(h)
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.0)
    # RoPE is relative, so a cache-free forward from position 0 equals depth 0's forward from position 1
    e = model.embed_raw(ids[:, 1:-1])
    labels = ids[:, 2:]

    def loss_fn(head):
        out = head.forward_depth(0, e, h[:, :-2], None)
        logits = drafter.logits(out)
        return nn.losses.cross_entropy(logits, labels, reduction="mean")

    grad_fn = nn.value_and_grad(head, loss_fn)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(head)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(float(loss))
    return losses


if __name__ == "__main__":  # figures for BENCHMARKS.md: python tests/mtp_training.py
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import glimmer_mlx
    from dflash_training import greedy_sequences, trained_pair

    tmp = Path(tempfile.mkdtemp())
    model, dflash, held, _ = trained_pair(tmp)  # target at tmp/target + a trained DFlash drafter (block 4)
    add_random_mtp(tmp / "target")
    model, _ = glimmer_mlx.load(tmp / "target")
    model.eos_token_ids = set()
    dflash.target = model
    mtp = glimmer_mlx.load_drafter(tmp / "target", model)
    losses = train_mtp(model, mtp, greedy_sequences(model, 24, 8, 40, seed=0), steps=200)
    print(json.dumps({"mtp_loss_first": losses[0], "mtp_loss_last": losses[-1]}))
    runs = [("mtp", mtp, d) for d in (1, 2, 3, 4)] + [("dflash", dflash, b) for b in (2, 3, 4)]
    for temp in (0.0, 1.0):
        for name, drafter, width in runs:
            t_plain = t_spec = 0.0
            taus = []
            for i, p in enumerate(held * 2):
                kw = dict(max_tokens=64, temperature=temp, seed=i)
                a = glimmer_mlx.generate(model, p, **kw)
                b = glimmer_mlx.generate(model, p, drafter=drafter, block_size=width, **kw)
                if temp == 0.0:
                    assert a.tokens == b.tokens
                t_plain += a.stats.generation_time
                t_spec += b.stats.generation_time
                taus.append(b.stats.extra["tau"])
            print(json.dumps({"temperature": temp, "drafter": name,
                              ("depth" if name == "mtp" else "block_size"): width,
                              "tau": round(float(np.mean(taus)), 3), "speedup": round(t_plain / t_spec, 3),
                              "draft_share": round(b.stats.extra["draft_share"], 3)}), flush=True)
