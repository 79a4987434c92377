"""Figures for the embedded model card: held-out loss, τ and same-run speed of plain vs DFlash vs MTP decoding on
held-out code and chat prompts (greedy and T=1), and the verify cost curve measured on this machine.

    LD_PRELOAD=.../libblas.so.3 python models/build_embedded.py --stage measure

Writes benchmarks/results/embedded_figures.json and prints the markdown tables used in the model card / BENCHMARKS.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
MODELS = ROOT / "models"
MODES = [("ar", None, None), ("dflash-16", "dflash", 16), ("mtp-1", "mtp", 1), ("mtp-2", "mtp", 2),
         ("mtp-3", "mtp", 3)]


def prompts(work: Path, tok, n: int = 8) -> dict[str, list[list[int]]]:
    """Held-out prompts: chat = first user turn of held-out conversations (chat template, generation prompt);
    code = the opening lines of held-out stdlib files as raw completion prompts."""
    chats = []
    for line in (work / "data" / "chat_heldout.jsonl").read_text(encoding="utf-8").splitlines():
        msgs = json.loads(line)["messages"]
        first = [m for m in msgs if m["role"] == "user"][0]
        if first["content"].startswith(("Hi", "Who", "What can", "Thanks")):
            continue
        chats.append(tok.apply_chat_template([first], add_generation_prompt=True, tokenize=True))
        if len(chats) == n:
            break
    code = []
    for doc in (work / "data" / "code_heldout.txt").read_text(encoding="utf-8").split("\x00\n"):
        ids = tok.encode(doc)
        if len(ids) > 400:
            code.append(ids[:160])
        if len(code) == n:
            break
    return {"code": code, "chat": chats}


def verify_costs(model, sizes=(1, 2, 4, 8, 16), context: int = 256, repeats: int = 15) -> dict[int, float]:
    import mlx.core as mx

    from glimmer_mlx.cache import rewind_cache
    from glimmer_mlx.generate import prefill

    cache = model.make_cache()
    prefill(model, cache, list(range(10, 10 + context)))
    out = {}
    for L in sizes:
        x = mx.array([[11] * L], dtype=mx.int32)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(model(x, cache))
            ts.append(time.perf_counter() - t0)
            rewind_cache(cache, L)
        out[L] = statistics.median(ts)
    return {L: round(out[L] / out[1], 3) for L in sizes} | {"step_ms": round(out[1] * 1e3, 3)}


def measure(work: Path, max_tokens: int = 96) -> dict:
    from glimmer_mlx import generate, load
    from glimmer_mlx.speculative import load_drafter

    model, tok = load(str(MODELS / "glimmer-tiny"))
    dflash = load_drafter(str(MODELS / "glimmer-tiny-dflash"), model)
    mtp = load_drafter(str(MODELS / "glimmer-tiny-mtp"), model)
    sets = prompts(work, tok)
    log = json.loads((MODELS / "glimmer-tiny" / "training_log.json").read_text())
    results = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                           "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")},
               "heldout_loss": log["history"][-1]["heldout"], "parameters": log["parameters"],
               "max_tokens": max_tokens, "verify_cost_ratio": verify_costs(model), "runs": {}}
    generate(model, sets["chat"][0], tokenizer=tok, max_tokens=16)  # warm up
    for temp in (0.0, 1.0):
        for cat, ps in sets.items():
            rows = {name: {"tokens": 0, "time": 0.0, "rounds": 0, "tok_per_s": []} for name, _, _ in MODES}
            for i, ids in enumerate(ps):
                for name, kind, width in MODES:  # interleaved: every mode on the same prompt, back to back
                    drafter = {"dflash": dflash, "mtp": mtp}.get(kind)
                    r = generate(model, ids, tokenizer=tok, max_tokens=max_tokens, temperature=temp, seed=i,
                                 drafter=drafter, block_size=width)
                    s = r.stats
                    row = rows[name]
                    row["tokens"] += s.generation_tokens
                    row["time"] += s.generation_time
                    row["rounds"] += s.extra.get("rounds", s.generation_tokens)
                    row["tok_per_s"].append(s.generation_tps)
            base = rows["ar"]["tokens"] / rows["ar"]["time"]
            for name, row in rows.items():
                tps = row["tokens"] / row["time"]
                row.update(tok_s=round(tps, 1), speedup=round(tps / base, 2),
                           tau=round(row["tokens"] / max(1, row["rounds"]), 2))
                del row["tok_per_s"]
            results["runs"][f"{cat}/T={temp:g}"] = rows
            print(f"{cat} T={temp:g}: " + ", ".join(f"{n} τ {r['tau']} {r['speedup']}×" for n, r in rows.items()),
                  flush=True)
    out = ROOT / "benchmarks" / "results" / "embedded_figures.json"
    out.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return results


def markdown(res: dict) -> str:
    names = [n for n, _, _ in MODES]
    lines = ["| prompts | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, rows in res["runs"].items():
        cells = [f"{rows[n]['tok_s']} tok/s" if n == "ar" else f"τ {rows[n]['tau']}, {rows[n]['speedup']}×"
                 for n in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    vc = res["verify_cost_ratio"]
    lines.append("")
    lines.append("verify cost (forward over k+1 tokens ÷ one decode step, context 256): "
                 + ", ".join(f"{k}: {v}" for k, v in vc.items() if k != "step_ms") + f"; step {vc['step_ms']} ms")
    return "\n".join(lines)
