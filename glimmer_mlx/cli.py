"""`glimmer` command line (typer + rich). Commands parse arguments and call library functions."""

from __future__ import annotations

import json
import sys
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="glimmer-mlx: run Muse Glimmer locally with MLX, with lossless speculative decoding.")
console = Console(stderr=True)


def _fail(msg: str) -> None:
    # soft_wrap: paths and tensor names stay on one line; escape: '[...]' in a message is text, not rich markup
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(1)


def _resolve(model: str | None, part: str = "target") -> str:
    """`model`, or the embedded model's folder (announced once)."""
    from .embedded import resolve_model

    try:
        return resolve_model(model, part, announce=lambda m: console.print(f"[dim]{escape(m)}[/]", soft_wrap=True))
    except FileNotFoundError as e:
        _fail(str(e))


def _default_model(model, draft_model, mtp: bool, dflash: bool):
    """No --model: the embedded target, with its MTP layer for --mtp and its DFlash drafter for --dflash (unless
    --draft-model names another)."""
    if model is None:
        model = _resolve(None)
        if draft_model is None and (mtp or dflash):
            draft_model = _resolve(None, "mtp" if mtp else "dflash")
    return model, draft_model


@app.command()
def generate(
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint folder or Hub repo id (default: the "
                                        "embedded glimmer-tiny)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text; '-' reads stdin."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m"),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt"),
    chat: bool = typer.Option(True, "--chat-template/--raw", help="Wrap the prompt in the chat template if any."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: checkpoint dtype)."),
    prefill_step_size: int = typer.Option(512, "--prefill-step-size"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model",
                                              help="Drafter checkpoint: a DFlash assistant or MTP layers."),
    block_size: Optional[str] = typer.Option(None, "--block-size", help="DFlash: drafts per round + 1, or 'auto'."),
    dflash: bool = typer.Option(False, "--dflash", help="Speculate with the embedded DFlash drafter (default model "
                                "only; otherwise give --draft-model)."),
    mtp: bool = typer.Option(False, "--mtp", help="Speculate with MTP layers: the target's own, or --draft-model's "
                             "(default model: the embedded MTP layer)."),
    mtp_depth: Optional[str] = typer.Option(None, "--mtp-depth", help="MTP drafts per round (past the trained "
                                            "layers the last is reused), or 'auto'. Default: trained layers."),
    auto: bool = typer.Option(False, "--auto", help="Per round, the fastest of DFlash (--draft-model, or the "
                              "embedded drafter), MTP (the target's own layers, or the embedded ones), n-gram prompt "
                              "lookup and plain steps, from acceptance and costs measured on this machine."),
    image: List[str] = typer.Option([], "--image", help="Image file (repeatable). Put one <|patch|> in the prompt "
                                    "where each image goes, or none to put them all before the prompt text."),
    verbose: bool = typer.Option(True, "--verbose/--quiet", help="Print the stats line."),
):
    """Generate text from a prompt (optionally with images)."""
    from . import load, stream_generate
    from .generate import GenerationStats
    from .loading import CheckpointError

    if prompt == "-":
        prompt = sys.stdin.read()
    if dflash and mtp:
        _fail("--dflash and --mtp exclude each other")
    if dflash and draft_model is None and model is not None:
        _fail("--dflash without --draft-model only works with the embedded default model; give --draft-model")
    if auto and (dflash or mtp or block_size is not None or mtp_depth is not None):
        _fail("--auto chooses the drafter and the width itself: drop --dflash / --mtp / --block-size / --mtp-depth")
    embedded_default = model is None
    model, draft_model = _default_model(model, draft_model, mtp, dflash)
    images = None
    if image:
        from .image_processing import IMAGE_TOKEN, ImageError, preprocess_image

        try:  # decode and check every file before loading the model
            images = [preprocess_image(p) for p in image]
        except ImageError as e:
            _fail(str(e))
        if IMAGE_TOKEN not in prompt:  # images first in the user turn (inside the chat template)
            prompt = IMAGE_TOKEN * len(image) + prompt
    try:
        m, tok = load(model, dtype=dtype)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    if tok is None:
        _fail(f"{model}: no tokenizer.json in the checkpoint; use the Python API with token ids")
    drafter = None
    if mtp_depth is not None and not mtp:
        _fail("--mtp-depth needs --mtp")
    if mtp and block_size is not None:
        _fail("--block-size is for DFlash; with --mtp use --mtp-depth")
    if auto:
        from .speculative.auto import load_auto

        try:
            drafter = load_auto(m, dflash=draft_model, embedded=embedded_default,
                                log=lambda msg: console.print(f"[dim]{escape(msg)}[/]", soft_wrap=True))
        except (CheckpointError, ValueError) as e:
            _fail(str(e))
    elif draft_model is not None or mtp:
        from .speculative import MTPDrafter, load_drafter

        try:
            drafter = load_drafter(draft_model if draft_model is not None else model, m)
        except (CheckpointError, ValueError) as e:
            _fail(str(e))
        if mtp and not isinstance(drafter, MTPDrafter):
            _fail(f"{draft_model or model}: --mtp needs a checkpoint with MTP layers (num_mtp_layers and mtp.* "
                  "weights); this one is a DFlash drafter")
    bs = None
    width = mtp_depth if mtp else block_size
    if width is not None:
        try:
            bs = "auto" if width == "auto" else int(width)
        except ValueError:
            _fail(f"{'--mtp-depth' if mtp else '--block-size'} must be an integer or 'auto', got {width!r}")
    if chat and tok.chat_template:
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok.encode(prompt)
    stats = GenerationStats()
    # chat-templated output goes through the template's response parser: headers (` to=user<|message|>`) hidden,
    # tool calls summarised after the answer; --raw prints the model's text as generated
    parser = None
    if chat and tok.chat_template:
        from .tool_calls import get_parser

        parser = get_parser(tok.chat_template)
    text, shown = "", 0
    try:
        for chunk in stream_generate(m, ids, tokenizer=tok, max_tokens=max_tokens, temperature=temp, top_p=top_p,
                                     top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                     stop=stop, drafter=drafter, block_size=bs, prefill_step_size=prefill_step_size,
                                     stats=stats, images=images):
            # model text is data: written verbatim (rich would expand :emoji: codes and drop control characters)
            text += chunk.text
            out = chunk.text
            if parser is not None:
                visible = parser.visible(text) if chunk.finish_reason is None else parser.parse(text).content
                out, shown = visible[shown:], max(shown, len(visible))
            sys.stdout.write(out)
            sys.stdout.flush()
    except ValueError as e:
        _fail(str(e))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if parser is not None:
        for call in parser.parse(text).tool_calls:
            console.print(f"[cyan]tool call:[/] {escape(call.name)}({escape(json.dumps(call.arguments))})",
                          soft_wrap=True)
    if verbose:
        console.print(f"[dim]{stats.line()}[/]")


