"""auto vs plain decoding, interleaved, long (issue 20): the embedded model, the first prompt of each shipped category
under the chat template, MAX_TOKENS tokens, REPS repeats with the mode order alternating per repeat; per category
the median seconds per generated token, and auto's choices. Greedy outputs are checked identical to plain's.

    python benchmarks/auto_vs_plain_ab.py T REPS [MAX_TOKENS [MODES]]     e.g. 1 12 96
"""
import sys, statistics
import glimmer_mlx
from glimmer_mlx.session import load_session
from glimmer_mlx.bench.settings import load_prompts
T = float(sys.argv[1]); reps = int(sys.argv[2]) if len(sys.argv) > 2 else 4; maxt = int(sys.argv[3]) if len(sys.argv) > 3 else 96
modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["ar", "auto"]
s = load_session(None); m, tok = s.model, s.tokenizer
P = load_prompts(); cats = list(P)
ids = {c: tok.apply_chat_template([{"role": "user", "content": P[c][0]}], add_generation_prompt=True, tokenize=True) for c in cats}
auto = s.drafters.auto()
drafter = {"ar": None, "auto": auto, "dflash": s.drafters.dflash, "ngram": s.drafters.ngram(), "mtp": s.drafters.mtp}
times = {mo: {c: [] for c in cats} for mo in modes}
toks = {}
for r in range(reps):
    for c in cats:
        for mo in (modes if r % 2 == 0 else modes[::-1]):
            res = glimmer_mlx.generate(m, ids[c], max_tokens=maxt, temperature=T, seed=r, drafter=drafter[mo],
                                       block_size=8 if mo == "dflash" else None)
            times[mo][c].append(res.stats.generation_time / res.stats.generation_tokens)
            if T == 0: toks.setdefault(c, res.tokens); assert res.tokens == toks[c], (mo, c)
out = {}
for c in cats:
    b = statistics.median(times["ar"][c])
    out[c] = {mo: round(b / statistics.median(times[mo][c]), 3) for mo in modes}
tot = {mo: sum(statistics.median(times[mo][c]) for c in cats) for mo in modes}
print("T", T, "x plain by category", out)
print("all", {mo: round(tot["ar"] / tot[mo], 3) for mo in modes}, "ar ms/token %.2f" % (1e3 * tot["ar"] / len(cats)))
print("auto chosen", auto.chooser.summary()["chosen"])
