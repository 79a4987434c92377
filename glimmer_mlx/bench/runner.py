"""`glimmer bench`: every decoding mode on the same weights, prompts and seeds, in one process and one sitting.

Protocol. All models load once. One warm-up generation per mode and temperature. Then, for each repeat, for each
(category, prompt, temperature), every mode runs once in an order that changes from task to task so that each
mode runs first, and right after each other mode, equally often (`task_order`, a Williams design; interleaving: load
from other processes, thermal drift and what the mode before left running hit every mode alike). The stop token is
ignored, so every run generates exactly `max_tokens` and all modes do the same work. Per run: time to first token
(prefill + first token), generation speed (N − 1 tokens over the time from the first token to the last), τ (tokens
committed per verify round), MLX peak memory. Per mode: tok/s per repeat (total tokens over total time, over all
prompts), its median and spread, and the speedup vs plain decoding (`ar`) *in the same repeat*, median over repeats.
Greedy outputs of our speculative modes are checked against `ar` token by token (lossless). Timings are only
comparable inside one results.json.

Every mode of ours decodes as `glimmer generate` would: the drafters come from `strategy.load_drafters`, each mode is
a `strategy.DecodeSpec` (`settings.decode_spec`), and `Drafters.select` gives the drafter and block size per run.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..embedded import resolve_model
from ..generate import GenerationStats, stream_generate
from ..loading import load
from ..machine import apple_chip, machine_fingerprint, machine_info, package_version
from ..strategy import DecodeSpec, Drafters, ModeError, load_drafters
from .describe import model_desc, summary
from .report import verdict
from .settings import CONTROL, BenchSettings, decode_spec, load_prompts


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked (missing model parts, nothing to compare)."""


# -------------------------------------------------------------------------------------------------------------
# environment


def machine_fingerprint_info() -> dict:
    """machine.machine_info() + chip (Apple), OS, Python, glimmer-mlx version, relevant environment, fingerprint."""
    info = machine_info()
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("MLX_", "OMP_", "OPENBLAS_", "GLIMMER_")) or k in ("LD_PRELOAD", "VECLIB_MAXIMUM_THREADS")}
    info.update(chip=apple_chip() or info.get("cpu"), python=platform.python_version(),
                glimmer_mlx=package_version("glimmer-mlx"), env=env, fingerprint=machine_fingerprint())
    info["os"] = f"macOS {platform.mac_ver()[0]}" if platform.system() == "Darwin" else platform.platform()
    return info


def task_order(modes: list, j: int) -> list:
    """The modes' order for the j-th timed task: a Williams design — the order 0, 1, n−1, 2, n−2, … of the n modes
    shifted by one mode every two tasks, reversed every other task — so that over 2n tasks each mode runs first
    equally often and right after each other mode equally often (twice). What a mode leaves running slows the next
    for a while (OpenBLAS's idle threads spin ~0.1 s after a multi-row GEMM, taking a core from the next request's
    pipelined plain tokens on a 2-core machine): rotation alone kept every mode behind the same one (on the trained
    tiny set auto ran 0.81x n-gram lookup alone behind it and 0.96x behind plain decoding: BENCHMARKS.md, issue 20,
    twelfth session), and rotation with reversal behind its two neighbours in the list only — the modes next to
    DFlash-8 in `--quick`'s list paid for its wide verifies, the others did not (auto, plain in every round, 0.95x
    plain in that sitting and 1.05x in one without DFlash-8)."""
    n = len(modes)
    if n == 0:
        return []
    base = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...: its steps +1, -2, +3, ... (mod n)
        base.append((i + 1) // 2 if i % 2 else n - i // 2)
    k = (j // 2) % n
    order = [modes[(b + k) % n] for b in base]
    return order[::-1] if j % 2 else order


# -------------------------------------------------------------------------------------------------------------
# prompts


def encode_prompts(prompts: dict[str, list[str]], tokenizer, vocab_size: int) -> tuple[dict[str, list[list[int]]], str]:
    """Token ids per category: the chat template (user turn) if the tokenizer has one, else plain encoding; without
    a tokenizer (tiny test models) a byte fallback maps each UTF-8 byte b to id 2 + b mod (V − 2), which keeps the
    texts' repetitions (what n-gram lookup feeds on) but not their meaning."""
    out = {}
    if tokenizer is None:
        span = max(1, vocab_size - 2)
        for c, ps in prompts.items():
            out[c] = [[2 + b % span for b in p.encode("utf-8")] for p in ps]
        return out, "byte fallback (no tokenizer)"
    how = "chat template" if getattr(tokenizer, "chat_template", None) else "plain encoding"
    for c, ps in prompts.items():
        if how == "chat template":
            out[c] = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                         tokenize=True)) for p in ps]
        else:
            out[c] = [tokenizer.encode(p) for p in ps]
    return out, how


