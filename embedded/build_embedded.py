"""Build the embedded default model set in glimmer_mlx/embedded/: glimmer-tiny (target), glimmer-tiny-dflash,
glimmer-tiny-dflash2, glimmer-tiny-mtp.

    python embedded/build_embedded.py                 # every stage, in order (≈ 3 h on 2 CPU cores)
    python embedded/build_embedded.py --stage target  # one stage: data → tokenizer → target → target2 → distill →
                                                      # drafters (dflash ∥ mtp, then dflash2) → publish → eval → measure

New drafters for the shipped target, without retraining it (how the published drafters were made):

    python embedded/build_embedded.py --stage data --work W
    python embedded/build_embedded.py --stage from-embedded --work W   # its tokenizer + transformers checkpoint
    python embedded/build_embedded.py --stage distill --work W --distill-procs 2
    python embedded/build_embedded.py --stage dflash --work W --dflash-init glimmer_mlx/embedded/glimmer-tiny-dflash
    ...                                    # mtp (--mtp-init), dflash2 (from W/dflash), measure --measure-from work,
    python embedded/build_embedded.py --stage publish --work W --publish dflash,mtp   # then eval, measure

Data (offline, deterministic): the Python standard library's source of the interpreter running the script (files
hashed into train / held-out), and synthetic chat + agent conversations about that code (embedded/build/synthetic.py,
Muse chat/tool format of embedded/build/chat_template.jinja). The target is trained with transformers' reference
implementation in torch (the oracle's code path; its HF checkpoint goes through our loader); the DFlash drafter and
the MTP layer are trained with `glimmer train dflash|mtp`. Intermediate files go to build/embedded/ (git-ignored).
Seeds are fixed; the target's step count is fixed, so a rerun on the same stdlib and library versions reproduces
the data and tokenizer exactly and the weights up to torch's CPU reduction order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "embedded" / "build"
MODELS = ROOT / "glimmer_mlx" / "embedded"
sys.path.insert(0, str(BUILD))

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|eom|>", "<|start|>", "<|message|>",
                  "<|finetune_right_pad|>", "<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>",
                  "<|vid_start|>", "<|vid_end|>", "<|vid_frame_separator|>", "<|mask|>"]
# single tokens for the tool-call markup (plain added tokens: they decode as text)
MARKUP_TOKENS = ["<atem:function_calls>", "</atem:function_calls>", "<atem:invoke name=\"", "</atem:invoke>",
                 "<atem:parameter name=\"", "</atem:parameter>"]
VOCAB = 4096
SEQ = 512
TARGET = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, sliding_window=128, max_position_embeddings=2048,
              output_multiplier=1.0, final_logit_softcapping=20.0, bos_token_id=0, eos_token_id=1,
              pad_token_id=6, tie_word_embeddings=False)
TRAIN = dict(steps=320, batch=16, lr=2e-3, warmup=30, min_lr_ratio=0.05, weight_decay=0.1, seed=0,
             mix={"code": 0.45, "chat": 0.3, "agent": 0.25}, eval_every=40)
# phase 2 continues from phase 1's weights on fresh batches (another seed) with a re-warmed, lower cosine schedule
TRAIN2 = dict(TRAIN, steps=480, lr=1e-3, warmup=20, seed=1)
N_CHAT, N_AGENT = 30000, 6000  # synthetic conversations for training (held-out: 1/10 of these counts)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(os.__file__).resolve().parent
    skip = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo",
            "ensurepip", "pydoc_data", "encodings")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    return root, files


def held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0


# -- stage: data -----------------------------------------------------------------------------------------------
def stage_data(work: Path) -> None:
    from synthetic import TOOLS, Generator, index_functions

    root, files = stdlib_files()
    split = {"train": [f for f in files if not held_out(str(f.relative_to(root)))],
             "heldout": [f for f in files if held_out(str(f.relative_to(root)))]}
    (work / "data").mkdir(parents=True, exist_ok=True)
    for name, fs in split.items():
        with open(work / "data" / f"code_{name}.txt", "w", encoding="utf-8") as out:
            for f in fs:
                try:
                    text = f.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    continue
                out.write(f"# file: {f.relative_to(root)}\n{text}\n\x00\n")  # \x00: document separator
        funcs = index_functions(root, fs)
        gen = Generator(funcs, root, files, seed=0 if name == "train" else 1)
        scale = 1 if name == "train" else 10
        for kind, n, make, tools in (("chat", N_CHAT // scale, gen.chat, None),
                                     ("agent", N_AGENT // scale, gen.agent, TOOLS)):
            with open(work / "data" / f"{kind}_{name}.jsonl", "w", encoding="utf-8") as out:
                for _ in range(n):
                    rec = {"messages": make()}
                    if tools:
                        rec["tools"] = tools
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        log(f"data {name}: {len(fs)} files, {len(funcs)} documented functions")
    (work / "data" / "stdlib.json").write_text(json.dumps({"root": str(root), "python": sys.version.split()[0],
                                                           "files": len(files)}))


# -- stage: tokenizer ------------------------------------------------------------------------------------------
def render_all(tok, path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        out.append(tok.apply_chat_template(rec["messages"], tools=rec.get("tools"), add_generation_prompt=False))
    return out


def stage_tokenizer(work: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    out = work / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(MARKUP_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    code = (work / "data" / "code_train.txt").read_text(encoding="utf-8").split("\x00\n")
    from glimmer_mlx.tokenizer import Tokenizer as Renderer

    renderer = Renderer(None, chat_template=(BUILD / "chat_template.jinja").read_text(),
                        special={"bos_token": "<|begin_of_text|>"}, eos_token_ids=set())
    chats = []
    for kind, n in (("chat", 8000), ("agent", 1500)):
        for line in (work / "data" / f"{kind}_train.jsonl").read_text(encoding="utf-8").splitlines()[:n]:
            rec = json.loads(line)
            chats.append(renderer.apply_chat_template(rec["messages"], tools=rec.get("tools"),
                                                      add_generation_prompt=False))
    tok.train_from_iterator(code + chats, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|finetune_right_pad|>",
        "model_max_length": TARGET["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"},
        indent=2))
    shutil.copy(BUILD / "chat_template.jinja", out / "chat_template.jinja")
    log(f"tokenizer: {tok.get_vocab_size()} tokens")


def load_tok(work: Path):
    from glimmer_mlx.tokenizer import load_tokenizer

    return load_tokenizer(work / "tokenizer")


def token_streams(work: Path) -> dict:
    """{split: {source: np.int32 stream}}, cached in work/tokens.npz."""
    cache = work / "tokens.npz"
    if cache.exists():
        z = np.load(cache)
        out: dict = {}
        for k in z.files:
            s, src = k.split("/")
            out.setdefault(s, {})[src] = z[k]
        return out
    tok = load_tok(work)
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    arrays = {}
    for split in ("train", "heldout"):
        docs = (work / "data" / f"code_{split}.txt").read_text(encoding="utf-8").split("\x00\n")
        ids = []
        for d in docs:
            if d.strip():
                ids += [bos] + tok.encode(d, add_special_tokens=False) + [eos]
        arrays[f"{split}/code"] = np.array(ids, dtype=np.int32)
        for kind in ("chat", "agent"):
            ids = []
            for text in render_all(tok, work / "data" / f"{kind}_{split}.jsonl"):
                ids += tok.encode(text, add_special_tokens=False)
            arrays[f"{split}/{kind}"] = np.array(ids, dtype=np.int32)
    np.savez(cache, **arrays)
    return token_streams(work)


# -- stage: target (torch, transformers' reference implementation) ---------------------------------------------------
def hf_config(tok):
    from transformers import MuseGlimmerConfig

    text = dict(TARGET, image_token_id=tok.token_to_id("<|patch|>"), video_token_id=tok.token_to_id("<|video|>"))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                  pos_emb_height=4, pos_emb_width=4)  # transformers needs one to build the class; not saved
    return MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=128, projector_hidden_size=48,
                             image_token_id=text["image_token_id"], video_token_id=text["video_token_id"])


def batches(streams: dict, rng: np.random.RandomState, batch: int, mix: dict):
    names = sorted(mix)
    p = np.array([mix[n] for n in names])
    while True:
        rows = []
        for src in rng.choice(names, size=batch, p=p / p.sum()):
            s = streams[src]
            a = rng.randint(0, len(s) - SEQ - 1)
            rows.append(s[a : a + SEQ + 1])
        yield np.stack(rows)


def eval_windows(stream: np.ndarray, n: int) -> np.ndarray:
    step = max(1, (len(stream) - SEQ - 1) // n)
    return np.stack([stream[i * step : i * step + SEQ + 1] for i in range(n)])


def stage_target(work: Path, steps: int | None, phase: int = 1) -> None:
    """Phase 1 trains from scratch (TRAIN); phase 2 continues from phase 1's checkpoint in work/target_hf (TRAIN2)."""
    import torch
    import torch.nn.functional as F
    from transformers import MuseGlimmerForConditionalGeneration

    train = TRAIN if phase == 1 else TRAIN2
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    torch.manual_seed(train["seed"])
    tok = load_tok(work)
    streams = token_streams(work)
    prior: list[dict] = []
    if phase == 1:
        model = MuseGlimmerForConditionalGeneration(hf_config(tok))
    else:
        if not (work / "target_hf" / "config.json").exists():
            raise SystemExit(f"phase 2 needs phase 1's checkpoint in {work / 'target_hf'}: run --stage target first")
        model = MuseGlimmerForConditionalGeneration.from_pretrained(work / "target_hf", dtype=torch.float32)
        prior = json.loads((MODELS / "glimmer-tiny" / "training_log.json").read_text())["history"]
        prior = [r for r in prior if r.get("phase", 1) == 1]
    model.config._attn_implementation = "sdpa"
    model.train()
    params = [p for n, p in model.named_parameters() if "language_model" in n or n.startswith("lm_head")]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=train["lr"], betas=(0.9, 0.95))
    steps = steps or train["steps"]

    def lr_at(i):
        if i < train["warmup"]:
            return train["lr"] * (i + 1) / train["warmup"]
        t = (i - train["warmup"]) / max(1, steps - train["warmup"])
        r = train["min_lr_ratio"]
        return train["lr"] * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * t)))

    def loss_of(x):
        logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))

    held = {src: torch.from_numpy(eval_windows(streams["heldout"][src], 24).astype(np.int64))
            for src in ("code", "chat", "agent")}

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = {src: float(np.mean([loss_of(held[src][i : i + 8]).item() for i in range(0, 24, 8)]))
                   for src in held}
        model.train()
        return out

    rng = np.random.RandomState(train["seed"])
    gen = batches(streams["train"], rng, train["batch"], train["mix"])
    history = []
    log(f"target: {n_params / 1e6:.2f} M parameters, {steps} steps of {train['batch']}×{SEQ} tokens")
    t0 = time.time()
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        x = torch.from_numpy(next(gen).astype(np.int64))
        loss = loss_of(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": len(prior) + i + 1, "phase": phase, "train_loss": loss.item(), "lr": lr_at(i),
               "elapsed_s": time.time() - t0}
        if (i + 1) % train["eval_every"] == 0 or i + 1 == steps or i == 0:
            rec["heldout"] = evaluate()
            log(f"step {i + 1}/{steps} loss {loss.item():.3f} held-out {rec['heldout']} "
                f"({(i + 1) * train['batch'] * SEQ / (time.time() - t0):.0f} tok/s)")
        history.append(rec)
        if (i + 1) % 10 == 0 and "heldout" not in rec:
            log(f"step {i + 1}/{steps} loss {loss.item():.3f} "
                f"({(i + 1) * train['batch'] * SEQ / (time.time() - t0):.0f} tok/s)")
    seconds = time.time() - t0 + sum(r["elapsed_s"] for r in prior[-1:])
    save_target(model, tok, work, prior + history, n_params, seconds, len(prior) + steps)


