"""What the batch's `auto` chooser (`speculative.auto.batch.BatchAuto`) decides step by step, and on what (issue 24):
N auto rows of the embedded model (the shipped prompts under the chat template, 64 tokens, greedy), RUNS runs in one
process, interleaved with runs of N ar rows and N DFlash rows for the same-sitting baseline. Per auto step: the
batch's shape (rows B, positions per row L), its measured seconds (`BatchGenerator.step_seconds`, what `_observe`
measures), the chooser's width k and what it explores, its price of a 1-row plain step and of a verify of the
drafter's block (`step_cost`), its DFlash draft-cost factor, DFlash's first-draft acceptance estimate in the row's
phase, and the ledger (saved / elapsed seconds, barred). Prints a summary per run; writes every step to OUT (JSON).

    python benchmarks/batch_auto_trace.py N RUNS [OUT]        e.g. 1 6 /tmp/trace.json
"""
import json
import sys
import time

from ab_setup import batch_prompts

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto.batch import BatchAuto
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest
from glimmer_mlx.strategy import DecodeSpec

N, RUNS = int(sys.argv[1]), int(sys.argv[2])
OUT = sys.argv[3] if len(sys.argv) > 3 else None
s = load_session(None)
m, tok = s.model, s.tokenizer
ids = batch_prompts(tok)
ba = s.drafters.batch_auto()
trace, cur = [], {}
choose, observe = BatchAuto.choose, BatchGenerator._observe


def traced_choose(self, rows, *a):
    k, plan = choose(self, rows, *a)
    cur["choice"] = (k, [p[0] for p in plan], self.exploring, [r[0] for r in rows])
    return k, plan


def traced_observe(self, st, B, L, now, committed, queued):
    dt = self.step_seconds(st, now)  # before `_observe`: what it measures
    observe(self, st, B, L, now, committed, queued)
    a = self.auto
    k, names, exploring, keys = cur.pop("choice", (0, [], None, []))
    block = a.chooser.options["dflash"].max_k + 1 if "dflash" in a.chooser.options else 16
    key = keys[0] if keys else "greedy"
    rec = {"run": cur["run"], "B": B, "L": L, "dt_ms": 1e3 * dt, "drafting_ms": 1e3 * st.drafting,
           "chained": st.chained, "queued": queued, "k": k, "options": names, "exploring": exploring, "key": key,
           "committed": committed, "plain_ms": 1e3 * a.step_cost(B, rows=B),
           "verify_ms": 1e3 * a.step_cost(B * block, rows=B), "ratio": a.ratio,
           "dflash_draft_ms": 1e3 * a.draft_cost("dflash", block - 1) if "dflash" in a.chooser.options else None,
           "dflash_alpha0": a.acceptance("dflash", key).alphas()[0] if "dflash" in a.chooser.options else None,
           "saved_ms": 1e3 * a.saved, "elapsed_ms": 1e3 * a.elapsed, "barred": a.barred,
           "carried": sorted({kind for r in st.rows if r.options for kind in r.options})}
    trace.append(rec)


BatchAuto.choose, BatchGenerator._observe = traced_choose, traced_observe


def run(mode, r):
    g = BatchGenerator(m, auto=ba)
    for j in range(N):
        d, k = s.drafters.resolve(DecodeSpec(mode)) if mode == "dflash" else (None, None)
        g.add(BatchRequest(ids[(r + j) % len(ids)], Sampler(SamplingParams(), j), 64, set(tok.eos_token_ids), tok,
                           auto=mode == "auto", drafter=None if d is None else d.fork(), width=k))
    while g.waiting:
        g.step()
    t, n, first = time.perf_counter(), 0, len(trace)
    while len(g):
        for _, c in g.step():
            n += len(c.tokens)
    return n / (time.perf_counter() - t), trace[first:]


res = {"ar": [], "auto": [], "dflash": []}
for r in range(RUNS):
    for mode in (("ar", "auto", "dflash") if r % 2 == 0 else ("dflash", "auto", "ar")):
        cur["run"] = f"{mode}{r}"
        tps, steps = run(mode, r)
        res[mode].append(tps)
        if mode == "auto":
            spec = [x for x in steps if x["L"] > 1]
            last = steps[-1] if steps else {}
            print(f"run {r}: ar-order tok/s auto {tps:.1f}; {len(spec)}/{len(steps)} speculative steps "
                  f"(explored {sum(1 for x in steps if x['exploring'])}); plain step {last.get('plain_ms', 0):.2f} ms, "
                  f"verify priced {last.get('verify_ms', 0):.2f} ms, DFlash draft {last.get('dflash_draft_ms') or 0:.2f} "
                  f"ms, alpha0 {last.get('dflash_alpha0') or 0:.2f}, ledger {last.get('saved_ms', 0):.1f} of "
                  f"{last.get('elapsed_ms', 0):.0f} ms, barred {last.get('barred')}, carried {last.get('carried')}",
                  flush=True)
means = {k: sum(v) / len(v) for k, v in res.items() if v}
print("N", N, "mean tok/s", {k: round(v, 1) for k, v in means.items()},
      "x ar", {k: round(v / means["ar"], 3) for k, v in means.items()}, flush=True)
if OUT:
    with open(OUT, "w") as f:
        json.dump({"N": N, "runs": RUNS, "tok_s": res, "steps": trace}, f)
