"""`glimmer bench` (every decoding mode on shipped prompt sets), `glimmer bench kernels`, `glimmer bench-plain`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..bench import (BenchError, BenchSettings, bench_plain, compare_logits, decode_step_profile, format_plain,
                     make_random_checkpoint, render_kernel_table, render_table, run_bench, run_kernel_bench,
                     write_chart)
from ..loading import CheckpointError
from .app import DraftModel, Model, MtpModel, app, console, fail, note


def bench_progress(transient: bool = True) -> Progress:
    """The benchmarks' progress display, redrawn only when the benchmark reports progress (between its timed runs):
    rich's default redraws from a thread of its own 10 times a second, and on a 2-core machine that thread's
    rendering ran beside the runs being timed (the quick bench's plain decoding measured 13 % slower with it and its
    per-run spread grew from 15 % to 19 %)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=console, transient=transient, auto_refresh=False)


@app.command("bench-plain")
def bench_plain_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint folder (must load with mlx-lm too)."),
    make_model: Optional[str] = typer.Option(None, "--make-model", help="Write a random-weight Glimmer checkpoint "
                                             "here with mlx-lm's save utilities (reused if present), then bench it."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="With --make-model: quantize (affine) to this many bits."),
    group_size: int = typer.Option(64, "--group-size", help="With --make-model --q-bits: quantization group size."),
    dtype: str = typer.Option("bf16", "--dtype", help="With --make-model: weight (and scale) dtype bf16 | fp16 | fp32."),
    layers: int = typer.Option(12, "--layers", help="With --make-model: decoder layers (12 ≈ 211M parameters)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="With --make-model: rewrite an existing folder."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Random prompt ids."),
    gen_tokens: int = typer.Option(64, "--gen-tokens", help="Tokens generated per run (no stop token)."),
    repeats: int = typer.Option(3, "--repeats", help="Interleaved repeats per implementation."),
    warmup_tokens: int = typer.Option(8, "--warmup-tokens"),
    modes: str = typer.Option("glimmer,mlx-lm", "--modes", help="Comma-separated: glimmer, mlx-lm."),
    check_logits: bool = typer.Option(False, "--check-logits", help="First compare both runtimes' logits."),
    profile: bool = typer.Option(False, "--profile", help="Also count graph nodes per decode step and time single "
                                 "synchronous steps of both, interleaved step by step."),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[str] = typer.Option(None, "--out", help="Results JSON (default: bench-plain.json in the model folder)."),
):
    """Plain greedy decode tok/s: glimmer vs mlx-lm on the same checkpoint, interleaved in one process."""
    if (model is None) == (make_model is None):
        fail("give exactly one of --model and --make-model")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    path = Path(model or make_model)
    with bench_progress(transient=False) as prog:
        if make_model is not None and (overwrite or not (path / "config.json").exists()):
            t = prog.add_task(f"writing random checkpoint to {path}", total=None)
            make_random_checkpoint(path, dtype=dtype, q_bits=q_bits, group_size=group_size, seed=seed,
                                   num_hidden_layers=layers)
            prog.update(t, total=1, completed=1, refresh=True)
        elif make_model is not None:
            console.print(f"[dim]{path} exists; reusing it (--overwrite rewrites it)[/]")
        if check_logits:
            t = prog.add_task("comparing logits", total=None)
            cmp = compare_logits(path, n_tokens=16 if q_bits else 64, seed=seed)
            prog.update(t, total=1, completed=1, refresh=True)
        total = len(mode_list) * (repeats + 1)  # warm-ups + timed runs
        task = prog.add_task("benchmark", total=total)

        def step(msg: str) -> None:
            prog.update(task, description=msg, advance=0 if msg.startswith("loading") else 1, refresh=True)

        try:
            res = bench_plain(path, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats,
                              modes=mode_list, warmup_tokens=warmup_tokens, seed=seed, progress=step)
        except ValueError as e:
            fail(str(e))
        prog.update(task, completed=total, description="done", refresh=True)
        if profile:
            t = prog.add_task("profiling single decode steps", total=None)
            prof = decode_step_profile(path, prompt_tokens=prompt_tokens, seed=seed)
            prog.update(t, total=1, completed=1, refresh=True)
    if check_logits:
        res["logits_vs_mlx_lm"] = cmp
    if profile:
        res["decode_step_profile"] = prof
    out_path = Path(out) if out else path / "bench-plain.json"
    out_path.write_text(json.dumps(res, indent=2))
    m = res["model"]
    Console().print(f"{path}: {m['parameters'] / 1e6:.0f}M parameters, {', '.join(m['dtypes'])}, "
                    f"quantization {m['quantization']}; BLAS: {res['machine']['blas']}\n" + format_plain(res))
    if check_logits:
        Console().print(f"logits vs mlx-lm: max |diff| {cmp['max_abs_diff']:.3g} (logit std {cmp['logit_std']:.3g}), "
                        f"cached decode max |diff| {cmp['cached_decode_max_abs_diff']:.3g}, argmax agreement "
                        f"{cmp['argmax_agreement']:.3f} over {cmp['tokens']} positions")
    if profile:
        g, b, st = prof["graph_nodes"], prof["build_ms"], prof["sync_step_ms"]
        Console().print(f"per decode step — graph nodes: glimmer {g['glimmer']}, mlx-lm {g['mlx-lm']}; graph build ms: "
                        f"glimmer {b['glimmer']:.1f}, mlx-lm {b['mlx-lm']:.1f}; synchronous step ms (median of "
                        f"{prof['steps']}, interleaved): glimmer {st['glimmer']['median']:.1f}, mlx-lm "
                        f"{st['mlx-lm']['median']:.1f}, ratio mlx-lm/glimmer {prof['sync_ratio']['median']:.3f}")
    console.print(f"[dim]results written to {out_path}[/]")


