"""How far token trees can lift τ at T = 1 with a given DFlash drafter (issue 23): per reached node, the probability
that the walk goes on past it, under lossless acceptance rules with K candidates per node.

At every node SpecInfer's recursive rejection emits a token distributed exactly as the target's p; the walk goes on
iff that token is one of the node's children. With the drafter's row q for the node's children:
  chain  (K = 1, one child drawn from q)              Σ min(p, q)
  drawn+PM (the shipped T > 0 scheme: the drawn child first, then the K − 1 likeliest other tokens of q as point
           masses, tried against the residual normalize(max(0, p − q)))
  PM+tail  (the K − 1 likeliest tokens as point masses first, then one child drawn from q without them)
  PM     (the K likeliest tokens of q as point masses: p of the set)
The rows come from the drafter's own chain rounds (embedded target, first prompt per category, T = 1, seeds 0 and
1, 96 tokens): every node the walk reached, its target row p and the q row its child was drawn from. Then, with the
per-depth means, the τ of an unbounded tree giving K candidates to every node it reaches (depth d's rate c_d:
τ = 1 + c_0 + c_0·c_1 + …, rates treated as independent) next to the chain's — what no 16-row tree can exceed by
much with this drafter.

    python benchmarks/tree_t1_coverage.py            the session's DFlash drafter (DFlash 2)
    TREE_DRAFTER=v1 python benchmarks/tree_t1_coverage.py    the embedded v1 drafter
"""
import json
import os
import sys

import mlx.core as mx
import numpy as np

import glimmer_mlx
import glimmer_mlx.speculative.engine as engine
from glimmer_mlx.runtime.loop import GenerationStats, collect, stop_ids, stream
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.engine import TreeDecoder

s = load_session(None)
m, tok, d = s.model, s.tokenizer, s.drafters.dflash
if os.environ.get("TREE_DRAFTER") == "v1":
    d = glimmer_mlx.load_drafter("glimmer_mlx/embedded/glimmer-tiny-dflash", m)
nodes = []  # (depth, p, q)
verify = engine.verify_tree_sampling


def recording(p_lp, tree, q, sampler):
    path, nxt = verify(p_lp, tree, q, sampler)
    p = np.exp(np.array(p_lp.astype(mx.float32), dtype=np.float64))
    for j in [0] + path:
        kids = tree.children[j]
        if kids and q is not None and q[kids[0]] is not None:
            nodes.append((tree.depths[j], p[j], np.exp(np.array(q[kids[0]].reshape(-1).astype(mx.float32),
                                                                dtype=np.float64))))
    return path, nxt


engine.verify_tree_sampling = recording
prompts = json.load(open("glimmer_mlx/bench/prompts/prompts.json"))
eos = stop_ids(m, tok)
for cat in [c for c in prompts if isinstance(prompts[c], list)]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompts[cat][0]}], add_generation_prompt=True,
                                  tokenize=True)
    for seed in (0, 1):
        st = GenerationStats()
        # budget = depth = the block's drafts: the tree is the drafter's chain round
        dec = TreeDecoder(m, d, Sampler(SamplingParams(temperature=1.0), seed), d.max_drafts, d.max_drafts)
        collect(stream(dec, ids, max_tokens=96, eos=eos, stats=st), st, False)


def go_on(p, q, K):
    """(chain, drawn+PM, PM+tail, PM) probabilities of going on past a node with K candidates."""
    order = np.argsort(-q, kind="stable")
    overlap = np.minimum(p, q)
    chain = overlap.sum()
    res = np.maximum(p - q, 0.0)
    res = res / res.sum() if res.sum() > 0 else res
    drawn_pm = chain
    if K > 1:
        rejected = q - overlap  # P(x drawn and rejected) per x
        for x in np.flatnonzero(rejected > 1e-12):
            others = [t for t in order[:K] if t != x][: K - 1]
            drawn_pm += rejected[x] * res[others].sum()
    S = order[: K - 1]
    pS = p[S].sum()
    rest = np.ones_like(p, dtype=bool)
    rest[S] = False
    pr, qr = p * rest, q * rest
    tail = np.minimum(pr / pr.sum(), qr / qr.sum()).sum() if pr.sum() > 0 and qr.sum() > 0 else 0.0
    return chain, drawn_pm, pS + (1 - pS) * tail, p[order[:K]].sum()


depths = sorted({dd for dd, _, _ in nodes})
out = {"drafter": d.source, "nodes": len(nodes), "per_depth_nodes": {}, "rates": {}, "tau_unbounded": {}}
print(f"{d.source}: {len(nodes)} reached nodes")
for K in (1, 2, 4, 8):
    rates = {dd: np.mean([go_on(p, q, K) for de, p, q in nodes if de == dd], axis=0) for dd in depths
             if sum(1 for de, _, _ in nodes if de == dd) >= 10}
    taus = []
    for scheme in range(4):
        t, run = 1.0, 1.0
        for dd in sorted(rates):
            run *= rates[dd][scheme]
            t += run
        taus.append(t)
    out["rates"][K] = {int(dd): [round(float(x), 4) for x in v] for dd, v in rates.items()}
    out["tau_unbounded"][K] = dict(zip(("chain", "drawn_pm", "pm_tail", "pm"), [round(x, 3) for x in taus]))
    print(f"K={K}: root chain {rates[0][0]:.3f} drawn+PM {rates[0][1]:.3f} PM+tail {rates[0][2]:.3f} PM "
          f"{rates[0][3]:.3f} | unbounded-tree tau chain {taus[0]:.2f} drawn+PM {taus[1]:.2f} PM+tail {taus[2]:.2f} "
          f"PM {taus[3]:.2f}")
out["per_depth_nodes"] = {int(dd): sum(1 for de, _, _ in nodes if de == dd) for dd in depths}
name = "v1" if os.environ.get("TREE_DRAFTER") == "v1" else "default"
path = f"benchmarks/results/issue23-t1-coverage-{name}.json"
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", path)
