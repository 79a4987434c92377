"""The training loop shared by the DFlash and MTP recipes: AdamW with warmup + cosine, gradient accumulation, rich
progress (loss, tokens/s), periodic checkpoints with optimizer state, `--resume`, validation loss."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


@dataclass
class TrainConfig:
    epochs: int = 1
    batch_size: int = 8
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.0
    grad_accum: int = 1
    save_every: int = 200  # optimizer steps; 0 = only at the end
    seed: int = 0
    max_steps: int | None = None


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optim.Optimizer:
    warm = max(1, int(round(cfg.warmup * total_steps)))
    sched = optim.join_schedules(
        [optim.linear_schedule(cfg.lr * 1e-2, cfg.lr, warm), optim.cosine_decay(cfg.lr, max(1, total_steps - warm))],
        [warm])
    return optim.AdamW(learning_rate=sched, weight_decay=cfg.weight_decay)


def save_training_state(ckpt: Path, module: nn.Module, opt: optim.Optimizer, state: dict, save_weights) -> None:
    """Write weights (via `save_weights(folder)`), optimizer state and counters into `ckpt`, atomically."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_weights(tmp)
    flat = {k: v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), flat)
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    if ckpt.exists():
        shutil.rmtree(ckpt)
    os.replace(tmp, ckpt)


def load_training_state(ckpt: Path, opt: optim.Optimizer) -> dict:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    flat = mx.load(str(ckpt / "optimizer.safetensors"))
    opt.state = tree_unflatten(list(flat.items()))
    return state


def run(module: nn.Module, loss_fn: Callable, batches: Callable[[int], Iterator], *, cfg: TrainConfig,
        steps_per_epoch: int, out: Path, save_weights, val_fn: Callable | None = None, resume: bool = False,
        console=None, label: str = "training") -> dict:
    """Train `module` in place. `loss_fn(module, batch) -> loss`; `batches(epoch)` yields batches.

    Returns a summary (steps, final/val losses, tokens/s). Checkpoints go to `out/checkpoint`. Each batch is a dict
    with an "n_tokens" entry (trained tokens, for the throughput figure)."""
    total = steps_per_epoch * cfg.epochs // cfg.grad_accum
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    if total < 1:
        raise ValueError("not enough data for one optimizer step: lower --batch-size / --grad-accum or add data")
    opt = make_optimizer(cfg, total)
    ckpt = out / "checkpoint"
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "losses": []}
    if resume:
        if not (ckpt / "trainer_state.json").exists():
            raise FileNotFoundError(f"{ckpt}: no checkpoint to resume from")
        state = load_training_state(ckpt, opt)
    grad_fn = nn.value_and_grad(module, loss_fn)
    tokens, t0 = 0, time.perf_counter()
    # a progress bar is only redrawn on a terminal: into a log file, print a line every 30 s instead
    log_lines = console is not None and not console.is_terminal
    last_line = t0
    acc, acc_n = None, 0
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeRemainingColumn(), console=console, transient=False, disable=console is None) as prog:
        task = prog.add_task(label, total=total, completed=state["step"], info="")
        for epoch in range(state["epoch"], cfg.epochs):
            for bi, batch in enumerate(batches(epoch)):
                if epoch == state["epoch"] and bi < state["batch_in_epoch"]:
                    continue  # resumed: these batches were already used before the checkpoint
                loss, grads = grad_fn(module, batch)
                n_tok = batch["n_tokens"]
                acc = grads if acc is None else tree_map_add(acc, grads)
                acc_n += 1
                tokens += n_tok
                state["batch_in_epoch"] = bi + 1
                if acc_n < cfg.grad_accum:
                    mx.eval(acc, loss)
                    continue
                if cfg.grad_accum > 1:
                    acc = tree_map_scale(acc, 1.0 / cfg.grad_accum)
                opt.update(module, acc)
                mx.eval(module.parameters(), opt.state, loss)
                acc, acc_n = None, 0
                state["step"] += 1
                state["losses"].append(float(loss))
                tps = tokens / max(time.perf_counter() - t0, 1e-9)
                prog.update(task, advance=1, info=f"loss {float(loss):.4f} · {tps:,.0f} tok/s")
                if log_lines and time.perf_counter() - last_line >= 30:
                    last_line = time.perf_counter()
                    console.print(f"{label}: step {state['step']}/{total} loss {float(loss):.4f} · {tps:,.0f} tok/s "
                                  f"· {last_line - t0:.0f} s", highlight=False)
                if cfg.save_every and state["step"] % cfg.save_every == 0:
                    save_training_state(ckpt, module, opt, dict(state, epoch=epoch), save_weights)
                if state["step"] >= total:
                    break
            if state["step"] >= total:
                state["epoch"] = epoch
                break
            state["epoch"], state["batch_in_epoch"] = epoch + 1, 0
    save_training_state(ckpt, module, opt, state, save_weights)
    summary = {"steps": state["step"], "final_loss": state["losses"][-1] if state["losses"] else None,
               "first_loss": state["losses"][0] if state["losses"] else None,
               "tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
               "train_seconds": round(time.perf_counter() - t0, 1), "train_config": asdict(cfg)}
    if val_fn is not None:
        summary["val_loss"] = val_fn()
    return summary


def tree_map_add(a, b):
    return tree_map(lambda x, y: x + y, a, b)


def tree_map_scale(a, s):
    return tree_map(lambda x: x * s, a)


def memory_estimate(n_trainable: int, n_frozen: int, tokens_per_batch: int, hidden: int, layers: int) -> float:
    """Rough peak bytes: fp32 trainable weights + grads + AdamW moments, frozen weights as stored, activations."""
    trainable = n_trainable * 4 * 4
    frozen = n_frozen * 2
    activations = tokens_per_batch * hidden * 4 * 24 * max(layers, 1)
    return trainable + frozen + activations


def mean_loss(values: list[tuple[float, int]]) -> float:
    n = sum(w for _, w in values)
    return sum(v * w for v, w in values) / n if n else math.nan
