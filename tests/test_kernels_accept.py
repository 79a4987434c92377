"""Fused greedy and rejection-sampling acceptance: the .metal kernels (through the MSL-on-CPU harness, and through
MLX on a Mac), the pure-MLX references, numpy oracles, and the verifier wired to them."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.kernels import accept
from glimmer_mlx.kernels._core import metal_available
from glimmer_mlx.sampling import Sampler, SamplingParams, greedy_token, history_rows, process
from glimmer_mlx.speculative import verify
from msl_harness import harness

needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")
needs_metal = pytest.mark.skipif(not metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")


# -- oracles -----------------------------------------------------------------------------------------------------------
def greedy_oracle(logits: np.ndarray, drafts):
    sel = logits.argmax(-1)
    n = 0
    while n < len(drafts) and drafts[n] == sel[n]:
        n += 1
    return n, int(sel[n])


def rejection_oracle(p: np.ndarray, q: np.ndarray | None, drafts, u: np.ndarray):
    """The documented math in numpy (float32 products, exact integer weights)."""
    p, u = p.astype(np.float32), u.astype(np.float32)
    k = len(drafts)
    n = 0
    while n < k and np.float32(u[n] * q[n, drafts[n]]) <= p[n, drafts[n]]:
        n += 1
    row = p[n]
    wp = (row * np.float32(2.0**38)).astype(np.uint64)
    w = wp
    if n < k:
        wr = (np.maximum(row - q[n].astype(np.float32), np.float32(0)) * np.float32(2.0**38)).astype(np.uint64)
        if int(wr.sum()) > 0:
            w = wr
    W = int(w.sum())
    t = (int(np.float32(u[k] * np.float32(2.0**24))) * W) >> 24
    cum = np.cumsum(w.astype(object))
    idx = int(np.argmax(cum > t)) if W > 0 else 0
    return n, idx


def softcapped(rng, rows, V, cap=20.0, scale=6.0):
    z = rng.standard_normal((rows, V)).astype(np.float32) * scale
    return (np.tanh(z / cap) * cap).astype(np.float32)


def run_greedy_kernel(logits, drafts):
    out = harness.run(accept.greedy_accept_call(logits, drafts))[0].tolist()
    return out[0], out[1]


def run_rejection_kernel(p, q, drafts, u):
    out = harness.run(accept.rejection_accept_call(p, q, drafts, u))[0].tolist()
    return out[0], out[1]


def greedy_cases(rng, V):
    """(logits, drafts) covering k = 0, 15, all accepted, none accepted, a mismatch in the middle, ties."""
    cases = []
    for k, n_match in [(0, 0), (15, 15), (15, 0), (7, 3), (3, 3), (1, 0)]:
        x = softcapped(rng, k + 1, V)
        sel = x.argmax(-1)
        drafts = [int(sel[j]) if j < n_match else int((sel[j] + 1 + j) % V) for j in range(k)]
        cases.append((x, drafts))
    # ties: the first index of the maximum wins (mx.argmax), also across threads and simdgroups
    x = softcapped(rng, 3, V)
    for r, pos in enumerate([(5, V - 1), (V // 2, V // 2 + 1), (V - 2, V - 1)]):
        x[r, list(pos)] = 25.0
    cases.append((x, [5, V // 2]))
    return cases


# -- greedy -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [1000, 4099])
def test_greedy_reference_matches_oracle(V):
    rng = np.random.default_rng(V)
    for x, drafts in greedy_cases(rng, V):
        assert accept.greedy_accept_reference(mx.array(x), drafts) == greedy_oracle(x, drafts)


@needs_cxx
@pytest.mark.parametrize("V,dtype", [(1000, mx.float32), (4099, mx.float32), (777, mx.bfloat16), (333, mx.float16)])
def test_greedy_kernel_matches_reference(V, dtype):
    """V not a multiple of the threadgroup; k = 0 and 15; all / none accepted; ties; NaN-free softcapped logits."""
    rng = np.random.default_rng(V + 1)
    for x, drafts in greedy_cases(rng, V):
        xm = mx.array(x).astype(dtype)
        ref = accept.greedy_accept_reference(xm, drafts)
        assert run_greedy_kernel(xm, drafts) == ref
        assert ref == greedy_oracle(np.array(xm.astype(mx.float32)), drafts)


def test_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="need 2 drafts"):
        accept.greedy_accept_reference(mx.zeros((3, 10)), [1])
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        accept.greedy_accept_reference(mx.zeros((10,)), [])


def test_verify_greedy_unchanged_with_repetition_penalty():
    """The verifier (now through the dispatcher) decides exactly as the previous argmax-and-compare code."""
    rng = np.random.default_rng(3)
    V = 300
    for penalty in (1.0, 1.3):
        sampler = Sampler(SamplingParams(repetition_penalty=penalty, repetition_context_size=8), seed=0)
        for k in (0, 4, 9):
            x = mx.array(softcapped(rng, k + 1, V))
            history = rng.integers(0, V, 12).tolist()
            sel_free = greedy_token(x, sampler.params).tolist()
            drafts = sel_free[:k]
            old = greedy_token(x, sampler.params, history_rows(sampler.params, history, drafts, k + 1)).tolist()
            n = 0
            while n < k and drafts[n] == old[n]:
                n += 1
            assert verify.verify_greedy(x, drafts, sampler, history) == (n, old[n])


# -- rejection sampling -------------------------------------------------------------------------------------------
def zero_residual_case(p):
    q = p[:2].copy()
    q[0, 0] = p[0, 0] * 1.5  # q_0 >= p_0 everywhere; draft 0 rejected with u close to 1
    return p, q, [0, 1], np.array([0.9999999, 0.5, 0.3], np.float32)


def rejection_cases(rng, V):
    cases = []

    def dist(rows, sharp=3.0, keep=None):
        z = rng.standard_normal((rows, V)).astype(np.float32) * sharp
        if keep is not None:  # top-k-style filtering: zero probability outside
            thr = np.sort(z, -1)[:, -keep][:, None]
            z = np.where(z >= thr, z, -np.inf)
        lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
        return np.exp(lp).astype(np.float32)

    for k in (0, 1, 5, 15):
        p, q = dist(k + 1), dist(max(k, 1))
        drafts = [int(rng.choice(V, p=q[j] / q[j].sum())) for j in range(k)]
        cases.append((p, q if k else None, drafts, rng.random(k + 1).astype(np.float32)))
    # all accepted: q == p on the drafted rows and u small
    k = 6
    p = dist(k + 1)
    drafts = [int(p[j].argmax()) for j in range(k)]
    cases.append((p, p[:k].copy(), drafts, np.full(k + 1, 0.25, np.float32)))
    # none accepted: a draft the target gives (almost) no mass
    p, q = dist(4, keep=20), dist(3)
    drafts = [int(np.argmin(p[0]))] + [1, 2]
    cases.append((p, q, drafts, np.array([0.5, 0.1, 0.1, 0.9], np.float32)))
    # rejected although the residual max(0, p_n - q_n) is zero everywhere (q_n >= p_n): falls back to p_n
    cases.append(zero_residual_case(dist(3)))
    # filtered distributions (top-k) on both sides, u = 0
    p, q = dist(5, keep=7), dist(4, keep=7)
    drafts = [int(rng.choice(V, p=q[j] / q[j].sum())) for j in range(4)]
    cases.append((p, q, drafts, np.zeros(5, np.float32)))
    return cases


@pytest.mark.parametrize("V", [1000, 3001])
def test_rejection_reference_matches_oracle(V):
    rng = np.random.default_rng(V)
    for p, q, drafts, u in rejection_cases(rng, V):
        ref = accept.rejection_accept_reference(mx.array(p), None if q is None else mx.array(q), drafts, mx.array(u))
        assert ref == rejection_oracle(p, q, drafts, u)


@pytest.mark.parametrize("V", [1000, 3001])
def test_rejection_from_logprobs_equals_reference_on_probabilities(V):
    """The verifier's path (exp only where read) is the reference on exp(log-probs), element for element."""
    rng = np.random.default_rng(V + 3)
    with np.errstate(divide="ignore"):
        for p, q, drafts, u in rejection_cases(rng, V):
            p_lp = mx.log(mx.array(p))
            q_lp = None if q is None else mx.log(mx.array(q))
            full = accept.rejection_accept_reference(mx.exp(p_lp), None if q is None else mx.exp(q_lp), drafts,
                                                     mx.array(u))
            assert accept.rejection_accept_reference_logprobs(p_lp, q_lp, drafts, mx.array(u)) == full
    # MLX's exp is elementwise-deterministic: one row / gathered entries equal the full array's
    z = mx.array(rng.standard_normal((5, V)).astype(np.float32) * 10)
    e = np.array(mx.exp(z))
    assert np.array_equal(np.array(mx.exp(z[3])), e[3])
    idx = mx.array(rng.integers(0, V, 5).astype(np.int32))
    assert np.array_equal(np.array(mx.exp(z[mx.arange(5), idx])), e[np.arange(5), np.array(idx)])


