"""Fused acceptance for speculative decoding: greedy and rejection sampling.

Each dispatcher returns `(n_accepted, next_token)` as two Python ints — the only host transfer of a verification
round. The `*_arrays` functions build the same answer as a lazy [2] int32 array (no host synchronisation);
`*_reference` is the pure-MLX definition; `*_call` builds the Metal launch of `metal_kernels/*.metal`.

Greedy: one threadgroup per row computes the row's argmax (`greedy_accept.metal`), then n and the next token come
from those k+1 indices. NaN policy: that of `mx.argmax` in this MLX on the CPU (and numpy's): a NaN is larger than
every number, so a row holding NaN selects its first NaN; ties select the first index; -0.0 equals +0.0.
(`test_greedy_nan_policy_is_mx_argmax` checks mx.argmax still behaves so.)

Rejection sampling (`rejection_accept.metal`): from the processed log-probs directly — the kernel exponentiates
only the 2k entries the acceptance test reads and the one row the residual / bonus draw needs, inside the kernel.
Probabilities are weighed `r > 0 ? trunc(min(r, 1) * 2^38) : 0` (NaN weighs 0); a NaN log-prob at a draft's entry
rejects that draft.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ._core import (FLOAT_DTYPES, KernelCall, KernelSpec, SelfTest, register_selftest, run_or_fallback)

GREEDY = KernelSpec("glimmer_greedy_argmax", "greedy_accept.metal", ("logits", "meta"), ("sel",))
REJECTION = KernelSpec("glimmer_rejection_accept", "rejection_accept.metal", ("p", "q", "drafts", "u", "meta"),
                       ("out",))

MAX_DRAFTS = 15  # k + 1 <= 16 rows
W_SCALE = 2.0**38  # fixed-point scale of the residual weights (see rejection_accept.metal)
U_SCALE = 2.0**24  # fixed-point scale of the inverse-CDF uniform


def threads_for(V: int) -> int:
    """Threads per threadgroup for a row of V elements: a power of two in [32, 1024]."""
    return int(min(1024, max(32, 1 << (max(V, 1) - 1).bit_length())))


def _drafts_array(drafts, k: int) -> mx.array:
    if isinstance(drafts, mx.array):
        d = drafts.astype(mx.int32).reshape(-1)
    else:
        d = mx.array(list(drafts), dtype=mx.int32)
    if d.size != k:
        raise ValueError(f"expected {k} drafts, got {d.size}")
    return d if k > 0 else mx.zeros((1,), dtype=mx.int32)  # a buffer may not be empty


def _pair(a: mx.array) -> tuple[int, int]:
    out = a.tolist()
    return int(out[0]), int(out[1])


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


def accept_from_argmax(sel: mx.array, drafts) -> mx.array:
    """[2] int32 (n, next) from the rows' argmaxes sel [k+1]: n = leading j with sel[j] == drafts[j], next = sel[n].
    Lazy."""
    k = sel.shape[0] - 1
    sel = sel.astype(mx.int32)
    if k == 0:
        return mx.stack([mx.array(0, dtype=mx.int32), sel[0]])
    n = mx.sum(mx.cumprod((sel[:k] == _drafts_array(drafts, k)).astype(mx.int32)))
    return mx.stack([n.astype(mx.int32), mx.take(sel, n)])


def greedy_accept_reference_arrays(logits: mx.array, drafts) -> mx.array:
    _check_greedy(logits, drafts)
    return accept_from_argmax(mx.argmax(logits, axis=-1), drafts)


def greedy_accept_reference(logits: mx.array, drafts) -> tuple[int, int]:
    """logits [k+1, V] (already repetition-penalised if that applies); drafts: k ints.
    n = length of the longest prefix with drafts[j] == argmax(logits[j]); next = argmax(logits[n])."""
    return _pair(greedy_accept_reference_arrays(logits, drafts))


def greedy_argmax_call(logits: mx.array) -> KernelCall:
    """The launch computing argmax of every row of logits [R, V]: one threadgroup per row."""
    if logits.ndim != 2 or logits.shape[0] < 1:
        raise ValueError(f"logits must be [k+1, V], got shape {tuple(logits.shape)}")
    R, V = logits.shape
    nt = threads_for(V)
    return KernelCall(GREEDY, [logits, mx.array([R, V], dtype=mx.int32)], output_shapes=[(R,)],
                      output_dtypes=[mx.int32], grid=(nt, R, 1), threadgroup=(nt, 1, 1),
                      template=[("T", logits.dtype)])


def greedy_supported(logits: mx.array) -> bool:
    return logits.ndim == 2 and logits.dtype in FLOAT_DTYPES and logits.shape[0] <= MAX_DRAFTS + 1 \
        and 0 < logits.shape[1] < 2**31


def greedy_accept_kernel_arrays(logits: mx.array, drafts) -> mx.array:
    """The kernel path, lazy: per-row argmax on the GPU, then (n, next) from the k+1 indices."""
    _check_greedy(logits, drafts)
    return accept_from_argmax(greedy_argmax_call(logits).run_metal()[0], drafts)


def greedy_accept(logits: mx.array, drafts) -> tuple[int, int]:
    """Dispatcher: the Metal kernel when enabled (self-tested) and supported, else the reference."""
    _check_greedy(logits, drafts)
    if not greedy_supported(logits):
        return greedy_accept_reference(logits, drafts)
    return run_or_fallback("greedy_accept", lambda: _pair(greedy_accept_kernel_arrays(logits, drafts)),
                           lambda: greedy_accept_reference(logits, drafts))


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


def weights(r: mx.array) -> mx.array:
    """Exact integer weights of probabilities r: trunc(min(r, 1) * 2^38) where r > 0, else 0 (NaN included)."""
    return mx.where(r > 0, mx.minimum(r, 1.0) * W_SCALE, 0.0).astype(mx.uint64)


def _draw(n: mx.array, k: int, row: mx.array, qrow: mx.array | None, u: mx.array) -> mx.array:
    """[2] int32 (n, token): inverse CDF over the chosen row's integer weights (see rejection_accept.metal)."""
    wp = weights(row)
    if k > 0:
        wr = weights(row - qrow)
        w = mx.where((n < k) & (mx.sum(wr) > 0), wr, wp)
    else:
        w = wp
    W = mx.sum(w)
    t = mx.right_shift((u[k] * U_SCALE).astype(mx.uint64) * W, mx.array(24, dtype=mx.uint64))
    idx = mx.where(W > 0, mx.sum((mx.cumsum(w) <= t).astype(mx.int32)), 0)
    return mx.stack([n.astype(mx.int32), idx.astype(mx.int32)])