# -------------------------------------------------------------------------------------------------------------
# runners: (ids, max_tokens, temperature, seed) -> run record


def _time_stream(chunks) -> tuple[list[int], float, float, float]:
    """Consume a stream of token lists; (tokens, t_start, t_first_token, t_last_token)."""
    toks, t_first, t_last = [], None, None
    t0 = time.perf_counter()
    for new in chunks:
        if not new:
            continue
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        t_last = now
        toks += new
    return toks, t0, t_first, t_last


def _record(toks, t0, t_first, t_last, n, peak_gb, extra=None) -> dict:
    if len(toks) != n:
        raise BenchError(f"a run generated {len(toks)} tokens, expected {n} (the stop token is ignored)")
    gen = t_last - t_first
    r = {"tokens": len(toks), "ttft_s": t_first - t0, "gen_s": gen, "tps": (n - 1) / gen if gen > 0 else 0.0,
         "peak_gb": peak_gb}
    r.update(extra or {})
    return r


def ours_runner(model, drafters: Drafters, spec: DecodeSpec):
    """Our generation as `spec` decodes; the drafter is selected per run (it sets the MTP depth the spec asks for,
    which other modes' runs change)."""

    def run(ids, n, temp, seed):
        drafter, block_size = drafters.select(spec)
        stats = GenerationStats()
        toks, t0, tf, tl = _time_stream(ch.tokens for ch in stream_generate(
            model, ids, max_tokens=n, temperature=temp, seed=seed, drafter=drafter, block_size=block_size,
            stats=stats, tree=spec.tree))
        extra = {}
        hist = stats.extra.get("acceptance_histogram")
        if hist is not None:
            extra["committed"] = sum(int(k) * v for k, v in hist.items())
            extra["rounds"] = stats.extra["rounds"]
        if "verify_cost_ratio" in stats.extra:
            extra["verify_cost_ratio"] = stats.extra["verify_cost_ratio"]
        if "chosen_k_histogram" in stats.extra:
            extra["chosen_k"] = stats.extra["chosen_k_histogram"]
        if "tree_rounds" in stats.extra:
            extra["tree_rounds"], extra["mean_tree_rows"] = stats.extra["tree_rounds"], stats.extra["mean_tree_rows"]
        return _record(toks, t0, tf, tl, n, stats.peak_memory_gb, extra), toks

    return run


def mlx_lm_runner(lm_model, draft_model=None, num_draft_tokens: int = 3):
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    def run(ids, n, temp, seed):
        mx.random.seed(seed)
        sampler = make_sampler(temp=temp)
        mx.clear_cache()
        mx.reset_peak_memory()
        prompt = mx.array(ids, dtype=mx.int32)
        flags = []
        if draft_model is None:
            gen = ([int(t)] for t, _ in generate_step(prompt, lm_model, max_tokens=n, sampler=sampler))
        else:
            def spec():
                for t, _, from_draft in speculative_generate_step(prompt, lm_model, draft_model, max_tokens=n,
                                                                  sampler=sampler, num_draft_tokens=num_draft_tokens):
                    flags.append(bool(from_draft))
                    yield [int(t)]
            gen = spec()
        toks, t0, tf, tl = _time_stream(gen)
        extra = {}
        if draft_model is not None:  # every round ends with one target token (not from the draft)
            rounds = sum(1 for f in flags[1:] if not f)
            extra.update(committed=len(flags) - 1, rounds=rounds)
        return _record(toks, t0, tf, tl, n, mx.get_peak_memory() / 1e9, extra), toks

    return run


