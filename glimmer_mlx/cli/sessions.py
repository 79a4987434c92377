"""The commands that keep one model resident in a `session.Session`: `glimmer chat`, `glimmer serve`,
`glimmer agent`."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import distributed as dist
from ..agent import MLXBackend, load_backend, run_command
from ..chat import Chat
from ..follower import LeaderSession, follow, load_distributed_session, trap_termination
from ..loading import CheckpointError
from ..sampling import SamplingParams
from ..serve import GlimmerServer, is_loopback
from ..session import load_session
from ..strategy import ModeError
from .app import (AutoFlag, BlockSize, DflashFlag, DraftModel, Dtype, MaxContext, MinP, Mode, Model, MtpFlag,
                  MtpModel, RepetitionPenalty, Seed, SystemPrompt, Temp, TopK, TopP, Tree, app, check_spec, console,
                  decode_spec, fail, note)


Distributed = Annotated[Optional[str], typer.Option(
    "--distributed", help="tp (tensor parallelism) | pp (pipeline parallelism) over the ranks of `mlx.launch -n N "
    "--backend ring -- glimmer …`: only rank 0 talks to the terminal / HTTP / tools, the other ranks follow it in "
    "lockstep; modes ar|dflash|mtp|ngram (auto is refused; default ar).")]


PpMicrobatch = Annotated[int, typer.Option(
    "--pp-microbatch", help="--distributed pp: split each verify block / prefill chunk into up to N micro-batches "
    "that overlap across stages (1: off; same output; pays where a stage is compute-bound, see BENCHMARKS).")]


def open_session(model, draft_model, mtp_model, dtype=None, max_context=None, distributed=None, mode=None,
                 width=None, pp_microbatch=1):
    """A session.Session for chat / serve / agent (errors → a clean exit). With `distributed`: rank 0 gets a
    `follower.LeaderSession`; every other rank follows it here and exits when rank 0 does."""
    if distributed is not None:
        return open_distributed(model, draft_model, mtp_model, dtype, max_context, distributed, mode, width,
                                pp_microbatch)
    if pp_microbatch != 1:
        fail("--pp-microbatch needs --distributed pp")
    try:
        return load_session(model, draft_model=draft_model, mtp_model=mtp_model, dtype=dtype, max_context=max_context,
                            announce=note)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        fail(str(e))


def open_distributed(model, draft_model, mtp_model, dtype, max_context, strategy, mode, width, pp_microbatch):
    if pp_microbatch != 1 and strategy != "pp":
        fail("--pp-microbatch needs --distributed pp")
    try:
        group = dist.start(strategy)
        dist.check_mode(mode or "ar", width)
    except (dist.DistributedError, ValueError) as e:
        fail(str(e))
    rank = group.rank()
    if rank != 0:  # only rank 0 talks to the terminal (its stdin too: mlx.launch copies the input to every rank)
        console.quiet = True
        sys.stdout = open(os.devnull, "w")
        sys.stdin.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
        trap_termination(rank)
    try:
        session = load_distributed_session(model, group, strategy, microbatch=pp_microbatch,
                                           draft_model=draft_model, mtp_model=mtp_model,
                                           dtype=dtype, max_context=max_context, announce=note)
    except (CheckpointError, FileNotFoundError, ValueError, dist.DistributedError) as e:
        fail(str(e))
    if rank != 0:
        raise typer.Exit(follow(session, group))
    return LeaderSession(session, group, strategy=strategy)


@app.command()
def chat(
    model: Model = None,
    draft_model: DraftModel = None,
    mtp_model: MtpModel = None,
    mode: Mode = None,
    block_size: BlockSize = None,
    dflash: DflashFlag = False,
    mtp: MtpFlag = False,
    auto: AutoFlag = False,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    seed: Seed = None,
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Tokens per answer at most."),
    max_context: MaxContext = None,
    system_prompt: SystemPrompt = None,
    dtype: Dtype = None,
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="Measure the plain-decoding rate "
                                   "(32 tokens) for the speedup shown after speculative turns, if no ar turn ran."),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="Print the stats line after each answer."),
    distributed: Distributed = None,
    pp_microbatch: PpMicrobatch = 1,
    tree: Tree = None,
):
    """Chat in the terminal: streaming answers, history, /commands (/help), prompt-cache reuse across turns.
    Default mode: auto when a drafter is loaded (the embedded model has two), else ar."""
    mode, width = decode_spec(mode, block_size, dflash=dflash, mtp=mtp, auto=auto)
    if max_tokens < 1:
        fail(f"--max-tokens must be >= 1, got {max_tokens}")
    try:
        SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty)
    except ValueError as e:
        fail(str(e))
    session = open_session(model, draft_model, mtp_model, dtype, max_context, distributed, mode, width, pp_microbatch)
    spec = check_spec(session.drafters, mode or session.default_mode(), width)
    try:
        app_ = Chat(session, mode=spec.mode, block_size=spec.width, temperature=temp, top_p=top_p, top_k=top_k,
                    min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_tokens,
                    system_prompt=system_prompt, calibrate=calibrate, show_stats=stats, tree=tree)
    except (ModeError, ValueError) as e:
        fail(str(e))
    raise typer.Exit(app_.run())


@app.command()
def serve(
    model: Model = None,
    draft_model: DraftModel = None,
    mtp_model: MtpModel = None,
    mode: Mode = None,
    block_size: BlockSize = None,
    dflash: DflashFlag = False,
    mtp: MtpFlag = False,
    auto: AutoFlag = False,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (127.0.0.1: this machine only; "
                             "any other address needs --api-key)."),
    port: int = typer.Option(8080, "--port", help="Port (0: any free port, printed at start)."),
    max_tokens: int = typer.Option(2048, "--max-tokens", help="Default max_tokens for requests without one."),
    max_context: MaxContext = None,
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together (continuous batching; 1: one "
                                  "at a time). More wait in the queue."),
    prompt_cache_gb: float = typer.Option(4.0, "--prompt-cache-gb", help="Memory for the prompt cache across "
                                          "conversations (KV caches of finished requests, least recently used "
                                          "dropped first; 0: off)."),
    model_name: Optional[str] = typer.Option(None, "--served-model-name", help="Model id in /v1/models "
                                             "(default: the checkpoint folder's name)."),
    dtype: Dtype = None,
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="GLIMMER_API_KEY", show_default=False,
                                          help="Require 'Authorization: Bearer <key>' on every request (env: "
                                          "GLIMMER_API_KEY, which keeps the key out of the process list). Required "
                                          "for a --host other than loopback."),
    distributed: Distributed = None,
    pp_microbatch: PpMicrobatch = 1,
):
    """A local OpenAI-compatible server: /v1/chat/completions (streaming, tools), /v1/completions, /v1/models,
    /health. One model resident, requests continuously batched (speculative modes included), a prompt cache across
    conversations. --mode is the
    default decoding mode (default: auto when a drafter is loaded, else ar); requests may override it with
    {"glimmer": {"mode": ..., "block_size": ...}}. With --distributed: one request decoded at a time (no batching
    across ranks; /health says so), the session's own prompt cache (the latest conversation)."""
    mode, width = decode_spec(mode, block_size, dflash=dflash, mtp=mtp, auto=auto)
    if not is_loopback(host) and not api_key:  # before loading a model for nothing
        fail(f"refusing to listen on {host or 'every interface'} without an API key: pass --api-key (or set "
             "GLIMMER_API_KEY), or bind 127.0.0.1")
    session = open_session(model, draft_model, mtp_model, dtype, max_context, distributed, mode, width, pp_microbatch)
    spec = check_spec(session.drafters, mode or session.default_mode(), width)
    solo = None if distributed is None else (f"--distributed {distributed} over {session.group.size()} ranks: one "
                                             f"request decoded at a time (no batching across ranks)")
    try:
        if not 0 <= prompt_cache_gb < 1e6:
            raise ValueError(f"--prompt-cache-gb must be >= 0, got {prompt_cache_gb}")
        server = GlimmerServer(session, host=host, port=port, mode=spec.mode, block_size=spec.width,
                               default_max_tokens=max_tokens, model_name=model_name, api_key=api_key,
                               max_batch=max_batch, prompt_cache_bytes=int(prompt_cache_gb * 2**30),
                               one_at_a_time=solo)
    except (ModeError, ValueError, OSError) as e:
        fail(str(e))
    console.print(f"[bold]glimmer serve[/] {escape(server.model_name)} on http://{server.host}:{server.port} "
                  f"(mode {escape(server.default_mode)}; modes: {', '.join(session.available_modes())}"
                  f"{'; API key required' if server.api_key else ''}) — Ctrl-C stops",
                  soft_wrap=True)
    if solo:
        note(solo)
    try:
        server.serve_forever()
    except dist.DistributedError as e:
        fail(str(e))
    console.print("[dim]stopped[/]")


