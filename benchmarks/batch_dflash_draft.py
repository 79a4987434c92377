"""Batched DFlash drafting (issue 24): one drafter forward for N batch rows (`dflash.draft_hidden_batch`) vs a
forward per row, the embedded glimmer-tiny + its DFlash drafter, the same row states each repeat (the shipped
prompts under the chat template, each row with 4 positions of new context, as after a round of 3 accepted drafts),
interleaved, median over repeats. Usage: python benchmarks/batch_dflash_draft.py [N,N,...] [REPEATS]
-> benchmarks/results/issue24-batched-dflash-draft.json"""
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.dflash import draft_hidden_batch

SIZES = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16").split(",")]
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
s = load_session(None)
m, tok, d = s.model, s.tokenizer, s.drafters.dflash
P = load_prompts()
texts = [t for c in P for t in P[c]]
ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
       for t in texts]
rows = []
for i in range(max(SIZES)):
    p = ids[i % len(ids)]
    f = d.fork()
    _, taps = m(mx.array([p[:-5]], dtype=mx.int32), m.make_cache(), taps=d.taps)
    f.start(list(taps), p[:-4])
    _, more = m(mx.array([p[-5:-1]], dtype=mx.int32), m.make_cache(), taps=d.taps)  # 4 positions of new context
    f.ctx = mx.concatenate([f.ctx, mx.concatenate(list(more), axis=-1)], axis=1)
    mx.eval(f.ctx)
    rows.append((f, p[-1], len(p) - 1))


def per_row(states):
    hs = [st.draft_hidden(a, st.ctx, pos, st.cache) for st, (_, a, pos) in zip(states, rows)]
    mx.eval(hs)


def batched(states):
    hs = draft_hidden_batch(states, [a for _, a, _ in rows[:len(states)]], [pos for _, _, pos in rows[:len(states)]])
    mx.eval(hs)


out = {"loadavg_start": os.getloadavg(), "sizes": {}}
for n in SIZES:
    times = {"per_row": [], "batched": []}
    for rep in range(REPS + 2):
        for name, fn in (("per_row", per_row), ("batched", batched)):
            states = [f.copy_state() for f, _, _ in rows[:n]]
            for st, (f, _, _) in zip(states, rows):
                st.ctx = f.ctx
            t = time.perf_counter()
            fn(states)
            if rep >= 2:
                times[name].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out["sizes"][n] = dict(per_row_ms=1000 * med["per_row"], batched_ms=1000 * med["batched"],
                           speedup=med["per_row"] / med["batched"])
    print(f"N={n:2d}  per-row {1000 * med['per_row']:7.2f} ms  batched {1000 * med['batched']:7.2f} ms  "
          f"{med['per_row'] / med['batched']:.2f}x", flush=True)
out["loadavg_end"] = os.getloadavg()
os.makedirs("benchmarks/results", exist_ok=True)
with open("benchmarks/results/issue24-batched-dflash-draft.json", "w") as fh:
    json.dump(out, fh, indent=1)