# -------------------------------------------------------------------------------------------------------------
# the sitting


def _tkey(t: float) -> str:
    return f"T={t:g}"


def _load_parts(model, draft_model, mtp_model, mlx_lm_draft_model, settings: BenchSettings, log):
    """Target (+ tokenizer), its drafters, mlx-lm's models; and why each mlx-lm mode that cannot run is skipped."""
    embedded = model is None
    path = resolve_model(model, announce=log)
    target, tok = load(path)
    target.eos_token_ids = set()  # benchmark runs never stop early: every mode generates max_tokens
    drafters = load_drafters(target, dflash=draft_model, mtp=mtp_model, embedded=embedded, log=log)
    skipped = {}
    parts = {"target": str(path), "embedded": embedded,
             "dflash": drafters.dflash.source if drafters.dflash is not None else None,
             "mtp": drafters.mtp.source if drafters.mtp is not None else None,
             "mtp_layers": drafters.mtp.head.num_layers if drafters.mtp is not None else None,
             "dflash_variant": getattr(drafters.dflash, "variant", None)}

    lm = lm_draft = None
    modes = settings.expanded_modes()
    if any(m.startswith("mlx-lm") for m in modes):
        import mlx_lm

        try:
            lm, _ = mlx_lm.load(str(path))
        except Exception as e:  # noqa: BLE001 - mlx-lm raises many types for checkpoints it cannot read
            msg = " ".join(str(e).split())
            skipped["mlx-lm"] = f"mlx-lm cannot load {path}: {type(e).__name__}: " + (
                msg if len(msg) < 240 else msg[:240] + " …")
        if "mlx-lm-draft" in modes:
            if lm is None:
                skipped["mlx-lm-draft"] = skipped.get("mlx-lm", "mlx-lm cannot load the target")
            elif mlx_lm_draft_model is None:
                skipped["mlx-lm-draft"] = ("no --mlx-lm-draft-model given (mlx-lm's draft-model speculation needs a "
                                           "small model with the same tokenizer)")
            else:
                try:
                    lm_draft, _ = mlx_lm.load(str(mlx_lm_draft_model))
                except Exception as e:  # noqa: BLE001
                    raise BenchError(f"mlx-lm cannot load --mlx-lm-draft-model {mlx_lm_draft_model}: "
                                     f"{type(e).__name__}: {e}")
                v_t, v_d = target.args.vocab_size, lm_draft.args.vocab_size
                if v_t != v_d:
                    raise BenchError(f"--mlx-lm-draft-model {mlx_lm_draft_model}: vocabulary {v_d} != the target's "
                                     f"{v_t} (it must share the target's tokenizer)")
                parts["draft_model"] = str(mlx_lm_draft_model)
    return target, tok, drafters, lm, lm_draft, skipped, parts