def save_target(model, tok, work: Path, history, n_params, seconds, steps) -> None:
    from safetensors.torch import load_file, save_file

    tmp = work / "target_hf"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    out = MODELS / "glimmer-tiny.tmp"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    tensors = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(f).items() if "vision" not in k and "projector" not in k})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    for k in ("vision_config", "out_hidden_size", "projector_hidden_size"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1, tok.token_to_id("<|eot|>")], "pad_token_id": TARGET["pad_token_id"]},
        indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(work / "tokenizer" / f, out / f)
    (out / "training_log.json").write_text(json.dumps(
        {"parameters": n_params, "train_seconds": seconds, "steps": steps, "train": TRAIN, "train_phase2": TRAIN2,
         "seq_len": SEQ,
         "config": TARGET, "history": history}, indent=1))
    final = MODELS / "glimmer-tiny"
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    log(f"target written to {final}")


# -- stage: from-embedded (the drafters of an existing target) ------------------------------------------------------
def stage_from_embedded(work: Path) -> None:
    """work/tokenizer and work/target_hf from the *shipped* glimmer-tiny (its tokenizer files as they are, so the ids
    match; its weights in transformers' full layout with this script's small vision stub, which the shipped config
    leaves out), so that distill and the drafter stages can run again without retraining the target."""
    import torch
    from safetensors.torch import load_file
    from transformers import MuseGlimmerForConditionalGeneration

    src = MODELS / "glimmer-tiny"
    (work / "tokenizer").mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, work / "tokenizer" / f)
    tok = load_tok(work)
    model = MuseGlimmerForConditionalGeneration(hf_config(tok))
    missing, unexpected = model.load_state_dict(load_file(src / "model.safetensors"), strict=False)
    missing = [k for k in missing if "vision" not in k and "projector" not in k]
    if missing or unexpected:
        raise SystemExit(f"from-embedded: {src} does not match this script's target (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    tmp = work / "target_hf.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.eval()
    with torch.no_grad():
        model.save_pretrained(tmp, safe_serialization=True)
    if (work / "target_hf").exists():
        shutil.rmtree(work / "target_hf")
    tmp.rename(work / "target_hf")
    log(f"from-embedded: {work / 'tokenizer'}, {work / 'target_hf'}")


# -- stage: distill (the target's own outputs, the drafters' training data) ------------------------------------------
# Counts are caps; the counts actually drawn are in distill_summary.json. Every prompt comes from the *training*
# splits (measure uses the held-out ones).
#   chat:  distinct first user turns (the synthetic set has fewer), plus `chat2` second turns (the conversation's own
#          first exchange, then its second user turn)
#   agent: conversations cut before *each* assistant turn (a tool call, or the answer after tool results), prompt +
#          reply within the drafters' 1024-token --max-length
#   code:  per stdlib file, its opening plus cuts spread over the rest of the file (one per ~`code_every` tokens, at
#          most `code_per_file` in all), each prompt the `code_len` tokens before its cut (length drawn per prompt);
#          half of them start with BOS, half are raw text (both ways a completion prompt reaches the target)
# Sized for ≈ 25 min of batched greedy generation on the 2 shared CPU cores (≈ 150 generated tok/s there); the
# previous set (one 160-token prefix per file, one cut per agent conversation) is DISTILL_V1.
DISTILL_V1 = dict(chat=3000, agent=1000, code=1200, code_prompt=160, max_new={"chat": 160, "agent": 160, "code": 192},
                  batch=96, seed=0)
DISTILL = dict(chat=1000, chat2=0, agent=1000, code=1600, code_every=350, code_len=(64, 384), code_per_file=5,
               max_new={"chat": 160, "agent": 160, "code": 96}, max_length=1024, batch=64, seed=0)


def distill_prompts(work: Path, tok) -> list[tuple[str, list[int]]]:
    """(kind, prompt ids) from the *training* splits, as DISTILL describes."""
    rng = np.random.RandomState(DISTILL["seed"])
    out, seen, seconds = [], set(), []
    lines = (work / "data" / "chat_train.jsonl").read_text(encoding="utf-8").splitlines()
    for line in lines:
        msgs = json.loads(line)["messages"]
        first = [m for m in msgs if m["role"] == "user"][:1]
        if not first or first[0]["content"] in seen:
            continue
        seen.add(first[0]["content"])
        out.append(("chat", tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)))
        if len(out) == DISTILL["chat"]:
            break
    for line in lines if DISTILL["chat2"] else []:
        msgs = [m for m in json.loads(line)["messages"] if m["role"] != "system"]
        if len(msgs) >= 4 and msgs[0]["content"] in seen and msgs[2]["role"] == "user":
            seconds.append(tok.apply_chat_template(msgs[:3], add_generation_prompt=True, tokenize=True))
            if len(seconds) == DISTILL["chat2"]:
                break
    out += [("chat", ids) for ids in seconds]
    n = 0
    room = DISTILL["max_length"] - DISTILL["max_new"]["agent"]
    for line in (work / "data" / "agent_train.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        for cut in (i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"):
            ids = tok.apply_chat_template(rec["messages"][:cut], tools=rec.get("tools"), add_generation_prompt=True,
                                          tokenize=True)
            if len(ids) > room:  # later cuts are longer still
                break
            out.append(("agent", ids))
            n += 1
            if n == DISTILL["agent"]:
                break
        if n == DISTILL["agent"]:
            break
    n = 0
    bos = tok.token_to_id("<|begin_of_text|>")
    lo, hi = DISTILL["code_len"]
    for doc in (work / "data" / "code_train.txt").read_text(encoding="utf-8").split("\x00\n"):
        if not doc.strip():
            continue
        ids = tok.encode(doc, add_special_tokens=False)
        first = min(len(ids) - 32, rng.randint(lo, hi + 1))  # the file's opening
        if first < 32:
            continue
        m = min(DISTILL["code_per_file"], max(1, len(ids) // DISTILL["code_every"])) - 1
        rest = sorted(rng.choice(np.arange(first + 1, len(ids) - 32), size=m, replace=False)) \
            if m and len(ids) - 33 > first + m else []
        for k, cut in enumerate([first] + [int(c) for c in rest]):
            prompt = ids[max(0, cut - rng.randint(lo, hi + 1)) : cut] if k else ids[:cut]
            out.append(("code", ([bos] if rng.rand() < 0.5 else []) + prompt))
            n += 1
        if n >= DISTILL["code"]:
            break
    return out


def stage_distill(work: Path, max_seconds: float | None = None, procs: int = 1) -> None:
    """`procs` processes (one torch thread each) generate disjoint shares of the batches (`distill_shard`), then
    their parts are merged into work/distill/distill.jsonl and work/distill_summary.json."""
    parts = work / "distill_parts"
    if parts.exists():
        shutil.rmtree(parts)
    parts.mkdir()
    if procs == 1:
        distill_shard(work, 0, 1, max_seconds)
    else:
        cmd = [sys.executable, __file__, "--stage", "distill-shard", "--work", str(work), "--distill-procs", str(procs)]
        if max_seconds is not None:
            cmd += ["--distill-seconds", str(max_seconds)]
        running = [subprocess.Popen(cmd + ["--distill-shard", str(i)]) for i in range(procs)]
        if any(p.wait() for p in running):
            raise SystemExit("a distill shard failed")
    lines, summaries = [], []
    for i in range(procs):
        lines += (parts / f"part{i}.jsonl").read_text(encoding="utf-8").splitlines()
        summaries.append(json.loads((parts / f"part{i}.json").read_text()))
    rng = np.random.RandomState(DISTILL["seed"])
    out = work / "distill.tmp"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    (out / "distill.jsonl").write_text("\n".join(lines[i] for i in rng.permutation(len(lines))) + "\n")
    kinds = {k: {f: round(sum(sm["kinds"][k][f] for sm in summaries), 1) for f in ("prompts", "tokens", "seconds")}
             for k in summaries[0]["kinds"]}
    (work / "distill_summary.json").write_text(json.dumps(dict(
        DISTILL, prompts=sum(sm["prompts"] for sm in summaries), prompts_planned=summaries[0]["prompts_planned"],
        generated_tokens=sum(sm["generated_tokens"] for sm in summaries),
        seconds=max(sm["seconds"] for sm in summaries), processes=procs,
        stopped_at_max_seconds=any(sm["stopped_at_max_seconds"] for sm in summaries), max_seconds=max_seconds,
        kinds=kinds), indent=2))
    final = work / "distill"
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)


def distill_shard(work: Path, shard: int, procs: int, max_seconds: float | None = None) -> None:
    """Greedy continuations of the target (transformers' implementation, batched with left padding) →
    work/distill/distill.jsonl, pre-tokenized `{"prompt_ids", "completion_ids"}` lines for `glimmer train --data`
    (the loss falls on the target's own tokens only). Batches of similar prompt lengths, taken round-robin over the
    kinds in a seeded order; max_seconds: stop starting batches after this long (the counts reached are in
    distill_summary.json; without it every prompt is done and the set is deterministic)."""
    import torch
    from transformers import MuseGlimmerForConditionalGeneration

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs))
    tok = load_tok(work)
    model = MuseGlimmerForConditionalGeneration.from_pretrained(work / "target_hf", dtype=torch.float32).eval()
    pad = TARGET["pad_token_id"]
    eos = [TARGET["eos_token_id"], tok.token_to_id("<|eot|>")]
    prompts = distill_prompts(work, tok)
    rng = np.random.RandomState(DISTILL["seed"])
    queues = {}
    for kind in ("code", "agent", "chat"):
        items = sorted((p for k, p in prompts if k == kind), key=len)  # similar lengths share a batch
        groups = [items[i : i + DISTILL["batch"]] for i in range(0, len(items), DISTILL["batch"])]
        queues[kind] = [groups[j] for j in rng.permutation(len(groups))]
    order = [(kind, g) for r in range(max(map(len, queues.values())))
             for kind in queues if r < len(queues[kind]) for g in [queues[kind][r]]][shard::procs]
    t0, generated, stopped = time.time(), 0, False
    lines, done, per_kind = [], 0, {k: {"prompts": 0, "tokens": 0, "seconds": 0.0} for k in queues}
    for kind, group in order:
        if max_seconds is not None and time.time() - t0 > max_seconds:
            stopped = True
            break
        tb = time.time()
        L = max(map(len, group))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in group])
        att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=DISTILL["max_new"][kind],
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)[:, L:].tolist()
        n_tok = 0
        for p, g in zip(group, gen):
            g = [t for t in g if t != pad]  # generate pads the rows that stopped early
            lines.append(json.dumps({"kind": kind, "prompt_ids": p, "completion_ids": g}))
            n_tok += len(g)
        generated += n_tok
        done += len(group)
        pk = per_kind[kind]
        pk["prompts"] += len(group)
        pk["tokens"] += n_tok
        pk["seconds"] = round(pk["seconds"] + time.time() - tb, 1)
        log(f"distill {shard + 1}/{procs}: {done} prompts ({kind} {pk['prompts']}), {generated} tokens generated "
            f"({time.time() - t0:.0f} s)")
    part = work / "distill_parts" / f"part{shard}"
    atomic_write(part.with_suffix(".jsonl"), "".join(line + "\n" for line in lines))
    atomic_write(part.with_suffix(".json"), json.dumps(dict(
        prompts=done, prompts_planned=len(prompts), generated_tokens=generated, seconds=round(time.time() - t0),
        stopped_at_max_seconds=stopped, kinds=per_kind), indent=2))


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# -- stages: drafters, through our own CLI --------------------------------------------------------------------------
def glimmer(*args) -> str:
    """Run `glimmer ARGS`; returns the command line (paths relative to the checkout where they are inside it)."""
    cmd = [sys.executable, "-m", "glimmer_mlx.cli", *map(str, args)]

    def rel(a):
        try:
            return str(Path(a).resolve().relative_to(ROOT)) if isinstance(a, Path) else str(a)
        except ValueError:
            return str(a)

    line = "glimmer " + " ".join(map(rel, args))
    log("$ " + line)
    subprocess.run(cmd, check=True)
    return line