@app.command()
def info(
    model: Optional[str] = typer.Argument(None, help="Checkpoint folder or Hub repo id (with --plan also: "
                                          "muse-glimmer-30b). Default: the embedded glimmer-tiny."),
    context: List[int] = typer.Option([4096, 32768, 131072], "--context", help="Context lengths for the KV table."),
    plan: bool = typer.Option(False, "--plan", help="Memory plan: model + drafter + quantization + context vs Mac "
                              "memory sizes (what `glimmer convert` with these settings would need)."),
    drafter: str = typer.Option("default", "--drafter", help="With --plan: DFlash drafter folder / Hub id, "
                                "'default' (the released assistant's config) or 'none'."),
    q_bits: Optional[int] = typer.Option(4, "--q-bits", help="With --plan: bits (0 = unquantized bf16)."),
    q_group_size: Optional[int] = typer.Option(None, "--q-group-size"),
    q_mode: str = typer.Option("affine", "--q-mode"),
    recipe: Optional[str] = typer.Option(None, "--quant-predicate", "--recipe", help="With --plan: mixed recipe."),
    quantize_vision: bool = typer.Option(False, "--quantize-vision", help="With --plan: vision weights quantized."),
    text_only: bool = typer.Option(False, "--text-only", help="With --plan: without the vision tower."),
    mem: List[int] = typer.Option(list((24, 32, 36, 48, 64, 128)), "--mem", help="With --plan: Mac memory sizes (GB)."),
):
    """Architecture summary, parameter count by part, and memory needed per dtype / quantization and context."""
    model = _resolve(model)
    from .info import model_info
    from .loading import CheckpointError

    if plan:
        _print_plan(model, drafter, q_bits, q_group_size, q_mode, recipe, quantize_vision, text_only, context, mem)
        return
    try:
        report = model_info(model, contexts=context)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    out = Console()
    arch = Table(title=f"{report['path']} — {report['model_type']}", show_header=False)
    for k, v in report["architecture"].items():
        arch.add_row(k, str(v))
    out.print(arch)
    params = Table(title="parameters")
    params.add_column("part")
    params.add_column("count", justify="right")
    for k, v in report["parameters"].items():
        params.add_row(k, f"{v:,}")
    out.print(params)
    mem = Table(title="memory (GB): weights + KV cache at batch 1")
    mem.add_column("weights")
    mem.add_column("weights GB", justify="right")
    for c in report["contexts"]:
        mem.add_column(f"ctx {c:,}", justify="right")
    for row in report["memory"]:
        mem.add_row(row["format"], f"{row['weights_gb']:.2f}", *[f"{x:.2f}" for x in row["total_gb"]])
    out.print(mem)


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
    import json
    from pathlib import Path

    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .bench import bench_plain, compare_logits, decode_step_profile, format_plain, make_random_checkpoint

    if (model is None) == (make_model is None):
        _fail("give exactly one of --model and --make-model")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    path = Path(model or make_model)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        if make_model is not None and (overwrite or not (path / "config.json").exists()):
            t = prog.add_task(f"writing random checkpoint to {path}", total=None)
            make_random_checkpoint(path, dtype=dtype, q_bits=q_bits, group_size=group_size, seed=seed,
                                   num_hidden_layers=layers)
            prog.update(t, total=1, completed=1)
        elif make_model is not None:
            console.print(f"[dim]{path} exists; reusing it (--overwrite rewrites it)[/]")
        if check_logits:
            t = prog.add_task("comparing logits", total=None)
            cmp = compare_logits(path, n_tokens=16 if q_bits else 64, seed=seed)
            prog.update(t, total=1, completed=1)
        total = len(mode_list) * (repeats + 1)  # warm-ups + timed runs
        task = prog.add_task("benchmark", total=total)

        def step(msg: str) -> None:
            prog.update(task, description=msg, advance=0 if msg.startswith("loading") else 1)

        try:
            res = bench_plain(path, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats,
                              modes=mode_list, warmup_tokens=warmup_tokens, seed=seed, progress=step)
        except ValueError as e:
            _fail(str(e))
        prog.update(task, completed=total, description="done")
        if profile:
            t = prog.add_task("profiling single decode steps", total=None)
            prof = decode_step_profile(path, prompt_tokens=prompt_tokens, seed=seed)
            prog.update(t, total=1, completed=1)
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
    model: Optional[str] = typer.Option(None, "--model", help="Target checkpoint (default: the embedded model)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="A small mlx-lm model with the same "
                                              "tokenizer, for mlx-lm's own draft-model speculative decoding."),
    dflash: Optional[str] = typer.Option(None, "--dflash", help="DFlash drafter (default: the embedded one when "
                                         "--model is not given; 'none' disables)."),
    mtp_model: Optional[str] = typer.Option(None, "--mtp-model", help="MTP layers (default: the target's own, else "
                                            "the embedded ones when --model is not given; 'none' disables)."),
    modes: Optional[str] = typer.Option(None, "--modes", help="Comma-separated: ar, dflash, mtp, ngram, auto, "
                                        "mlx-lm, mlx-lm-draft, or single variants (dflash-b8, dflash-auto, mtp-d2)."),
    profile: str = typer.Option("default", "--profile", help="quick | default | m5-max (sizes, repeats; see "
                                "BENCHMARKS.md)."),
    quick: bool = typer.Option(False, "--quick", help="Same as --profile quick (CI scale)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Prompt categories (default: all shipped)."),
    prompts_per_category: Optional[int] = typer.Option(None, "--prompts", help="Prompts per category."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Tokens generated per run (EOS ignored)."),
    temps: Optional[str] = typer.Option(None, "--temps", help="Comma-separated temperatures (default 0,1)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Interleaved timed repeats."),
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
    time to first token, peak memory; writes results.json (with the machine fingerprint) and chart.png."""
    if ctx.invoked_subcommand is not None:
        return
    from pathlib import Path

    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .benchmark import BenchError, BenchSettings, render_table, run_bench, write_chart
    from .loading import CheckpointError

    try:
        settings = BenchSettings.from_profile("quick" if quick else profile, modes=modes, categories=categories,
                                              prompts_per_category=prompts_per_category, max_tokens=max_tokens,
                                              temps=temps, repeats=repeats, dflash_blocks=dflash_blocks,
                                              mtp_depths=mtp_depths, num_draft_tokens=num_draft_tokens, seed=seed)
    except ValueError as e:
        _fail(str(e))
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task("loading", total=None)

        def progress(msg: str, done: int | None = None, total: int | None = None) -> None:
            prog.update(task, description=escape(msg[-70:]), completed=done, total=total)

        try:
            res = run_bench(model, settings, dflash=dflash, mtp_model=mtp_model, draft_model=draft_model,
                            recalibrate=recalibrate, progress=progress, log=lambda m: console.print(f"[dim]{escape(m)}[/]", soft_wrap=True))
        except (BenchError, CheckpointError, FileNotFoundError, ValueError) as e:
            _fail(str(e))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import json

    (out_dir / "results.json").write_text(json.dumps(res, indent=2))
    write_chart(res, out_dir / "chart.png")
    wide = Console(width=None if sys.stdout.isatty() else 200)
    for table in render_table(res):
        wide.print(table)
    console.print(f"[dim]results written to {out_dir / 'results.json'} and {out_dir / 'chart.png'}[/]")


@bench_app.command("kernels")
def bench_kernels_cmd(
    rows: str = typer.Option("1,2,4,8,16", "--rows", help="Comma-separated k+1 row counts (1..16)."),
    contexts: str = typer.Option("1024,8192,32768", "--contexts", help="Comma-separated KV lengths (attention)."),
    kernels: str = typer.Option("accept_greedy,accept_sampling,block_attention,qmm", "--kernels",
                                help="Comma-separated subset of accept_greedy, accept_sampling, block_attention, qmm."),
    vocab: int = typer.Option(202048, "--vocab", help="Vocabulary size (acceptance kernels)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="float32 | float16 | bfloat16 (attention, qmm)."),
    bits: int = typer.Option(4, "--bits", help="4 or 8 (qmm)."),
    window: Optional[int] = typer.Option(None, "--window", help="Sliding window for attention (default: global)."),
    repeats: int = typer.Option(20, "--repeats"),
    out: Optional[str] = typer.Option(None, "--out", help="Write the results as JSON to this file."),
):
    """µs per call of the custom Metal kernels vs their pure-MLX references vs stock MLX (Muse Glimmer shapes).
    Without Metal only the reference and stock paths are timed; kernel figures are reported as not measured."""
    import json

    from .kernels.bench import render_table, run_kernel_bench

    try:
        res = run_kernel_bench(rows=tuple(int(x) for x in rows.split(",")),
                               contexts=tuple(int(x) for x in contexts.split(",")),
                               kernels=tuple(x.strip() for x in kernels.split(",") if x.strip()), vocab=vocab,
                               dtype=dtype, bits=bits, window=window, repeats=repeats,
                               progress=lambda m: console.print(f"[dim]{escape(m)}[/]"))
    except ValueError as e:
        _fail(str(e))
    if not res["metal"]["available"]:
        console.print(f"[yellow]{res['metal']['note']}[/]")
    console.print(render_table(res))
    if out:
        from pathlib import Path

        Path(out).write_text(json.dumps(res, indent=2))
        console.print(f"[dim]results written to {out}[/]")


def _print_plan(model, drafter, q_bits, q_group_size, q_mode, recipe, quantize_vision, text_only, contexts, mem):
    from .info import memory_plan
    from .loading import CheckpointError

    try:
        r = memory_plan(model, None if drafter == "none" else drafter, bits=q_bits or None, group_size=q_group_size,
                        mode=q_mode, recipe=recipe, quantize_vision=quantize_vision, text_only=text_only,
                        contexts=contexts, mem_sizes=mem)
    except (CheckpointError, ValueError, KeyError) as e:
        _fail(str(e))
    out = Console()
    w = Table(title=f"{model}: weights, {r['quantization']} (vision: {r['vision']})")
    for c in ("part", "parameters", "GB"):
        w.add_column(c, justify="left" if c == "part" else "right")
    for k, v in r["parts"].items():
        w.add_row(k, f"{v['params'] / 1e9:.2f} B", f"{v['bytes'] / 1e9:.2f}")
    w.add_row("total weights", "", f"{r['weights_bytes'] / 1e9:.2f}")
    out.print(w)
    t = Table(show_edge=False, title=f"memory needed (GB, batch 1, incl. {r['overhead_bytes'] / 1e9:.1f} GB runtime overhead) and "
                    "fit per Mac memory size (GPU working set ≈ 2/3 of RAM below 36 GB, 3/4 from 36 GB)")
    for c in ("context", "KV", "dKV", "total", *[f"{m}GB" for m in r["mem_sizes"]]):
        t.add_column(c, justify="right", no_wrap=True)
    for row in r["rows"]:
        t.add_row(f"{row['context']:,}", f"{row['kv_cache_bytes'] / 1e9:.2f}", f"{row['drafter_cache_bytes'] / 1e9:.2f}",
                  f"{row['total_bytes'] / 1e9:.2f}",
                  *[{"yes": "[green]yes[/]", "no": "[red]no[/]"}.get(row["fits"][m], "[yellow]sysctl[/]")
                    for m in r["mem_sizes"]])
    out.print(t)
    out.print("[dim]KV: target KV cache, dKV: drafter context cache; sysctl: fits only after raising the GPU wired limit, `sudo sysctl iogpu.wired_limit_mb=<RAM − 6 GB "
              "in MB>`[/]")


@app.command()
def convert(
    src: str = typer.Argument(..., help="Source checkpoint: folder or Hub repo id (target or DFlash drafter)."),
    out: str = typer.Argument(..., help="Output folder (mlx-lm layout); must not exist unless --force."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize (default: affine 4-bit, group 64)."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Bits per weight (mode default if omitted)."),
    q_group_size: Optional[int] = typer.Option(None, "--q-group-size", help="Group size (mode default if omitted)."),
    q_mode: str = typer.Option("affine", "--q-mode", help="affine | mxfp4 | nvfp4 | mxfp8."),
    recipe: Optional[str] = typer.Option(None, "--quant-predicate", "--recipe",
                                         help="Mixed recipe: mixed_2_6 | mixed_3_4 | mixed_3_6 | mixed_4_6 | "
                                         "glimmer_4_6 (implies -q)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float16 | bfloat16 | float32 for unquantized tensors "
                                        "and scales (default: config.json's dtype, else the source's)."),
    quantize_vision: bool = typer.Option(False, "--quantize-vision/--keep-vision",
                                         help="Also quantize the vision linear weights (default: keep them)."),
    text_only: bool = typer.Option(False, "--text-only", help="Drop the vision tensors; write a flat text config."),
    target: Optional[str] = typer.Option(None, "--target", help="For a drafter: its target, to measure τ."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists (only once the new one is done)."),
    evaluate: bool = typer.Option(True, "--eval/--no-eval", help="Measure quality (KL, top-1, τ) after writing."),
    eval_tokens: int = typer.Option(128, "--eval-tokens", help="Sample length for the quality check."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB, 500MB (GiB/MiB)."),
):
    """Convert (and optionally quantize) a checkpoint to MLX format, streaming, with a quality report."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    from .convert import ConvertError, convert as run_convert, parse_size
    from .loading import CheckpointError

    try:
        limit = parse_size(max_shard_size)
    except ValueError as e:
        _fail(str(e))
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        task = prog.add_task("converting", total=None)

        def progress(done, total, msg):
            prog.update(task, completed=done, total=total, description=escape(msg[-60:]))

        try:
            res = run_convert(src, out, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, q_mode=q_mode,
                              dtype=dtype, recipe=recipe, quantize_vision=quantize_vision, text_only=text_only,
                              target=target, force=force, evaluate=evaluate, eval_tokens=eval_tokens,
                              max_shard_bytes=limit, progress=progress,
                              log=lambda m: console.print(f"[dim]{escape(m)}[/]", soft_wrap=True))
        except KeyboardInterrupt as e:
            _fail(str(e) or "interrupted; nothing was written")
        except (ConvertError, CheckpointError, ValueError) as e:
            _fail(str(e))
    s, q = res.summary, res.quality
    o = Console()
    lt = Table(title="relative weight error ‖W − Ŵ‖/‖W‖ by layer")
    for c in ("group", "part", "tensors", "bits", "mean", "max"):
        lt.add_column(c, justify="left" if c in ("group", "part") else "right")
    for row in q["layers"]:
        lt.add_row(row["group"], row["part"], str(row["tensors"]), ",".join(map(str, row["bits"])) or "-",
                   f"{row['rel_error_mean']:.4f}", f"{row['rel_error_max']:.4f}")
    if q["layers"]:
        o.print(lt)
    if "logits" in q:
        g = q["logits"]
        t = Table(title=f"logits vs source (fp32), {g['positions']} positions, {g['sample']}")
        for c in ("KL mean", "KL max", "top-1 agreement", "max |Δlogit|", "NLL source → converted"):
            t.add_column(c, justify="right")
        t.add_row(f"{g['kl_mean']:.4g}", f"{g['kl_max']:.4g}", f"{g['top1_agreement']:.3f}",
                  f"{g['max_abs_logit_diff']:.3g}",
                  f"{g.get('nll_ref', float('nan')):.3f} → {g.get('nll_quantized', float('nan')):.3f}")
        o.print(t)
    if "drafter" in q:
        d = q["drafter"]
        t = Table(title=f"drafter vs target {d['target']} ({d['prompts']} prompts, greedy, {d['max_tokens']} tokens)")
        for c in ("τ before", "τ after", "greedy == plain", "draft KL", "draft top-1"):
            t.add_column(c, justify="right")
        t.add_row(f"{d['tau_source']:.3f}", f"{d['tau_converted']:.3f}", str(d["greedy_identical_to_plain"]),
                  f"{d['draft_logits']['kl_mean']:.4g}", f"{d['draft_logits']['top1_agreement']:.3f}")
        o.print(t)
    o.print(f"{s['out']}: {s['quantization']}, {s['bits_per_weight']:.2f} bits/weight, "
            f"{s['bytes_out'] / 1e9:.3f} GB in {len(s['shards'])} shard(s); {s['tensors_in']} tensors {s['parts']}; "
            f"{s['throughput_mb_s']:.0f} MB/s, peak RSS {s['peak_rss_convert_bytes'] / 1e9:.2f} GB while writing "
            f"(largest shard {s['largest_shard_bytes'] / 1e9:.3f} GB), {s['seconds_total']:.1f} s in all")
    console.print(f"[dim]quality report: {s['out']}/quality.json; model card: {s['out']}/README.md[/]")


train_app = typer.Typer(help="Train drafters against a frozen target: `train dflash`, `train mtp`.",
                        no_args_is_help=True)
app.add_typer(train_app, name="train")


def _train(kind, model, out, data, text, regenerate, regen_max_tokens, regen_temp, init, layers, block_size,
           target_layer_ids, mask_token_id, mtp_layers, anchors_per_seq, gamma, max_length, val_fraction, epochs,
           batch_size, lr, warmup, grad_accum, save_every, max_steps, seed, resume, draft_logits, eval_tokens):
    from .loading import CheckpointError
    from .train import DataError, TrainConfig, train

    if data is None and not text:
        _fail("give training data: --data CHATS.jsonl and/or --text FILE_OR_FOLDER")
    model = _resolve(model)
    taps = None
    if target_layer_ids:
        try:
            taps = [int(x) for x in target_layer_ids.split(",")]
        except ValueError:
            _fail(f"--target-layer-ids must be comma-separated integers, got {target_layer_ids!r}")
    cfg = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, warmup=warmup, grad_accum=grad_accum,
                      save_every=save_every, seed=seed, max_steps=max_steps)
    try:
        summary = train(kind, model, out, chats=data, texts=text, regenerate=regenerate,
                        regen_max_tokens=regen_max_tokens, regen_temperature=regen_temp, init=init, layers=layers,
                        block_size=block_size, target_layer_ids=taps, mask_token_id=mask_token_id,
                        mtp_layers=mtp_layers, anchors_per_seq=anchors_per_seq, gamma=gamma, max_length=max_length,
                        val_fraction=val_fraction, draft_logits=draft_logits, resume=resume, cfg=cfg,
                        console=console, eval_tokens=eval_tokens)
    except (CheckpointError, DataError, ValueError, FileExistsError, FileNotFoundError) as e:
        _fail(str(e))
    ev = summary["eval"]
    console.print(f"done: {summary['steps']} steps, loss {summary['first_loss']:.3f} → {summary['final_loss']:.3f}"
                  f" (validation {summary.get('val_loss')}), {summary['tokens_per_s']:,.0f} tok/s; "
                  f"τ greedy {ev['before'] and ev['before']['tau_greedy']} → {ev['after']['tau_greedy']}, "
                  f"T=1 {ev['before'] and ev['before']['tau_t1']} → {ev['after']['tau_t1']}; written to {out}")


