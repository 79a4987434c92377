"""n-gram lookup with vs without the overlapping copy (a continuation that reaches the context's end copied on from
itself), fixed `ngram` mode and `auto`, interleaved, one sitting: tokens per round (τ) and generation time as ×
plain. The "trunc" modes draft only what the context holds (the lookup before the overlapping copy). Greedy outputs
are checked identical to plain's.

    python benchmarks/ngram_overlap_ab.py T REPS [MAX_TOKENS]            the embedded model
    AB_SET=DIR python benchmarks/ngram_overlap_ab.py T REPS [MAX_TOKENS]  the trained tiny set (bench_tiny_set.py DIR)
"""
import json
import os
import platform

import glimmer_mlx
from ab_setup import args, session_and_prompts
from glimmer_mlx.speculative.ngram import NGramDrafter, NGramIndex
from glimmer_mlx.strategy import NGRAM_DRAFTS

T, reps, maxt = args()
s, ids, SET = session_and_prompts()
cats = list(ids)
m, d = s.model, s.drafters


class TruncatingIndex(NGramIndex):
    """The lookup before the overlapping copy: a continuation stops at the context's end."""

    def copy(self, start, k):
        return self.tokens[start:start + k]


def truncating(ngram):
    ngram.index.__class__ = TruncatingIndex
    return ngram


def auto_over(trunc):
    first, d._auto = d._auto, None
    try:
        a = d.auto()
    finally:
        d._auto = first
    if trunc:
        truncating(a.drafters["ngram"])
    return a


drafters = {"ar": None, "ngram": d.ngram(), "ngram_trunc": truncating(NGramDrafter(m.args.vocab_size, NGRAM_DRAFTS)), "auto": auto_over(False),
            "auto_trunc": auto_over(True)}
modes = list(drafters)
seconds = {mo: 0.0 for mo in modes}
rounds = {mo: 0 for mo in modes}
tokens = {mo: 0 for mo in modes}
ref = {}
for r in range(reps):
    for ci, c in enumerate(cats):
        shift = (r * len(cats) + ci) % len(modes)
        for mo in modes[shift:] + modes[:shift]:
            res = glimmer_mlx.generate(m, ids[c], max_tokens=maxt, temperature=T, seed=r, drafter=drafters[mo])
            seconds[mo] += res.stats.generation_time
            tokens[mo] += res.stats.generation_tokens
            rounds[mo] += res.stats.extra.get("rounds", res.stats.generation_tokens)
            if T == 0:
                assert res.tokens == ref.setdefault(c, res.tokens), (mo, c)
print(f"T {T} reps {reps} tokens {maxt}" + (f" set {SET}" if SET else " embedded"))
for mo in modes:
    print(f"  {mo:12s} x plain {seconds['ar'] / seconds[mo] * tokens[mo] / tokens['ar']:.3f}   tau "
          f"{tokens[mo] / rounds[mo]:.2f}")
for mo in ("auto", "auto_trunc"):
    print(f"  {mo} chosen:", drafters[mo].chooser.summary()["chosen"])
out = (f"benchmarks/results/issue20g-ngram-overlap-{'tiny-set' if SET else 'embedded'}-t{T:g}.json")
with open(out, "w") as f:
    json.dump({"machine": dict(platform=platform.platform(), cpus=os.cpu_count(), loadavg=os.getloadavg(),
                               ld_preload=os.environ.get("LD_PRELOAD", "")),
               "settings": dict(temperature=T, reps=reps, max_tokens=maxt, set=SET or "embedded"),
               "x_plain": {mo: seconds["ar"] / seconds[mo] * tokens[mo] / tokens["ar"] for mo in modes},
               "tau": {mo: tokens[mo] / rounds[mo] for mo in modes},
               "auto_chosen": {mo: drafters[mo].chooser.summary()["chosen"] for mo in ("auto", "auto_trunc")}},
              f, indent=1)
print("wrote", out)
