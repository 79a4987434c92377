"""auto's cost model against what its speculative rounds did (issue 20): the embedded set, the first prompt of each
shipped category under the chat template, 96 tokens, REPS repeats, one auto. Per option, over the rounds it drafted:
the expected tokens and the round's parts (draft, verify, overhead; and the one-time switch/catch-up it was charged)
as the chooser priced them when it chose the round, against the tokens the round committed and the wall time of the
engine's step. Diagnostic (times depend on the load; compare the columns of one run).

    python benchmarks/auto_rounds_check.py T REPS
"""
import statistics
import sys
import time
from collections import defaultdict

import ab_setup  # noqa: F401  (sets GLIMMER_MLX_AUTO_LEARNED=off: every auto here starts cold)
import glimmer_mlx
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative import engine

T = float(sys.argv[1])
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
s = load_session(None)
m, tok = s.model, s.tokenizer
P = load_prompts()
ids = {c: tok.apply_chat_template([{"role": "user", "content": P[c][0]}], add_generation_prompt=True, tokenize=True)
       for c in P}
auto = s.drafters.auto()
ch = auto.chooser
priced: dict = {}
choose = ch.choose


def pricing_choose(available, regime="greedy", remaining=None, picked=None):
    name, k = choose(available, regime, remaining, picked)
    priced.clear()
    if name:
        o = ch.options[name]
        vf = o.verify_factor.get(regime, ch.verify_factor.get(regime, 1.0))
        priced.update(name=name, E=o.acceptance(regime).expected_tokens(k), draft=ch.scale * o.cost(k),
                      verify=ch.scale * vf * ch.costs[o.verify_rows(k)], over=ch.scale * ch.round_overhead,
                      once=ch.scale * ch._switch(name), plain=ch.plain_cost)
    return name, k


ch.choose = pricing_choose
rounds = defaultdict(list)
step = engine.AutoDecoder.step


def timed_step(self, budget):
    t0 = time.perf_counter()
    out = step(self, budget)
    if self.last_round == "spec" and priced:
        rounds[priced["name"].split("@")[0]].append(dict(priced, n=len(out), wall=time.perf_counter() - t0))
    priced.clear()
    return out


engine.AutoDecoder.step = timed_step
for r in range(reps):
    for c in ids:
        glimmer_mlx.generate(m, ids[c], max_tokens=96, temperature=T, seed=r, drafter=auto)
print("T", T, "chosen", ch.summary()["chosen"])
for name, xs in sorted(rounds.items()):
    def mean(key):
        return statistics.mean(x[key] for x in xs)
    print(f"{name:12s} rounds {len(xs):4d}  tokens expected {mean('E'):.2f} committed {mean('n'):.2f} | ms priced: "
          f"draft {1e3 * mean('draft'):.1f} + verify {1e3 * mean('verify'):.1f} + overhead {1e3 * mean('over'):.1f} "
          f"= {1e3 * (mean('draft') + mean('verify') + mean('over')):.1f} (+ once {1e3 * mean('once'):.1f}), "
          f"step wall {1e3 * mean('wall'):.1f} | plain token {1e3 * mean('plain'):.2f}")