# options `glimmer train dflash` and `glimmer train mtp` share (same flags, same defaults)
_TrainModel = Annotated[Optional[str], typer.Option("--model", help="Target checkpoint (folder or Hub id; default: "
                                                    "the embedded glimmer-tiny).")]
_TrainData = Annotated[Optional[str], typer.Option("--data", help="Chat JSONL ({'messages': [...]} per line), or "
                                                   "pre-tokenized {'prompt_ids', 'completion_ids'} lines.")]
_TrainText = Annotated[List[str], typer.Option("--text", help="Plain-text / code file or folder (repeatable).")]
_RegenMaxTokens = Annotated[int, typer.Option("--regen-max-tokens")]
_RegenTemp = Annotated[float, typer.Option("--regen-temp")]
_MaxLength = Annotated[int, typer.Option("--max-length")]
_ValFraction = Annotated[float, typer.Option("--val-fraction")]
_BatchSize = Annotated[int, typer.Option("--batch-size")]
_Lr = Annotated[float, typer.Option("--lr")]
_Warmup = Annotated[float, typer.Option("--warmup")]
_GradAccum = Annotated[int, typer.Option("--grad-accum")]
_SaveEvery = Annotated[int, typer.Option("--save-every")]
_MaxSteps = Annotated[Optional[int], typer.Option("--max-steps")]
_TrainSeed = Annotated[int, typer.Option("--seed")]
_Resume = Annotated[bool, typer.Option("--resume")]
_DraftLogits = Annotated[str, typer.Option("--draft-logits", help="target | raw: which logits the loss uses.")]
_EvalTokens = Annotated[int, typer.Option("--eval-tokens")]


