"""What a lone request's `auto` chooser predicted for its speculative rounds against what they did (issue 20): plain
decoding and auto alternated over the shipped prompts (`ab_setup.session_and_prompts`: the embedded model, or with
AB_SET=DIR the trained tiny set), REPS repeats of MAX_TOKENS tokens at temperature T, EOS ignored (every run is
MAX_TOKENS long, as `auto_vs_plain_ab.py` has it). For every speculative round whose draft and verify were both timed
as steady ones (no catch-up, no first round at a width), grouped by option, width and whether the round before it
was plain: the round's seconds (draft + verify + the chooser's round overhead) over the chooser's price for it when it
chose it (`AutoChooser._round_costs` × the speed scale), the tokens it committed over the ones its estimates expected,
and the plain token the chooser priced it against, beside what plain decoding's tokens took in the same sitting. A
chooser that prices its rounds well but its plain token high takes rounds that lose; one whose estimates sit low
stays plain where its drafter would pay.

    AB_SET=/tmp/pair3 python benchmarks/auto_predictions.py T REPS [MAX_TOKENS]        e.g. 1 8 96
"""
import collections
import statistics

import ab_setup
import glimmer_mlx
from ab_setup import args, session_and_prompts
from glimmer_mlx.bench.runner import task_order
from glimmer_mlx.speculative.auto.chooser import AutoChooser, expected_tokens

T, reps, maxt = args()
s, ids, _ = session_and_prompts()
m = s.model
m.eos_token_ids = set()
auto = ab_setup.second_auto(s)
ch = auto.chooser
# (option, k, the round before it was speculative) -> [predicted s, actual s, predicted tokens, actual tokens, rounds,
# Σ predicted plain token s]
sums = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0, 0.0])
pending = {}
choose, observe = AutoChooser.choose, AutoChooser._observe_round


def predicting_choose(self, available, regime="greedy", remaining=None, picked=None):
    after_spec = self._spec_last
    name, k = choose(self, available, regime, remaining, picked)
    pending.clear()
    if self is ch and name is not None and k > 0:
        pending["round"] = (name, k, after_spec, self.scale * self._round_costs(name, regime)[k - 1],
                            expected_tokens(self.options[name].alphas(self._key(regime))[:k]), self.plain_cost)
    return name, k


def measured_observe(self, name, k, n_accepted, regime, draft_time, verify_time):
    got = pending.pop("round", None) if self is ch else None
    if got is not None and got[0] == name and got[1] == k and draft_time is not None and verify_time is not None:
        x = sums[got[:3]]
        x[0] += got[3]
        x[1] += draft_time + verify_time + self.scale * max(0.0, self.round_overhead)
        x[2] += got[4]
        x[3] += n_accepted + 1
        x[4] += 1
        x[5] += got[5]
    return observe(self, name, k, n_accepted, regime, draft_time, verify_time)


AutoChooser.choose, AutoChooser._observe_round = predicting_choose, measured_observe
seconds = {"ar": [], "auto": []}
for r in range(reps):
    for ci, c in enumerate(ids):
        for mode in task_order(["ar", "auto"], r * len(ids) + ci):
            res = glimmer_mlx.generate(m, ids[c], max_tokens=maxt, temperature=T, seed=r,
                                       drafter=auto if mode == "auto" else None)
            seconds[mode].append(res.stats.generation_time / res.stats.generation_tokens)
plain = statistics.mean(seconds["ar"])
print(f"T {T} reps {reps} tokens {maxt}: auto {sum(seconds['ar']) / sum(seconds['auto']):.3f}x plain; plain decoding "
      f"{1e3 * plain:.2f} ms a token; auto chose {dict(ch.chosen)}")
print("option k after | rounds | seconds actual/priced | tokens actual/expected | rate/plain expected, actual | "
      "plain priced ms (÷ plain decoding's)")
for (name, k, after_spec), (pc, ac, pt, at, n, pp) in sorted(sums.items()):  # (keys are unique)
    print(f"{name} {k} {'spec' if after_spec else 'plain'} | {n} | {ac / pc:.3f} | {at / pt:.3f} | "
          f"{pt * pp / n / pc:.3f}, {at * plain / ac:.3f} | {1e3 * pp / n:.2f} ({pp / n / plain:.3f})")
