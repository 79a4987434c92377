"""Where auto's time goes, by the drafter of each round (issue 20): the shipped prompts (`ab_setup.py`; the trained
tiny set with AB_SET=DIR), MAX_TOKENS tokens, greedy, REPS repeats (the first a warm-up, not counted), the modes
alternated prompt by prompt in one process. Per mode and kind of round (plain, or the family of the option drafted:
ngram, mtp, dflash): rounds, milliseconds and tokens a request, commit to commit as the engine times them; for the
speculative kinds the chooser's own price of the round at the moment it chose it (its round without a switch or
catch-up, and those, × the speed scale) against what the round took; and per kind, in µs a round, the host's parts
(`AutoDrafter.plan` / `propose` / `accept` / `end_round`; `VERIFY`: the engine's verify window, the forward's wait
included) — perf_counter wrappers, no profiler (it inflates small Python calls many times over). Last, the
chooser's plain price at its plain rounds against what pipelined plain tokens inside plain stretches took.

Modes: auto (built as the session's) and its variants (`ab_setup.VARIANTS`: ngauto, nowarm, nokeep, auto2, never).

    AB_SET=/tmp/pair3 python benchmarks/round_costs.py REPS MAX_TOKENS MODES        e.g. 6 96 auto,never,ngauto
"""
import collections
import statistics
import sys

from ab_setup import VARIANTS, auto_variant, second_auto, session_and_prompts, timed_method

import glimmer_mlx
from glimmer_mlx.speculative import engine
from glimmer_mlx.speculative.auto import chooser as C, multiplex as MX

reps, max_tokens, modes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
sys.argv = sys.argv[:1] + ["0", str(reps), str(max_tokens)]  # what `session_and_prompts` reads
s, ids, _ = session_and_prompts()
autos = {m: second_auto(s) if m == "auto" else auto_variant(s, m) for m in modes if m == "auto" or m in VARIANTS}
if len(autos) != len(modes):
    raise SystemExit(f"modes: auto or one of {', '.join(VARIANTS)}")

current = ["warm-up"]
host = collections.Counter()  # this step's host parts (seconds)
kinds = collections.defaultdict(lambda: [0, 0.0, 0])  # (mode, kind) -> rounds, seconds, tokens
parts = collections.defaultdict(collections.Counter)  # (mode, kind) -> part -> seconds
priced = collections.defaultdict(list)  # (mode, kind) -> (took, its round, switch + catch-up) seconds
plain = collections.defaultdict(list)  # mode -> (pipelined plain token's seconds, the chooser's plain price)
chosen = {}  # id(chooser) -> (family, round seconds, one-time seconds) of its latest speculative choice


def add(name: str, seconds: float) -> None:
    host[name] += seconds


for part in ("plan", "propose", "accept", "end_round"):
    timed_method(MX.AutoDrafter, part, add)
choose = C.AutoChooser.choose


def noted_choose(self, available, regime="greedy", remaining=None, picked=None):
    spec_last = self._spec_last  # (what the round is priced with: `choose` sets it for the next)
    name, k = choose(self, available, regime, remaining, picked)
    if name is not None:
        after, self._spec_last = self._spec_last, spec_last
        chosen[id(self)] = (name.split("@")[0].split("+")[0], self.scale * self._round_costs(name, regime)[k - 1],
                            self.scale * self._switch(name))
        self._spec_last = after
    return name, k


C.AutoChooser.choose = noted_choose
step = engine.AutoDecoder.step


def noted_step(self, budget):
    t_prev, after, t_verify = self._t_commit, self._after, self.t_verify
    host.clear()
    out = step(self, budget)
    if t_prev is None or current[0] == "warm-up":
        return out
    took = self._t_commit - t_prev
    kind = self.last_round
    if kind == "spec":
        c = chosen.pop(id(self.drafter.chooser), None)
        kind = c[0] if c is not None else "spec"
        if c is not None:
            priced[(current[0], kind)].append((took, c[1], c[2]))
    elif kind == "plain" and after == "plain" and self.plain.queued:
        plain[current[0]].append((took, self.drafter.chooser.plain_cost))
    k = kinds[(current[0], kind)]
    k[0], k[1], k[2] = k[0] + 1, k[1] + took, k[2] + len(out)
    host["VERIFY"] += self.t_verify - t_verify
    parts[(current[0], kind)].update(host)
    return out


engine.AutoDecoder.step = noted_step
for r in range(reps):
    for c in ids:
        for mode in (modes if r % 2 else modes[::-1]):
            current[0] = mode if r else "warm-up"
            glimmer_mlx.generate(s.model, ids[c], max_tokens=max_tokens, temperature=0.0, seed=r, drafter=autos[mode])
n = (reps - 1) * len(ids)  # requests counted
print(f"{n} requests a mode, {max_tokens} tokens, greedy")
for mode in modes:
    total = sum(v[1] for k, v in kinds.items() if k[0] == mode)
    print(f"{mode}: {1e3 * total / n:.2f} ms a request")
    for (m, kind), (rounds, sec, tok) in sorted(kinds.items()):
        if m != mode:
            continue
        line = f"  {kind:7s} {rounds / n:5.1f} rounds {1e3 * sec / n:6.2f} ms {tok / n:5.1f} tokens a request"
        if priced[(m, kind)]:
            took, price, once = (1e3 * statistics.mean(x[i] for x in priced[(m, kind)]) for i in range(3))
            line += f"; a round took {took:.2f} ms, priced {price:.2f} + one-time {once:.2f}"
        print(line)
        print("          µs a round: " + " ".join(f"{p}={1e6 * v / rounds:.0f}"
                                               for p, v in sorted(parts[(m, kind)].items())))
    if plain[mode]:
        took, price = (1e3 * statistics.median(x[i] for x in plain[mode]) for i in range(2))
        print(f"  pipelined plain tokens in plain stretches: {len(plain[mode])}, median {took:.3f} ms; the chooser's "
              f"price then, median {price:.3f} ms")