def write_recipe(out: Path, line: str, init: Path | None) -> None:
    """out/build_recipe.json: the command that trained this drafter (shipped with it, read by the model card)."""
    prior = Path(init) / "build_recipe.json" if init is not None else None
    (out / "build_recipe.json").write_text(json.dumps(
        {"command": line, "fine_tuned_from": None if init is None else Path(init).name,
         "init_recipe": json.loads(prior.read_text()) if prior is not None and prior.exists() else None,
         "distill": json.loads((out.parent / "distill_summary.json").read_text())
         if (out.parent / "distill_summary.json").exists() else None}, indent=2))


# The drafters' recipes. `init`: fine-tune that drafter instead of starting fresh (the from-scratch path is the
# default; the embedded set's published drafters were fine-tuned from the previous ones on the rebuilt distillation
# set, see the model card). DFlash 2 always starts from the DFlash v1 drafter of the same build (its weights,
# identity convolutions) unless given another `init`.
DRAFTERS = dict(
    dflash=dict(steps=2000, lr=2e-3, batch=32, anchors=32, save_every=100),
    dflash2=dict(steps=1000, lr=1e-3, batch=32, anchors=16, save_every=250),
    mtp=dict(steps=250, lr=1e-3, batch=8, max_length=1024, save_every=30),
)
DFLASH_SHAPE = ("--layers", 2, "--block-size", 16, "--target-layer-ids", "1,2,3,4,5")


