"""DFlash chain vs DFlash tree at equal verify rows (issue 23) on the embedded glimmer-tiny + its DFlash drafter.

Verify rows R = the target forward's rows per round: a chain of R - 1 drafts (anchor + drafts), or a tree of R - 1
draft nodes (anchor + nodes) at several depths (8, 16 and 32 rows; no 32-row chain: the drafter's block is 16), and
`auto` over this DFlash drafter alone (plain, any chain width or its 16-row tree per round; its choices are kept). Per category of glimmer_mlx/bench/prompts/prompts.json (the first N
prompts, chat template), greedy and T = 1 (seed 0): tau = committed tokens / rounds (the engine's stats, the
prefill's token counted as a round as everywhere else) and tok/s; plus the verify cost curve of the same run (one
target forward of n rows — chain and tree mask — after the prompt, relative to a plain 1-row step).

    python benchmarks/tree_dflash.py [N_PROMPTS] [MAX_TOKENS]   -> benchmarks/results/issue23-dflash-trees.json
    TREE_SET=DIR python benchmarks/tree_dflash.py ...   the trained tiny set (benchmarks/bench_tiny_set.py DIR; block 8:
        no 16-row chain, tree paths <= 7 deep) -> ...issue23-dflash-trees-tiny-set*.json
    python benchmarks/tree_dflash.py N MAXT SEEDS CONFIGS   (e.g. 2 96 1,2,3 chain16,tree16_d4,tree16_d8: T = 1 only,
        those seeds and configs, no cost curve) -> benchmarks/results/issue23-dflash-trees-t1-seeds.json

Environment: TREE_DRAFTER=v1 — the embedded v1 drafter (glimmer_mlx/embedded/glimmer-tiny-dflash) instead of the
session's default (DFlash 2); TREE_SCORING=calibrated|draft|both — how DFlash trees are grown (`dflash` module
docstring; default: the drafter's own, "calibrated"); "both" runs every tree config twice, the "draft" scheme's
named treeR_dD_draft; TREE_CONFIGS=a,b,… — only those configs, both temperatures (no cost curve; include
"plain" for the greedy identity check); TREE_BLEND=x — the drafter's `tree_blend`; TREE_CALIBRATED_SAMPLING=1 —
calibrated trees at T > 0 too (`tree_calibrated_sampling`; off by default); TREE_OUT=PATH — the results file.
The rank statistics of calibrated trees carry over the runs of one temperature (as in a session).
"""
import copy
import json
import os
import platform
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np

import ab_setup  # noqa: F401  (sets GLIMMER_MLX_AUTO_LEARNED=off: every auto here starts cold)
from glimmer_mlx.cache import rewind_cache
from glimmer_mlx.runtime.loop import GenerationStats, collect, stop_ids, stream
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto import make_auto
from glimmer_mlx.speculative.engine import SpeculativeDecoder, TreeDecoder
from glimmer_mlx.speculative.tree import TokenTree
from glimmer_mlx.strategy import make_decoder

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1
MAXT = int(sys.argv[2]) if len(sys.argv) > 2 else 96
SEEDS = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0]
ONLY = sys.argv[4].split(",") if len(sys.argv) > 4 else None
TEMPS = (1.0,) if len(sys.argv) > 3 else (0.0, 1.0)
OUT = ("benchmarks/results/issue23-dflash-trees-t1-seeds.json" if len(sys.argv) > 3
       else "benchmarks/results/issue23-dflash-trees.json")

SET = os.environ.get("TREE_SET")  # a trained tiny set's folder (benchmarks/bench_tiny_set.py) instead of the embedded
if SET:
    import glimmer_mlx
    from glimmer_mlx.bench.runner import encode_prompts
    from glimmer_mlx.bench.settings import load_prompts

    m, _ = glimmer_mlx.load(f"{SET}/target")
    m.eos_token_ids = set()
    tok, d = None, glimmer_mlx.load_drafter(f"{SET}/dflash", m)
    encoded, _ = encode_prompts(load_prompts(), None, m.args.vocab_size)  # byte fallback, as glimmer bench
    OUT = OUT.replace("issue23-dflash-trees", "issue23-dflash-trees-tiny-set")
else:
    s = load_session(None)
    m, tok, d = s.model, s.tokenizer, s.drafters.dflash
    if os.environ.get("TREE_DRAFTER") == "v1":
        import glimmer_mlx

        d = glimmer_mlx.load_drafter("glimmer_mlx/embedded/glimmer-tiny-dflash", m)
SCORING = os.environ.get("TREE_SCORING")
if SCORING not in (None, "calibrated", "draft", "both"):
    sys.exit(f"TREE_SCORING must be calibrated, draft or both, got {SCORING!r}")
if os.environ.get("TREE_CALIBRATED_SAMPLING"):
    d.tree_calibrated_sampling = os.environ["TREE_CALIBRATED_SAMPLING"] == "1"
