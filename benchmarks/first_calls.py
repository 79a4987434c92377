"""What a shape's first forward costs next to its second (issue 24's kernel-build stalls; issues 20 and 23): MLX's CUDA
back-end compiles kernels on first use, so the first step of a shape can cost seconds where the next costs ms. In a
fresh process (no calibration run in it), on the trained tiny set (TREE_SET=DIR: `bench_tiny_set.py`'s) or the
embedded model: a plain step, chain verifies of 2..16 rows, a DFlash token tree of 16 and 32 rows (its tree-masked
forward), the DFlash drafter's round and tree round, and a batch step of 1 and 2 rows x 1 and x 16 positions
(`BatchKVCache`). Each timed twice, evaluated, milliseconds:

    python benchmarks/first_calls.py                 the embedded model
    TREE_SET=DIR python benchmarks/first_calls.py    the trained tiny set
"""
import os
import time

import mlx.core as mx

from glimmer_mlx.cache import make_batch_cache, rewind_cache
from glimmer_mlx.runtime.prefill import prefill
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session

SET = os.environ.get("TREE_SET")
s = load_session(f"{SET}/target", draft_model=f"{SET}/dflash") if SET else load_session(None)
m, d = s.model, s.drafters.dflash
ids = [2 + i % 50 for i in range(100)]
cache = m.make_cache()
_, taps = prefill(m, cache, ids, taps=d.taps)
mx.eval(taps)
rows = []


def timed(name, f):
    out = []
    for _ in range(2):
        t = time.perf_counter()
        f()
        out.append(1e3 * (time.perf_counter() - t))
    rows.append((name, *out))
    print(f"{name:34s} first {out[0]:9.2f} ms   second {out[1]:8.2f} ms", flush=True)


def forward(L, tree=None):
    def f():
        out = m(mx.array([ids[:L]], dtype=mx.int32), cache, taps=d.taps, tree=tree)
        mx.eval(out)
        rewind_cache(cache, L)
    return f


timed("plain step (1 row)", forward(1))
for L in (2, 4, 8, 9, 16):
    timed(f"chain verify {L} rows", forward(L))
sampler = Sampler(SamplingParams())
d.enable_trees()
for budget in (15, 31):
    def tree_round(budget=budget):
        d.start([t for t in taps], ids + [ids[-1]])
        tree, _ = d.propose_tree(ids[-1], len(ids), d.max_drafts, budget, sampler, ids + [ids[-1]])
        mx.eval(m(mx.array([tree.tokens], dtype=mx.int32), cache, taps=d.taps, tree=tree.attention_inputs()))
        rewind_cache(cache, len(tree))
    timed(f"DFlash tree round {budget + 1} rows", tree_round)


def draft():
    d.start([t for t in taps], ids + [ids[-1]])
    d.propose(ids[-1], len(ids), d.max_drafts, sampler, ids + [ids[-1]])


timed("DFlash chain draft", draft)
for B, L in ((1, 1), (1, 16), (2, 1), (2, 16)):
    def batch_step(B=B, L=L):
        layout, bc = make_batch_cache(m.args)
        for _ in range(B):
            b = layout.append(cache[0].offset)
            for c, sc in zip(bc, cache):
                c.put_row(b, sc)
        mx.eval(m(mx.array([ids[:L]] * B, dtype=mx.int32), bc, taps=d.taps))
    timed(f"batch step {B} x {L}", batch_step)
