"""Fused acceptance for speculative decoding: greedy and rejection sampling.

Each returns `(n_accepted, next_token)` as two Python ints — the only host transfer of a verification round.
`*_reference` is the pure-MLX definition (one lazy graph, one `tolist()` at the end); `*_call` builds the Metal
launch of `metal_kernels/*.metal`; `greedy_accept` / `rejection_accept` dispatch between them.
"""

from __future__ import annotations

import mlx.core as mx

from ._core import FLOAT_DTYPES, KernelCall, KernelSpec, use_metal

GREEDY = KernelSpec("glimmer_greedy_accept", "greedy_accept.metal", ("logits", "drafts", "meta"), ("out",))
REJECTION = KernelSpec("glimmer_rejection_accept", "rejection_accept.metal", ("p", "q", "drafts", "u", "meta"),
                       ("out",))

MAX_DRAFTS = 15  # k + 1 <= 16 rows
W_SCALE = 2.0**38  # fixed-point scale of the residual weights (see rejection_accept.metal)
U_SCALE = 2.0**24  # fixed-point scale of the inverse-CDF uniform


def _threads(V: int) -> int:
    return int(min(1024, max(32, 1 << (max(V, 1) - 1).bit_length())))


def _drafts_array(drafts, k: int) -> mx.array:
    if isinstance(drafts, mx.array):
        d = drafts.astype(mx.int32).reshape(-1)
    else:
        d = mx.array(list(drafts), dtype=mx.int32)
    if d.size != k:
        raise ValueError(f"expected {k} drafts, got {d.size}")
    return d if k > 0 else mx.zeros((1,), dtype=mx.int32)  # a buffer may not be empty


# -- greedy --------------------------------------------------------------------------------------------------------
def _check_greedy(logits: mx.array, drafts) -> int:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [k+1, V], got shape {tuple(logits.shape)}")
    k = logits.shape[0] - 1
    if k < 0:
        raise ValueError("logits must have at least one row")
    n = drafts.size if isinstance(drafts, mx.array) else len(drafts)
    if n != k:
        raise ValueError(f"{logits.shape[0]} logit rows need {logits.shape[0] - 1} drafts, got {n}")
    return k


def greedy_accept_reference(logits: mx.array, drafts) -> tuple[int, int]:
    """logits [k+1, V] (already repetition-penalised if that applies); drafts: k ints.
    n = length of the longest prefix with drafts[j] == argmax(logits[j]); next = argmax(logits[n])."""
    k = _check_greedy(logits, drafts)
    sel = mx.argmax(logits, axis=-1).astype(mx.int32)
    if k == 0:
        return 0, int(sel[0].item())
    d = _drafts_array(drafts, k)
    n = mx.sum(mx.cumprod((sel[:k] == d).astype(mx.int32)))
    out = mx.stack([n, mx.take(sel, n)]).tolist()
    return int(out[0]), int(out[1])


def greedy_accept_call(logits: mx.array, drafts) -> KernelCall:
    k = _check_greedy(logits, drafts)
    V = logits.shape[1]
    nt = _threads(V)
    return KernelCall(GREEDY, [logits, _drafts_array(drafts, k), mx.array([k, V], dtype=mx.int32)],
                      output_shapes=[(2,)], output_dtypes=[mx.int32], grid=(nt, 1, 1), threadgroup=(nt, 1, 1),
                      template=[("T", logits.dtype)])


def greedy_supported(logits: mx.array) -> bool:
    return logits.ndim == 2 and logits.dtype in FLOAT_DTYPES and logits.shape[0] <= MAX_DRAFTS + 1 \
        and 0 < logits.shape[1] < 2**31


def greedy_accept(logits: mx.array, drafts) -> tuple[int, int]:
    """Dispatcher: the Metal kernel when enabled and supported, else the reference."""
    if use_metal() and greedy_supported(logits):
        _check_greedy(logits, drafts)
        out = greedy_accept_call(logits, drafts).run_metal()[0].tolist()
        return int(out[0]), int(out[1])
    return greedy_accept_reference(logits, drafts)


# -- rejection sampling -------------------------------------------------------------------------------------------
def _check_rejection(p: mx.array, q: mx.array | None, drafts, u: mx.array) -> int:
    if p.ndim != 2:
        raise ValueError(f"p must be [k+1, V], got shape {tuple(p.shape)}")
    k = p.shape[0] - 1
    n = drafts.size if isinstance(drafts, mx.array) else len(drafts)
    if n != k:
        raise ValueError(f"{p.shape[0]} target rows need {k} drafts, got {n}")
    if k > 0 and (q is None or tuple(q.shape) != (k, p.shape[1])):
        raise ValueError(f"q must be [{k}, {p.shape[1]}], got {None if q is None else tuple(q.shape)}")
    if u.shape != (k + 1,):
        raise ValueError(f"u must hold k+1 = {k + 1} uniforms, got shape {tuple(u.shape)}")
    return k