if os.environ.get("TREE_BLEND"):
    d.tree_blend = float(os.environ["TREE_BLEND"])
if SCORING in ("calibrated", "draft"):
    d.tree_scoring = SCORING
OUT = os.environ.get("TREE_OUT", OUT)
prompts = json.load(open("glimmer_mlx/bench/prompts/prompts.json"))
cats = [c for c in prompts if isinstance(prompts[c], list)]
eos = stop_ids(m, tok) if tok is not None else set()

# (name, verify rows, tree nodes or None for a chain, max depth)
CONFIGS = [("plain", 1, None, None), ("chain8", 8, None, 7)]
CONFIGS += [(f"tree8_d{dp}", 8, 7, dp) for dp in (2, 3, 4, 5)]
CONFIGS += [("chain16", 16, None, 15)]
CONFIGS += [(f"tree16_d{dp}", 16, 15, dp) for dp in (3, 4, 6, 8)]
# 32 rows: no chain (the drafter's block is 16: at most 15 drafts); trees of 31 nodes
CONFIGS += [(f"tree32_d{dp}", 32, 31, dp) for dp in (6, 8)]
# auto over this DFlash drafter alone (plain, a chain of any width, or its 16-row tree, chosen per round)
CONFIGS += [("auto", 0, None, None)]
ONLY = ONLY or (os.environ["TREE_CONFIGS"].split(",") if os.environ.get("TREE_CONFIGS") else None)
if ONLY:
    CONFIGS = [c for c in CONFIGS if c[0] in ONLY]
# a chain deeper than the drafter's block cannot run; a tree's paths are capped at the block's drafts
CONFIGS = [c for c in CONFIGS if c[2] is not None or c[3] is None or c[3] <= d.max_drafts]
CONFIGS = [(n, r, nd, dp if dp is None or nd is None else min(dp, d.max_drafts)) for n, r, nd, dp in CONFIGS]
if SCORING == "both":
    CONFIGS = [c for cfg in CONFIGS for c in ([cfg] + ([(cfg[0] + "_draft",) + cfg[1:]] if cfg[2] else []))]


def ids_of(p):
    if tok is None:
        return next(e for c in cats for q, e in zip(prompts[c], encoded[c]) if q == p)
    return tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)


AUTO_SUMMARY = {}  # "T0" | "T1" -> the summary of that temperature's auto after its last run (its cost model)
AUTO = {}  # temperature -> its auto (what it learns carries over that temperature's prompts, as in a session)


def decoder(name, rows, nodes, depth, sampler):
    if rows == 0:
        t = sampler.params.temperature
        if t not in AUTO:
            AUTO[t] = make_auto(m, dflash=copy.copy(d), ngram=False)
        return make_decoder(m, AUTO[t], sampler)
    if rows == 1:
        return make_decoder(m, None, sampler)
    if nodes is None:
        return SpeculativeDecoder(m, d, sampler, depth)
    d.tree_scoring = "draft" if name.endswith("_draft") else SCORING if SCORING in ("calibrated", "draft") \
        else "calibrated"
    return TreeDecoder(m, d, sampler, nodes, depth)


def run(cfg, ids, temp, seed=0, max_tokens=MAXT):
    name, rows, nodes, depth = cfg
    st = GenerationStats()
    dec = decoder(name, rows, nodes, depth, Sampler(SamplingParams(temperature=temp), seed))
    t = time.perf_counter()
    r = collect(stream(dec, ids, max_tokens=max_tokens, eos=eos, stats=st), st, False)
    dt = time.perf_counter() - t
    rounds = st.extra.get("rounds", len(r.tokens))
    chosen = st.extra.get("auto", {}).get("chosen")
    if chosen:
        AUTO_SUMMARY[f"T{temp:g}"] = st.extra["auto"]  # cumulative: the last run's is that temperature's whole
    return dict(tokens=len(r.tokens), rounds=rounds, seconds=dt, gen_tps=st.generation_tokens / st.generation_time
                if st.generation_time else 0.0, mean_tree_rows=st.extra.get("mean_tree_rows"),
                tree_rounds=st.extra.get("tree_rounds", 0), auto_chosen=chosen), r.tokens


