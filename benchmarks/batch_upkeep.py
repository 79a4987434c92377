"""What auto rows' upkeep costs a batch step (issue 24), timed in place: N rows of the embedded model (the shipped
prompts under the chat template, greedy, 64 tokens), plain rows and auto rows in alternate runs of one process (one
`BatchAuto` across the auto runs, cold), every step's work split by `time.perf_counter` wrappers around the
generator's parts — `_chainable` (the choice asked one token behind: `_choose`, an ask every few steps), `_launch`
(the forward queued), `_land` (read back: each row's `accept`, the step's price `_observe`) — in µs a step, and ms a
token over the runs (medians; the forwards' noise is in the token time, the parts are host work). cProfile is not
used: it inflates small Python calls many times over.

    python benchmarks/batch_upkeep.py N RUNS        e.g. 8 16
"""
import collections
import statistics
import sys

from ab_setup import batch_prompts, second_auto, timed_method, timed_steps

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative import batch as B
from glimmer_mlx.speculative.auto.batch import BatchAuto

N, RUNS = int(sys.argv[1]), int(sys.argv[2])
s = load_session(None)
tok, ids = s.tokenizer, batch_prompts(s.tokenizer)
spent = collections.defaultdict(float)
mode = ["ar"]


def add(name: str, seconds: float) -> None:
    spent[(mode[0], name)] += seconds


PARTS = ("_chainable", "_choose", "_launch", "_land", "_observe")
for part in PARTS:
    timed_method(B.BatchGenerator, part, add)
timed_method(B.Row, "accept", add)
ba = BatchAuto(second_auto(s))
ms, steps = collections.defaultdict(list), collections.Counter()
for r in range(RUNS):
    for mode[0] in (["ar", "auto"] if r % 2 == 0 else ["auto", "ar"]):
        g = B.BatchGenerator(s.model, auto=ba if mode[0] == "auto" else None)
        for j in range(N):
            g.add(B.BatchRequest(ids[(r + j) % len(ids)], Sampler(SamplingParams(temperature=0.0), 100 * r + j), 64,
                                 set(tok.eos_token_ids), tok, auto=mode[0] == "auto"))
        ms[mode[0]].append(timed_steps(g))
        steps[mode[0]] += g.steps
print(f"N={N} runs={RUNS}: ms a token ar {statistics.median(ms['ar']):.3f}, auto {statistics.median(ms['auto']):.3f}; "
      f"ar ÷ auto run by run, median {statistics.median(a / b for a, b in zip(ms['ar'], ms['auto'])):.3f}")
for part in PARTS + ("accept",):
    print(f"  {part:11s} µs a step: ar {1e6 * spent[('ar', part)] / steps['ar']:8.1f}   "
          f"auto {1e6 * spent[('auto', part)] / steps['auto']:8.1f}")
print(" ", ba.counts())
