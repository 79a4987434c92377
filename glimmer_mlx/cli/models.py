"""The commands about checkpoints themselves: `glimmer info`, `glimmer convert`, `glimmer train dflash|dflash2|mtp`."""

from __future__ import annotations

import json
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
from rich.table import Table

from ..convert import ConvertError, convert as run_convert, parse_size
from ..info import LINKS, distributed_plan, memory_plan, model_info, parse_memory_gb
from ..loading import CheckpointError
from ..train import SELECTOR_WEIGHT, DataError, TrainConfig, train
from .app import app, console, fail, model_path, note


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
    hosts: Optional[int] = typer.Option(None, "--hosts", help="With --plan: split over N Macs (`--distributed`): "
                                        "per-rank weights, KV cache and fit, bytes and time communicated."),
    strategy: str = typer.Option("tp", "--strategy", help="With --hosts: tp (tensor parallelism) | pp (pipeline)."),
    memory_gb: Optional[str] = typer.Option(None, "--memory-gb", help="With --hosts: each Mac's memory in GB: one "
                                            "size for all, or one per host (64,32). Default: the fit per Mac size."),
    link: str = typer.Option("tb5", "--link", help="With --hosts: " + " | ".join(LINKS) + " (published line rate, "
                             "assumed per-message latency)."),
    latency_us: Optional[float] = typer.Option(None, "--latency-us", help="With --hosts: per-message latency "
                                               "(µs) instead of the link's assumed one."),
    as_json: bool = typer.Option(False, "--json", help="With --plan: the plan as JSON."),
):
    """Architecture summary, parameter count by part, and memory needed per dtype / quantization and context."""
    model = model_path(model)
    if hosts is not None:
        if not plan:
            fail("--hosts needs --plan (glimmer info --plan --hosts N)")
        _print_distributed_plan(model, drafter, q_bits, q_group_size, q_mode, recipe, quantize_vision, text_only,
                                context, hosts, strategy, memory_gb, link, latency_us, as_json)
        return
    if plan and as_json:
        try:
            r = memory_plan(model, None if drafter == "none" else drafter, bits=q_bits or None,
                            group_size=q_group_size, mode=q_mode, recipe=recipe, quantize_vision=quantize_vision,
                            text_only=text_only, contexts=context, mem_sizes=mem)
        except (CheckpointError, ValueError, KeyError) as e:
            fail(str(e))
        print(json.dumps(r, indent=1))
        return
    if plan:
        _print_plan(model, drafter, q_bits, q_group_size, q_mode, recipe, quantize_vision, text_only, context, mem)
        return
    try:
        report = model_info(model, contexts=context)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
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
    out.print(f"checked: {escape(report['checked'])}", soft_wrap=True)


