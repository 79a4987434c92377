"""Where auto's rounds part from a variant's on the same request (issue 20): the shipped prompts (`ab_setup.py`; the
trained tiny set with AB_SET=DIR), MAX_TOKENS tokens, greedy, REPS repeats (the first a warm-up), auto and the variant
alternated prompt by prompt in one process. Greedy output is the same for both, so a position is the same point
of the same text in both: for the last repeat, every position where the two took different rounds, each round as
kind:option:drafts->tokens committed, with each chooser's own price there (ms a token of the options it was
offered, plain's, and its speed scale); then, over the counted repeats, each option's rounds and tokens a round,
and the n-gram rounds that committed one token (their first draft rejected) by the kind of round before them.

Variants: any of `ab_setup.VARIANTS` (never: the model drafters carried, offered and never drafted; ngauto: n-gram
lookup alone; ...).

    AB_SET=/tmp/pair3 python benchmarks/auto_divergence.py REPS MAX_TOKENS VARIANT        e.g. 4 96 never
"""
import collections
import sys

from ab_setup import VARIANTS, auto_variant, second_auto, session_and_prompts

import glimmer_mlx
from glimmer_mlx.speculative import engine
from glimmer_mlx.speculative.auto import chooser as C

reps, max_tokens, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if variant not in VARIANTS:
    raise SystemExit(f"variant: one of {', '.join(VARIANTS)}")
sys.argv = sys.argv[:1] + ["0", str(reps), str(max_tokens)]  # what `session_and_prompts` reads
s, ids, _ = session_and_prompts()
modes = ("auto", variant)
autos = {"auto": second_auto(s), variant: auto_variant(s, variant)}
current = ["warm-up"]
asked = {}  # id(chooser) -> (option, drafts, its prices) of the round being decided
rounds = collections.defaultdict(list)  # (mode, prompt, rep) -> [(position, kind, option, drafts, committed, prices)]
choose = C.AutoChooser.choose


def noted_choose(self, available, regime="greedy", remaining=None, picked=None):
    name, k = choose(self, available, regime, remaining, picked)
    prices = {n: 1e3 / self.rate(n, c, regime) for n, c in available.items()}
    prices.update(plain=1e3 / self.rate(None, 0, regime), scale=self.scale)
    asked[id(self)] = (name, k, prices)
    return name, k


C.AutoChooser.choose = noted_choose
step = engine.AutoDecoder.step


def noted_step(self, budget):
    pos, key = len(self.history), id(self.drafter.chooser)
    asked.pop(key, None)
    out = step(self, budget)
    name, k, prices = asked.pop(key, (None, 0, None))
    rounds[current[0]].append((pos, self.last_round, name if self.last_round == "spec" else None, k, len(out),
                               prices))
    return out


engine.AutoDecoder.step = noted_step
for r in range(reps):
    for c in ids:
        for mode in modes if r % 2 else modes[::-1]:
            current[0] = (mode, c, r)
            glimmer_mlx.generate(s.model, ids[c], max_tokens=max_tokens, temperature=0.0, seed=r, drafter=autos[mode])


def label(x) -> str:
    return "-" if x is None else f"{x[1]}:{x[2]}:{x[3]}->{x[4]}"


def priced(x) -> str:
    if x is None or x[5] is None:
        return "not asked"
    return " ".join(f"{n} {v:.2f}" for n, v in sorted(x[5].items()) if n != "scale") + f" (scale {x[5]['scale']:.3f})"


last = reps - 1
for c in ids:
    a = {x[0]: x for x in rounds[("auto", c, last)]}
    b = {x[0]: x for x in rounds[(variant, c, last)]}
    print(f"== {c}: auto {len(a)} rounds, {variant} {len(b)}")
    for p in sorted(set(a) | set(b)):
        if label(a.get(p)) != label(b.get(p)):
            print(f"  position {p}: auto {label(a.get(p)):22s} {variant} {label(b.get(p))}")
            print(f"      auto's prices (ms a token): {priced(a.get(p))}")
            print(f"      {variant}'s: {priced(b.get(p))}")
print(f"over repeats 1..{last}:")
for mode in modes:
    count, tokens, failed, tried = (collections.Counter() for _ in range(4))
    for (m, c, r), xs in rounds.items():
        if m != mode or r == 0:
            continue
        before = None
        for x in xs:
            option = x[2] or x[1]
            count[option] += 1
            tokens[option] += x[4]
            kind = "plain" if x[1] in ("plain", "first") else option.split("@")[0].split("+")[0]
            if kind == "ngram":
                tried[(before, option)] += 1
                failed[(before, option)] += x[4] == 1
            before = kind
    print(f"  {mode}: " + ", ".join(f"{o} {count[o]} rounds {tokens[o] / count[o]:.2f} tokens" for o in sorted(count)))
    print(f"  {mode}: n-gram rounds that committed 1 token, by the round before: "
          + ", ".join(f"after {b} {o} {failed[(b, o)]}/{tried[(b, o)]}" for b, o in sorted(tried, key=str)))