def run_bench(model: str | None = None, settings: BenchSettings | None = None, *, draft_model: str | None = None,
              mtp_model: str | None = None, mlx_lm_draft_model: str | None = None, calibration_dir=None,
              recalibrate: bool = False, progress: Callable | None = None, log: Callable | None = None) -> dict:
    """Run the sitting; returns the results dict (what `glimmer bench` writes as results.json).

    draft_model: our drafter (a DFlash drafter, or a folder of MTP layers), mtp_model: MTP layers, as in `glimmer
    generate` ("none" disables either; without --model the embedded set's are the default); mlx_lm_draft_model: a
    small mlx-lm model for mlx-lm's own draft-model speculation (`mlx-lm-draft`)."""
    settings = settings or BenchSettings.from_profile("default")
    settings.validate()
    say = log or (lambda m: None)
    prog = progress or (lambda msg, done=None, total=None: None)
    t_start = time.perf_counter()
    prog("loading models")
    target, tok, drafters, lm, lm_draft, skipped, parts = _load_parts(
        model, draft_model, mtp_model, mlx_lm_draft_model, settings, say)
    V = target.args.vocab_size

    # -- runners per mode
    runners: dict[str, Callable] = {}
    for m in settings.expanded_modes():
        spec = decode_spec(m)
        if spec is None:  # mlx-lm's own (skipped above when it cannot run)
            if m == "mlx-lm" and lm is not None:
                runners[m] = mlx_lm_runner(lm)
            elif m == "mlx-lm-draft" and lm is not None and lm_draft is not None:
                runners[m] = mlx_lm_runner(lm, lm_draft, settings.num_draft_tokens)
            continue
        try:
            drafters.check(spec)
        except ModeError as e:
            skipped[m] = str(e)
            continue
        runners[m] = ours_runner(target, drafters, spec)
    modes = [m for m in settings.expanded_modes() if m in runners]
    if set(modes) <= {"ar", CONTROL}:  # every other mode skipped: plain decoding against itself says nothing
        modes = ["ar"]
    auto = None
    if "auto" in runners:  # built (and calibrated) once, before the runs: their `select` returns this same object
        auto = drafters.auto(calibration_dir=calibration_dir, recalibrate=recalibrate, log=say)
    for m, why in skipped.items():
        say(f"skipping {m}: {why}")

    # -- prompts and tasks
    all_prompts = load_prompts()
    cats = settings.categories or list(all_prompts)
    chosen = {c: all_prompts[c][: settings.prompts_per_category] for c in cats}
    encoded, tokenization = encode_prompts(chosen, tok, V)
    tasks = [(c, i, t) for t in settings.temps for c in cats for i in range(len(encoded[c]))]
    n = settings.max_tokens

    # -- warm-up
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    warm_ids = encoded[cats[0]][0]
    for t in settings.temps:
        for m in modes:
            prog(f"warm-up {m} {_tkey(t)}")
            runners[m](warm_ids, max(2, min(settings.warmup_tokens, n)), t, settings.seed)

    # -- timed, interleaved
    runs: list[dict] = []
    outputs: dict[tuple, list[int]] = {}
    auto_choices: dict[str, dict[str, Counter]] = {}
    planned, done, ran, longest = settings.repeats, 0, 0, 0.0
    while ran < planned:
        r = ran
        t_rep = time.perf_counter()
        for ti, (c, i, t) in enumerate(tasks):
            order = task_order(modes, r * len(tasks) + ti)
            seed = settings.seed + 1000 * r + ti
            for m in order:
                prog(f"repeat {r + 1}/{planned} {c}[{i}] {_tkey(t)} {m}", done, planned * len(tasks) * len(modes))
                before = Counter(auto.chooser.chosen) if (m == "auto" and auto is not None) else None
                mx.clear_cache()
                rec, toks = runners[m](encoded[c][i], n, t, seed)
                rec.update(mode=m, category=c, prompt=i, temperature=t, repeat=r, seed=seed,
                           prompt_tokens=len(encoded[c][i]))
                if before is not None:
                    delta = Counter(auto.chooser.chosen)
                    delta.subtract(before)
                    rec["auto_chosen"] = {f"{a}:{b}": v for (a, b), v in delta.items() if v}
                    slot = auto_choices.setdefault(_tkey(t), {}).setdefault(c, Counter())
                    slot.update(rec["auto_chosen"])
                if t == 0:
                    outputs[(m, c, i, r)] = toks
                runs.append(rec)
                done += 1
        ran += 1
        longest = max(longest, time.perf_counter() - t_rep)
        planned = max(settings.repeats, more_repeats(settings, ran, time.perf_counter() - t_start, longest))
    prog("done", done, done)

    # -- lossless check at greedy: every speculative mode of ours must reproduce `ar` token for token
    lossless = {}
    if 0.0 in [float(x) for x in settings.temps]:
        for m in modes:
            if m == "ar":
                continue
            same = [outputs[(m, c, i, r)] == outputs[("ar", c, i, r)] for (mm, c, i, r) in outputs if mm == m]
            prefix = []
            for (mm, c, i, r) in outputs:
                if mm == m:
                    a, b = outputs[(m, c, i, r)], outputs[("ar", c, i, r)]
                    prefix.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            lossless[m] = {"identical_runs": sum(same), "runs": len(same),
                           "min_common_prefix": min(prefix) if prefix else None}

    results = {t_key: _aggregate([x for x in runs if _tkey(x["temperature"]) == t_key], modes, cats)
               for t_key in [_tkey(t) for t in settings.temps]}
    calib = None
    if auto is not None:
        s = auto.chooser.summary()
        calib = {**auto.calibration, "verify_cost_ms": s["verify_cost_ms"], "verify_cost_ratio": s["verify_cost_ratio"],
                 "taps": list(auto.taps), "learned": auto.memory.stats() if auto.memory is not None else None}
    res = {
        "schema": "glimmer-bench/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["glimmer"] + sys.argv[1:]) if Path(sys.argv[0]).name == "glimmer" else None,
        "machine": machine_fingerprint_info(),
        "model": {**parts, **model_desc(target)},
        "settings": {**settings.as_dict(), "modes_run": modes, "repeats_run": ran, "ignore_eos": True,
                     "speed": "(max_tokens - 1) / (time of last token - time of first token)"},
        "tokenization": tokenization,
        "skipped": skipped,
        "calibration": calib,
        "auto": auto.chooser.summary() if auto is not None else None,
        "auto_choices": {tk: {c: dict(v) for c, v in d.items()} for tk, d in auto_choices.items()},
        "lossless_greedy": lossless,
        "load_average": {"before": load_before, "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "results": results,
        "runs": runs,
        "wall_s": time.perf_counter() - t_start,
    }
    res["verdict"] = verdict(res)
    return res


def more_repeats(settings: BenchSettings, done: int, elapsed: float, longest: float) -> int:
    """The repeats a sitting with a time budget (`BenchSettings.budget_s`) runs in all, `done` of them run in
    `elapsed` seconds since it started (loading and calibration included), the longest in `longest`: as many more as
    fit in what is left of the budget at the longest's time each, at most `max_repeats` (without a budget: `done`)."""
    if settings.budget_s is None or longest <= 0:
        return done
    fit = int(max(0.0, settings.budget_s - elapsed) // longest)
    return min(settings.max_repeats, done + fit)


def _aggregate(runs: list[dict], modes: list[str], cats: list[str]) -> dict:
    """Per mode: tok/s per repeat (over the prompts in scope), speedup vs `ar` per repeat, τ, TTFT, peak memory;
    overall and per category."""
    def scope(rs):
        by_rep: dict[int, list[dict]] = {}
        for x in rs:
            by_rep.setdefault(x["repeat"], []).append(x)
        return {r: sum(x["tokens"] - 1 for x in v) / sum(x["gen_s"] for x in v) for r, v in by_rep.items()}

    def block(rs_mode, rs_ar):
        tps, base = scope(rs_mode), scope(rs_ar)
        committed = sum(x.get("committed", 0) for x in rs_mode)
        rounds = sum(x.get("rounds", 0) for x in rs_mode)
        return {
            "tps": summary([tps[r] for r in sorted(tps)]),
            "speedup": summary([tps[r] / base[r] for r in sorted(tps) if r in base and base[r] > 0]),
            "tau": committed / rounds if rounds else None,
            "ttft_ms": summary([1000 * x["ttft_s"] for x in rs_mode]),
            "peak_gb": max(x["peak_gb"] for x in rs_mode),
            "runs": len(rs_mode),
        }

    out = {}
    ar = [x for x in runs if x["mode"] == "ar"]
    for m in modes:
        rs = [x for x in runs if x["mode"] == m]
        if not rs:
            continue
        d = block(rs, ar)
        d["categories"] = {}
        for c in cats:
            rc = [x for x in rs if x["category"] == c]
            if rc:
                d["categories"][c] = block(rc, [x for x in ar if x["category"] == c])
        out[m] = d
    return out
