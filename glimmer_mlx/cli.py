"""`glimmer` command line (typer + rich). Commands parse arguments and call library functions."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="glimmer-mlx: run Muse Glimmer locally with MLX, with lossless speculative decoding.")
console = Console(stderr=True)


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {msg}")
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
        bs = "auto" if block_size == "auto" else int(block_size)
    if chat and tok.chat_template:
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok.encode(prompt)
    stats = GenerationStats()
    out = Console()
    try:
        for chunk in stream_generate(m, ids, tokenizer=tok, max_tokens=max_tokens, temperature=temp, top_p=top_p,
                                     top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                     stop=stop, drafter=drafter, block_size=bs, prefill_step_size=prefill_step_size,
                                     stats=stats):
            out.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
    except ValueError as e:
        _fail(str(e))
    out.print()
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


if __name__ == "__main__":
    app()