def _print_plan(model, drafter, q_bits, q_group_size, q_mode, recipe, quantize_vision, text_only, contexts, mem):
    try:
        r = memory_plan(model, None if drafter == "none" else drafter, bits=q_bits or None, group_size=q_group_size,
                        mode=q_mode, recipe=recipe, quantize_vision=quantize_vision, text_only=text_only,
                        contexts=contexts, mem_sizes=mem)
    except (CheckpointError, ValueError, KeyError) as e:
        fail(str(e))
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


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def _print_distributed_plan(model, drafter, q_bits, q_group_size, q_mode, recipe, quantize_vision, text_only,
                            contexts, hosts, strategy, memory_gb, link, latency_us, as_json):
    try:
        r = distributed_plan(model, None if drafter == "none" else drafter, hosts=hosts, strategy=strategy,
                             memory_gb=parse_memory_gb(memory_gb, max(hosts, 1)), link=link, latency_us=latency_us,
                             bits=q_bits or None, group_size=q_group_size, mode=q_mode, recipe=recipe,
                             quantize_vision=quantize_vision, text_only=text_only, contexts=contexts)
    except (CheckpointError, ValueError, KeyError) as e:
        fail(str(e))
    if as_json:
        print(json.dumps(r, indent=1))
        return
    out = Console()
    lk = r["link"]
    rep = f", each KV head replicated on {r['kv_replication']} ranks" if r["kv_replication"] > 1 else ""
    t = Table(show_edge=False, title=f"{r['model']} over {r['hosts']} Mac(s), --distributed {r['strategy']}{rep}: "
              f"{r['quantization']}, vision {r['vision']}; per-rank GB (incl. {r['overhead_bytes_per_rank'] / 1e9:.1f}"
              f" GB runtime overhead each; all weights {_gb(r['total_weights_bytes'])} GB)")
    one_size = r["ranks"][0]["memory_gb"] is not None
    for c in ("rank", "layers", "target split+whole", "drafter", "KV heads", "context", "KV", "total", "fits"):
        t.add_column(c, justify="right", no_wrap=True)
    mark = {"yes": "[green]yes[/]", "no": "[red]no[/]", "with wired limit raised": "[yellow]sysctl[/]"}
    for k in r["ranks"]:
        head = [str(k["rank"]) + (f" · {k['memory_gb']:g} GB" if one_size else ""),
                f"{k['layers'][0]}–{k['layers'][1]}" if k["layers"] else "—",
                f"{_gb(k['target_split_bytes'])} + {_gb(k['target_replicated_bytes'])}",
                _gb(sum(k["replicated_parts_bytes"].values())), str(k["kv_heads"])]
        for j, row in enumerate(k["rows"]):
            if one_size:
                fit = mark[next(iter(row["fits"].values()))]
            else:  # the smallest Mac size that holds it
                ok = [m for m, v in row["fits"].items() if v == "yes"]
                fit = f"≥ {min(ok)} GB Mac" if ok else "[red]> 128 GB[/]"
            t.add_row(*(head if j == 0 else [""] * len(head)), f"{row['context']:,}", _gb(row["kv_cache_bytes"]),
                      _gb(row["total_bytes"]), fit, end_section=j == len(k["rows"]) - 1)
    out.print(t)
    c = r["communication"]
    ct = Table(show_edge=False, title=f"communicated per rank over {lk['name']}: {lk['gbps']:g} Gb/s line rate, "
               f"{lk['latency_us']:g} µs per message (ring algorithm)")
    for col in ("forward", "coll", "AR MB", "AG MB", "sent MB", "msgs", "lat ms", "xfer ms", "comm ms", "bound"):
        ct.add_column(col, justify="right", no_wrap=True)

    def add(name, f, bound):
        ct.add_row(name, str(f["collectives"]), f"{f['allreduce_payload_bytes'] / 1e6:.2f}",
                   f"{f['gather_bytes'] / 1e6:.2f}", f"{f['sent_bytes_per_rank'] / 1e6:.2f}", str(f["messages"]),
                   f"{f['latency_s'] * 1e3:.2f}", f"{f['transfer_s'] * 1e3:.2f}", f"{f['seconds'] * 1e3:.2f}", bound)

    tok = c["per_token"]
    add("token", tok, "—" if tok["tok_s_bound"] is None else f"≤ {tok['tok_s_bound']:.0f} tok/s")
    for f in c["per_round"]:
        add(f"round L={f['positions']}", f, "—" if f["rounds_s_bound"] is None else
            f"≤ {f['rounds_s_bound']:.0f} rd/s")
    out.print(ct)
    out.print(f"[dim]token: one plain decoding step; round L: one verify round of L positions (1 + drafts). coll: "
              "collectives; AR: all_sum payload; AG: gathered logits; sent: bytes each rank sends (ring); msgs: "
              f"sequential messages. {escape(c['what'])}. A verify round adds the DFlash drafter's block embedding all_sum and draft "
              "logits gather. Activations bf16. Bounds are from communication alone (compute not included): "
              "tok/s ≤ 1 / comm time; a verify round yields τ ≤ L tokens (tok/s ≤ τ × rounds/s, rd/s). The drafter and "
              "the norms are whole on every rank, embedding and lm_head vocabulary-split, the vision tower not "
              "loaded.[/]", soft_wrap=True)


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
    try:
        limit = parse_size(max_shard_size)
    except ValueError as e:
        fail(str(e))
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
                              log=note)
        except KeyboardInterrupt as e:
            fail(str(e) or "interrupted; nothing was written")
        except (ConvertError, CheckpointError, ValueError) as e:
            fail(str(e))
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


