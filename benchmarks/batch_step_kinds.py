"""What an auto batch's steps cost by kind (issue 24): N rows of the embedded model (the shipped prompts under the chat
template, greedy, 64 tokens), plain rows and auto rows in alternate runs of one process (one `BatchAuto` across the
auto runs, cold). Each step with all N rows decoding is classed — ar's plain steps; auto's plain steps its quiet
batch did not ask its choice (`BatchAuto.asks`), plain steps it asked, the first step after a speculative one, and
speculative steps — and timed whole (read-back to read-back) and in its host parts (`time.perf_counter` wrappers:
`_chainable`, `_choose`, `_launch`, `_land`, `_observe`, `Row.accept`; `_launch` and `_land` include waiting on the
forward), medians in ms / µs. A plain step of auto rows costs what a plain row's does plus these parts' excess.

    python benchmarks/batch_step_kinds.py N RUNS        e.g. 2 16
"""
import collections
import statistics
import sys
import time

from ab_setup import batch_prompts, second_auto, timed_method

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative import batch as B
from glimmer_mlx.speculative.auto.batch import BatchAuto

N, RUNS = int(sys.argv[1]), int(sys.argv[2])
PARTS = ("_chainable", "_choose", "_launch", "_land", "_observe", "accept")
s = load_session(None)
tok, ids = s.tokenizer, batch_prompts(s.tokenizer)
ba = BatchAuto(second_auto(s))
spent = {}  # this step's host parts (seconds), and whether its choice was asked


def add(name: str, seconds: float) -> None:
    spent[name] = spent.get(name, 0.0) + seconds


for part in PARTS[:-1]:
    timed_method(B.BatchGenerator, part, add)
timed_method(B.Row, "accept", add)
asks = ba.quiet.asks


def noted_asks(*a, **k):
    out = asks(*a, **k)
    spent["asked"] = spent.get("asked", False) or out
    return out


ba.quiet.asks = noted_asks
kinds = collections.defaultdict(list)  # (mode, kind) -> [(step seconds, parts)]
for r in range(RUNS):
    for mode in (["ar", "auto"] if r % 2 == 0 else ["auto", "ar"]):
        g = B.BatchGenerator(s.model, auto=ba if mode == "auto" else None)
        for j in range(N):
            g.add(B.BatchRequest(ids[(r + j) % len(ids)], Sampler(SamplingParams(temperature=0.0), 100 * r + j), 64,
                                 set(tok.eos_token_ids), tok, auto=mode == "auto"))
        while g.waiting:
            g.step()
        prev, last_spec = time.perf_counter(), False
        while len(g):
            spent.clear()
            events = g.step()
            now = time.perf_counter()
            spec = any(len(c.tokens) > 1 for _, c in events)
            if len(g.rows) == N:
                kind = "spec" if spec else "after spec" if last_spec else "plain, asked" if spent.get("asked") \
                    else "plain"
                kinds[(mode, kind)].append((now - prev, dict(spent)))
            last_spec, prev = spec, now
print(f"N={N} runs={RUNS}: median ms a step, µs of its host parts")
for (mode, kind), steps in sorted(kinds.items()):
    print(f"  {mode:4s} {kind:12s} {len(steps):5d} steps {1e3 * statistics.median(t for t, _ in steps):7.3f} ms | "
          + " ".join(f"{p} {1e6 * statistics.median(x.get(p, 0.0) for _, x in steps):.0f}" for p in PARTS))
print(" ", ba.counts())