def _accepted(pd: mx.array, qd: mx.array, u: mx.array, k: int) -> mx.array:
    return mx.sum(mx.cumprod(((u[:k] * qd) <= pd).astype(mx.int32)))


def rejection_accept_reference(p: mx.array, q: mx.array | None, drafts, u: mx.array) -> tuple[int, int]:
    """The definition, on probabilities: p [k+1, V], q [k, V] target / draft probabilities (after the same
    processing); drafts: k ints; u: k+1 uniforms in [0, 1) (k for acceptance, the last for the inverse-CDF draw).
    See rejection_accept.metal."""
    k = _check_rejection(p, q, drafts, u)
    p = p.astype(mx.float32)
    u = u.astype(mx.float32)
    if k == 0:
        return _pair(_draw(mx.array(0, dtype=mx.int32), 0, p[0], None, u))
    q = q.astype(mx.float32)
    d = _drafts_array(drafts, k)
    rows = mx.arange(k)
    n = _accepted(p[rows, d], q[rows, d], u, k)
    return _pair(_draw(n, k, mx.take(p, n, axis=0), mx.take(q, mx.minimum(n, k - 1), axis=0), u))


def rejection_accept_reference_arrays(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts,
                                      u: mx.array) -> mx.array:
    """`rejection_accept_reference(exp(p_logprobs), exp(q_logprobs), drafts, u)` as a lazy [2] int32 array that
    exponentiates only what it reads: the 2k draft entries, row n of p and of q (gathered by the lazy n)."""
    k = _check_rejection(p_logprobs, q_logprobs, drafts, u)
    p_logprobs = p_logprobs.astype(mx.float32)
    u = u.astype(mx.float32)
    if k == 0:
        return _draw(mx.array(0, dtype=mx.int32), 0, mx.exp(p_logprobs[0]), None, u)
    q_logprobs = q_logprobs.astype(mx.float32)
    d = _drafts_array(drafts, k)
    rows = mx.arange(k)
    n = _accepted(mx.exp(p_logprobs[rows, d]), mx.exp(q_logprobs[rows, d]), u, k)
    row = mx.exp(mx.take(p_logprobs, n, axis=0))
    qrow = mx.exp(mx.take(q_logprobs, mx.minimum(n, k - 1), axis=0))
    return _draw(n, k, row, qrow, u)


def rejection_accept_reference_logprobs(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts,
                                        u: mx.array) -> tuple[int, int]:
    """The reference from log-probs (what the verifier runs without the kernel); one host read."""
    return _pair(rejection_accept_reference_arrays(p_logprobs, q_logprobs, drafts, u))


def rejection_accept_logprobs_call(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts,
                                   u: mx.array) -> KernelCall:
    """The launch of rejection_accept.metal on the log-probs as they are (no host-side exp or cast)."""
    k = _check_rejection(p_logprobs, q_logprobs, drafts, u)
    V = p_logprobs.shape[1]
    q = q_logprobs if k > 0 else mx.zeros((1,), dtype=p_logprobs.dtype)  # never read when k = 0
    return KernelCall(REJECTION, [p_logprobs, q, _drafts_array(drafts, k), u.astype(mx.float32),
                                  mx.array([k, V], dtype=mx.int32)],
                      output_shapes=[(2,)], output_dtypes=[mx.int32], grid=(threads_for(V), 1, 1),
                      threadgroup=(threads_for(V), 1, 1), template=[("TP", p_logprobs.dtype), ("TQ", q.dtype)])