def verify_curve(ids, sizes=(1, 2, 4, 8, 16, 24, 32), reps=15):
    """Median seconds of one target forward of n rows after the prompt: chain and a bushy tree of n nodes."""
    cache = m.make_cache(max_rewind=64)
    m(mx.array([ids[:-1]], dtype=mx.int32), cache)
    mx.eval([c.keys for c in cache if getattr(c, "keys", None) is not None])
    out = {}
    for n in sizes:
        toks = mx.array([ids[-1:] + ids[:n - 1]], dtype=mx.int32)
        tree = TokenTree([ids[-1]] + list(range(1, n)), [-1] + [(i - 1) // 3 for i in range(1, n)])
        row = {}
        for kind in ("chain", "tree"):
            ts = []
            for _ in range(reps + 2):
                t = time.perf_counter()
                y = m(toks, cache, tree=tree.attention_inputs() if kind == "tree" and n > 1 else None)
                mx.eval(y)
                ts.append(time.perf_counter() - t)
                rewind_cache(cache, n)
            row[kind] = float(np.median(ts[2:]))
        out[n] = row
    base = out[1]["chain"]
    return {n: dict(v, chain_rel=v["chain"] / base, tree_rel=v["tree"] / base) for n, v in out.items()}


results = {"machine": dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                           loadavg_start=os.getloadavg(), mlx=mx.__version__,
                           commit=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                 text=True).stdout.strip()),
           "settings": dict(prompts_per_category=N, max_tokens=MAXT, seeds=SEEDS, drafter=d.source,
                            block_size=d.block_size, tree_top_k=d.tree_top_k,
                            tree_scoring=SCORING or d.tree_scoring, tree_blend=d.tree_blend,
                            tree_calibrated_sampling=d.tree_calibrated_sampling),
           "configs": [dict(name=c[0], rows=c[1], nodes=c[2], depth=c[3]) for c in CONFIGS], "runs": []}
first_ids = ids_of(prompts[cats[0]][0])
for temp in TEMPS:  # warm-up: every config at every temperature (a back-end that compiles kernels on first use,
    for cfg in CONFIGS:  # as MLX's CUDA one does, would otherwise charge that to the first config to use them)
        run(cfg, first_ids, temp, max_tokens=16)
AUTO.clear()  # the measured autos start fresh
if ONLY is None:
    results["verify_cost_curve"] = verify_curve(first_ids)
for temp in TEMPS:
    for cat in cats:
        for pi, p in enumerate(prompts[cat][:N]):
            ids = ids_of(p)
            plain_tokens = None
            for seed in SEEDS:
                for cfg in CONFIGS:
                    rec, tokens = run(cfg, ids, temp, seed)
                    if cfg[0] == "plain":
                        plain_tokens = tokens
                    rec.update(temp=temp, seed=seed, category=cat, prompt=pi, config=cfg[0],
                               same_as_plain=tokens == plain_tokens if temp == 0.0 else None)
                    results["runs"].append(rec)
            line = "  ".join(f"{r['config']} {r['tokens'] / r['rounds']:.2f}" for r in results["runs"][-len(CONFIGS):])
            print(f"T={temp} {cat} {pi}: {line}", flush=True)
results["machine"]["loadavg_end"] = os.getloadavg()

# summary: τ = Σ tokens / Σ rounds, tok/s = Σ tokens / Σ seconds, per (temp, category) and overall
summary = {}
for temp in TEMPS:
    for cat in cats + ["all"]:
        for cfg in CONFIGS:
            rs = [r for r in results["runs"] if r["temp"] == temp and r["config"] == cfg[0]
                  and (cat == "all" or r["category"] == cat)]
            summary[f"T{temp:g}/{cat}/{cfg[0]}"] = dict(
                tau=sum(r["tokens"] for r in rs) / sum(r["rounds"] for r in rs),
                tps=sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs))
results["summary"] = summary
auto_choices = {}  # temp -> {"plain" | "dflash" | "dflash+tree": rounds} over that temperature's auto runs
for r in results["runs"]:
    if r.get("auto_chosen"):  # cumulative counts of that temperature's auto: the last run's are the total
        auto_choices[f"T{r['temp']:g}"] = {}
        for key, c in r["auto_chosen"].items():
            bucket = auto_choices[f"T{r['temp']:g}"]
            bucket[key.split(":")[0]] = bucket.get(key.split(":")[0], 0) + c
results["auto_choices"] = auto_choices
results["auto_summary"] = AUTO_SUMMARY
os.makedirs(os.path.dirname(OUT), exist_ok=True)
with open(OUT, "w") as f:
    json.dump(results, f, indent=1)
for temp in TEMPS:
    print(f"\nT={temp:g}  " + " ".join(f"{c[0]:>15s}" for c in CONFIGS))
    for cat in cats + ["all"]:
        print(f"{cat:8s} tau " + " ".join(f"{summary[f'T{temp:g}/{cat}/{c[0]}']['tau']:15.2f}" for c in CONFIGS))
    print(f"{'all':8s} t/s " + " ".join(f"{summary[f'T{temp:g}/all/{c[0]}']['tps']:15.1f}" for c in CONFIGS))
print("\nauto's rounds by choice:", auto_choices)
if "verify_cost_curve" in results:
    print("\nverify cost (relative to a 1-row step):",
          {n: (round(v["chain_rel"], 2), round(v["tree_rel"], 2)) for n, v in results["verify_cost_curve"].items()})
