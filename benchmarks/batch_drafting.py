"""Batched drafting in a server batch (issue 24): N rows' drafts (greedy, each row's full round: forward, logits,
draws) with one drafter forward (DFlash: `dflash.propose_batch`; MTP: one forward per depth, `mtp.propose_batch`) vs
a forward per row (each row's own `propose`), the embedded glimmer-tiny + its DFlash drafter (block 16, 15 drafts) and MTP layer
(depth 1), the same row states each repeat (the shipped prompts under the chat template, each row caught up on its
prompt and then given 4 positions of new context, as after a round of 3 accepted drafts), interleaved, median over
repeats.
Usage: python benchmarks/batch_drafting.py [N,N,...] [REPEATS] -> benchmarks/results/issue24-batched-drafting.json"""
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.session import load_session
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative.dflash import propose_batch as dflash_propose_batch
from glimmer_mlx.speculative.mtp import propose_batch

SIZES = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16").split(",")]
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
s = load_session(None)
m, tok, d, mtp = s.model, s.tokenizer, s.drafters.dflash, s.drafters.mtp
P = load_prompts()
texts = [t for c in P for t in P[c]]
ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
       for t in texts]
rows, mrows = [], []
for i in range(max(SIZES)):
    p = ids[i % len(ids)]
    f = d.fork()
    cache = m.make_cache()
    _, taps = m(mx.array([p[:-5]], dtype=mx.int32), cache, taps=d.taps)
    f.start(list(taps), p[:-4])
    f.propose(p[-5], len(p) - 5, 1, Sampler(SamplingParams()), p[:-4])  # the prompt's context into its cache
    _, more = m(mx.array([p[-5:-1]], dtype=mx.int32), cache, taps=d.taps)  # 4 positions of new context
    f.ctx = mx.concatenate(list(more), axis=-1)
    mx.eval(f.ctx)
    rows.append((f, p[-1], len(p) - 1))
    g = mtp.fork()
    cache = m.make_cache()
    _, t0 = m(mx.array([p[:-5]], dtype=mx.int32), cache, taps=g.taps)
    g.start(list(t0), p[:-4])
    g.propose(p[-5], len(p) - 5, g.depth, Sampler(SamplingParams()), p[:-4])  # the prompt's catch-up: steady after
    _, t1 = m(mx.array([p[-5:-1]], dtype=mx.int32), cache, taps=g.taps)
    g.accept(list(t1), p[-4:])
    mrows.append(g)


K = d.max_drafts


def per_row(states):
    for st, (_, a, pos) in zip(states, rows):
        st.propose(a, pos, K, Sampler(SamplingParams()), [a])


def batched(states):
    n = len(states)
    dflash_propose_batch(states, [a for _, a, _ in rows[:n]], [pos for _, _, pos in rows[:n]], [K] * n,
                         [Sampler(SamplingParams()) for _ in states], [[a] for _, a, _ in rows[:n]])


def mtp_per_row(states):
    for st, (_, a, pos) in zip(states, rows):
        st.propose(a, pos, st.depth, Sampler(SamplingParams()), st.tokens)


def mtp_batched(states):
    n = len(states)
    propose_batch(states, [a for _, a, _ in rows[:n]], [pos for _, _, pos in rows[:n]], [st.depth for st in states],
                  [Sampler(SamplingParams()) for _ in states], [st.tokens for st in states])


out = {"loadavg_start": os.getloadavg(), "dflash": {}, "mtp": {}}
for n in SIZES:
    times = {k: [] for k in ("per_row", "batched", "mtp_per_row", "mtp_batched")}
    for rep in range(REPS + 2):
        for name, fn in (("per_row", per_row), ("batched", batched)):
            states = [f.copy_state() for f, _, _ in rows[:n]]
            for st, (f, _, _) in zip(states, rows):
                st.ctx = f.ctx
            t = time.perf_counter()
            fn(states)
            if rep >= 2:
                times[name].append(time.perf_counter() - t)
        for name, fn in (("mtp_per_row", mtp_per_row), ("mtp_batched", mtp_batched)):
            states = [g.copy_state() for g in mrows[:n]]
            for st, g in zip(states, mrows):
                st.main, st.main_pos = g.main, g.main_pos
            t = time.perf_counter()
            fn(states)
            if rep >= 2:
                times[name].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for kind, a, b in (("dflash", "per_row", "batched"), ("mtp", "mtp_per_row", "mtp_batched")):
        out[kind][n] = dict(per_row_ms=1000 * med[a], batched_ms=1000 * med[b], speedup=med[a] / med[b])
        print(f"{kind:6s} N={n:2d}  per-row {1000 * med[a]:7.2f} ms  batched {1000 * med[b]:7.2f} ms  "
              f"{med[a] / med[b]:.2f}x", flush=True)
out["loadavg_end"] = os.getloadavg()
os.makedirs("benchmarks/results", exist_ok=True)
with open("benchmarks/results/issue24-batched-drafting.json", "w") as fh:
    json.dump(out, fh, indent=1)