train_app = typer.Typer(help="Train drafters against a frozen target: `train dflash`, `train dflash2`, `train mtp`.",
                        no_args_is_help=True)
app.add_typer(train_app, name="train")


def _train(kind, model, out, data, text, regenerate, regen_max_tokens, regen_temp, init, layers, block_size,
           target_layer_ids, mask_token_id, mtp_layers, anchors_per_seq, gamma, max_length, val_fraction, epochs,
           batch_size, lr, warmup, grad_accum, save_every, max_steps, seed, resume, draft_logits, eval_tokens,
           selector_weight=SELECTOR_WEIGHT):
    if data is None and not text:
        fail("give training data: --data CHATS.jsonl and/or --text FILE_OR_FOLDER")
    model = model_path(model)
    taps = None
    if target_layer_ids:
        try:
            taps = [int(x) for x in target_layer_ids.split(",")]
        except ValueError:
            fail(f"--target-layer-ids must be comma-separated integers, got {target_layer_ids!r}")
    cfg = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, warmup=warmup, grad_accum=grad_accum,
                      save_every=save_every, seed=seed, max_steps=max_steps)
    try:
        summary = train(kind, model, out, chats=data, texts=text, regenerate=regenerate,
                        regen_max_tokens=regen_max_tokens, regen_temperature=regen_temp, init=init, layers=layers,
                        block_size=block_size, target_layer_ids=taps, mask_token_id=mask_token_id,
                        mtp_layers=mtp_layers, anchors_per_seq=anchors_per_seq, gamma=gamma, max_length=max_length,
                        val_fraction=val_fraction, draft_logits=draft_logits, resume=resume, cfg=cfg,
                        console=console, eval_tokens=eval_tokens, selector_weight=selector_weight)
    except (CheckpointError, DataError, ValueError, FileExistsError, FileNotFoundError) as e:
        fail(str(e))
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


@train_app.command("dflash2")
def train_dflash2_cmd(
    model: _TrainModel = None,
    out: str = typer.Option(..., "--out", help="Output folder (the published DFlash2DraftModel layout)."),
    data: _TrainData = None,
    text: _TrainText = [],
    regenerate: bool = typer.Option(False, "--regenerate", help="Rewrite assistant replies with the target "
                                    "(resumable, cached in OUT/regenerated.jsonl)."),
    regen_max_tokens: _RegenMaxTokens = 256,
    regen_temp: _RegenTemp = 0.0,
    init: Optional[str] = typer.Option(None, "--init", help="Fine-tune this DFlash 2 drafter, or start from this "
                                       "DFlash v1 drafter (its weights, identity convolutions)."),
    layers: int = typer.Option(1, "--layers", help="New drafter: decoder layers."),
    block_size: int = typer.Option(16, "--block-size", help="New drafter: block size B."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="e.g. 1,13,25,37,49 "
                                                   "(default: evenly spaced)."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Default: <|mask|> or 201818."),
    anchors_per_seq: int = typer.Option(16, "--anchors-per-seq"),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Loss decay (default 7 for B=16)."),
    selector_weight: float = typer.Option(SELECTOR_WEIGHT, "--selector-weight",
                                          help="λ: loss = DFlash CE + λ·selector CE."),
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
    eval_tokens: _EvalTokens = 64,
):
    """Train a DFlash 2 drafter (dynamic convolutions + pairwise path selector; DFlash CE + λ·selector CE) against a
    frozen target. Its draft logits are its config's (the target's multiplier and softcap)."""
    _train("dflash2", model, out, data, text, regenerate, regen_max_tokens, regen_temp, init, layers, block_size,
           target_layer_ids, mask_token_id, 1, anchors_per_seq, gamma, max_length, val_fraction, epochs, batch_size,
           lr, warmup, grad_accum, save_every, max_steps, seed, resume, "target", eval_tokens, selector_weight)


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


