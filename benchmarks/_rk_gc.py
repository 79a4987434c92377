"""Where a mode's time goes, by kind of round (issue 20): per request the time to its first token (the prefill and
the first token's step), then every later round by what it committed — a plain token ("plain") or a speculative
round of n tokens ("specN") — chunk to chunk as a consumer of `stream_generate` sees it; summed per repeat, with
each kind's count and median. MAX_TOKENS (96) tokens of the shipped prompts (`ab_setup.py`; the trained tiny set with
AB_SET=DIR), at temperature T (0: greedy; default 0), REPS repeats, the modes interleaved (`task_order`). Modes: any
fixed mode (ngram, dflash, mtp), auto (the session's) and auto's variants (`ab_setup.auto_variant`: ngauto, nowarm,
nokeep, auto2).

    AB_SET=/tmp/pair python benchmarks/round_kinds.py REPS MODES [T]        e.g. 8 ngram,ngauto,auto
"""
import collections
import statistics
import sys
import time

from ab_setup import VARIANTS, auto_variant, session_and_prompts

from glimmer_mlx.bench.runner import task_order
from glimmer_mlx.generate import stream_generate
from glimmer_mlx.strategy import DecodeSpec

reps, modes = int(sys.argv[1]), sys.argv[2].split(",")
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
s, ids, _ = session_and_prompts()
m = s.model
m.eos_token_ids = set()  # every run decodes MAX_TOKENS tokens
own = {mo: auto_variant(s, mo) for mo in modes if mo in VARIANTS}
acc = {mo: collections.defaultdict(list) for mo in modes}
import gc
for r in range(reps):
    for ci, c in enumerate(ids):
        for mo in task_order(modes, r * len(ids) + ci):
            mm = {"autogc": "auto", "arx": "ar"}.get(mo, mo); drafter, block = (own[mo], None) if mo in own else s.drafters.select(DecodeSpec(mm))
            kinds, t0, prev = acc[mo], time.perf_counter(), None
            (gc.disable if mo.endswith("gc") or mo=="arx" else gc.enable)()
            for i, ch in enumerate(stream_generate(m, ids[c], max_tokens=96, temperature=temperature,
                                                   seed=1000 * r + ci, drafter=drafter, block_size=block)):
                now = time.perf_counter()
                key = "first" if i == 0 else "plain" if len(ch.tokens) == 1 else f"spec{len(ch.tokens)}"
                kinds[key].append(now - (t0 if i == 0 else prev))
                prev = now
            kinds["total"].append(prev - t0)
for mo in modes:
    parts = [f"{k} {len(v)}x {1e3 * sum(v) / reps:.1f} ms (med {1e6 * statistics.median(v):.0f} us)"
             for k, v in sorted(acc[mo].items(), key=lambda kv: (kv[0] != "total", kv[0]))]
    print(f"{mo:7s} per repeat: " + "; ".join(parts))