@needs_cxx
@pytest.mark.parametrize("V", [1000, 3001])
def test_rejection_kernel_bit_exact_with_reference(V):
    rng = np.random.default_rng(V + 7)
    cases = rejection_cases(rng, V)
    for _ in range(6):  # random uniforms on the same distributions: other (n, token) paths
        p, q, drafts, _u = cases[2]
        cases.append((p, q, drafts, rng.random(len(drafts) + 1).astype(np.float32)))
    seen_n = set()
    for p, q, drafts, u in cases:
        args = (mx.array(p), None if q is None else mx.array(q), drafts, mx.array(u))
        ref = accept.rejection_accept_reference(*args)
        assert run_rejection_kernel(*args) == ref
        seen_n.add(ref[0] == len(drafts))
    assert seen_n == {True, False}  # both the correction and the bonus path were exercised


@needs_cxx
def test_rejection_zero_residual_falls_back_to_target():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((3, 500)).astype(np.float32)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    p, q, drafts, u = zero_residual_case(p.astype(np.float32))
    args = (mx.array(p), mx.array(q), drafts, mx.array(u))
    ref = accept.rejection_accept_reference(*args)
    assert ref[0] == 0 and ref == rejection_oracle(p, q, drafts, u) == run_rejection_kernel(*args)
    # inverse CDF of p_0 itself at u = 0.3
    assert ref[1] == int(np.searchsorted(np.cumsum(p[0].astype(np.float64)), 0.3 * p[0].sum(), side="right"))


