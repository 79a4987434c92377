"""Continuous batching where speculation pays alone (issue 24): the engine (speculative/batch.py BatchGenerator, no
HTTP) on the trained tiny set (`python benchmarks/bench_tiny_set.py DIR`: a token-map target whose greedy text falls
into short cycles, a trained block-8 DFlash drafter, one trained MTP layer), N rows of the shipped prompts (byte
fallback into its 48-token vocabulary, as `glimmer bench` maps them), 64 tokens each, greedy; modes ar, ngram,
dflash, mtp and auto per row, interleaved over repeats; aggregate tok/s = tokens / wall time of the decode steps
(every row admitted first: the admission steps are not timed). Greedy output of every row is checked identical to
ar's.

    python benchmarks/batch_tiny_set.py DIR [N,N,...] [REPEATS] -> benchmarks/results/issue24-batch-tiny-set.json
"""
import json
import os
import sys
import time

import numpy as np

import glimmer_mlx
from glimmer_mlx.bench.runner import encode_prompts
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest
from glimmer_mlx.strategy import DecodeSpec, load_drafters

DIR = sys.argv[1]
SIZES = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16").split(",")]
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
MODES = ["ar", "ngram", "dflash", "mtp", "auto"]
model, _ = glimmer_mlx.load(f"{DIR}/target")
model.eos_token_ids = set()
drafters = load_drafters(model, dflash=f"{DIR}/dflash", mtp=f"{DIR}/mtp")
ids_by_cat, _ = encode_prompts(load_prompts(), None, model.args.vocab_size)
prompts = [p for c in ids_by_cat.values() for p in c]
ba = drafters.batch_auto()


def run(mode, n):
    g = BatchGenerator(model, auto=ba)
    rows = []
    for j in range(n):
        d, k = drafters.resolve(DecodeSpec(mode)) if mode not in ("ar", "auto") else (None, None)
        rows.append(g.add(BatchRequest(prompts[j % len(prompts)], Sampler(SamplingParams(), j), 64, set(), None,
                                       auto=mode == "auto", drafter=None if d is None else d.fork(), width=k)))
    out = {id(r): [] for r in rows}
    while g.waiting:  # admission (prefills): its steps' tokens are kept, not timed
        for r, ch in g.step():
            out[id(r)] += ch.tokens
    t, tokens, before = time.perf_counter(), 0, dict(ba.steps)
    while len(g):
        for r, ch in g.step():
            out[id(r)] += ch.tokens
            tokens += len(ch.tokens)
    dt = time.perf_counter() - t
    taus = [r.tau() for r in rows]
    return tokens / dt, [out[id(r)] for r in rows], float(np.mean(taus)), ba.steps["spec"] - before["spec"]


results = {"dir": DIR, "loadavg_start": os.getloadavg(), "sizes": {}}
run("ar", 2)  # warm-up (and auto's calibration)
run("auto", 2)
for n in SIZES:
    tps = {m: [] for m in MODES}
    tau, spec = {}, []
    for rep in range(REPS):
        ref = None
        for mode in MODES:
            rate, toks, t, s = run(mode, n)
            tps[mode].append(rate)
            tau[mode] = t
            if mode == "ar":
                ref = toks
            else:
                assert toks == ref, f"{mode} at N={n}: greedy output differs from ar"
            if mode == "auto":
                spec.append(s)
    med = {m: float(np.median(v)) for m, v in tps.items()}
    results["sizes"][n] = dict(tps=tps, median=med, ratio={m: med[m] / med["ar"] for m in MODES}, tau=tau,
                               auto_spec_steps=spec)
    print(f"N={n:2d} " + "  ".join(f"{m} {med[m]:6.0f} ({med[m] / med['ar']:.2f}x, τ {tau[m]:.2f})" for m in MODES)
          + f"  auto spec steps {spec}", flush=True)
results["loadavg_end"] = os.getloadavg()
os.makedirs("benchmarks/results", exist_ok=True)
with open("benchmarks/results/issue24-batch-tiny-set.json", "w") as fh:
    json.dump(results, fh, indent=1)
