"""`glimmer generate`: one prompt, streamed to stdout."""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer
from rich.markup import escape

from .. import distributed as dist
from ..generate import stream_generate
from ..image_processing import IMAGE_TOKEN, ImageError, preprocess_image
from ..loading import CheckpointError, load
from ..runtime.loop import GenerationStats
from ..strategy import load_drafters
from ..tool_calls import get_parser
from .app import (AutoFlag, BlockSize, DflashFlag, DraftModel, Dtype, Images, MinP, Mode, Model, MtpFlag, MtpModel,
                  RepetitionPenalty, Seed, SystemPrompt, Temp, TopK, TopP, Tree, app, check_spec, console, decode_spec,
                  fail, model_path, note)

# which drafter models a mode needs loaded (generate loads nothing it will not use)
NEEDS = {"ar": (), "ngram": (), "dflash": ("dflash",), "mtp": ("mtp",), "auto": ("dflash", "mtp")}


@app.command()
def generate(
    model: Model = None,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text; '-' reads stdin."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m"),
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    seed: Seed = None,
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    system_prompt: SystemPrompt = None,
    chat: bool = typer.Option(True, "--chat-template/--raw", help="Wrap the prompt in the chat template if any."),
    dtype: Dtype = None,
    prefill_step_size: int = typer.Option(512, "--prefill-step-size"),
    mode: Mode = None,
    block_size: BlockSize = None,
    tree: Tree = None,
    draft_model: DraftModel = None,
    mtp_model: MtpModel = None,
    dflash: DflashFlag = False,
    mtp: MtpFlag = False,
    auto: AutoFlag = False,
    mtp_depth: Optional[str] = typer.Option(None, "--mtp-depth", help="Alias of --block-size with --mode mtp."),
    image: Images = [],
    verbose: bool = typer.Option(True, "--verbose/--quiet", help="Print the stats line."),
    distributed: Optional[str] = typer.Option(None, "--distributed", help="tp (tensor parallelism) | pp (pipeline "
                                              "parallelism) over the ranks of `mlx.launch -n N --backend ring -- "
                                              "glimmer generate …` (only rank 0 prints)."),
    pp_microbatch: int = typer.Option(1, "--pp-microbatch", help="--distributed pp: split each verify block / "
                                      "prefill chunk into up to N micro-batches so stage s+1 works on one while "
                                      "stage s works on the next (1: off; same output). Pays when a stage is "
                                      "compute-bound, costs a weight read per micro-batch when it is "
                                      "memory-bound (see BENCHMARKS)."),
):
    """Generate text from a prompt (optionally with images). Default mode: plain decoding; with --draft-model or
    --mtp-model, auto over the drafters loaded; --mode picks another."""
    group = None
    if pp_microbatch != 1 and distributed != "pp":
        fail("--pp-microbatch needs --distributed pp")
    if distributed is not None:
        try:
            group = dist.start(distributed)
        except dist.DistributedError as e:
            fail(str(e))
        if group.rank() != 0:  # only rank 0 talks to the terminal
            console.quiet = True
            sys.stdout = open(os.devnull, "w")
    if prompt == "-":
        prompt = sys.stdin.read()
    mode, width = decode_spec(mode, block_size, dflash=dflash, mtp=mtp, auto=auto, mtp_depth=mtp_depth)
    if tree is not None and mode not in ("ngram", "mtp", "dflash"):
        fail("--tree needs --mode ngram, mtp or dflash (token trees are implemented for n-gram lookup, MTP and "
             "DFlash; auto chooses its own DFlash trees)")
    if mode == "dflash" and draft_model is None and model is not None:
        fail("--mode dflash without --draft-model only works with the embedded default model; give --draft-model")
    embedded = model is None
    path = model_path(model)
    images = None
    if image:
        try:  # decode and check every file before loading the model
            images = [preprocess_image(p) for p in image]
        except ImageError as e:
            fail(str(e))
        if IMAGE_TOKEN not in prompt:  # images first in the user turn (inside the chat template)
            prompt = IMAGE_TOKEN * len(image) + prompt
    if group is not None and images is not None:
        fail("--distributed: images are not supported with --distributed yet")
    try:
        if group is None:
            m, tok = load(path, dtype=dtype)
        else:
            m, tok = dist.load_agreed(path, group, dtype, distributed, pp_microbatch, mode=mode, width=width,
                                      draft_model=draft_model, mtp_model=mtp_model, max_tokens=max_tokens, temp=temp,
                                      top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                      stop=stop, tree=tree)
        if tok is None:
            fail(f"{path}: no tokenizer.json in the checkpoint; use the Python API with token ids")
        given = draft_model is not None or mtp_model is not None
        drafters = load_drafters(m, dflash=draft_model, mtp=mtp_model, embedded=embedded and mode is not None,
                                 want=NEEDS[mode] if mode is not None else ("dflash", "mtp") if given else (),
                                 log=note)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    except dist.DistributedError as e:
        fail(str(e))
    spec = check_spec(drafters, mode or drafters.default_mode(), width)
    if group is not None:
        try:
            dist.check_mode(spec.mode, spec.width)
        except ValueError as e:
            fail(str(e))
        dist.expose_taps(m, [t for d in (drafters.dflash, drafters.mtp) if d is not None for t in d.taps])
    drafter, bs = drafters.select(spec)
    if chat and tok.chat_template:
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok.encode(prompt)
    if group is not None:  # rank 0's prompt and seed (stdin and a random seed are per rank)
        ids, seed = dist.broadcast_ints(ids, group), dist.agree_seed(seed, group)
    stats = GenerationStats()
    # chat-templated output goes through the template's response parser: headers (` to=user<|message|>`) hidden,
    # tool calls summarised after the answer; --raw prints the model's text as generated
    parser = get_parser(tok.chat_template) if chat and tok.chat_template else None
    text, shown = "", 0
    try:
        chunks = stream_generate(m, ids, tokenizer=tok, max_tokens=max_tokens, temperature=temp, top_p=top_p,
                                 top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                 stop=stop, drafter=drafter, block_size=bs, prefill_step_size=prefill_step_size,
                                 stats=stats, images=images, tree=tree)
        for chunk in chunks if group is None else dist.lockstep(chunks, group):
            # model text is data: written verbatim (rich would expand :emoji: codes and drop control characters)
            text += chunk.text
            out = chunk.text
            if parser is not None:
                visible = parser.visible(text) if chunk.finish_reason is None else parser.parse(text).content
                out, shown = visible[shown:], max(shown, len(visible))
            sys.stdout.write(out)
            sys.stdout.flush()
    except (ValueError, dist.DistributedError) as e:
        fail(str(e))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if parser is not None:
        for call in parser.parse(text).tool_calls:
            console.print(f"[cyan]tool call:[/] {escape(call.name)}({escape(json.dumps(call.arguments))})",
                          soft_wrap=True)
    if verbose:
        console.print(f"[dim]{stats.line()}[/]")