def test_rejection_sampling_is_lossless_on_a_small_vocab():
    """The first emitted token is distributed exactly as the target's p_0 (chi-square, 6000 rounds)."""
    rng = np.random.default_rng(11)
    V, k, rounds = 6, 2, 6000
    p = np.array([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03]] * (k + 1), np.float32)
    q = np.array([[0.05, 0.10, 0.15, 0.20, 0.25, 0.25]] * k, np.float32)
    pm, qm = mx.array(p), mx.array(q)
    counts = np.zeros(V)
    for _ in range(rounds):
        drafts = [int(rng.choice(V, p=q[j] / q[j].sum())) for j in range(k)]
        n, tok = accept.rejection_accept_reference(pm, qm, drafts, mx.array(rng.random(k + 1).astype(np.float32)))
        counts[drafts[0] if n > 0 else tok] += 1
    expected = p[0] / p[0].sum() * rounds
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 22.46, (chi2, counts, expected)  # df = 5, p = 0.0005


def test_verify_sampling_uses_one_uniform_draw_and_returns_valid_tokens():
    params = SamplingParams(temperature=0.8, top_k=20)
    rng = np.random.default_rng(5)
    V, k = 200, 4
    logits = mx.array(softcapped(rng, k + 1, V))
    qlogits = mx.array(softcapped(rng, k, V))
    p_lp, q_lp = process(logits, params), process(qlogits, params)
    s1, s2 = Sampler(params, seed=9), Sampler(params, seed=9)
    drafts = mx.random.categorical(q_lp, key=mx.random.key(1)).tolist()
    n, tok = verify.verify_sampling(p_lp, q_lp, drafts, s1)
    # same seed, same math by hand: k+1 uniforms from the sampler's next key, probabilities = exp(log-probs)
    u = s2.uniform((k + 1,))
    assert (n, tok) == rejection_oracle(np.array(mx.exp(p_lp)), np.array(mx.exp(q_lp)), drafts, np.array(u))
    assert 0 <= n <= k and math.isfinite(float(p_lp[n, tok].item()))  # never a filtered-out token


# -- Metal (Mac only) ---------------------------------------------------------------------------------------------------
@needs_metal
def test_metal_kernels_match_reference():
    rng = np.random.default_rng(21)
    for x, drafts in greedy_cases(rng, 202048 // 8):
        xm = mx.array(x)
        out = accept.greedy_accept_call(xm, drafts).run_metal()[0].tolist()
        assert tuple(out) == accept.greedy_accept_reference(xm, drafts)
    for p, q, drafts, u in rejection_cases(rng, 25000):
        args = (mx.array(p), None if q is None else mx.array(q), drafts, mx.array(u))
        out = accept.rejection_accept_call(*args).run_metal()[0].tolist()
        assert tuple(out) == accept.rejection_accept_reference(*args)
