"""Where auto's n-gram rounds lose to n-gram lookup alone (issue 20): per fully accepted round of the widest n-gram
draft (8 drafts, 9 tokens committed), its wall time from the chunk before to its own, the time inside
`verify_greedy` (where the verify forward is evaluated) and the rest — the host's work, drafting and bookkeeping —
as medians over every such round of REPS repeats of the shipped prompts (`ab_setup.py`; the trained tiny set with
AB_SET=DIR), the modes interleaved (`task_order`). Greedy only (T = 0).

Modes: ngram (n-gram lookup alone); auto (the session's); ngauto (auto over n-gram lookup alone: plain or n-gram per
round); nowarm (auto whose forwards never yield the model drafters' taps); nokeep (auto whose chooser never keeps a
stretch's option by bounds: `AutoChooser.keep`); auto2 (a second auto built as the first: an A/A control).

    AB_SET=/tmp/pair python benchmarks/ngram_round_host.py REPS [MAX_TOKENS [MODES]]     e.g. 8 96 ngram,auto,nokeep
"""
import collections
import statistics
import sys
import time

from ab_setup import VARIANTS, auto_variant, session_and_prompts, time_verifies

from glimmer_mlx.bench.runner import task_order
from glimmer_mlx.generate import stream_generate
from glimmer_mlx.strategy import DecodeSpec

reps = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 96
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["ngram", "ngauto", "auto"]
s, ids, _ = session_and_prompts()
m = s.model
m.eos_token_ids = set()  # every run decodes n tokens
in_verify = time_verifies()


own = {mo: auto_variant(s, mo) for mo in modes if mo in VARIANTS}
res = collections.defaultdict(list)
for r in range(reps):
    for ci, c in enumerate(ids):
        for mo in task_order(modes, r * len(ids) + ci):
            drafter, block = (own[mo], None) if mo in own else s.drafters.select(DecodeSpec(mo))
            prev = None
            for ch in stream_generate(m, ids[c], max_tokens=n, temperature=0.0, seed=1000 * r + ci, drafter=drafter,
                                      block_size=block):
                now = time.perf_counter()
                if prev is not None and len(ch.tokens) == 9:
                    res[mo].append((now - prev, in_verify[0]))
                prev, in_verify[0] = now, 0.0
for mo in modes:
    xs = res[mo]
    print(f"{mo:9s} full rounds {len(xs):4d}  wall {1e6 * statistics.median(a for a, _ in xs):5.0f} us  in verify "
          f"{1e6 * statistics.median(b for _, b in xs):5.0f}  rest {1e6 * statistics.median(a - b for a, b in xs):5.0f}")
