"""Which of auto's forwards yield the model drafters' taps, by phase of the response (issue 20): the shipped prompts
(`ab_setup.py`; the trained tiny set with AB_SET=DIR), MAX_TOKENS tokens, greedy, REPS repeats (the first a warm-up,
not counted), one auto. Per phase (`chooser.PHASES`) and kind of round (plain; or the drafter a speculative round
drafted with), rounds a request and whether their forward also returned the taps. Counts, not times: independent
of the machine's load. `paying` restores the rule before the forty-second session (a drafter kept in step wherever
it pays by its mean estimate, chosen there or not: `AutoChooser.drafted_lately` ignored).

    AB_SET=/tmp/pair3 python benchmarks/auto_taps_phase.py REPS MAX_TOKENS [paying]        e.g. 6 96
"""
import collections
import sys

from ab_setup import second_auto, session_and_prompts

import glimmer_mlx
from glimmer_mlx.speculative.auto import chooser as C, multiplex as MX

reps, max_tokens = int(sys.argv[1]), int(sys.argv[2])
before = len(sys.argv) > 3 and sys.argv[3] == "paying"
sys.argv = sys.argv[:1] + ["0", str(reps), str(max_tokens)]  # what `session_and_prompts` reads
s, ids, _ = session_and_prompts()
if before:
    C.AutoChooser.drafted_lately = lambda self, name, regime="greedy": True
auto = second_auto(s)
counted = [False]
rounds = collections.Counter()  # (phase, kind, taps) -> rounds
D = MX.AutoDrafter
propose, plan = D.propose, D.plan


def noted_propose(self, *a, **k):
    out = propose(self, *a, **k)
    if counted[0]:
        name = self._pending[0] if self._pending else None
        rounds[(self.chooser.phase, "plain" if name is None else self._kind_of[name], self.needs_taps)] += 1
    return out


def noted_plan(self, *a, **k):
    plain = plan(self, *a, **k)
    if counted[0] and plain:
        rounds[(self.chooser.phase, "plain", self.needs_taps)] += 1
    return plain


D.propose, D.plan = noted_propose, noted_plan
for r in range(reps):
    counted[0] = r > 0
    for c in ids:
        glimmer_mlx.generate(s.model, ids[c], max_tokens=max_tokens, temperature=0.0, seed=r, drafter=auto)
n = (reps - 1) * len(ids)
print(f"{n} requests, {max_tokens} tokens, greedy, rule: {'paying alone' if before else 'paying and drafted lately'}")
print("phase  kind      rounds a request (with taps / without)")
for phase in sorted({p for p, _, _ in rounds}, key=lambda p: -1 if p is None else p):
    for kind in sorted({k for p, k, _ in rounds if p == phase}):
        w, wo = rounds[(phase, kind, True)] / n, rounds[(phase, kind, False)] / n
        print(f"{str(phase):6s} {kind:9s} {w + wo:5.2f} ({w:.2f} / {wo:.2f})")
total = sum(v for (_, k, t), v in rounds.items() if t and k in ("plain", "ngram")) / n
print(f"plain and n-gram rounds whose forward returned the taps: {total:.2f} a request")
