"""Plain greedy decoding, ours vs mlx-lm, on one checkpoint (`glimmer bench-plain`; `checkpoint.make_random_checkpoint`
writes one that both load).

`bench_plain` loads the folder once per implementation in one process and interleaves repeats of plain greedy
decoding: ours (`glimmer_mlx.stream_generate`, i.e. what `generate` runs) and mlx-lm's `generate_step`, from the
same random prompt ids, neither stopping early. Generation speed excludes prefill: (N - 1) tokens over the time from
the first generated token to the last. Timings are only comparable within one run: compare the per-pair ratios.
`compare_logits` checks both give the same logits; `decode_step_profile` compares single decode steps.
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..generate import stream_generate
from ..loading import load
from ..machine import machine_info
from ..sampling import Sampler, SamplingParams
from .describe import model_desc, summary

MODES = ("glimmer", "mlx-lm")


def compare_logits(path, n_tokens: int = 64, seed: int = 0) -> dict:
    """Load `path` with both runtimes and compare full-prompt logits (no cache) and a few cached decode steps."""
    import mlx_lm

    ours, _ = load(path)
    theirs, _ = mlx_lm.load(str(path))
    V = ours.args.vocab_size
    ids = np.random.default_rng(seed).integers(0, V, n_tokens).tolist()
    x = mx.array(ids, dtype=mx.int32)[None]
    a = ours(x).astype(mx.float32)
    b = theirs(x).astype(mx.float32)
    diff = mx.abs(a - b)
    # cached decode: prefill half, then step token by token
    ca, cb = ours.make_cache(), theirs.make_cache()
    h = n_tokens // 2
    ours(x[:, :h], ca)
    theirs(x[:, :h], cb)
    step_diff = 0.0
    for t in range(h, n_tokens):
        la = ours(x[:, t : t + 1], ca).astype(mx.float32)
        lb = theirs(x[:, t : t + 1], cb).astype(mx.float32)
        step_diff = max(step_diff, mx.max(mx.abs(la - lb)).item())
    return {
        "max_abs_diff": mx.max(diff).item(),
        "mean_abs_diff": mx.mean(diff).item(),
        "logit_std": mx.std(a).item(),
        "argmax_agreement": mx.mean(mx.argmax(a, -1) == mx.argmax(b, -1)).item(),
        "cached_decode_max_abs_diff": step_diff,
        "tokens": n_tokens,
    }


def _run_glimmer(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[float], float]:
    """(tokens, wall time at each token, process CPU time at each token, start time)."""
    toks, stamps, cpu = [], [], []
    t0 = time.perf_counter()
    for chunk in stream_generate(model, ids, max_tokens=n):
        now, c = time.perf_counter(), time.process_time()
        toks += chunk.tokens
        stamps += [now] * len(chunk.tokens)
        cpu += [c] * len(chunk.tokens)
    return toks, stamps, cpu, t0


def _run_mlx_lm(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[float], float]:
    from mlx_lm.generate import generate_step

    def greedy(logprobs):  # mlx-lm's make_sampler(temp=0)
        return mx.argmax(logprobs, axis=-1)

    toks, stamps, cpu = [], [], []
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(ids, dtype=mx.int32), model, max_tokens=n, sampler=greedy):
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        toks.append(int(tok))
    return toks, stamps, cpu, t0


def bench_plain(path, *, prompt_tokens: int = 128, gen_tokens: int = 64, repeats: int = 3,
                modes: Sequence[str] = MODES, warmup_tokens: int = 8, seed: int = 0, out: str | None = None,
                progress: Callable[[str], None] | None = None) -> dict:
    """Plain greedy decode speed of each mode in `modes`, interleaved repeat by repeat in this process.

    Returns {"machine", "model", "settings", "load_average", "modes": {mode: {"tps", "median_step_ms",
    "cpu_ms_per_token", "prefill_s"}}} and, when both modes ran, "ratio" (ours / mlx-lm tok/s per repeat pair),
    "ratio_median_step" and "ratio_cpu" (mlx-lm / ours; > 1: ours faster) and "tokens_agree" (length of the common
    greedy prefix). Each summary has median, min, max, spread_pct and the per-repeat values. Written as JSON to
    `out` when given.
    """
    import mlx_lm

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
    if gen_tokens < 2:
        raise ValueError("gen_tokens must be >= 2 (speed is measured between the first and the last token)")
    say = progress or (lambda _msg: None)
    path = Path(path)
    models, runners = {}, {}
    if "glimmer" in modes:
        say("loading glimmer_mlx")
        m, _ = load(path)
        m.eos_token_ids = set()  # no stop token: always generate gen_tokens
        models["glimmer"], runners["glimmer"] = m, _run_glimmer
    if "mlx-lm" in modes:
        say("loading mlx-lm")
        models["mlx-lm"], _ = mlx_lm.load(str(path))
        runners["mlx-lm"] = _run_mlx_lm  # generate_step has no stop tokens
    desc_model = models.get("glimmer")
    if desc_model is None:
        desc_model, _ = load(path, lazy=True)
    V = desc_model.args.vocab_size
    ids = np.random.default_rng(seed).integers(0, V, prompt_tokens).tolist()

    load_before = os.getloadavg()
    for mode in modes:  # warm-up (first calls build kernels / allocate)
        say(f"warm-up {mode}")
        runners[mode](models[mode], ids, warmup_tokens)

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    outputs: dict[str, list[int]] = {}
    for r in range(repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))  # alternate who goes first
        for mode in order:
            say(f"repeat {r + 1}/{repeats}: {mode}")
            mx.clear_cache()
            toks, stamps, cpu, t0 = runners[mode](models[mode], ids, gen_tokens)
            if len(toks) != gen_tokens:
                raise RuntimeError(f"{mode} generated {len(toks)} tokens, expected {gen_tokens}")
            gen_time = stamps[-1] - stamps[0]
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            runs[mode].append({"tps": (gen_tokens - 1) / gen_time, "gen_time": gen_time,
                               "prefill_time": stamps[0] - t0,
                               "median_step_ms": 1000 * statistics.median(gaps),
                               "cpu_ms_per_token": 1000 * (cpu[-1] - cpu[0]) / (gen_tokens - 1)})
            outputs.setdefault(mode, toks)

    res = {
        "machine": machine_info(),
        "model": {"path": str(path), **model_desc(desc_model)},
        "settings": {"prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "repeats": repeats,
                     "warmup_tokens": warmup_tokens, "seed": seed, "sampling": "greedy",
                     "speed": "(gen_tokens - 1) / (time of last token - time of first token)"},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "modes": {m: {"tps": summary([x["tps"] for x in runs[m]]),
                      "median_step_ms": summary([x["median_step_ms"] for x in runs[m]]),
                      "cpu_ms_per_token": summary([x["cpu_ms_per_token"] for x in runs[m]]),
                      "prefill_s": summary([x["prefill_time"] for x in runs[m]])} for m in modes},
    }
    if "glimmer" in runs and "mlx-lm" in runs:
        g, b = runs["glimmer"], runs["mlx-lm"]
        res["ratio"] = summary([x["tps"] / y["tps"] for x, y in zip(g, b)])
        # robust companions: per-pair ratio of median step times, and of process CPU time per token
        res["ratio_median_step"] = summary([y["median_step_ms"] / x["median_step_ms"] for x, y in zip(g, b)])
        res["ratio_cpu"] = summary([y["cpu_ms_per_token"] / x["cpu_ms_per_token"] for x, y in zip(g, b)])
        a, b = outputs["glimmer"], outputs["mlx-lm"]
        res["tokens_agree"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2))
    return res


def _count_graph(outputs) -> dict[str, int]:
    """Primitive nodes (by name) of the lazy graph that produces `outputs` (via mx.export_to_dot)."""
    f = io.StringIO()
    mx.export_to_dot(f, outputs)
    return dict(collections.Counter(re.findall(r'label\s*=\s*"([A-Za-z]+)', f.getvalue())))


def decode_step_profile(path, *, prompt_tokens: int = 32, steps: int = 16, seed: int = 0) -> dict:
    """Per-decode-step costs of both implementations on one checkpoint, without generation-loop effects.

    - graph: primitive nodes MLX runs for one step (model + sampling, as each generation loop builds it);
    - build_ms: Python time to build that graph (no evaluation);
    - sync_step_ms: wall time of one step evaluated synchronously, ours and mlx-lm's steps interleaved one by one
      (A, B, A, B, …) so that load from other processes hits both alike; ratio = mlx-lm / ours.
    """
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    ours, _ = load(path)
    theirs, _ = mlx_lm.load(str(path))
    ids = np.random.default_rng(seed).integers(0, ours.args.vocab_size, prompt_tokens).tolist()
    x = mx.array(ids, dtype=mx.int32)[None]
    sampler = Sampler(SamplingParams())

    def ours_step(y, cache):  # what PlainDecoder.step queues
        return sampler(ours(y.reshape(1, 1), cache)[:, -1], None)

    def theirs_step(y, cache):  # what mlx_lm.generate_step's _step queues
        logits = theirs(y.reshape(1, 1), cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logprobs

    def fresh():
        ca, cb = ours.make_cache(), make_prompt_cache(theirs)
        ours(x, ca)
        theirs(x, cache=cb)
        mx.eval([c.state for c in ca], [c.state for c in cb])
        return ca, cb

    y = mx.array([ids[-1]], dtype=mx.int32)
    ca, cb = fresh()
    graph = {"glimmer": _count_graph(ours_step(y, ca)), "mlx-lm": _count_graph(list(theirs_step(y, cb)))}

    build = {"glimmer": [], "mlx-lm": []}
    for _ in range(3):  # graph building only (discarded)
        ca, cb = fresh()
        for name, fn, c in (("glimmer", ours_step, ca), ("mlx-lm", theirs_step, cb)):
            t = time.perf_counter()
            for _ in range(8):
                fn(y, c)
            build[name].append(1000 * (time.perf_counter() - t) / 8)

    ca, cb = fresh()
    ya, yb = y, y
    for _ in range(2):  # warm-up
        ya = ours_step(ya, ca)
        mx.eval(ya)
        yb = theirs_step(yb, cb)[0]
        mx.eval(yb)
    sync = {"glimmer": [], "mlx-lm": []}
    for i in range(steps):
        order = (("glimmer", "mlx-lm") if i % 2 == 0 else ("mlx-lm", "glimmer"))
        for name in order:
            t = time.perf_counter()
            if name == "glimmer":
                ya = ours_step(ya, ca)
                mx.eval(ya)
            else:
                yb, lp = theirs_step(yb, cb)
                mx.eval(yb, lp)
            sync[name].append(1000 * (time.perf_counter() - t))
    return {
        "graph_nodes": {k: sum(v.values()) for k, v in graph.items()},
        "graph": graph,
        "build_ms": {k: statistics.median(v) for k, v in build.items()},
        "sync_step_ms": {k: summary(v) for k, v in sync.items()},
        "sync_ratio": summary([b / a for a, b in zip(sync["glimmer"], sync["mlx-lm"])]),
        "steps": steps,
        "prompt_tokens": prompt_tokens,
    }


def format_plain(res: dict) -> str:
    """One Markdown table row per mode plus the ratio lines."""
    lines = ["| impl | tok/s median | min–max | spread | median step ms | CPU ms/token | prefill s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m, d in res["modes"].items():
        t = d["tps"]
        lines.append(f"| {m} | {t['median']:.2f} | {t['min']:.2f}–{t['max']:.2f} | {t['spread_pct']:.0f}% | "
                     f"{d['median_step_ms']['median']:.1f} | {d['cpu_ms_per_token']['median']:.1f} | "
                     f"{d['prefill_s']['median']:.2f} |")
    if "ratio" in res:
        r, rs, rc = res["ratio"], res["ratio_median_step"], res["ratio_cpu"]
        lines.append(f"\nratio glimmer/mlx-lm (tok/s, per repeat pair): median {r['median']:.3f} "
                     f"(min {r['min']:.3f}, max {r['max']:.3f}); by median step time {rs['median']:.3f}; "
                     f"by CPU time per token {rc['median']:.3f}")
        lines.append(f"greedy tokens agree for the first {res['tokens_agree']} of {res['settings']['gen_tokens']}; "
                     f"load average {res['load_average']['before'][0]:.1f} → {res['load_average']['after'][0]:.1f}")
    return "\n".join(lines)
