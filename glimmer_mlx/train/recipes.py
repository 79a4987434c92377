"""The DFlash and MTP training recipes (speculative-decoding notes §2, §3). Target, embedding and lm_head are
frozen; the target's hidden states are computed once per batch without gradients.

DFlash: random anchors inside response tokens (a fixed number per sequence, resampled every epoch); the block
[anchor, mask × (B−1)] attends bidirectionally to itself and to the context strictly before the anchor (each sample's
context is right-aligned and its left padding masked, which RoPE's relativity makes exact); cross-entropy on block
positions 1..B−1 weighted exp(−(k−1)/γ). MTP: depth k (teacher-forced on the target's own tokens and the previous
depth's outputs) predicts the token after its input token, i.e. k+2 tokens after the target hidden state it started
from; the loss is the mean over depths.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..generate import stream_generate
from ..speculative.auto.chooser import PHASES, phase_of
from ..models.assistant import Assistant, AssistantConfig
from ..models.dflash2 import DFlash2, DFlash2Config
from ..models.mtp import MTPHead, mtp_text_config
from .data import Sequence, pad_batch
from .loop import TrainConfig, mean_loss, memory_estimate, run

MASK_TOKEN_NAMES = ("<|mask|>", "<|dflash_mask|>")


def default_gamma(block_size: int) -> float:
    """The paper's γ: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated elsewhere)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))


def even_taps(num_layers: int, k: int) -> list[int]:
    """Evenly spaced target layers from 1 to L−3 (the released assistant's [1, 13, 25, 37, 49] for L = 52, k = 5)."""
    if k == 1:
        return [max(0, num_layers // 2)]
    return [int(round(x)) for x in np.linspace(1, max(1, num_layers - 3), k)]


def new_assistant_config(target, tokenizer, *, layers: int, block_size: int, target_layer_ids=None,
                         mask_token_id=None, window=None) -> AssistantConfig:
    t = target.args
    if mask_token_id is None:
        ids = [tokenizer.token_to_id(n) for n in MASK_TOKEN_NAMES] if tokenizer is not None else []
        ids = [i for i in ids if i is not None]
        if ids:
            mask_token_id = ids[0]
        elif 201818 < t.vocab_size:
            mask_token_id = 201818
        else:
            raise ValueError("no DFlash mask token found (<|mask|>); pass --mask-token-id")
    taps = list(target_layer_ids) if target_layer_ids else even_taps(t.num_hidden_layers, 5 if t.num_hidden_layers
                                                                      >= 20 else 2)
    return AssistantConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=max(1, min(t.num_attention_heads, 8)),
        head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=t.max_position_embeddings, sliding_window=window or t.sliding_window or 2048,
        layer_types=["sliding_attention"] * layers, hidden_act=t.hidden_activation, block_size=block_size,
        mask_token_id=int(mask_token_id), target_layer_ids=taps)


def save_assistant(assistant: Assistant, folder: Path, dtype=mx.float32) -> None:
    """The official `muse_glimmer_assistant` layout: config.json + model.safetensors (no prefix), loadable by
    `load_drafter` and by transformers' `MuseGlimmerAssistantModel.from_pretrained`."""
    c = assistant.config
    cfg = asdict(c)
    cfg.update(model_type="muse_glimmer_assistant", architectures=["MuseGlimmerAssistantModel"],
               bos_token_id=None, eos_token_id=None, pad_token_id=None, dtype="float32" if dtype == mx.float32
               else "bfloat16")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: v.astype(dtype) for k, v in tree_flatten(assistant.parameters())}, metadata={"format": "pt"})


SELECTOR_WEIGHT = 1.0  # λ of DFlash 2's loss (module docstring)


def new_dflash2_config(target, tokenizer, *, layers: int, block_size: int, target_layer_ids=None,
                       mask_token_id=None, window=None) -> DFlash2Config:
    """A fresh DFlash 2 drafter's config: v1's (`new_assistant_config`) plus the published convolution and selector
    sizes (group 16, two taps, rank 256, top-16), scaled down where the target is smaller, and the target's own
    logit multiplier and softcap as the draft logits'."""
    base = new_assistant_config(target, tokenizer, layers=layers, block_size=block_size,
                                target_layer_ids=target_layer_ids, mask_token_id=mask_token_id, window=window)
    return dflash2_config_for(base, target)


