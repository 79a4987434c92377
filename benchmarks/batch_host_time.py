"""Where a batch step's host time goes, by method (issue 24): N rows of the embedded model (the shipped prompts under the
chat template, 64 tokens, greedy), 2 warm-up runs then RUNS runs of one mode, every listed method wrapped in a timer
(µs per call and per step; the timers add ~1 µs a call). Modes: ar (plain rows), auto (auto rows), barred (auto rows
in a batch whose ledger bars speculation throughout: what the auto rows cost where the choice cannot speculate),
eager (auto rows whose batch asks its choice every step, as before the thirtieth session: `BatchAuto.asks`).
Times are measured in place, right after the step's forward (on this 2-core machine BLAS threads still spin then, so
a method costs 2-4x what it does alone): compare modes and commits, not absolute figures.

    python benchmarks/batch_host_time.py N RUNS MODE        e.g. 8 6 auto
"""
import sys
import time
from collections import Counter, defaultdict

from ab_setup import batch_prompts

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative import batch as engine
from glimmer_mlx.speculative.auto import batch as auto_batch
from glimmer_mlx.speculative.ngram import NGramDrafter

N, RUNS, MODE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
seconds, calls = defaultdict(float), Counter()


def timed(cls, name):
    real = getattr(cls, name)
    label = f"{cls.__name__}.{name}"

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        seconds[label] += time.perf_counter() - t
        calls[label] += 1
        return out

    setattr(cls, name, wrapper)


for cls, name in [(engine.BatchGenerator, "step"), (engine.BatchGenerator, "_launch"),
                  (engine.BatchGenerator, "_land"), (engine.BatchGenerator, "_chainable"),
                  (engine.BatchGenerator, "_choose"), (engine.BatchGenerator, "_observe"), (engine.Row, "accept"),
                  (engine.Row, "available"), (auto_batch.BatchAuto, "choose"), (auto_batch.BatchAuto, "carries"),
                  (auto_batch.StepChoice, "bound"), (auto_batch.StepChoice, "at"), (NGramDrafter, "accept"),
                  (NGramDrafter, "offer")]:
    timed(cls, name)
s = load_session(None)
m, tok = s.model, s.tokenizer
ids = batch_prompts(tok)
ba = s.drafters.batch_auto()
if MODE == "eager":
    ba.asks = lambda: True


def run():
    g = engine.BatchGenerator(m, auto=ba)
    for j in range(N):
        g.add(engine.BatchRequest(ids[j % len(ids)], Sampler(SamplingParams(), j), 64, set(tok.eos_token_ids), tok,
                                  auto=MODE != "ar"))
    while len(g):
        if MODE == "barred":
            ba.saved = -1e9
        g.step()


for _ in range(2):
    run()
seconds.clear()
calls.clear()
for _ in range(RUNS):
    run()
steps = calls["BatchGenerator.step"]
print(f"N={N} {MODE}: {steps} steps, the batch's chooser {ba.steps}, barred at the end: {ba.barred}")
for label in sorted(seconds, key=lambda x: -seconds[x]):
    print(f"  {label:28s} {calls[label]:6d} calls {1e6 * seconds[label] / calls[label]:9.1f} µs a call "
          f"{1e6 * seconds[label] / steps:9.1f} µs a step")