def stage_dflash(work: Path, steps: int, *, init: Path | None = None, lr: float | None = None,
                 anchors: int | None = None, seed: int = 0) -> None:
    """One cosine schedule over `steps` optimizer steps of 32 anchor blocks (up to `anchors` per sequence)."""
    r = DRAFTERS["dflash"]
    out = work / "dflash"
    if out.exists():
        shutil.rmtree(out)
    shape = ("--init", init) if init else DFLASH_SHAPE
    line = glimmer("train", "dflash", "--model", MODELS / "glimmer-tiny", "--out", out, "--data",
            work / "distill" / "distill.jsonl", *shape, "--max-length", 1024, "--batch-size", r["batch"],
            "--anchors-per-seq", anchors or r["anchors"], "--lr", lr or r["lr"], "--max-steps", steps,
            "--epochs", 50, "--val-fraction", 0.01, "--save-every", r["save_every"],
            *(("--seed", seed) if seed else ()))
    write_recipe(out, line, init)


def stage_dflash2(work: Path, steps: int, *, init: Path | None = None, lr: float | None = None,
                  anchors: int | None = None, seed: int = 0) -> None:
    """DFlash 2 (same block size and taps as v1), from the v1 drafter of this build (work/dflash) by default."""
    r = DRAFTERS["dflash2"]
    init = init or work / "dflash"
    if not (init / "config.json").exists():
        raise SystemExit(f"dflash2 starts from a DFlash drafter: {init} has none (run --stage dflash first, or "
                         "pass --dflash2-init)")
    out = work / "dflash2"
    if out.exists():
        shutil.rmtree(out)
    line = glimmer("train", "dflash2", "--model", MODELS / "glimmer-tiny", "--out", out, "--data",
            work / "distill" / "distill.jsonl", "--init", init, "--max-length", 1024, "--batch-size", r["batch"],
            "--anchors-per-seq", anchors or r["anchors"], "--lr", lr or r["lr"], "--max-steps", steps,
            "--epochs", 50, "--val-fraction", 0.01, "--save-every", r["save_every"],
            *(("--seed", seed) if seed else ()))
    write_recipe(out, line, init)


