"""`glimmer` command line (typer + rich). Commands parse arguments and call library functions."""

from __future__ import annotations

import sys
from typing import List, Optional

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


@app.command()
def generate(
    model: str = typer.Option(..., "--model", help="Checkpoint folder or Hub repo id."),
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
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="DFlash drafter checkpoint."),
    block_size: Optional[str] = typer.Option(None, "--block-size", help="Drafts per round + 1, or 'auto'."),
    verbose: bool = typer.Option(True, "--verbose/--quiet", help="Print the stats line."),
):
    """Generate text from a prompt."""
    from . import load, stream_generate
    from .generate import GenerationStats
    from .loading import CheckpointError

    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        m, tok = load(model, dtype=dtype)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    if tok is None:
        _fail(f"{model}: no tokenizer.json in the checkpoint; use the Python API with token ids")
    drafter = None
    if draft_model is not None:
        from .speculative import load_drafter

        try:
            drafter = load_drafter(draft_model, m)
        except (CheckpointError, ValueError) as e:
            _fail(str(e))
    bs = None
    if block_size is not None:
        try:
            bs = "auto" if block_size == "auto" else int(block_size)
        except ValueError:
            _fail(f"--block-size must be an integer or 'auto', got {block_size!r}")
    if chat and tok.chat_template:
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok.encode(prompt)
    stats = GenerationStats()
    try:
        for chunk in stream_generate(m, ids, tokenizer=tok, max_tokens=max_tokens, temperature=temp, top_p=top_p,
                                     top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                     stop=stop, drafter=drafter, block_size=bs, prefill_step_size=prefill_step_size,
                                     stats=stats):
            # model text is data: written verbatim (rich would expand :emoji: codes and drop control characters)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except ValueError as e:
        _fail(str(e))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose:
        console.print(f"[dim]{stats.line()}[/]")


@app.command()
def info(
    model: str = typer.Argument(..., help="Checkpoint folder or Hub repo id."),
    context: List[int] = typer.Option([4096, 32768, 131072], "--context", help="Context lengths for the KV table."),
):
    """Architecture summary, parameter count by part, and memory needed per dtype / quantization and context."""
    from .info import model_info
    from .loading import CheckpointError

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


if __name__ == "__main__":
    app()
