"""MTP chain vs MTP tree on the embedded glimmer-tiny (its own MTP layer), greedy and T=1: τ (tokens / round)."""
import json
import glimmer_mlx
from glimmer_mlx.embedded import resolve_model
from glimmer_mlx.speculative.mtp import load_mtp
m, tok = glimmer_mlx.load(resolve_model(None, "target"))
d = load_mtp(resolve_model(None, "mtp"), m)
prompts = json.load(open("glimmer_mlx/bench/prompts/prompts.json"))
for temp in (0.0, 1.0):
    for depth, tree in ((6, None), (9, None)):
        toks = rounds = 0
        for cat in prompts:
            for p in prompts[cat][:1]:
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
                r = glimmer_mlx.generate(m, ids, max_tokens=64, temperature=temp, seed=0, drafter=d, block_size=depth, tree=tree)
                toks += len(r.tokens); rounds += r.stats.extra["rounds"]
        print(f"T={temp} depth {depth} tree {tree}: tau {toks / rounds:.3f}", flush=True)