def dflash2_config_for(base: AssistantConfig, target) -> DFlash2Config:
    """v1 fields `base` + the published convolution and selector sizes (scaled down to a smaller target) + the
    target's logit multiplier and softcap."""
    t = target.args
    D = t.hidden_size
    return DFlash2Config(**asdict(base), vocab_size=t.vocab_size,
                         conv_group_size=next(g for g in (16, 8, 4, 2, 1) if D % g == 0), conv_kernel_size=2,
                         selector_rank=min(256, D), selector_top_k=min(16, t.vocab_size),
                         output_multiplier=float(t.output_multiplier),
                         final_logit_softcapping=t.final_logit_softcapping or None,
                         num_target_layers=t.num_hidden_layers)


def new_dflash2(cfg: DFlash2Config, seed: int = 0) -> DFlash2:
    """Fresh weights: identity convolutions (base taps (1, 0), no correction: a v1 drafter at the start) and small
    random codebooks (both factors of the bilinear term nonzero, so that both get gradients)."""
    mx.random.seed(seed)
    m = DFlash2(cfg)
    D, K = cfg.hidden_size, cfg.conv_kernel_size
    for layer in m.layers:
        for c in (layer.attention_conv, layer.mlp_conv):
            c.base_kernel = mx.concatenate([mx.ones((2, 1, D)), mx.zeros((2, K - 1, D))], axis=1)
            c.kernel_projection.weight = mx.zeros_like(c.kernel_projection.weight)
    sel = m.candidate_selector
    sel.predecessor_codebook = 0.02 * mx.random.normal(sel.predecessor_codebook.shape)
    sel.successor_codebook = 0.02 * mx.random.normal(sel.successor_codebook.shape)
    mx.eval(m.parameters())
    return m


def dflash2_from_v1(assistant: Assistant, target, seed: int = 0) -> DFlash2:
    """A DFlash 2 drafter that starts as a trained v1 one: v1's weights (`encoder.fc` → `fc`,
    `encoder.output_norm_enc` → `hidden_norm`, the layers as they are), identity convolutions, small random
    codebooks, and a sliding window one wider (DFlash 2 sees q − k < W, v1 q − k <= W): its hidden states are
    exactly v1's."""
    c = assistant.config
    fields = {k: getattr(c, k) for k in AssistantConfig.__dataclass_fields__}
    if fields["sliding_window"] is not None:
        fields["sliding_window"] += 1
    m = new_dflash2(dflash2_config_for(AssistantConfig(**fields), target), seed)
    rename = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    m.load_weights([(rename.get(k, k), v.astype(mx.float32)) for k, v in tree_flatten(assistant.parameters())],
                   strict=False)
    mx.eval(m.parameters())
    return m


def save_dflash2(model: DFlash2, folder: Path, dtype=mx.float32) -> None:
    """The published DFlash 2 layout (`DFlash2Config.to_dict` + model.safetensors without prefix), loadable by
    `load_drafter`."""
    cfg = model.config.to_dict()
    cfg["dtype"] = "float32" if dtype == mx.float32 else "bfloat16"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}, metadata={"format": "pt"})


