"""`glimmer bench kernels`: µs per call of each custom kernel vs its pure-MLX reference vs stock MLX, at
k+1 ∈ {1, 2, 4, 8, 16} rows and (attention) context lengths {1k, 8k, 32k}, with Muse Glimmer's shapes.

Without Metal the kernel column is not measured (the function says why) — the reference and stock paths are
still timed, which is what a CPU user runs.

Paths compared
- accept_greedy:    kernel | reference (argmax + prefix compare in one MLX graph, one host read) |
                    stock (the previous verifier: `argmax(...).tolist()` and a Python compare)
- accept_sampling:  kernel (over exp(log-probs)) | reference (from log-probs, integer inverse CDF, one host
                    read) |
                    stock (the previous verifier: log-ratio test, host read of n, `mx.random.categorical`)
- block_attention:  kernel (two passes) | reference (masked float32 softmax) | stock `mx.fast.scaled_dot_product_attention`
- qmm:              kernel | reference (dequantize + matmul) | stock `mx.quantized_matmul`
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from ..kernels import accept, attention, metal_available, quantized
from ..machine import machine_info

KERNELS = ("accept_greedy", "accept_sampling", "block_attention", "qmm")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _time(fn, repeats: int, warmup: int) -> float:
    """Median µs per call; `fn` must synchronise (return host values or evaluate its outputs)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _stock_greedy(logits, drafts):
    sel = mx.argmax(logits, axis=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == sel[n]:
        n += 1
    return n, sel[n]


def _stock_sampling(p_lp, q_lp, drafts, u, key):
    """The verifier before the kernels (same acceptance uniforms, so the same path is taken)."""
    k = len(drafts)
    k1, k2 = mx.random.split(key)
    if k == 0:
        return 0, int(mx.random.categorical(p_lp[0], key=k1).item())
    d = mx.array(drafts, dtype=mx.int32)[:, None]
    lp = mx.take_along_axis(p_lp[:k], d, axis=-1)[:, 0]
    lq = mx.take_along_axis(q_lp, d, axis=-1)[:, 0]
    u = u[:k]
    n = int(mx.sum(mx.cumprod((mx.log(u) <= lp - lq).astype(mx.int32))).item())
    if n == k:
        return n, int(mx.random.categorical(p_lp[k], key=k2).item())
    residual = mx.maximum(mx.exp(p_lp[n]) - mx.exp(q_lp[n]), 0.0)
    logits = mx.where(mx.sum(residual) > 0, mx.log(residual), p_lp[n])
    return n, int(mx.random.categorical(logits, key=k2).item())


def run_kernel_bench(*, rows=(1, 2, 4, 8, 16), contexts=(1024, 8192, 32768), kernels=KERNELS, vocab: int = 202048,
                     heads: int = 32, kv_heads: int = 2, head_dim: int = 128, window: int | None = None,
                     in_features: int = 6656, out_features: int = 4096, bits: int = 4, group_size: int = 64,
                     dtype: str = "bfloat16", repeats: int = 20, warmup: int = 3, seed: int = 0,
                     progress=None) -> dict:
    """Time every requested (kernel, rows[, context]) for the kernel / reference / stock paths. Returns a dict with
    the machine, the settings, `metal` (whether kernel figures were measured, and why not) and `results` rows
    {kernel, rows, context, kernel_us, reference_us, stock_us}."""
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
    if any(not 1 <= r <= 16 for r in rows):
        raise ValueError("rows (k+1) must be in 1..16")
    dt = DTYPES[dtype]
    have_metal = metal_available()
    rng = np.random.default_rng(seed)
    results = []

    def note(msg):
        if progress:
            progress(msg)

    def add(kernel, r, ctx, kfn, rfn, sfn):
        note(f"{kernel} rows={r}" + (f" context={ctx}" if ctx else ""))
        results.append({
            "kernel": kernel, "rows": r, "context": ctx,
            "kernel_us": _time(kfn, repeats, warmup) if have_metal else None,
            "reference_us": _time(rfn, repeats, warmup),
            "stock_us": _time(sfn, repeats, warmup),
        })

    for r in rows:
        k = r - 1
        if "accept_greedy" in kernels:
            z = rng.standard_normal((r, vocab)).astype(np.float32) * 6
            logits = mx.array(np.tanh(z / 20) * 20)
            sel = logits.argmax(-1).tolist()
            drafts = sel[:k]  # all accepted: every row is read (the kernel's worst case)
            mx.eval(logits)
            add("accept_greedy", r, None,
                lambda: tuple(accept.greedy_accept_call(logits, drafts).run_metal()[0].tolist()),
                lambda: accept.greedy_accept_reference(logits, drafts),
                lambda: _stock_greedy(logits, drafts))
        if "accept_sampling" in kernels:
            z = mx.array(rng.standard_normal((r, vocab)).astype(np.float32) * 3)
            p_lp = z - mx.logsumexp(z, axis=-1, keepdims=True)
            q_lp = (p_lp[:k] + mx.array(rng.standard_normal((k, vocab)).astype(np.float32)) * 0.3) if k else None
            if k:
                q_lp = q_lp - mx.logsumexp(q_lp, axis=-1, keepdims=True)
            drafts = mx.random.categorical(q_lp, key=mx.random.key(seed)).tolist() if k else []
            u = mx.random.uniform(shape=(r,), key=mx.random.key(seed + 1))
            mx.eval(p_lp, u, *([q_lp] if k else []))
            # as the verifier runs it: probabilities from the processed log-probs, then the acceptance
            add("accept_sampling", r, None,
                lambda: tuple(accept.rejection_accept_call(mx.exp(p_lp), mx.exp(q_lp) if k else None, drafts, u)
                              .run_metal()[0].tolist()),
                lambda: accept.rejection_accept_reference_logprobs(p_lp, q_lp, drafts, u),
                lambda: _stock_sampling(p_lp, q_lp, drafts, u, mx.random.key(seed + 2)))
        if "qmm" in kernels:
            wf = mx.array(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02).astype(dt)
            w, s, b = mx.quantize(wf, group_size=group_size, bits=bits)
            x = mx.array(rng.standard_normal((r, in_features)).astype(np.float32)).astype(dt)
            mx.eval(w, s, b, x)
            add("qmm", r, None,
                lambda: mx.eval(quantized.qmm_call(x, w, s, b, group_size=group_size, bits=bits).run_metal()[0]),
                lambda: mx.eval(quantized.qmm_reference(x, w, s, b, group_size=group_size, bits=bits)),
                lambda: mx.eval(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)))
        if "block_attention" in kernels:
            for n in contexts:
                q = mx.array(rng.standard_normal((1, heads, r, head_dim)).astype(np.float32)).astype(dt)
                kk = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32)).astype(dt)
                vv = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32)).astype(dt)
                scale, qk = head_dim**-0.5, n - r
                mask = attention.block_mask(r, n, qk, window) if r > 1 or window else None
                mx.eval(q, kk, vv, *([mask] if mask is not None else []))

                def kern(q=q, kk=kk, vv=vv, qk=qk):
                    part, combine = attention.block_attention_calls(q, kk, vv, scale=scale, qk=qk, window=window)
                    o_part, ml = part.run_metal()
                    mx.eval(combine(o_part, ml).run_metal()[0])

                add("block_attention", r, n, kern,
                    lambda q=q, kk=kk, vv=vv, qk=qk: mx.eval(
                        attention.block_attention_reference(q, kk, vv, scale=scale, qk=qk, window=window)),
                    lambda q=q, kk=kk, vv=vv, mask=mask: mx.eval(
                        mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask=mask)))
    return {
        "machine": machine_info(),
        "settings": {"rows": list(rows), "contexts": list(contexts), "kernels": list(kernels), "vocab": vocab,
                     "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "window": window,
                     "in_features": in_features, "out_features": out_features, "bits": bits,
                     "group_size": group_size, "dtype": dtype, "repeats": repeats, "warmup": warmup},
        "metal": {"available": have_metal,
                  "note": None if have_metal else "no Metal back-end (mx.metal.is_available() is False): kernel "
                                                  "figures are not measured on this machine; run on an Apple GPU"},
        "results": results,
    }


def render_kernel_table(res: dict):
    """The results of `run_kernel_bench` as one rich Table."""
    from rich.table import Table

    t = Table(title="µs per call (median) — kernel vs reference vs stock MLX")
    for col in ("kernel", "k+1", "context", "Metal kernel", "reference", "stock MLX", "stock/kernel"):
        t.add_column(col, justify="left" if col == "kernel" else "right")

    def fmt(v):
        return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"

    for row in res["results"]:
        ratio = (f"{row['stock_us'] / row['kernel_us']:.2f}×" if row["kernel_us"] else "—")
        t.add_row(row["kernel"], str(row["rows"]), "" if row["context"] is None else f"{row['context']:,}",
                  fmt(row["kernel_us"]) if res["metal"]["available"] else "not measured",
                  fmt(row["reference_us"]), fmt(row["stock_us"]), ratio)
    return t
