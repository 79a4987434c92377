"""Chain vs tree n-gram lookup on the embedded glimmer-tiny, bench prompts, greedy and T=1, same run."""
import json, sys, time
import glimmer_mlx
from glimmer_mlx.embedded import resolve_model
from glimmer_mlx.speculative.ngram import NGramDrafter
m, tok = glimmer_mlx.load(resolve_model(None, "target"))
prompts = json.load(open("glimmer_mlx/bench/prompts/prompts.json"))
cats = [c for c in prompts if isinstance(prompts[c], list)]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 2
MAXT = 96
def ids_of(p):
    return tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
configs = [("plain", None, None, None), ("chain8", 8, None, None), ("chain16", 16, None, None),
           ("tree8", 8, 8, 4), ("tree16", 16, 16, 8)]
for temp in (0.0, 1.0):
    for cat in cats:
        row = {}
        for name, drafts, tree, depth in configs:
            t_tot = n_tot = rounds = committed = 0
            for p in prompts[cat][:N]:
                ids = ids_of(p)
                d = None if drafts is None else NGramDrafter(m.args.vocab_size, max_drafts=depth or drafts)
                t = time.perf_counter()
                r = glimmer_mlx.generate(m, ids, max_tokens=MAXT, temperature=temp, seed=0, drafter=d, tree=tree)
                t_tot += time.perf_counter() - t
                n_tot += len(r.tokens)
                if d is not None:
                    rounds += r.stats.extra["rounds"]
            row[name] = (n_tot / t_tot, n_tot / rounds if rounds else 1.0)
        print(f"T={temp} {cat:10s} " + "  ".join(f"{k}: {v[0]:6.1f} tok/s τ {v[1]:.2f}" for k, v in row.items()),
              flush=True)
