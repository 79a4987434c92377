"""How often `auto`'s plain rounds ask the chooser (issue 20): the embedded set, the shipped prompts (2 per category,
chat template, 64 tokens, seed 1), T = 0 and 1, one session; `old` asks afresh every round (no held plain verdict).
Per plain round: the chooser's `relevant` / `pick` calls and the n-gram look-ups (`peek`). Counts, not times:
independent of the machine's load. Usage: python benchmarks/auto_plan_count.py old|new"""
import sys
from collections import Counter

import ab_setup  # noqa: F401  (sets GLIMMER_MLX_AUTO_LEARNED=off: every auto here starts cold)
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto import chooser as ch
from glimmer_mlx.speculative.auto import multiplex
from glimmer_mlx.speculative.ngram import NGramDrafter

old = sys.argv[1] == "old"
if old:
    multiplex.AutoDrafter._held = lambda self, k, regime: False
calls = Counter()


def counting(cls, name):
    real = getattr(cls, name)

    def wrapped(*a, **k):
        calls[name] += 1
        return real(*a, **k)

    setattr(cls, name, wrapped)


for cls, name in ((ch.AutoChooser, "relevant"), (ch.AutoChooser, "pick"), (ch.AutoChooser, "count_plain"),
                  (NGramDrafter, "peek")):
    counting(cls, name)
s = load_session(None)
P = load_prompts()
tok = s.tokenizer
for temp in (0.0, 1.0):
    calls.clear()
    for c in P:
        for p in P[c][:2]:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            s.generate(ids, mode="auto", max_tokens=64, temperature=temp, seed=1)
    n = calls["count_plain"]
    print(sys.argv[1], "T", temp, "plain rounds", n, "per plain round: relevant %.2f, pick %.2f, n-gram peek %.2f"
          % (calls["relevant"] / n, calls["pick"] / n, calls["peek"] / n))
