"""`glimmer bench kernels`: µs per call of each custom kernel vs the built-in MLX path vs our pure-MLX reference, in
the same run, at k+1 ∈ {1, 2, 4, 8, 16} rows and (attention) context lengths {1k, 8k, 32k}, with Muse Glimmer's
shapes; `block_attention_tree` times a token tree of that many nodes (up to 32 when it is the only kernel asked for).

Timing (`kernels.time_calls`): each window issues `calls` calls back to back without a host synchronisation and
evaluates all their outputs once at the end; the median of `windows` windows, divided by `calls`, is reported. So
per-call launch overhead is amortised as in a decode loop, not hidden behind one `tolist()` per call. Every path
returns lazy arrays (the acceptance paths their [2] (n, next) arrays, not Python ints).

Without Metal the kernel column says "no Metal" (and "self-test failed" for a kernel that failed its runtime
self-test); the built-in and reference paths are still timed, which is what a CPU user runs.

Paths compared
- accept_greedy:    kernel (per-row argmax kernel, then n / next from k+1 indices) | built-in (`mx.argmax` of all rows,
                    the previous verifier's device work) | reference (argmax + prefix compare in one MLX graph)
- accept_sampling:  kernel (from log-probs, exp inside) | built-in (the previous verifier's ops: log-ratio test,
                    residual, `mx.random.categorical`, all lazy) | reference (exp of the rows read, integer inverse CDF)
- block_attention:  kernel (two passes) | built-in `mx.fast.scaled_dot_product_attention` with the block mask |
                    reference (masked float32 softmax)
- block_attention_tree: the same three paths for a token tree's nodes (`attention.random_tree(kind="wide")`, seed
                    `seed`: mostly long branches with forks) with the tree mask (`cache.tree_mask`); the kernel is the
                    TREE variant (ancestor bits per row)
- qmm:              kernel | built-in `mx.quantized_matmul` | reference (dequantize + float32 matmul)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels import accept, attention, metal_available, quantized, time_calls, verdict
from ..machine import machine_info

KERNELS = ("accept_greedy", "accept_sampling", "block_attention", "qmm", "block_attention_tree")
REGISTRY_NAME = {"accept_greedy": "greedy_accept", "accept_sampling": "rejection_accept",
                 "block_attention": "block_attention", "qmm": "qmm", "block_attention_tree": "block_attention_tree"}
TREE_KIND = "wide"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def stock_sampling_arrays(p_lp, q_lp, drafts, u, key) -> mx.array:
    """The verifier before the kernels, as lazy MLX ops: log-ratio acceptance with the same uniforms, then the
    residual (or bonus) row drawn by `mx.random.categorical`; [2] int32 (n, token)."""
    k = len(drafts)
    if k == 0:
        return mx.stack([mx.array(0, dtype=mx.int32), mx.random.categorical(p_lp[0], key=key).astype(mx.int32)])
    d = mx.array(drafts, dtype=mx.int32)[:, None]
    lp = mx.take_along_axis(p_lp[:k], d, axis=-1)[:, 0]
    lq = mx.take_along_axis(q_lp, d, axis=-1)[:, 0]
    n = mx.sum(mx.cumprod((mx.log(u[:k]) <= lp - lq).astype(mx.int32)))
    row = mx.take(p_lp, n, axis=0)
    residual = mx.maximum(mx.exp(row) - mx.exp(mx.take(q_lp, mx.minimum(n, k - 1), axis=0)), 0.0)
    logits = mx.where((n < k) & (mx.sum(residual) > 0), mx.log(residual), row)
    return mx.stack([n.astype(mx.int32), mx.random.categorical(logits, key=key).astype(mx.int32)])


def kernel_status(kernel: str) -> str | None:
    """None when the kernel column can be measured, else why not."""
    if not metal_available():
        return "no Metal"
    return None if verdict(REGISTRY_NAME[kernel]).ok else "self-test failed"


def run_kernel_bench(*, rows=(1, 2, 4, 8, 16), contexts=(1024, 8192, 32768), kernels=KERNELS, vocab: int = 202048,
                     heads: int = 32, kv_heads: int = 2, head_dim: int = 128, window: int | None = None,
                     in_features: int = 6656, out_features: int = 4096, bits: int = 4, group_size: int = 64,
                     dtype: str = "bfloat16", calls: int = 50, windows: int = 5, warmup: int = 1, seed: int = 0,
                     progress=None) -> dict:
    """Time every requested (kernel, rows[, context]) for the kernel / built-in / reference paths. Returns a dict
    with the machine, the settings, `metal` (whether kernel figures were measured, and why not), `kernel_status`
    per kernel, and `results` rows {kernel, rows, context, kernel_us, builtin_us, reference_us}."""
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
    max_rows = attention.TREE_MAX_ROWS if set(kernels) == {"block_attention_tree"} else 16
    if any(not 1 <= r <= max_rows for r in rows):
        raise ValueError("rows (k+1) must be in 1..16 (1..32 when block_attention_tree is the only kernel)")
    if calls < 1 or windows < 1:
        raise ValueError("calls and windows must be >= 1")
    dt = DTYPES[dtype]
    status = {name: kernel_status(name) for name in kernels}
    rng = np.random.default_rng(seed)
    results = []

    def note(msg):
        if progress:
            progress(msg)

    def timed(fn):
        return time_calls(fn, calls=calls, windows=windows, warmup=warmup)

    def add(kernel, r, ctx, kfn, bfn, rfn):
        note(f"{kernel} rows={r}" + (f" context={ctx}" if ctx else ""))
        results.append({"kernel": kernel, "rows": r, "context": ctx,
                        "kernel_us": timed(kfn) if status[kernel] is None else None,
                        "builtin_us": timed(bfn), "reference_us": timed(rfn)})

    for r in rows:
        k = r - 1
        if "accept_greedy" in kernels:
            z = rng.standard_normal((r, vocab)).astype(np.float32) * 6
            logits = mx.array(np.tanh(z / 20) * 20)
            drafts = logits.argmax(-1).tolist()[:k]  # all accepted: every row decides (the worst case)
            mx.eval(logits)
            add("accept_greedy", r, None,
                lambda logits=logits, drafts=drafts: accept.greedy_accept_kernel_arrays(logits, drafts),
                lambda logits=logits: mx.argmax(logits, axis=-1),
                lambda logits=logits, drafts=drafts: accept.greedy_accept_reference_arrays(logits, drafts))
        if "accept_sampling" in kernels:
            z = mx.array(rng.standard_normal((r, vocab)).astype(np.float32) * 3)
            p_lp = z - mx.logsumexp(z, axis=-1, keepdims=True)
            q_lp = None
            if k:
                q_lp = p_lp[:k] + mx.array(rng.standard_normal((k, vocab)).astype(np.float32)) * 0.3
                q_lp = q_lp - mx.logsumexp(q_lp, axis=-1, keepdims=True)
            drafts = mx.random.categorical(q_lp, key=mx.random.key(seed)).tolist() if k else []
            u = mx.random.uniform(shape=(r,), key=mx.random.key(seed + 1))
            mx.eval(p_lp, u, *([q_lp] if k else []))
            args = (p_lp, q_lp, drafts, u)
            add("accept_sampling", r, None,
                lambda args=args: accept.rejection_accept_kernel_arrays(*args),
                lambda args=args: stock_sampling_arrays(*args, mx.random.key(seed + 2)),
                lambda args=args: accept.rejection_accept_reference_arrays(*args))
        if "qmm" in kernels:
            wf = mx.array(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02).astype(dt)
            w, s, b = mx.quantize(wf, group_size=group_size, bits=bits)
            x = mx.array(rng.standard_normal((r, in_features)).astype(np.float32)).astype(dt)
            mx.eval(w, s, b, x)
            qa = (x, w, s, b)
            add("qmm", r, None,
                lambda qa=qa: quantized.qmm_call(*qa, group_size=group_size, bits=bits).run_metal()[0],
                lambda qa=qa: quantized.builtin_qmm(*qa, group_size=group_size, bits=bits),
                lambda qa=qa: quantized.qmm_reference(*qa, group_size=group_size, bits=bits))
        if "block_attention" in kernels:
            for n in contexts:
                q = mx.array(rng.standard_normal((1, heads, r, head_dim)).astype(np.float32)).astype(dt)
                kk = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32)).astype(dt)
                vv = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32)).astype(dt)
                mx.eval(q, kk, vv)
                aa = (q, kk, vv)
                kw = dict(scale=head_dim**-0.5, qk=n - r, window=window)
                add("block_attention", r, n,
                    lambda aa=aa, kw=kw: attention.kernel_attention(*aa, **kw),
                    lambda aa=aa, kw=kw: attention.builtin_attention(*aa, **kw),
                    lambda aa=aa, kw=kw: attention.block_attention_reference(*aa, **kw))
        if "block_attention_tree" in kernels:
            tree = attention.tree_inputs(*attention.random_tree(np.random.default_rng(seed), r, TREE_KIND))
            for n in contexts:
                q = mx.array(rng.standard_normal((1, heads, r, head_dim)).astype(np.float32)).astype(dt)
                kk = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32)).astype(dt)
                vv = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32)).astype(dt)
                mx.eval(q, kk, vv, *tree)
                aa = (q, kk, vv)
                kw = dict(scale=head_dim**-0.5, qk=n - r, window=window, tree=tree)
                add("block_attention_tree", r, n,
                    lambda aa=aa, kw=kw: attention.kernel_attention(*aa, **kw),
                    lambda aa=aa, kw=kw: attention.builtin_attention(*aa, **kw),
                    lambda aa=aa, kw=kw: attention.block_attention_reference(*aa, **kw))
    have_metal = metal_available()
    return {
        "machine": machine_info(),
        "settings": {"rows": list(rows), "contexts": list(contexts), "kernels": list(kernels), "vocab": vocab,
                     "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "window": window,
                     "tree_kind": TREE_KIND if "block_attention_tree" in kernels else None,
                     "in_features": in_features, "out_features": out_features, "bits": bits,
                     "group_size": group_size, "dtype": dtype, "calls_per_window": calls, "windows": windows,
                     "warmup": warmup},
        "metal": {"available": have_metal,
                  "note": None if have_metal else "no Metal back-end (mx.metal.is_available() is False): kernel "
                                                  "figures are not measured on this machine; run on an Apple GPU"},
        "kernel_status": {name: st or "measured" for name, st in status.items()},
        "results": results,
    }


def render_kernel_table(res: dict):
    """The results of `run_kernel_bench` as one rich Table."""
    from rich.table import Table

    s = res["settings"]
    t = Table(title=f"µs per call (median of {s['windows']} windows of {s['calls_per_window']} calls, one eval per "
                    f"window) — kernel vs built-in MLX vs reference")
    for col in ("kernel", "k+1", "context", "Metal kernel", "built-in MLX", "reference", "built-in/kernel"):
        t.add_column(col, justify="left" if col == "kernel" else "right")

    def fmt(v):
        return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"

    for row in res["results"]:
        st = res["kernel_status"].get(row["kernel"], "measured")
        ratio = f"{row['builtin_us'] / row['kernel_us']:.2f}×" if row["kernel_us"] else "—"
        t.add_row(row["kernel"], str(row["rows"]), "" if row["context"] is None else f"{row['context']:,}",
                  fmt(row["kernel_us"]) if st == "measured" else st, fmt(row["builtin_us"]),
                  fmt(row["reference_us"]), ratio)
    return t