def rejection_supported(p_logprobs: mx.array, q_logprobs: mx.array | None) -> bool:
    return (p_logprobs.ndim == 2 and p_logprobs.shape[0] <= MAX_DRAFTS + 1 and 0 < p_logprobs.shape[1] < 2**31
            and p_logprobs.dtype in FLOAT_DTYPES and (q_logprobs is None or q_logprobs.dtype in FLOAT_DTYPES))


def rejection_accept_kernel_arrays(p_logprobs, q_logprobs, drafts, u) -> mx.array:
    return rejection_accept_logprobs_call(p_logprobs, q_logprobs, drafts, u).run_metal()[0]


def rejection_accept_logprobs(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts,
                              u: mx.array) -> tuple[int, int]:
    """What the verifier calls, from processed log-probs: the fused kernel when enabled (self-tested) and
    supported, else the reference. Both compute `rejection_accept_reference(exp(p_logprobs), exp(q_logprobs),
    drafts, u)`; they agree bit for bit when both use the same `exp` (on a Mac: MLX's Exp is metal::precise::exp,
    the kernel's too)."""
    _check_rejection(p_logprobs, q_logprobs, drafts, u)
    if not rejection_supported(p_logprobs, q_logprobs if len(drafts) else None):
        return rejection_accept_reference_logprobs(p_logprobs, q_logprobs, drafts, u)
    return run_or_fallback(
        "rejection_accept", lambda: _pair(rejection_accept_kernel_arrays(p_logprobs, q_logprobs, drafts, u)),
        lambda: rejection_accept_reference_logprobs(p_logprobs, q_logprobs, drafts, u))


# -- self-tests (small deterministic inputs; see _core) ------------------------------------------------------------
SELFTEST_V = 1500  # not a multiple of the threadgroup; several simdgroups, a tie inside one thread's range


def greedy_selftest_inputs():
    rng = np.random.default_rng(1234)
    x = (np.tanh(rng.standard_normal((5, SELFTEST_V)) * 0.3) * 20).astype(np.float32)
    x[1, [7, 7 + threads_for(SELFTEST_V)]] = 30.0  # a tie in one thread's strided range: the first index wins
    x[3, [100, 1499]] = 30.0  # a tie across threads
    sel = x.argmax(-1)
    drafts = [int(sel[0]), int(sel[1]), int(sel[2]), int((sel[3] + 1) % SELFTEST_V)]
    return mx.array(x), drafts


def _greedy_kernel_selftest(inp):
    logits, drafts = inp
    return greedy_argmax_call(logits).run_metal()[0], greedy_accept_kernel_arrays(logits, drafts)


def _greedy_reference_selftest(inp):
    logits, drafts = inp
    return mx.argmax(logits, axis=-1).astype(mx.int32), greedy_accept_reference_arrays(logits, drafts)


def rejection_selftest_inputs():
    """Three cases: a rejection in the middle (residual draw), all accepted (bonus draw), k = 0."""
    rng = np.random.default_rng(4321)
    V, k = SELFTEST_V, 4

    def logprobs(rows, sharp):
        z = rng.standard_normal((rows, V)) * sharp
        return (z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True))

    p = logprobs(k + 1, 2.0).astype(np.float32)
    q = (p[:k] + rng.standard_normal((k, V)) * 0.5).astype(np.float32)
    q = (q - np.log(np.exp(q.astype(np.float64)).sum(-1, keepdims=True))).astype(np.float32)
    d_mid = [int(np.argmax(p[j])) for j in range(2)] + [int(np.argmin(p[2])), 5]
    q[2, d_mid[2]] = np.log(0.3)  # the drafter was sure of a token the target gives (almost) nothing: rejected
    d_all = [int(np.argmax(p[j])) for j in range(k)]
    cases = [(p, q, d_mid, np.array([0.1, 0.2, 0.9, 0.5, 0.37], np.float32)),
             (p, p[:k].copy(), d_all, np.array([0.5, 0.5, 0.5, 0.5, 0.61], np.float32)),
             (p[:1], None, [], np.array([0.73], np.float32))]
    return [(mx.array(a), None if b is None else mx.array(b), d, mx.array(uu)) for a, b, d, uu in cases]


register_selftest(SelfTest(
    "greedy_accept", _greedy_kernel_selftest, _greedy_reference_selftest,
    lambda: greedy_selftest_inputs(), sources=("greedy_accept.metal",),
    builtin="pure-MLX reference (mx.argmax + prefix compare)"))
register_selftest(SelfTest(
    "rejection_accept", lambda cases: tuple(rejection_accept_kernel_arrays(*c) for c in cases),
    lambda cases: tuple(rejection_accept_reference_arrays(*c) for c in cases),
    rejection_selftest_inputs, sources=("rejection_accept.metal",),
    builtin="pure-MLX reference (exp of the rows read, integer inverse CDF)"))
