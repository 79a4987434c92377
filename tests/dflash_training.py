"""A tiny DFlash drafter trained against a tiny target inside the test fixtures (greedy self-distillation).

The target's own greedy continuations of random prompts are the data (drafters must learn the target's
distribution); the loss is the DFlash recipe's: cross-entropy on block positions 1..B−1 weighted exp(−(k−1)/γ), with
random anchors, context strictly before the anchor, target frozen.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

import glimmer_mlx


def greedy_sequences(model, n: int, prompt_len: int, gen: int, seed: int) -> np.ndarray:
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        p = [int(x) for x in rng.randint(10, model.args.vocab_size, size=prompt_len)]
        out.append(p + glimmer_mlx.generate(model, p, max_tokens=gen).tokens)
    return np.array(out, dtype=np.int32)


def train_drafter(model, drafter, seqs: np.ndarray, *, prompt_len: int, steps: int = 300, lr: float = 3e-3,
                  gamma: float = 4.0, seed: int = 0) -> list[float]:
    B = drafter.block_size
    mask_id = drafter.config.mask_token_id
    ids = mx.array(seqs)
    _, taps = model(ids, taps=drafter.taps)
    ctx_all = mx.concatenate(taps, axis=-1)
    mx.eval(ctx_all)
    w = mx.array([math.exp(-(k - 1) / gamma) for k in range(1, B)])
    rng = np.random.RandomState(seed)
    assistant = drafter.assistant
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.0)

    def loss_fn(a_mod, anchor):
        block = mx.concatenate([ids[:, anchor : anchor + 1], mx.full((ids.shape[0], B - 1), mask_id, mx.int32)], 1)
        h = a_mod(model.embed_raw(block), ctx_all[:, :anchor], anchor)[:, 1:]
        logits = model.lm_head_raw(h).astype(mx.float32)
        labels = ids[:, anchor + 1 : anchor + B]
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [N, B-1]
        return (ce * w).sum() / (w.sum() * ids.shape[0])

    grad_fn = nn.value_and_grad(assistant, loss_fn)
    losses = []
    for _ in range(steps):
        anchor = int(rng.randint(prompt_len - 1, seqs.shape[1] - B))
        loss, grads = grad_fn(assistant, anchor)
        opt.update(assistant, grads)
        mx.eval(assistant.parameters(), opt.state, loss)
        losses.append(float(loss))
    return losses


def mean_tau(model, drafter, prompts: list[list[int]], max_tokens: int = 40, **kw) -> float:
    taus = []
    for p in prompts:
        r = glimmer_mlx.generate(model, p, max_tokens=max_tokens, drafter=drafter, **kw)
        taus.append(r.stats.extra["tau"])
    return float(np.mean(taus))


def progressions(n: int, length: int, vocab: int, seed: int, lo: int = 10) -> np.ndarray:
    """Arithmetic progressions modulo (vocab − lo), offset by lo: a structured language a tiny target can learn."""
    rng = np.random.RandomState(seed)
    span = vocab - lo
    a = rng.randint(0, span, size=(n, 1))
    d = rng.randint(1, 8, size=(n, 1))
    return (lo + (a + d * np.arange(length)[None]) % span).astype(np.int32)


def train_target_torch(hf_model, *, steps: int = 150, batch: int = 32, length: int = 32, lr: float = 3e-3,
                       seed: int = 0) -> float:
    """Teach a tiny transformers Muse Glimmer to continue progressions (the target is trained with the reference
    implementation in torch, then saved and loaded by our loader). Returns the final training loss."""
    import torch

    torch.manual_seed(seed)
    vocab = hf_model.config.text_config.vocab_size
    opt = torch.optim.AdamW(hf_model.parameters(), lr=lr)
    hf_model.train()
    loss = None
    for step in range(steps):
        x = torch.tensor(progressions(batch, length, vocab, seed * 100003 + step), dtype=torch.long)
        loss = hf_model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    hf_model.eval()
    return float(loss)


def token_map_target(path, vocab: int = 48, seed: int = 1):
    """A tiny Muse Glimmer whose sandwich post-norm gains are ~0.03, so its greedy dynamics are dominated by the
    current token (sequences fall into short cycles): a target whose future a 2-layer drafter can learn in seconds.
    Built and saved with transformers, loaded with our loader."""
    import torch

    from hf_fixtures import build_hf_model, save_hf_model

    hf = build_hf_model({"vocab_size": vocab}, seed=seed)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                p.fill_(-0.97)
    save_hf_model(hf, path)
    return hf


def trained_pair(tmp: "Path", steps: int = 300):
    """(model, drafter, held-out prompts, tau_before) with the drafter trained on the target's greedy outputs."""
    from hf_fixtures import build_hf_drafter
    from glimmer_mlx.speculative import load_drafter

    token_map_target(tmp / "target")
    model, _ = glimmer_mlx.load(tmp / "target")
    model.eos_token_ids = set()
    build_hf_drafter({"sliding_window": 100, "mask_token_id": 8}).save_pretrained(tmp / "drafter")
    drafter = load_drafter(tmp / "drafter", model)
    rng = np.random.RandomState(999)
    held = [[int(x) for x in rng.randint(10, 48, size=8)] for _ in range(6)]
    before = mean_tau(model, drafter, held)
    seqs = greedy_sequences(model, 24, 8, 40, seed=0)
    train_drafter(model, drafter, seqs, prompt_len=8, steps=steps)
    return model, drafter, held, before


if __name__ == "__main__":  # figures for BENCHMARKS.md: python tests/dflash_training.py
    import json
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    model, drafter, held, before = trained_pair(Path(tempfile.mkdtemp()))
    rows = []
    for temp in (0.0, 1.0):
        for logits_mode in (("raw", "target") if temp else ("raw",)):
            drafter.draft_logits = logits_mode
            for bs in (None, 2, 3, 4, "auto"):
                t_plain = t_spec = 0.0
                taus = []
                for i, p in enumerate(held * 2):
                    kw = dict(max_tokens=64, temperature=temp, seed=i)
                    a = glimmer_mlx.generate(model, p, **kw)
                    b = glimmer_mlx.generate(model, p, drafter=drafter, block_size=bs, **kw)
                    t_plain += a.stats.generation_time
                    t_spec += b.stats.generation_time
                    taus.append(b.stats.extra["tau"])
                    if temp == 0.0:
                        assert a.tokens == b.tokens
                rows.append(dict(temperature=temp, draft_logits=logits_mode, block_size=bs or drafter.block_size,
                                 tau=round(float(np.mean(taus)), 3), speedup=round(t_plain / t_spec, 3),
                                 stats=b.stats.extra))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "stats"}), flush=True)
    print(json.dumps({"tau_untrained": before, "last_stats": rows[-1]["stats"]}, default=str))
