"""How many target forwards of `auto` compute the drafters' taps (issue 20): the embedded set, the shipped prompts (2
per category, chat template, 64 tokens, seed 1), T = 0 and 1, one session; `old` restores the previous rules (a
plain stretch kept a drafter's taps warm at 1 % over plain, wherever it paid, chosen there or not). Counts, not
times: independent of the machine's load.
Usage: python benchmarks/auto_taps_count.py old|new"""
import sys
import ab_setup  # noqa: F401  (sets GLIMMER_MLX_AUTO_LEARNED=off: every auto here starts cold)
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto import chooser as ch
from glimmer_mlx.bench.settings import load_prompts
old = sys.argv[1] == "old"
if old:
    # the previous bar: MIN_GAIN
    def paying(self, regime="greedy", remaining=None, among=None):
        self.set_horizon(remaining)
        spec_last, self._spec_last = self._spec_last, False
        try:
            bar = (1 + ch.MIN_GAIN) / self.plain_cal
            return frozenset(n for n in self.options if (among is None or n in among)
                             and self._leaders(n, regime)[-1][1] > bar)
        finally:
            self._spec_last = spec_last
    ch.AutoChooser.paying = paying
    ch.AutoChooser.drafted_lately = lambda self, name, regime="greedy": True  # (before the forty-second session)
s = load_session(None)
m = s.model
calls = {"taps": 0, "plain": 0}
orig = type(m).__call__
def counted(self, *a, **k):
    taps = k.get("taps")
    calls["taps" if taps else "plain"] += 1
    return orig(self, *a, **k)
type(m).__call__ = counted
P = load_prompts()
tok = s.tokenizer
for temp in (0.0, 1.0):
    calls.update(taps=0, plain=0)
    for c in P:
        for p in P[c][:2]:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            r = s.generate(ids, mode="auto", max_tokens=64, temperature=temp, seed=1)
    st = r[3].extra["auto"]
    print(sys.argv[1], "T", temp, "forwards with taps", calls["taps"], "without", calls["plain"], "chosen", st["chosen"])
