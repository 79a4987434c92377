"""What `auto` costs the host per round (issue 20): plain decoding, DFlash alone (block 8) and auto interleaved on the
first prompt of each shipped category, MAX_TOKENS tokens, REPS repeats (the modes' order rotated:
`glimmer_mlx.bench.runner.task_order`). Prints, from the same sitting:

- each mode × plain and DFlash alone's seconds per round and τ;
- auto's host time: the seconds spent in its per-round bookkeeping (`AutoDrafter.plan`, `propose` without the
  drafters' own drafting and catch-up, `accept` without the n-gram index's, `end_round`, `lead`, `restart`,
  `plain_token`, `wants_taps`, `AutoChooser.elapse`) as a share of its decoding time, per round and per token;
- auto's DFlash rounds inside a stretch (the round before was speculative too): their mean commit-to-commit time
  next to DFlash alone's mean round — what a round costs auto beyond the same drafter's own loop.

    python benchmarks/auto_overhead.py T REPS [MAX_TOKENS]          the embedded model
    AB_SET=DIR python benchmarks/auto_overhead.py T REPS [...]      the trained tiny set (benchmarks/bench_tiny_set.py)
"""
import functools
import statistics
import time

import glimmer_mlx
from ab_setup import args, session_and_prompts
from glimmer_mlx.bench.runner import task_order
from glimmer_mlx.speculative.auto.chooser import AutoChooser
from glimmer_mlx.speculative.auto.multiplex import AutoDrafter
from glimmer_mlx.speculative.engine import AutoDecoder

T, reps, maxt = args()
s, ids, SET = session_and_prompts()
cats = list(ids)
m = s.model
m.eos_token_ids = set()  # every run decodes MAX_TOKENS tokens
d = s.drafters
auto = d.auto()

host = [0.0]


def timed(cls, name, sign):
    """Add (sign +1) or take back (sign -1) the seconds every call of cls.name takes to the host clock."""
    f = getattr(cls, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            host[0] += sign * (time.perf_counter() - t)
    setattr(cls, name, g)


for n in ("plan", "propose", "accept", "end_round", "lead", "restart", "plain_token", "wants_taps"):
    timed(AutoDrafter, n, 1)
timed(AutoChooser, "elapse", 1)
for kind, dr in auto.drafters.items():  # the drafters' own work is what each of them costs alone too
    for n in ("propose", "propose_tree", "start", "extend") + (("accept",) if kind == "ngram" else ()):
        if hasattr(type(dr), n):
            timed(type(dr), n, -1)
timed(AutoDecoder, "_fill", -1)

in_stretch = []  # commit-to-commit seconds of auto's DFlash chain rounds whose previous round was speculative
end_round, step = AutoDrafter.end_round, AutoDecoder.step
last = [None, None]  # the round before the latest, the latest


def end_round_seen(self, seconds, tokens):
    if self._round is not None and self._option == "dflash" and last[0] == "spec":
        in_stretch.append(seconds)
    return end_round(self, seconds, tokens)


def step_seen(self, budget):
    last[0] = last[1]
    out = step(self, budget)
    last[1] = self.last_round
    return out


AutoDrafter.end_round, AutoDecoder.step = end_round_seen, step_seen

modes = ["ar", "dflash", "auto"]
runs = {mo: [0.0, 0, 0] for mo in modes}  # seconds, tokens, rounds
auto_host = 0.0
for r in range(reps):
    for ci, c in enumerate(cats):
        for mo in task_order(modes, r * len(cats) + ci):
            before = host[0]
            res = glimmer_mlx.generate(m, ids[c], max_tokens=maxt, temperature=T, seed=r,
                                       drafter={"ar": None, "dflash": d.dflash, "auto": auto}[mo],
                                       block_size=8 if mo == "dflash" else None)
            if mo == "auto":
                auto_host += host[0] - before
            x = runs[mo]
            x[0] += res.stats.generation_time
            x[1] += res.stats.generation_tokens
            x[2] += res.stats.extra.get("rounds", 0)
plain = runs["ar"][0] / runs["ar"][1]
print(f"T {T} reps {reps} tokens {maxt} ({SET or 'embedded'}); x plain:",
      {mo: round(plain / (v[0] / v[1]), 3) for mo, v in runs.items()}, f"plain {1e3 * plain:.2f} ms/token")
secs, toks, rounds = runs["dflash"]
alone = secs / rounds
print(f"DFlash alone: {1e3 * alone:.2f} ms a round, tau {toks / rounds:.2f}")
secs, toks, rounds = runs["auto"]
print(f"auto host: {1e3 * auto_host:.1f} ms of {1e3 * secs:.0f} ms decoding ({100 * auto_host / secs:.2f} %), "
      f"{1e6 * auto_host / rounds:.0f} us a round, {1e6 * auto_host / toks:.0f} us a token; {rounds} rounds")
if in_stretch:
    mean = statistics.mean(in_stretch)
    print(f"auto's DFlash chain rounds inside a stretch: {len(in_stretch)}, {1e3 * mean:.2f} ms a round "
          f"(median {1e3 * statistics.median(in_stretch):.2f}) = {mean / alone:.3f} x DFlash alone's")
print("auto chose", auto.chooser.summary()["chosen"])