def save_mtp(head: MTPHead, target, folder: Path, dtype=mx.float32) -> None:
    """`mtp.*` weights + the target's config with `num_mtp_layers` / `mtp_layer_types` (transformers' MTP layout)."""
    raw = json.loads(json.dumps(target.config.raw))
    text = raw.get("text_config", raw)
    text["num_mtp_layers"] = head.num_layers
    text["mtp_layer_types"] = list(head.config.layer_types)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    mx.save_safetensors(str(folder / "mtp.safetensors"),
                        {f"mtp.{k}": v.astype(dtype) for k, v in tree_flatten(head.parameters())},
                        metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------------------------
# DFlash


def _anchor_items(seqs: list[Sequence], per_seq: int, block: int, rng) -> list[tuple[int, int]]:
    """(sequence, anchor) pairs: sequences in random order, each sequence's anchors together, so that one batch
    needs the target's hidden states of as few sequences as possible."""
    items = []
    for si in rng.permutation(len(seqs)):
        s = seqs[si]
        m = np.array(s.mask)
        cand = [a for a in range(1, len(s.ids) - 1) if m[a + 1]]  # the first drafted token is a response token
        if not cand:
            continue
        pick = rng.choice(cand, size=min(per_seq, len(cand)), replace=False)
        items += [(int(si), int(a)) for a in pick]
    return items


def context_reach(cfg: AssistantConfig) -> int | None:
    """How many context rows before the anchor a block query can see: the widest sliding window (`|q − k| ≤ W`:
    the anchor's own query reaches W rows back, later block queries fewer), None when a layer is global."""
    windows = [cfg.window(i) for i in range(cfg.num_hidden_layers)]
    return None if any(w is None for w in windows) else max(windows)


def dflash_batch(target, drafter_cfg: AssistantConfig, seqs: list[Sequence], items, pad_id: int = 0,
                 trim: bool = True) -> dict:
    """Tensors for a batch of (sequence, anchor) items; target taps computed here, without gradients. With `trim`,
    each item carries only the context rows its block can attend to (`context_reach`), not everything before the
    anchor: the loss is the same and the drafter's cost no longer grows with the sequence length."""
    used = sorted({s for s, _ in items})
    where = {s: i for i, s in enumerate(used)}
    ids, mask, lens = pad_batch([seqs[s] for s in used], pad_id)
    _, taps = target(mx.array(ids), taps=tuple(drafter_cfg.target_layer_ids))
    taps = mx.stop_gradient(mx.concatenate(taps, axis=-1))
    S, T, KD = taps.shape
    B = drafter_cfg.block_size
    anchors = np.array([a for _, a in items])
    rows = np.array([where[s] for s, _ in items])
    n_ctx = int(anchors.max())
    reach = context_reach(drafter_cfg) if trim else None
    if reach is not None:
        n_ctx = min(n_ctx, reach)
    src = np.arange(n_ctx)[None, :] - (n_ctx - anchors[:, None])  # right-align each context (positions < anchor)
    ctx_mask = src >= 0
    flat = rows[:, None] * T + np.clip(src, 0, None)
    ctx = taps.reshape(S * T, KD)[mx.array(flat.reshape(-1))].reshape(len(items), n_ctx, KD)
    block = np.full((len(items), B), drafter_cfg.mask_token_id, dtype=np.int32)
    block[:, 0] = ids[rows, anchors]
    lab_pos = anchors[:, None] + np.arange(1, B)[None, :]
    in_seq = lab_pos < lens[rows][:, None]
    lab_pos_c = np.minimum(lab_pos, T - 1)
    labels = ids[rows[:, None], lab_pos_c]
    valid = in_seq & mask[rows[:, None], lab_pos_c]
    return {"ctx": ctx, "ctx_mask": mx.array(ctx_mask), "pos": n_ctx, "block": mx.array(block),
            "labels": mx.array(labels), "valid": mx.array(valid), "n_tokens": int(valid.sum())}


def dflash_loss(target, gamma: float, draft_logits: str = "target"):
    def loss_fn(assistant: Assistant, b: dict):
        h = assistant(target.embed_raw(b["block"]), b["ctx"], b["pos"], ctx_mask=b["ctx_mask"])[:, 1:]
        logits = target.logits(h) if draft_logits == "target" else target.lm_head_raw(h).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, b["labels"], reduction="none")
        B1 = ce.shape[1]
        w = mx.exp(-mx.arange(B1, dtype=mx.float32) / gamma)[None, :] * b["valid"]
        return (ce * w).sum() / mx.maximum(w.sum(), 1e-6)

    return loss_fn


def dflash2_loss(target, gamma: float, selector_weight: float = SELECTOR_WEIGHT, parts: bool = False):
    """DFlash CE on the checkpoint's draft logits + λ·selector CE (module docstring); parts: return
    (total, dflash CE, selector CE)."""
    def loss_fn(model: DFlash2, b: dict):
        h = model(target.embed_raw(b["block"]), b["ctx"], b["pos"], ctx_mask=b["ctx_mask"])[:, 1:]
        logits = model.draft_logits(target.lm_head_raw(h))  # [N, B−1, V]
        labels, valid = b["labels"], b["valid"]
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        decay = mx.exp(-mx.arange(ce.shape[1], dtype=mx.float32) / gamma)[None, :]
        w = decay * valid
        base = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
        sel = model.candidate_selector
        cand, unary = sel.candidates(logits)  # [N, B−1, k]
        prev = mx.concatenate([b["block"][:, :1], labels[:, :-1]], axis=1)  # the true predecessor
        prev_ok = mx.concatenate([mx.ones_like(valid[:, :1]), valid[:, :-1]], axis=1)
        s = sel.scores(unary, sel.project(h), sel.successors(cand), prev)
        hit = cand == labels[..., None]
        covered = hit.any(axis=-1) & valid & prev_ok
        sce = mx.logsumexp(s, axis=-1) - (s * hit).sum(axis=-1)
        ws = decay * covered
        selector = (sce * ws).sum() / mx.maximum(ws.sum(), 1e-6)
        total = base + selector_weight * selector
        return (total, base, selector) if parts else total

    return loss_fn


