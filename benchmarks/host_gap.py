"""What host work before a forward costs on this machine (issue 20): n-gram lookup alone on the shipped prompts
(`ab_setup.py`; the trained tiny set with AB_SET=DIR), greedy, with BUSY microseconds of busy host work added to each
round before its drafts are proposed (the verify forward follows), the busy levels interleaved per repeat. Per level:
the median wall time of a fully accepted 8-draft round and of its verify (`verify_greedy`, where the forward is
evaluated). Where the host's work runs beside the model (a GPU) a round grows by at most BUSY; where it competes with
the model for the cores (this repository's 2-core CPU, OpenBLAS's threads spinning) it grows by more.

    AB_SET=/tmp/pair python benchmarks/host_gap.py REPS [BUSY_US,...]      e.g. 6 0,200,500
"""
import collections
import statistics
import sys
import time

from ab_setup import session_and_prompts, time_verifies

from glimmer_mlx.generate import stream_generate
from glimmer_mlx.speculative.ngram import NGramDrafter
from glimmer_mlx.strategy import DecodeSpec

reps = int(sys.argv[1])
levels = [float(x) * 1e-6 for x in (sys.argv[2] if len(sys.argv) > 2 else "0,200,500").split(",")]
s, ids, _ = session_and_prompts()
m = s.model
m.eos_token_ids = set()
in_verify, busy = time_verifies(), [0.0]
propose = NGramDrafter.propose


def busy_propose(self, *a, **k):
    t = time.perf_counter()
    while time.perf_counter() - t < busy[0]:
        pass
    return propose(self, *a, **k)


NGramDrafter.propose = busy_propose
res = collections.defaultdict(list)
for r in range(reps):
    for level in (levels if r % 2 == 0 else levels[::-1]):
        busy[0] = level
        for ci, c in enumerate(ids):
            drafter, block = s.drafters.select(DecodeSpec("ngram"))
            prev = None
            for ch in stream_generate(m, ids[c], max_tokens=96, temperature=0.0, seed=ci, drafter=drafter,
                                      block_size=block):
                now = time.perf_counter()
                if prev is not None and len(ch.tokens) == 9:
                    res[level].append((now - prev, in_verify[0]))
                prev, in_verify[0] = now, 0.0
base = statistics.median(a for a, _ in res[levels[0]])
for level in levels:
    xs = res[level]
    wall = statistics.median(a for a, _ in xs)
    print(f"busy {1e6 * level:4.0f} us: {len(xs)} rounds, wall {1e6 * wall:5.0f} us (+{1e6 * (wall - base):4.0f}), "
          f"in verify {1e6 * statistics.median(b for _, b in xs):5.0f} us")
