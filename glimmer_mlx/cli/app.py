"""The `glimmer` Typer app, its console, and what every command shares: the failure line, the model options and the
one decoding vocabulary (`--mode ar|dflash|mtp|ngram|auto --block-size N|auto`)."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..embedded import resolve_model
from ..strategy import MODES, DecodeSpec, ModeError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="glimmer-mlx: run Muse Glimmer locally with MLX, with lossless speculative decoding.")
console = Console(stderr=True)


def fail(msg: str) -> None:
    """One line on stderr, exit code 1."""
    # soft_wrap: paths and tensor names stay on one line; escape: '[...]' in a message is text, not rich markup
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(1)


def note(msg: str) -> None:
    console.print(f"[dim]{escape(msg)}[/]", soft_wrap=True)


def model_path(model: str | None, part: str = "target") -> str:
    """`model`, or the embedded model's folder (announced once)."""
    try:
        return resolve_model(model, part, announce=note)
    except FileNotFoundError as e:
        fail(str(e))


# -- options shared by generate, chat, serve, agent and bench -----------------------------------------------------
Model = Annotated[Optional[str], typer.Option("--model", help="Checkpoint folder or Hub repo id (default: the embedded "
                                              "glimmer-tiny, with its DFlash drafter and MTP layer).")]
DraftModel = Annotated[Optional[str], typer.Option("--draft-model", help="Drafter checkpoint: a DFlash assistant, or "
                                                   "MTP layers (default with the embedded model: its own).")]
MtpModel = Annotated[Optional[str], typer.Option("--mtp-model", help="MTP layers from another folder (a target "
                                                 "checkpoint's own mtp.* layers load without asking).")]
Mode = Annotated[Optional[str], typer.Option("--mode", help=f"Decoding: {' | '.join(MODES)} (ar: plain; ngram: "
                                             "prompt lookup; auto: per round the fastest, measured on this machine). "
                                             "Same output in every mode.")]
BlockSize = Annotated[Optional[str], typer.Option("--block-size", help="Width: DFlash block size, MTP depth or n-gram "
                                                  "drafts per round, or 'auto' (per round); default: as trained.")]
Tree = Annotated[Optional[int], typer.Option("--tree", help="Token-tree verification: up to N draft nodes per round, "
                                             "several candidate continuations in one verify forward (--mode ngram, "
                                             "mtp or dflash; --block-size is then the most drafts per path; auto "
                                             "chooses its own DFlash trees).")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="bf16 | fp16 | fp32 (default: checkpoint dtype).")]
MaxContext = Annotated[Optional[int], typer.Option("--max-context", help="Context limit in tokens (default: the "
                                                   "model's max_position_embeddings).")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature (0 = greedy).")]
TopP = Annotated[float, typer.Option("--top-p")]
TopK = Annotated[int, typer.Option("--top-k")]
MinP = Annotated[float, typer.Option("--min-p")]
RepetitionPenalty = Annotated[float, typer.Option("--repetition-penalty")]
Seed = Annotated[Optional[int], typer.Option("--seed")]
SystemPrompt = Annotated[Optional[str], typer.Option("--system-prompt")]
# documented aliases of --mode (the first vocabulary of `glimmer generate`)
DflashFlag = Annotated[bool, typer.Option("--dflash", help="Alias of --mode dflash.")]
MtpFlag = Annotated[bool, typer.Option("--mtp", help="Alias of --mode mtp.")]
AutoFlag = Annotated[bool, typer.Option("--auto", help="Alias of --mode auto.")]


def decode_spec(mode: str | None, block_size: str | None, *, dflash: bool = False, mtp: bool = False,
                auto: bool = False, mtp_depth: str | None = None) -> tuple[str | None, int | str | None]:
    """(mode or None when none was asked for, width) from --mode / --block-size and their aliases (--dflash, --mtp,
    --auto, --mtp-depth); a contradiction or a malformed width is a clean failure."""
    flags = [name for name, on in (("dflash", dflash), ("mtp", mtp), ("auto", auto)) if on]
    if len(flags) > 1:
        fail(f"--{' and --'.join(flags)} exclude each other (they are aliases of --mode)")
    if flags and mode is not None and mode != flags[0]:
        fail(f"--{flags[0]} and --mode {mode} disagree")
    mode = mode if mode is not None else (flags[0] if flags else None)
    flag = "--block-size"
    if mtp_depth is not None:
        if mode != "mtp":
            fail("--mtp-depth needs --mtp (or --mode mtp)")
        if block_size is not None:
            fail("give --block-size or --mtp-depth, not both")
        block_size, flag = mtp_depth, "--mtp-depth"
    try:
        spec = DecodeSpec.parse(mode, block_size, what=flag)
    except ModeError as e:
        fail(str(e))
    return mode, spec.width


def check_spec(drafters, mode: str, width) -> DecodeSpec:
    """The spec, checked against the loaded drafters (a clean failure if it cannot run)."""
    spec = DecodeSpec(mode, width)
    try:
        drafters.check(spec)
    except ModeError as e:
        fail(str(e))
    return spec


Images = Annotated[List[str], typer.Option("--image", help="Image file (repeatable). Put one <|patch|> in the prompt "
                                           "where each image goes, or none to put them all before the prompt text.")]