def _inverse_cdf_draw(n, k: int, row, qrow, u):
    """(n, token) from the chosen row's probabilities (see rejection_accept.metal for the integer math)."""
    wp = (row * W_SCALE).astype(mx.uint64)
    if k > 0:
        wr = (mx.maximum(row - qrow, 0.0) * W_SCALE).astype(mx.uint64)
        use_r = (n < k) & (mx.sum(wr) > 0)
        w = mx.where(use_r, wr, wp)
    else:
        w = wp
    W = mx.sum(w)
    t = mx.right_shift((u[k] * U_SCALE).astype(mx.uint64) * W, mx.array(24, dtype=mx.uint64))
    idx = mx.sum((mx.cumsum(w) <= t).astype(mx.int32))
    idx = mx.where(W > 0, idx, 0)
    out = mx.stack([n.astype(mx.int32), idx.astype(mx.int32)]).tolist()
    return int(out[0]), int(out[1])


def rejection_accept_reference(p: mx.array, q: mx.array | None, drafts, u: mx.array) -> tuple[int, int]:
    """p [k+1, V], q [k, V]: target / draft probabilities (float32) after the same processing; drafts: k ints;
    u: k+1 uniforms in [0, 1) (k for acceptance, the last for the inverse-CDF draw). See rejection_accept.metal."""
    k = _check_rejection(p, q, drafts, u)
    p = p.astype(mx.float32)
    u = u.astype(mx.float32)
    if k > 0:
        q = q.astype(mx.float32)
        d = _drafts_array(drafts, k)
        rows = mx.arange(k)
        acc = (u[:k] * q[rows, d]) <= p[rows, d]
        n = mx.sum(mx.cumprod(acc.astype(mx.int32)))
        qrow = mx.take(q, mx.minimum(n, k - 1), axis=0)
    else:
        n, qrow = mx.array(0, dtype=mx.int32), None
    return _inverse_cdf_draw(n, k, mx.take(p, n, axis=0), qrow, u)


def rejection_accept_reference_logprobs(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts,
                                        u: mx.array) -> tuple[int, int]:
    """`rejection_accept_reference(exp(p_logprobs), exp(q_logprobs), drafts, u)` computed the cheap way for a CPU:
    n is read first (a tiny graph), then `exp` is evaluated only where it is read — k draft entries per side and
    row n (and q's row n after a rejection) instead of [k+1, V] twice. Same elementwise exp, same integer math,
    so the same result (tests check it); MLX's CPU exp over a 202k vocabulary costs milliseconds per row."""
    k = _check_rejection(p_logprobs, q_logprobs, drafts, u)
    p_logprobs = p_logprobs.astype(mx.float32)
    u = u.astype(mx.float32)
    n = 0
    if k > 0:
        q_logprobs = q_logprobs.astype(mx.float32)
        d = _drafts_array(drafts, k)
        rows = mx.arange(k)
        acc = (u[:k] * mx.exp(q_logprobs[rows, d])) <= mx.exp(p_logprobs[rows, d])
        n = int(mx.sum(mx.cumprod(acc.astype(mx.int32))).item())
    row = mx.exp(p_logprobs[n])
    w = (row * W_SCALE).astype(mx.uint64)
    if n < k:
        wr = (mx.maximum(row - mx.exp(q_logprobs[n]), 0.0) * W_SCALE).astype(mx.uint64)
        w = mx.where(mx.sum(wr) > 0, wr, w)
    W = mx.sum(w)
    t = mx.right_shift((u[k] * U_SCALE).astype(mx.uint64) * W, mx.array(24, dtype=mx.uint64))
    idx = mx.where(W > 0, mx.sum((mx.cumsum(w) <= t).astype(mx.int32)), 0)
    return n, int(idx.item())


def rejection_accept_call(p: mx.array, q: mx.array | None, drafts, u: mx.array) -> KernelCall:
    k = _check_rejection(p, q, drafts, u)
    V = p.shape[1]
    nt = _threads(V)
    qa = q.astype(mx.float32) if k > 0 else mx.zeros((1, V), dtype=mx.float32)
    return KernelCall(REJECTION, [p.astype(mx.float32), qa, _drafts_array(drafts, k), u.astype(mx.float32),
                                  mx.array([k, V], dtype=mx.int32)],
                      output_shapes=[(2,)], output_dtypes=[mx.int32], grid=(nt, 1, 1), threadgroup=(nt, 1, 1))


def rejection_supported(p: mx.array) -> bool:
    return p.ndim == 2 and p.shape[0] <= MAX_DRAFTS + 1 and 0 < p.shape[1] < 2**31


def rejection_accept(p: mx.array, q: mx.array | None, drafts, u: mx.array) -> tuple[int, int]:
    """Dispatcher: the Metal kernel when enabled and supported, else the reference (identical results)."""
    if use_metal() and rejection_supported(p):
        out = rejection_accept_call(p, q, drafts, u).run_metal()[0].tolist()
        return int(out[0]), int(out[1])
    return rejection_accept_reference(p, q, drafts, u)


def rejection_accept_logprobs(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts,
                              u: mx.array) -> tuple[int, int]:
    """What the verifier calls, from processed log-probs: on Metal the fused kernel over exp(log-probs) (one
    elementwise pass on the GPU), otherwise the reference that exponentiates only the entries it reads. Both equal
    `rejection_accept_reference(exp(p_logprobs), exp(q_logprobs), drafts, u)`."""
    if use_metal() and rejection_supported(p_logprobs):
        q = mx.exp(q_logprobs) if q_logprobs is not None and len(drafts) > 0 else None
        return rejection_accept(mx.exp(p_logprobs), q, drafts, u)
    return rejection_accept_reference_logprobs(p_logprobs, q_logprobs, drafts, u)