@train_app.command("dflash")
def train_dflash_cmd(
    model: _TrainModel = None,
    out: str = typer.Option(..., "--out", help="Output folder (official muse_glimmer_assistant layout)."),
    data: _TrainData = None,
    text: _TrainText = [],
    regenerate: bool = typer.Option(False, "--regenerate", help="Rewrite assistant replies with the target "
                                    "(resumable, cached in OUT/regenerated.jsonl)."),
    regen_max_tokens: _RegenMaxTokens = 256,
    regen_temp: _RegenTemp = 0.0,
    init: Optional[str] = typer.Option(None, "--init", help="Fine-tune this drafter instead of a new one."),
    layers: int = typer.Option(1, "--layers", help="New drafter: decoder layers."),
    block_size: int = typer.Option(16, "--block-size", help="New drafter: block size B."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="e.g. 1,13,25,37,49 "
                                                   "(default: evenly spaced)."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Default: <|mask|> or 201818."),
    anchors_per_seq: int = typer.Option(16, "--anchors-per-seq"),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Loss decay (default 7 for B=16)."),
    max_length: _MaxLength = 1024,
    val_fraction: _ValFraction = 0.1,
    epochs: int = typer.Option(6, "--epochs"),
    batch_size: _BatchSize = 8,
    lr: _Lr = 6e-4,
    warmup: _Warmup = 0.04,
    grad_accum: _GradAccum = 1,
    save_every: _SaveEvery = 200,
    max_steps: _MaxSteps = None,
    seed: _TrainSeed = 0,
    resume: _Resume = False,
    draft_logits: _DraftLogits = "target",
    eval_tokens: _EvalTokens = 64,
):
    """Train a DFlash drafter (the paper's recipe) against a frozen target."""
    _train("dflash", model, out, data, text, regenerate, regen_max_tokens, regen_temp, init, layers, block_size,
           target_layer_ids, mask_token_id, 1, anchors_per_seq, gamma, max_length, val_fraction, epochs, batch_size,
           lr, warmup, grad_accum, save_every, max_steps, seed, resume, draft_logits, eval_tokens)


@train_app.command("mtp")
def train_mtp_cmd(
    model: _TrainModel = None,
    out: str = typer.Option(..., "--out", help="Output folder (mtp.safetensors + config.json)."),
    data: _TrainData = None,
    text: _TrainText = [],
    regenerate: bool = typer.Option(False, "--regenerate", help="Rewrite assistant replies with the target."),
    regen_max_tokens: _RegenMaxTokens = 256,
    regen_temp: _RegenTemp = 0.0,
    init: Optional[str] = typer.Option(None, "--init", help="Fine-tune these MTP layers instead of new ones."),
    mtp_layers: int = typer.Option(1, "--mtp-layers", help="New MTP layers (blocks start as the target's last "
                                   "layer)."),
    max_length: _MaxLength = 1024,
    val_fraction: _ValFraction = 0.1,
    epochs: int = typer.Option(3, "--epochs"),
    batch_size: _BatchSize = 8,
    lr: _Lr = 6e-4,
    warmup: _Warmup = 0.04,
    grad_accum: _GradAccum = 1,
    save_every: _SaveEvery = 200,
    max_steps: _MaxSteps = None,
    seed: _TrainSeed = 0,
    resume: _Resume = False,
    draft_logits: _DraftLogits = "target",
    eval_tokens: _EvalTokens = 64,
):
    """Train MTP layers (transformers' generic layout) against a frozen target."""
    _train("mtp", model, out, data, text, regenerate, regen_max_tokens, regen_temp, init, 1, 16, None, None,
           mtp_layers, 16, None, max_length, val_fraction, epochs, batch_size, lr, warmup, grad_accum, save_every,
           max_steps, seed, resume, draft_logits, eval_tokens)


@app.command()
def agent(
    task: Optional[str] = typer.Argument(None, help="What to do (omit with --resume to just continue)."),
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint (default: the embedded model)."),
    workspace: Optional[str] = typer.Option(None, "--workspace", "-w", help="The folder the agent may use "
                                            "(default: the current one; on --resume, the transcript's)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Write files and run commands without asking."),
    allow: List[str] = typer.Option([], "--allow", help="Command prefix run without asking, e.g. 'pytest -q' "
                                    "(repeatable; commands with shell operators always ask)."),
    max_steps: int = typer.Option(20, "--max-steps", help="Model replies before the loop stops (exit code 2)."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Tokens per model reply."),
    transcript: Optional[str] = typer.Option(None, "--transcript", help="JSONL transcript to write (default: "
                                             "~/.cache/glimmer-mlx/agent/TIME.jsonl)."),
    resume: Optional[str] = typer.Option(None, "--resume", help="Continue the run of this transcript."),
    mode: str = typer.Option("ar", "--mode", help="ar | dflash | mtp | auto (speculative decoding: same output)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Drafter for --mode dflash / mtp "
                                              "(default: the embedded one with the embedded model)."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds a `run` command may take."),
):
    """An offline tool-using agent in a workspace: list/read/search files, write or patch them (diff shown, asks
    first), run commands (asks first), answer. Paths are confined to the workspace."""
    from .agent import load_backend, run_command
    from .loading import CheckpointError

    def backend():
        return load_backend(model, mode=mode, draft_model=draft_model, max_tokens=max_tokens, temperature=temp,
                            seed=seed)

    try:
        res = run_command(task, backend_factory=backend, workspace=workspace, yes=yes, allow=allow,
                          max_steps=max_steps, transcript=transcript, resume=resume, timeout=timeout,
                          console=console, out=Console(), meta={"model": model, "mode": mode})
    except (CheckpointError, FileNotFoundError, NotADirectoryError, ValueError) as e:
        _fail(str(e))
    if res.status != "answered":
        raise typer.Exit(2)  # the step limit: no answer


def _session_options(model, draft_model, mtp, mtp_model, dtype, max_context):
    """Load a session.Session for chat / serve (errors → a clean exit)."""
    from .loading import CheckpointError
    from .session import load_session

    try:
        return load_session(model, draft_model=draft_model, mtp=mtp, mtp_model=mtp_model, dtype=dtype,
                            max_context=max_context,
                            announce=lambda m: console.print(f"[dim]{escape(m)}[/]", soft_wrap=True))
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        _fail(str(e))


def _width(block_size: Optional[str]):
    if block_size is None or block_size == "auto":
        return block_size
    try:
        return int(block_size)
    except ValueError:
        _fail(f"--block-size must be an integer or 'auto', got {block_size!r}")


# the model options of `glimmer chat` and `glimmer serve` (one session: target + drafters)
_SessionModel = Annotated[Optional[str], typer.Option("--model", help="Checkpoint (default: the embedded model, "
                                                      "with its DFlash drafter and MTP layer).")]
_SessionDraft = Annotated[Optional[str], typer.Option("--draft-model", help="DFlash drafter (or MTP layers) to load.")]
_SessionMtp = Annotated[bool, typer.Option("--mtp", help="Load the target checkpoint's own MTP layers.")]
_SessionMtpModel = Annotated[Optional[str], typer.Option("--mtp-model", help="MTP layers from another folder.")]


@app.command()
def chat(
    model: _SessionModel = None,
    draft_model: _SessionDraft = None,
    mtp: _SessionMtp = False,
    mtp_model: _SessionMtpModel = None,
    mode: Optional[str] = typer.Option(None, "--mode", help="ar | dflash | mtp | auto (default: dflash, else mtp, "
                                       "else ar — whatever is loaded). Same output in every mode."),
    block_size: Optional[str] = typer.Option(None, "--block-size", help="DFlash block size / MTP depth, or 'auto'."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Tokens per answer at most."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context limit in tokens (default: the "
                                              "model's max_position_embeddings)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: checkpoint dtype)."),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="Measure the plain-decoding rate "
                                   "(32 tokens) for the speedup shown after speculative turns, if no ar turn ran."),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="Print the stats line after each answer."),
):
    """Chat in the terminal: streaming answers, history, /commands (/help), prompt-cache reuse across turns."""
    from .chat import Chat
    from .sampling import SamplingParams
    from .session import ModeError

    if max_tokens < 1:
        _fail(f"--max-tokens must be >= 1, got {max_tokens}")
    try:
        SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty)
    except ValueError as e:
        _fail(str(e))
    session = _session_options(model, draft_model, mtp, mtp_model, dtype, max_context)
    try:
        app_ = Chat(session, mode=mode, block_size=_width(block_size), temperature=temp, top_p=top_p, top_k=top_k,
                    min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_tokens,
                    system_prompt=system_prompt, calibrate=calibrate, show_stats=stats)
    except (ModeError, ValueError) as e:
        _fail(str(e))
    raise typer.Exit(app_.run())