bench_app = typer.Typer(help="Speed benchmarks. `glimmer bench`: every decoding mode on shipped prompt sets in one "
                        "sitting (plain, mlx-lm, DFlash, MTP, n-gram, auto); subcommands add more (e.g. `bench kernels`).")
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
def bench_cmd(
    ctx: typer.Context,
    model: Model = None,
    draft_model: DraftModel = None,
    dflash: Optional[str] = typer.Option(None, "--dflash", help="Alias of --draft-model (the first vocabulary of "
                                         "`glimmer bench`). --draft-model none or --mtp-model none: bench without "
                                         "that drafter."),
    mtp_model: MtpModel = None,
    mlx_lm_draft_model: Optional[str] = typer.Option(None, "--mlx-lm-draft-model", help="A small mlx-lm model with "
                                                     "the same tokenizer, for mlx-lm's own draft-model speculative "
                                                     "decoding (mode mlx-lm-draft)."),
    modes: Optional[str] = typer.Option(None, "--modes", help="Comma-separated: ar, dflash, mtp, ngram, auto, "
                                        "mlx-lm, mlx-lm-draft, or single variants (dflash-b8, dflash-auto, mtp-d2)."),
    profile: str = typer.Option("default", "--profile", help="quick | default | m5-max (sizes, repeats; see "
                                "BENCHMARKS.md)."),
    quick: bool = typer.Option(False, "--quick", help="Same as --profile quick (CI scale)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Prompt categories (default: all shipped)."),
    prompts_per_category: Optional[int] = typer.Option(None, "--prompts", help="Prompts per category."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Tokens generated per run (EOS ignored)."),
    temps: Optional[str] = typer.Option(None, "--temps", help="Comma-separated temperatures (default 0,1)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Interleaved timed repeats (given alone: exactly "
                                          "that many)."),
    budget: Optional[float] = typer.Option(None, "--budget", help="Seconds the whole sitting may take: repeats after "
                                           "--repeats while one more fits (--quick: 150, at most 12 repeats; 0: "
                                           "none)."),
    dflash_blocks: Optional[str] = typer.Option(None, "--dflash-blocks", help="DFlash block sizes (default 4,8,16,auto;"
                                                " those above the drafter's trained block size are skipped)."),
    mtp_depths: Optional[str] = typer.Option(None, "--mtp-depths", help="MTP depths (default 1,2,3)."),
    num_draft_tokens: int = typer.Option(3, "--num-draft-tokens", help="mlx-lm-draft: drafts per round."),
    seed: int = typer.Option(0, "--seed"),
    recalibrate: bool = typer.Option(False, "--recalibrate", help="Measure auto's verify cost curve again (it is "
                                     "cached per machine and model in ~/.cache/glimmer-mlx or $GLIMMER_MLX_CACHE_DIR)."),
    out: str = typer.Option("bench-results", "--out", help="Folder for results.json and chart.png."),
):
    """Decode speed of every mode on shipped prompt sets, interleaved in one process: tok/s, speedup vs plain, τ,
    time to first token, peak memory; writes results.json (with the machine fingerprint) and chart.png.
    --draft-model / --mtp-model as in `glimmer generate`; 'none' disables either."""
    if ctx.invoked_subcommand is not None:
        return
    if dflash is not None and draft_model is not None and dflash != draft_model:
        fail("--dflash and --draft-model disagree (--dflash is an alias of --draft-model)")
    draft_model = draft_model if draft_model is not None else dflash
    try:
        settings = BenchSettings.from_profile("quick" if quick else profile, modes=modes, categories=categories,
                                              prompts_per_category=prompts_per_category, max_tokens=max_tokens,
                                              temps=temps, repeats=repeats, budget_s=budget,
                                              dflash_blocks=dflash_blocks, mtp_depths=mtp_depths,
                                              num_draft_tokens=num_draft_tokens, seed=seed)
    except ValueError as e:
        fail(str(e))
    with bench_progress() as prog:
        task = prog.add_task("loading", total=None)

        def progress(msg: str, done: int | None = None, total: int | None = None) -> None:
            prog.update(task, description=escape(msg[-70:]), completed=done, total=total, refresh=True)

        try:
            res = run_bench(model, settings, draft_model=draft_model, mtp_model=mtp_model,
                            mlx_lm_draft_model=mlx_lm_draft_model, recalibrate=recalibrate, progress=progress,
                            log=note)
        except (BenchError, CheckpointError, FileNotFoundError, ValueError) as e:
            fail(str(e))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(res, indent=2))
    write_chart(res, out_dir / "chart.png")
    wide = Console(width=None if sys.stdout.isatty() else 200)
    for table in render_table(res):
        wide.print(table)
    console.print(f"[dim]results written to {out_dir / 'results.json'} and {out_dir / 'chart.png'}[/]")