def train_dflash(target, tokenizer, train: list[Sequence], val: list[Sequence], out: Path, *,
                 assistant: Assistant | DFlash2, cfg: TrainConfig, anchors_per_seq: int = 16,
                 gamma: float | None = None, draft_logits: str = "target", resume: bool = False, console=None,
                 selector_weight: float = SELECTOR_WEIGHT) -> dict:
    """v1 (an `Assistant`) or DFlash 2 (a `DFlash2`: its own loss, its own layout) on the same batches."""
    B = assistant.config.block_size
    gamma = gamma or default_gamma(B)
    v2 = isinstance(assistant, DFlash2)
    loss_fn = dflash2_loss(target, gamma, selector_weight) if v2 else dflash_loss(target, gamma, draft_logits)
    save = save_dflash2 if v2 else save_assistant

    def batches(epoch):
        rng = np.random.RandomState(cfg.seed * 1000 + epoch)  # anchors resampled every epoch
        items = _anchor_items(train, anchors_per_seq, B, rng)
        for i in range(0, len(items) - cfg.batch_size + 1, cfg.batch_size):
            yield dflash_batch(target, assistant.config, train, items[i : i + cfg.batch_size])

    n_items = len(_anchor_items(train, anchors_per_seq, B, np.random.RandomState(cfg.seed * 1000)))

    def val_fn():
        if not val:
            return None
        items = _anchor_items(val, anchors_per_seq, B, np.random.RandomState(12345))
        vals = []
        for i in range(0, len(items), cfg.batch_size):
            b = dflash_batch(target, assistant.config, val, items[i : i + cfg.batch_size])
            vals.append((float(loss_fn(assistant, b)), b["n_tokens"]))
        return mean_loss(vals)

    return run(assistant, loss_fn, batches, cfg=cfg, steps_per_epoch=n_items // cfg.batch_size, out=out,
               save_weights=lambda d: save(assistant, d), val_fn=val_fn, resume=resume, console=console,
               label="train dflash2" if v2 else "train dflash")


# ---------------------------------------------------------------------------------------------------------------
# MTP


def new_mtp_head(target, num_layers: int, layer_type: str | None = None, seed: int = 0) -> MTPHead:
    """Fresh MTP layers; each `mtp_block` starts as a copy of the target's last decoder layer."""
    t = target.args
    lt = layer_type or t.layer_types[-1]
    raw_text = {"num_mtp_layers": num_layers, "mtp_layer_types": [lt] * num_layers}
    cfg, opts = mtp_text_config(t, raw_text)
    mx.random.seed(seed)
    head = MTPHead(cfg, opts)
    last = dict(tree_flatten(target.model.layers[-1].parameters()))
    if all(v.dtype in (mx.float32, mx.bfloat16, mx.float16) for v in last.values()):
        head.load_weights([(f"layers.{k}.mtp_block.{n}", v.astype(mx.float32)) for k in range(num_layers)
                           for n, v in last.items()], strict=False)
    return head


def mtp_batch(target, seqs: list[Sequence], pad_id: int = 0) -> dict:
    ids, mask, lens = pad_batch(seqs, pad_id)
    L = target.args.num_hidden_layers
    _, (h,) = target(mx.array(ids), taps=(L - 1,))
    valid = mask & (np.arange(ids.shape[1])[None, :] < lens[:, None])
    return {"ids": mx.array(ids), "h": mx.stop_gradient(h), "valid": mx.array(valid), "n_tokens": int(valid.sum())}


def mtp_loss(target, draft_logits: str = "target"):
    def loss_fn(head: MTPHead, b: dict):
        ids, prev = b["ids"], b["h"][:, :-1]  # depth −1 outputs at positions 0..T−2
        total, count = 0.0, 0
        T = ids.shape[1]
        for d in range(head.num_layers):
            if T - d - 2 < 1:
                break
            e = target.embed_raw(ids[:, d + 1 :])  # input tokens at positions d+1..T−1
            out = head.forward_depth(d, e, prev, None)  # RoPE is relative: a cache-free forward is exact
            z = out[:, :-1]
            logits = target.logits(z) if draft_logits == "target" else target.lm_head_raw(z).astype(mx.float32)
            labels = ids[:, d + 2 :]
            w = b["valid"][:, d + 2 :].astype(mx.float32)
            ce = nn.losses.cross_entropy(logits, labels, reduction="none")
            total = total + (ce * w).sum() / mx.maximum(w.sum(), 1.0)
            count += 1
            prev = out[:, :-1]
        return total / max(count, 1)

    return loss_fn


