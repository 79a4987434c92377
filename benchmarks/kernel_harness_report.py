"""Harness figures for BENCHMARKS.md: every kernel through the MSL-on-CPU harness (tests/msl_harness) against its
pure-MLX reference on random and edge-case inputs; prints a markdown table and writes JSON.

    python benchmarks/kernel_harness_report.py [--out benchmarks/results/kernels-harness.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from glimmer_mlx.kernels import accept, attention, quantized  # noqa: E402
from msl_harness import harness  # noqa: E402


def softcapped(rng, rows, V):
    z = rng.standard_normal((rows, V)).astype(np.float32) * 6
    return np.tanh(z / 20) * 20


def probs(rng, rows, V, keep=None):
    z = rng.standard_normal((rows, V)).astype(np.float32) * 3
    if keep:
        z = np.where(z >= np.sort(z, -1)[:, -keep][:, None], z, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def greedy_rows(rng):
    out = []
    for V, dt in [(1000, mx.float32), (4099, mx.float32), (777, mx.bfloat16), (333, mx.float16), (50000, mx.float32)]:
        for k, n_match in [(0, 0), (15, 15), (15, 0), (7, 3), (3, 3)]:
            x = softcapped(rng, k + 1, V)
            sel = x.argmax(-1)
            d = [int(sel[j]) if j < n_match else int((sel[j] + 1) % V) for j in range(k)]
            xm = mx.array(x).astype(dt)
            sel = harness.run(accept.greedy_argmax_call(xm))[0]
            got = tuple(int(v) for v in accept.accept_from_argmax(sel, d).tolist())
            out.append(got == accept.greedy_accept_reference(xm, d))
    return out


def rejection_rows(rng):
    out, paths = [], set()
    for V in (1000, 3001, 50000):
        for k in (0, 1, 5, 15):
            for trial in range(4):
                p = probs(rng, k + 1, V, keep=20 if trial == 3 else None)
                q = probs(rng, max(k, 1), V, keep=20 if trial == 3 else None)
                if trial == 1:  # q close to p: long accepted prefixes, bonus draws
                    q = p[:max(k, 1)].copy()
                d = [int(rng.choice(V, p=q[j] / q[j].sum())) for j in range(k)]
                u = rng.random(k + 1).astype(np.float32)
                with np.errstate(divide="ignore"):  # the kernel takes log-probs (zeros → -inf)
                    lp, lq = np.log(p), np.log(q)
                args = (mx.array(lp), mx.array(lq) if k else None, d, mx.array(u))
                ref = accept.rejection_accept_reference_logprobs(*args)
                paths.add(ref[0] == k)
                got = harness.run(accept.rejection_accept_logprobs_call(*args))[0]
                out.append(tuple(int(v) for v in got.tolist()) == ref)
    return out, paths


def attention_rows(rng):
    errs = {}
    cases = [(4, 2, 16, 300, 64, None, mx.float32), (4, 1, 5, 137, 64, 40, mx.float32),
             (2, 2, 16, 40, 64, 8, mx.float32), (4, 2, 1, 90, 64, None, mx.float32),
             (4, 2, 8, 260, 128, 2048, mx.bfloat16), (4, 4, 16, 100, 64, 16, mx.float16),
             (8, 2, 16, 1500, 128, 1024, mx.float32)]
    for Hq, Hkv, L, N, D, window, dt in cases:
        q = mx.array(rng.standard_normal((1, Hq, L, D)).astype(np.float32)).astype(dt)
        k = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dt)
        v = mx.array(rng.standard_normal((1, Hkv, N, D)).astype(np.float32)).astype(dt)
        part, combine = attention.block_attention_calls(q, k, v, scale=D**-0.5, qk=N - L, window=window, split=64)
        o_part, ml = harness.run(part)
        got = harness.run(combine(o_part, ml))[0][None]
        ref = attention.block_attention_reference(q, k, v, scale=D**-0.5, qk=N - L, window=window)
        e = float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item())
        errs.setdefault(str(dt).split(".")[-1], []).append(e)
    return errs


def qmm_rows(rng):
    errs = {}
    for M, K, N, bits, gs, dt in [(1, 256, 40, 4, 64, mx.float32), (2, 512, 37, 4, 32, mx.float32),
                                  (7, 384, 21, 8, 128, mx.float32), (16, 256, 18, 4, 64, mx.bfloat16),
                                  (16, 256, 9, 8, 64, mx.float16), (16, 1024, 64, 4, 64, mx.float32)]:
        wf = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(dt)
        w, s, b = mx.quantize(wf, group_size=gs, bits=bits)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dt)
        got = harness.run(quantized.qmm_call(x, w, s, b, group_size=gs, bits=bits))[0]
        ref = quantized.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
        scale = float(mx.abs(ref.astype(mx.float32)).max().item())
        e = float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()) / scale
        errs.setdefault(str(dt).split(".")[-1], []).append(e)
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if harness.find_compiler() is None:
        sys.exit("no C++20 compiler: the harness cannot run")
    rng = np.random.default_rng(0)
    res = {}
    t = time.perf_counter()
    g = greedy_rows(rng)
    res["greedy_accept"] = {"cases": len(g), "identical": sum(g), "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    r, paths = rejection_rows(rng)
    res["rejection_accept"] = {"cases": len(r), "identical": sum(r), "both_paths": len(paths) == 2,
                               "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    a = attention_rows(rng)
    res["block_attention"] = {"cases": sum(len(v) for v in a.values()), "max_abs_err": {k: max(v) for k, v in a.items()},
                              "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    qe = qmm_rows(rng)
    res["qmm_small"] = {"cases": sum(len(v) for v in qe.values()),
                        "max_rel_err": {k: max(v) for k, v in qe.items()}, "seconds": time.perf_counter() - t}
    print("| kernel | cases through the harness | result vs pure-MLX reference | wall s |")
    print("|---|---|---|---|")
    print(f"| greedy_accept | {len(g)} | {sum(g)}/{len(g)} identical (n, token) | {res['greedy_accept']['seconds']:.1f} |")
    print(f"| rejection_accept | {len(r)} | {sum(r)}/{len(r)} identical (n, token), correction and bonus paths | "
          f"{res['rejection_accept']['seconds']:.1f} |")
    print(f"| block_attention (2 passes) | {res['block_attention']['cases']} | max abs err "
          + ", ".join(f"{k} {v:.1e}" for k, v in res["block_attention"]["max_abs_err"].items())
          + f" | {res['block_attention']['seconds']:.1f} |")
    print(f"| qmm_small | {res['qmm_small']['cases']} | max err / max |y| "
          + ", ".join(f"{k} {v:.1e}" for k, v in res["qmm_small"]["max_rel_err"].items())
          + f" | {res['qmm_small']['seconds']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