@bench_app.command("kernels")
def bench_kernels_cmd(
    rows: str = typer.Option("1,2,4,8,16", "--rows", help="Comma-separated k+1 row counts (1..16; 1..32 for "
                             "block_attention_tree alone)."),
    contexts: str = typer.Option("1024,8192,32768", "--contexts", help="Comma-separated KV lengths (attention)."),
    kernels: str = typer.Option("accept_greedy,accept_sampling,block_attention,qmm", "--kernels",
                                help="Comma-separated subset of accept_greedy, accept_sampling, block_attention, "
                                "block_attention_tree, qmm."),
    vocab: int = typer.Option(202048, "--vocab", help="Vocabulary size (acceptance kernels)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="float32 | float16 | bfloat16 (attention, qmm)."),
    bits: int = typer.Option(4, "--bits", help="4 or 8 (qmm)."),
    window: Optional[int] = typer.Option(None, "--window", help="Sliding window for attention (default: global)."),
    calls: int = typer.Option(50, "--calls", help="Calls per timing window (no host sync between them; one "
                              "evaluation per window)."),
    windows: int = typer.Option(5, "--windows", help="Timing windows per path (the median is reported)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write the results as JSON to this file."),
):
    """µs per call of the custom Metal kernels vs the built-in MLX path vs our pure-MLX references, in one run
    (Muse Glimmer shapes). Without Metal the kernel column says "no Metal"; the built-in and reference are timed."""
    try:
        res = run_kernel_bench(rows=tuple(int(x) for x in rows.split(",")),
                               contexts=tuple(int(x) for x in contexts.split(",")),
                               kernels=tuple(x.strip() for x in kernels.split(",") if x.strip()), vocab=vocab,
                               dtype=dtype, bits=bits, window=window, calls=calls, windows=windows,
                               progress=note)
    except ValueError as e:
        fail(str(e))
    if not res["metal"]["available"]:
        console.print(f"[yellow]{res['metal']['note']}[/]")
    console.print(render_kernel_table(res))
    if out:
        Path(out).write_text(json.dumps(res, indent=2))
        console.print(f"[dim]results written to {out}[/]")


@bench_app.command("serve")
def bench_serve_cmd(
    model: Model = None,
    draft_model: DraftModel = None,
    mtp_model: MtpModel = None,
    modes: str = typer.Option("ar,dflash,auto,mlx-lm", "--modes", help="Comma-separated: ar, dflash, mtp, ngram, "
                              "auto (glimmer serve, the mode sent per request) and mlx-lm (mlx_lm.server on the "
                              "same weights)."),
    clients: str = typer.Option("1,2,4,8,16", "--clients", help="Comma-separated concurrency levels N."),
    requests: int = typer.Option(2, "--requests", help="Requests per client per level (N × this per level)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="max_tokens of every request."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature of every request (0: "
                                      "greedy)."),
    seed: int = typer.Option(0, "--seed", help="Request i's seed is seed + i."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Prompt categories (default: all shipped)."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help="Seconds a request may take."),
    startup_timeout: float = typer.Option(300.0, "--startup-timeout", help="Seconds a server may take to be ready."),
    out: str = typer.Option("bench-serve", "--out", help="Folder for bench-serve.json, bench-serve.png and the "
                            "servers' logs."),
):
    """The server under load: N concurrent streaming clients (closed loop) replay the shipped prompt sets against
    `glimmer serve` (modes ar/dflash/auto per request) and mlx_lm.server on the same weights, each started here on a
    free loopback port and stopped at the end. Per mode and N: aggregate tok/s, per-request tok/s, TTFT and latency
    p50/p95, errors; writes bench-serve.json (with the machine fingerprint) and bench-serve.png."""
    from ..bench.serve import (ServeBenchError, ServeBenchSettings, render_serve_table, run_serve_bench,
                               select_prompts, write_json, write_serve_chart)

    try:
        settings = ServeBenchSettings.parse(
            modes=modes, clients=clients, requests=requests, max_tokens=max_tokens, temperature=temperature,
            seed=seed, request_timeout=request_timeout, startup_timeout=startup_timeout,
            categories=[c.strip() for c in categories.split(",") if c.strip()] if categories else None)
        select_prompts(settings.categories)
    except ValueError as e:
        fail(str(e))
    out_dir = Path(out)
    with bench_progress() as prog:
        task = prog.add_task("starting", total=None)

        def progress(msg: str, done: int | None = None, total: int | None = None) -> None:
            prog.update(task, description=escape(msg[-70:]), completed=done, total=total, refresh=True)

        try:
            res = run_serve_bench(settings, model=model, draft_model=draft_model, mtp_model=mtp_model,
                                  out_dir=out_dir, progress=progress, log=note)
        except (ServeBenchError, FileNotFoundError, ValueError) as e:
            fail(str(e))
    write_json(res, out_dir / "bench-serve.json")
    write_serve_chart(res, out_dir / "bench-serve.png")
    wide = Console(width=None if sys.stdout.isatty() else 200)
    for part in render_serve_table(res):
        wide.print(part)
    console.print(f"[dim]results written to {out_dir / 'bench-serve.json'} and {out_dir / 'bench-serve.png'}[/]")