def train_mtp(target, train: list[Sequence], val: list[Sequence], out: Path, *, head: MTPHead, cfg: TrainConfig,
              draft_logits: str = "target", resume: bool = False, console=None) -> dict:
    loss_fn = mtp_loss(target, draft_logits)

    def batches(epoch):
        rng = np.random.RandomState(cfg.seed * 1000 + epoch)
        order = rng.permutation(len(train))
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            yield mtp_batch(target, [train[j] for j in order[i : i + cfg.batch_size]])

    def val_fn():
        if not val:
            return None
        vals = []
        for i in range(0, len(val), cfg.batch_size):
            b = mtp_batch(target, val[i : i + cfg.batch_size])
            vals.append((float(loss_fn(head, b)), b["n_tokens"]))
        return mean_loss(vals)

    return run(head, loss_fn, batches, cfg=cfg, steps_per_epoch=len(train) // cfg.batch_size, out=out,
               save_weights=lambda d: save_mtp(head, target, d), val_fn=val_fn, resume=resume, console=console,
               label="train mtp")


# ---------------------------------------------------------------------------------------------------------------
# evaluation and estimates


def eval_prompts(seqs: list[Sequence], n: int = 16) -> list[list[int]]:
    """Held-out prompts: each sequence up to its first response token, whole — as a user would send it (text chunks:
    their first tokens). Cut short they measure another drafter: the embedded DFlash 2 measured τ 1.73 on held-out
    prompts cut at 64 tokens (an agent prompt's tool list ends mid-way; the target continues it, not a reply) and 3.05
    on the same prompts whole."""
    prompts = []
    for s in seqs[:n]:
        cut = next((i for i, m in enumerate(s.mask) if m), 0)
        cut = cut if cut >= 4 else min(16, len(s.ids) // 2)
        prompts.append(s.ids[:cut])
    return [p for p in prompts if p]


def acceptance(target, drafter, prompts: list[list[int]], width, max_tokens: int = 64) -> dict:
    """τ of `drafter` at `width` over `prompts`, greedy and at T = 1 (seed = the prompt's index): "tau_greedy" /
    "tau_t1", the tokens committed per round over every round of every prompt (pooled, as `auto` counts them: a
    prompt with many rounds weighs more than one with few), and "tau_greedy_by_phase" / "tau_t1_by_phase", the same
    over the rounds that start in each phase of a response ("phases": `chooser.PHASES`, tokens generated before the
    round; None where no round started in it). A response's EOS counts as a committed token of its round."""
    out = {"phases": list(PHASES)}
    saved = getattr(target, "eos_token_ids", None)
    for name, temp in (("greedy", 0.0), ("t1", 1.0)):
        tokens, rounds = [0] * (len(PHASES) + 1), [0] * (len(PHASES) + 1)
        for i, p in enumerate(prompts):
            pos = None  # tokens generated before the round (None: the prefill's token, not a round)
            for chunk in stream_generate(target, p, max_tokens=max_tokens, temperature=temp, seed=i,
                                         drafter=drafter, block_size=width):
                n = len(chunk.tokens) + (chunk.finish_reason == "stop")
                if pos is not None and n:
                    ph = phase_of(pos)
                    tokens[ph] += n
                    rounds[ph] += 1
                pos = (pos or 0) + len(chunk.tokens)
        out[f"tau_{name}"] = sum(tokens) / sum(rounds) if sum(rounds) else None
        out[f"tau_{name}_by_phase"] = [t / r if r else None for t, r in zip(tokens, rounds)]
    target.eos_token_ids = saved
    return out


def estimate(module: nn.Module, target, tokens_per_batch: int) -> float:
    n_train = sum(v.size for _, v in tree_flatten(module.parameters()))
    n_frozen = sum(v.size for _, v in tree_flatten(target.parameters()))
    return memory_estimate(n_train, n_frozen, tokens_per_batch, target.args.hidden_size,
                           target.args.num_hidden_layers) / 1e9


def param_count(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