@app.command()
def agent(
    task: Optional[str] = typer.Argument(None, help="What to do (omit with --resume to just continue)."),
    model: Model = None,
    workspace: Optional[str] = typer.Option(None, "--workspace", "-w", help="The folder the agent may use "
                                            "(default: the current one, also on --resume: a transcript recorded "
                                            "in another folder is refused)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Write files and run commands without asking."),
    allow: List[str] = typer.Option([], "--allow", help="A whole command run without asking, e.g. 'pytest -q' "
                                    "(exact words, not a prefix; a last word * allows any further arguments, "
                                    "dangerous; repeatable; commands with shell operators always ask)."),
    max_steps: int = typer.Option(20, "--max-steps", help="Model replies before the loop stops (exit code 2)."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Tokens per model reply."),
    transcript: Optional[str] = typer.Option(None, "--transcript", help="JSONL transcript to write (default: "
                                             "~/.cache/glimmer-mlx/agent/TIME.jsonl)."),
    resume: Optional[str] = typer.Option(None, "--resume", help="Continue the run of this transcript."),
    mode: Mode = None,
    block_size: BlockSize = None,
    draft_model: DraftModel = None,
    mtp_model: MtpModel = None,
    temp: Temp = 0.0,
    seed: Seed = None,
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds a `run` command may take."),
    distributed: Distributed = None,
    pp_microbatch: PpMicrobatch = 1,
    tree: Tree = None,
):
    """An offline tool-using agent in a workspace: list/read/search files, write or patch them (diff shown, asks
    first), run commands (asks first), answer. Paths are confined to the workspace."""
    mode, width = decode_spec(mode, block_size)
    if pp_microbatch != 1 and distributed != "pp":
        fail("--pp-microbatch needs --distributed pp")
    if distributed is not None:  # every rank loads now; the followers stay in open_session
        session = open_session(model, draft_model, mtp_model, distributed=distributed, mode=mode, width=width,
                               pp_microbatch=pp_microbatch)
        try:
            built = MLXBackend(session, mode=mode or session.default_mode(), block_size=width, max_tokens=max_tokens,
                               temperature=temp, seed=seed, tree=tree)
        except ValueError as e:
            fail(str(e))

    def backend():  # loaded once the options and the workspace are checked
        if distributed is not None:
            return built
        return load_backend(model, mode=mode, block_size=width, draft_model=draft_model, mtp_model=mtp_model,
                            announce=note, max_tokens=max_tokens, temperature=temp, seed=seed, tree=tree)

    try:
        res = run_command(task, backend_factory=backend, workspace=workspace, yes=yes, allow=allow,
                          max_steps=max_steps, transcript=transcript, resume=resume, timeout=timeout,
                          console=console, out=Console(), meta={"model": model, "mode": mode})
    except (CheckpointError, FileNotFoundError, NotADirectoryError, ValueError) as e:
        fail(str(e))
    if res.status != "answered":
        raise typer.Exit(2)  # the step limit: no answer