def stage_mtp(work: Path, steps: int, *, init: Path | None = None, lr: float | None = None) -> None:
    """One MTP layer; --max-length 1024 so that the agent conversations (prompt + reply ≤ 1024) are kept."""
    r = DRAFTERS["mtp"]
    out = work / "mtp"
    if out.exists():
        shutil.rmtree(out)
    shape = ("--init", init) if init else ("--mtp-layers", 1)
    line = glimmer("train", "mtp", "--model", MODELS / "glimmer-tiny", "--out", out, "--data",
            work / "distill" / "distill.jsonl", *shape, "--max-length", r["max_length"], "--batch-size", r["batch"],
            "--lr", lr or r["lr"], "--max-steps", steps, "--epochs", 50, "--val-fraction", 0.01,
            "--save-every", r["save_every"], "--eval-tokens", 32)
    write_recipe(out, line, init)


EMBEDDED_NAMES = {"dflash": "glimmer-tiny-dflash", "dflash2": "glimmer-tiny-dflash2", "mtp": "glimmer-tiny-mtp"}


def stage_publish(work: Path, parts=("dflash", "dflash2", "mtp")) -> None:
    """The drafters trained in work/ → glimmer_mlx/embedded/ (the shipped set)."""
    for part in parts:
        if not (work / part / "config.json").exists():
            raise SystemExit(f"publish: {work / part} holds no trained {part} drafter")
    for part in parts:
        publish(work / part, MODELS / EMBEDDED_NAMES[part])


