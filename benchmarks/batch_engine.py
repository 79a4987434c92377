"""Engine-level continuous batching (issue 24): aggregate tok/s of BatchGenerator with N rows (the shipped prompts
under the chat template, 64 tokens, greedy, EOS honoured), ar rows vs auto rows vs DFlash rows (their blocks drafted
in one drafter forward per step), 3 interleaved repeats; no HTTP.
Usage: python benchmarks/batch_engine.py 1,2,4,8,16 [MODES, default ar,auto,dflash [REPEATS, default 3]]"""
import time, sys
from glimmer_mlx.session import load_session
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest
from glimmer_mlx.strategy import DecodeSpec
from ab_setup import batch_prompts
s = load_session(None)
m, tok = s.model, s.tokenizer
ids = batch_prompts(tok)
ba = s.drafters.batch_auto()
MODES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ar", "auto", "dflash"]
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
def run(mode, N):
    g = BatchGenerator(m, auto=ba)
    for j in range(N):
        d, k = s.drafters.resolve(DecodeSpec(mode)) if mode == "dflash" else (None, None)
        g.add(BatchRequest(ids[j % len(ids)], Sampler(SamplingParams(), j), 64, set(tok.eos_token_ids), tok,
                           auto=mode == "auto", drafter=None if d is None else d.fork(), width=k))
    while g.waiting: g.step()
    t = time.perf_counter(); n = 0; before = dict(ba.steps)
    while len(g):
        for r, c in g.step(): n += len(c.tokens)
    spec = ba.steps["spec"] - before["spec"]
    return n / (time.perf_counter() - t), spec
for N in (int(x) for x in sys.argv[1].split(",")):
    res = {mode: [] for mode in MODES}
    for rep in range(REPS):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):  # balanced order
            res[mode].append(run(mode, N))
    print(N, {k: [round(a, 1) for a, _ in v] for k, v in res.items()}, "auto spec steps", [s for _, s in res.get("auto", [])], flush=True)
    if "ar" in res:  # the mean of each mode's tok/s over the repeats, and x ar
        means = {k: sum(a for a, _ in v) / len(v) for k, v in res.items()}
        print("  mean tok/s", {k: round(v, 1) for k, v in means.items()}, "x ar", {k: round(v / means["ar"], 3) for k, v in means.items()}, flush=True)