@app.command()
def serve(
    model: _SessionModel = None,
    draft_model: _SessionDraft = None,
    mtp: _SessionMtp = False,
    mtp_model: _SessionMtpModel = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (127.0.0.1: this machine only)."),
    port: int = typer.Option(8080, "--port", help="Port (0: any free port, printed at start)."),
    mode: Optional[str] = typer.Option(None, "--mode", help="Default decoding mode: ar | dflash | mtp | auto "
                                       "(default: dflash, else mtp, else ar); requests may override it with "
                                       "{\"glimmer\": {\"mode\": ...}}."),
    block_size: Optional[str] = typer.Option(None, "--block-size", help="Default DFlash block size / MTP depth."),
    max_tokens: int = typer.Option(2048, "--max-tokens", help="Default max_tokens for requests without one."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context limit (default: the model's)."),
    model_name: Optional[str] = typer.Option(None, "--served-model-name", help="Model id in /v1/models "
                                             "(default: the checkpoint folder's name)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: checkpoint dtype)."),
):
    """A local OpenAI-compatible server: /v1/chat/completions (streaming, tools), /v1/completions, /v1/models,
    /health. One model resident, requests queued, prompt cache reused across a growing conversation."""
    from .server import GlimmerServer
    from .session import ModeError

    session = _session_options(model, draft_model, mtp, mtp_model, dtype, max_context)
    try:
        server = GlimmerServer(session, host=host, port=port, mode=mode, block_size=_width(block_size),
                               default_max_tokens=max_tokens, model_name=model_name)
    except (ModeError, ValueError, OSError) as e:
        _fail(str(e))
    console.print(f"[bold]glimmer serve[/] {escape(server.model_name)} on http://{server.host}:{server.port} "
                  f"(mode {escape(server.default_mode)}; modes: {', '.join(session.available_modes())}) — Ctrl-C stops",
                  soft_wrap=True)
    server.serve_forever()
    console.print("[dim]stopped[/]")


if __name__ == "__main__":
    app()