def publish(src: Path, dst: Path) -> None:
    """Copy the trained drafter's shippable files (not the regeneration cache / optimizer state)."""
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for f in src.iterdir():
        if f.is_file() and (f.suffix in (".safetensors", ".json") and "optimizer" not in f.name
                            and "state" not in f.name):
            shutil.copy(f, tmp / f.name)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    log(f"published {dst}: {sorted(p.name for p in dst.iterdir())}")


# -- stage: eval ------------------------------------------------------------------------------------------------
EVAL_PER_KIND = 8  # held-out prompts of each kind (chat, agent, code)
# tokens generated per prompt: past the chooser's last phase bound (64), so every phase of a response has its own τ
# (training's evaluation stops at 64: the late phase then starts from the pooled τ, which its opening lifts)
EVAL_TOKENS = 128


def heldout_prompts(work: Path, tok, n: int = EVAL_PER_KIND) -> list[list[int]]:
    """Prompts as the distillation set's (`distill_prompts`), drawn from the held-out splits, whole: n first user
    turns of held-out conversations, n agent prompts (a held-out agent conversation up to one of its assistant turns,
    tools included), n code completions (a held-out stdlib file cut after 64-384 tokens of a random place)."""
    chat, agent, code = [], [], []
    for line in (work / "data" / "chat_heldout.jsonl").read_text(encoding="utf-8").splitlines():
        first = [m for m in json.loads(line)["messages"] if m["role"] == "user"][:1]
        if first and len(chat) < n:
            chat.append(tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True))
    room = DISTILL["max_length"] - DISTILL["max_new"]["agent"]
    for line in (work / "data" / "agent_heldout.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        cuts = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        if cuts and len(agent) < n:  # the conversations' first, second, … assistant turn in turn
            ids = tok.apply_chat_template(rec["messages"][:cuts[len(agent) % len(cuts)]], tools=rec.get("tools"),
                                          add_generation_prompt=True, tokenize=True)
            if len(ids) <= room:
                agent.append(ids)
    rng = np.random.RandomState(DISTILL["seed"])
    lo, hi = DISTILL["code_len"]
    for doc in (work / "data" / "code_heldout.txt").read_text(encoding="utf-8").split("\x00\n"):
        ids = tok.encode(doc, add_special_tokens=False)
        if len(ids) > 2 * hi and len(code) < n:
            cut = int(rng.randint(hi, len(ids) - 2 * DISTILL["max_new"]["code"]))
            code.append(ids[cut - int(rng.randint(lo, hi + 1)):cut])
    return chat + agent + code


def stage_eval(work: Path, parts=("dflash", "dflash2", "mtp")) -> None:
    """Each published drafter's eval.json τ measured again on the held-out splits' prompts (`heldout_prompts`; the
    data stage first if work/ has none) by `glimmer train`'s own measure (`recipes.acceptance`: pooled over rounds,
    per phase of a response), at the width of its recipe; what training measured is kept beside it
    ("training_eval": on 8 validation prompts cut at 64 tokens, which the measure no longer does), `EVAL_TOKENS` tokens
    each. `auto` starts from these figures."""
    import mlx.core as mx

    from glimmer_mlx.loading import load
    from glimmer_mlx.speculative import load_drafter
    from glimmer_mlx.train.recipes import acceptance

    if not (work / "data" / "code_heldout.txt").exists():
        stage_data(work)
    target, tok = load(MODELS / "glimmer-tiny", dtype="fp32")
    prompts = heldout_prompts(work, tok)
    for part in parts:
        folder = MODELS / EMBEDDED_NAMES[part]
        ev = json.loads((folder / "eval.json").read_text())
        mx.random.seed(0)
        after = acceptance(target, load_drafter(folder, target, dtype="fp32"), prompts, ev["width"], EVAL_TOKENS)
        kept = {k: ev.pop(k) for k in ("before", "after", "prompts", "max_tokens") if k in ev}
        ev.update(before=None, after=after, prompts=len(prompts), max_tokens=EVAL_TOKENS,
                  prompts_from=f"held-out splits: {EVAL_PER_KIND} chat, agent and code prompts each, whole "
                               "(embedded/build_embedded.py --stage eval)",
                  training_eval=ev.get("training_eval", kept))
        atomic_write(folder / "eval.json", json.dumps(ev, indent=2) + "\n")
        log(f"eval {part}: τ greedy {after['tau_greedy']:.2f} {after['tau_greedy_by_phase']}, "
            f"T=1 {after['tau_t1']:.2f} {after['tau_t1_by_phase']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="all",
                    choices=["all", "data", "tokenizer", "target", "target2", "from-embedded", "distill",
                             "distill-shard", "dflash", "dflash2", "mtp",
                             "drafters", "publish", "eval", "measure", "card"])
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "embedded")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--target2-steps", type=int, default=None)
    ap.add_argument("--distill-procs", type=int, default=1, help="distill: processes generating in parallel")
    ap.add_argument("--distill-shard", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--distill-seconds", type=float, default=None,
                    help="distill: stop starting generation batches after this many seconds (default: all prompts)")
    for d, r in DRAFTERS.items():
        ap.add_argument(f"--{d}-steps", type=int, default=r["steps"])
        ap.add_argument(f"--{d}-lr", type=float, default=None, help=f"default {r['lr']}")
        ap.add_argument(f"--{d}-init", type=Path, default=None,
                        help="fine-tune this drafter instead of a fresh one" + (
                            " (default: this build's DFlash v1, work/dflash)" if d == "dflash2" else ""))
    ap.add_argument("--anchors-per-seq", type=int, default=None, help="DFlash / DFlash 2 (default: their recipe's)")
    ap.add_argument("--drafter-seed", type=int, default=0,
                    help="drafter stages: glimmer train --seed (another seed draws other anchors, e.g. for a continued "
                         "fine-tune)")
    ap.add_argument("--publish", default="dflash,dflash2,mtp", help="publish stage: which drafters")
    ap.add_argument("--figures", type=Path, default=None, help="card: the figures JSON (default WORK/figures.json)")
    ap.add_argument("--measure-from", choices=["embedded", "work"], default="embedded",
                    help="measure: the published drafters, or the ones trained in --work (before publishing)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    stages = (["data", "tokenizer", "target", "target2", "distill", "drafters", "publish", "eval", "measure"]
              if args.stage == "all" else [args.stage])
    for s in stages:
        t = time.time()
        if s == "data":
            stage_data(args.work)
        elif s == "tokenizer":
            stage_tokenizer(args.work)
        elif s == "target":
            stage_target(args.work, args.target_steps)
        elif s == "target2":
            stage_target(args.work, args.target2_steps, phase=2)
        elif s == "from-embedded":
            stage_from_embedded(args.work)
        elif s == "distill":
            stage_distill(args.work, args.distill_seconds, args.distill_procs)
        elif s == "distill-shard":
            distill_shard(args.work, args.distill_shard, args.distill_procs, args.distill_seconds)
        elif s == "drafters":  # DFlash v1 and MTP at once, in two processes; then DFlash 2 from that v1
            def sub(d):
                cmd = [sys.executable, __file__, "--stage", d, "--work", str(args.work),
                       f"--{d}-steps", str(getattr(args, f"{d}_steps"))]
                for opt in ("lr", "init"):
                    if getattr(args, f"{d}_{opt}") is not None:
                        cmd += [f"--{d}-{opt}", str(getattr(args, f"{d}_{opt}"))]
                if args.anchors_per_seq and d != "mtp":
                    cmd += ["--anchors-per-seq", str(args.anchors_per_seq)]
                return subprocess.Popen(cmd)

            if any(p.wait() for p in [sub("dflash"), sub("mtp")]) or sub("dflash2").wait():
                raise SystemExit("a drafter stage failed")
        elif s in ("dflash", "dflash2"):
            (stage_dflash if s == "dflash" else stage_dflash2)(
                args.work, getattr(args, f"{s}_steps"), init=getattr(args, f"{s}_init"), lr=getattr(args, f"{s}_lr"),
                anchors=args.anchors_per_seq, seed=args.drafter_seed)
        elif s == "mtp":
            stage_mtp(args.work, args.mtp_steps, init=args.mtp_init, lr=args.mtp_lr)
        elif s == "publish":
            stage_publish(args.work, tuple(p for p in args.publish.split(",") if p))
        elif s == "eval":
            stage_eval(args.work)
        elif s == "measure":
            from measure_embedded import measure

            measure(args.work, source=args.measure_from)
        elif s == "card":  # the model card from a measure run's figures (default: --measure-from work's)
            from measure_embedded import card_from

            log(f"model card: {card_from(args.work, args.figures or args.work / 'figures.json')}")
        log(f"stage {s}: {time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
