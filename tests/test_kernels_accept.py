"""Fused greedy and rejection-sampling acceptance: the .metal kernels (through the MSL-on-CPU harness, and through
MLX on a Mac), the pure-MLX references, numpy oracles, the NaN policy, deliberately broken kernels (mutants) that
the tests must reject, and the verifier wired to them."""

from __future__ import annotations

import dataclasses
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
NAN = float("nan")
NEG_NAN = float(np.copysign(np.float32(np.nan), -1))  # sign bit set: what x86 produces for 0 * inf


# -- oracles -----------------------------------------------------------------------------------------------------------
def greedy_oracle(logits: np.ndarray, drafts):
    sel = logits.argmax(-1)  # numpy: the first NaN of a row, else the first index of the maximum
    n = 0
    while n < len(drafts) and drafts[n] == sel[n]:
        n += 1
    return n, int(sel[n])


def np_weights(r: np.ndarray) -> np.ndarray:
    r = r.astype(np.float32)
    with np.errstate(invalid="ignore"):
        pos = r > 0
    out = np.zeros(r.shape, np.uint64)
    out[pos] = (np.minimum(r[pos], np.float32(1)) * np.float32(2.0**38)).astype(np.uint64)
    return out


def rejection_oracle(p: np.ndarray, q: np.ndarray | None, drafts, u: np.ndarray):
    """The documented math in numpy on probabilities (float32 products, exact integer weights)."""
    p, u = p.astype(np.float32), u.astype(np.float32)
    k = len(drafts)
    n = 0
    while n < k and np.float32(u[n] * q[n, drafts[n]]) <= p[n, drafts[n]]:
        n += 1
    w = np_weights(p[n])
    if n < k:
        wr = np_weights(p[n] - q[n].astype(np.float32))
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


def run_greedy_kernel(logits, drafts, spec=None):
    call = accept.greedy_argmax_call(logits)
    if spec is not None:
        call.spec = spec
    sel = harness.run(call)[0]
    return accept.accept_from_argmax(sel, drafts).tolist(), sel.tolist()


def greedy_kernel(logits, drafts, spec=None):
    (n, nxt), _ = run_greedy_kernel(logits, drafts, spec)
    return n, nxt


def run_rejection_kernel(p_lp, q_lp, drafts, u, spec=None):
    call = accept.rejection_accept_logprobs_call(p_lp, q_lp, drafts, u)
    if spec is not None:
        call.spec = spec
    out = harness.run(call)[0].tolist()
    return out[0], out[1]


def mutant(spec, old: str, new: str, count: int | None = None):
    """`spec` with its real .metal text changed: `old` -> `new` (which must occur, `count` times if given)."""
    src = spec.source
    assert old in src, f"mutation site {old!r} not in {spec.filename}: update the mutant"
    if count is not None:
        assert src.count(old) == count, (old, src.count(old))
    return dataclasses.replace(spec, name=f"{spec.name}_mutant_{abs(hash((old, new))) % 10**8}",
                               text=src.replace(old, new))


def greedy_cases(rng, V):
    """(logits, drafts) covering k = 0, 15, all accepted, none accepted, a mismatch in the middle, ties."""
    cases = []
    for k, n_match in [(0, 0), (15, 15), (15, 0), (7, 3), (3, 3), (1, 0)]:
        x = softcapped(rng, k + 1, V)
        sel = x.argmax(-1)
        drafts = [int(sel[j]) if j < n_match else int((sel[j] + 1 + j) % V) for j in range(k)]
        cases.append((x, drafts))
    # ties: the first index of the maximum wins (mx.argmax), across threads, simdgroups, and inside one thread
    nt = accept.threads_for(V)
    x = softcapped(rng, 4, V)
    for r, pos in enumerate([(5, V - 1), (V // 2, V // 2 + 1), (V - 2, V - 1), (3, 3 + nt if 3 + nt < V else V - 3)]):
        x[r, list(pos)] = 25.0
    cases.append((x, [5, V // 2, V - 2]))
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
    """V not a multiple of the threadgroup; k = 0 and 15; all / none accepted; ties; every row's argmax."""
    rng = np.random.default_rng(V + 1)
    for x, drafts in greedy_cases(rng, V):
        xm = mx.array(x).astype(dtype)
        ref = accept.greedy_accept_reference(xm, drafts)
        (n, nxt), sel = run_greedy_kernel(xm, drafts)
        assert (n, nxt) == ref
        assert sel == mx.argmax(xm, axis=-1).tolist()
        assert ref == greedy_oracle(np.array(xm.astype(mx.float32)), drafts)


@needs_cxx
def test_greedy_tie_inside_one_threads_strided_range_returns_the_first_index():
    """Thread t reads t, t + NT, …: a tie between two elements of the same thread must give the smaller index.
    The mutant that keeps the last of equal values (>= instead of >) is caught."""
    V = 3000
    nt = accept.threads_for(V)
    rng = np.random.default_rng(7)
    x = softcapped(rng, 3, V)
    x[0, [10, 10 + nt]] = 30.0
    x[1, [nt - 1, 2 * nt - 1]] = 30.0  # the last thread's first two slots
    x[2, [0, nt, 2 * nt]] = 30.0
    xm = mx.array(x)
    want = x.argmax(-1).tolist()
    assert want == [10, nt - 1, 0]
    assert run_greedy_kernel(xm, [10, nt - 1])[1] == want
    broken = mutant(accept.GREEDY, "if (key > bk) {", "if (key >= bk) {", count=1)
    assert run_greedy_kernel(xm, [10, nt - 1], broken)[1] != want


def test_greedy_nan_policy_is_mx_argmax():
    """What mx.argmax does with NaN on this MLX (CPU) — the policy the kernel implements: the first NaN wins; ties
    and ±0 go to the first index. If an MLX upgrade changes this, the kernel's policy must follow."""
    # a list, not a dict: (-0.0, 0.0) and (0.0, -0.0) are equal tuples, one dict key
    rows = [((1, NAN, 3), 1), ((NAN, 1, 3), 0), ((1, 3, NAN), 2), ((NAN, NAN, 1), 0), ((1, 2, NAN, NAN), 2),
            ((-math.inf, NAN), 1), ((math.inf, NAN), 1), ((-math.inf, -math.inf), 0), ((3, 3, 1), 0),
            ((-0.0, 0.0), 0), ((0.0, -0.0), 0)]
    for row, want in rows:
        assert mx.argmax(mx.array(row), stream=mx.cpu).item() == want == int(np.argmax(np.array(row))), row


def nan_cases(V):
    nt = accept.threads_for(V)
    rng = np.random.default_rng(V)
    x = softcapped(rng, 8, V)
    x[0, 0] = NEG_NAN                  # a NaN in thread 0's first slot
    x[1, [17, (17 + nt) % V]] = NAN    # two NaNs (in one thread's range when V > NT): the first
    x[1, 3] = 40.0                     # … beat a larger number elsewhere
    x[2, [V - 1, (5 + nt) % V]] = [NAN, NEG_NAN]  # NaNs of both signs in different threads
    x[3] = NAN                         # all NaN
    x[4] = -np.inf                     # all -inf: index 0
    x[5, :] = 0.0
    x[5, 9] = -0.0                     # -0 == +0: the first
    x[5, :5] = -0.0
    x[6, [40, 41]] = [np.inf, NAN]     # NaN above +inf
    x[7, [2 * nt % V, 1]] = np.inf     # +inf ties: the first
    return x


@needs_cxx
@pytest.mark.parametrize("V,dtype", [(2000, mx.float32), (700, mx.bfloat16), (300, mx.float16)])
def test_greedy_kernel_nan_inputs_match_mx_argmax(V, dtype):
    xm = mx.array(nan_cases(V)).astype(dtype)
    want = mx.argmax(xm, axis=-1, stream=mx.cpu).tolist()
    assert want == np.array(xm.astype(mx.float32)).argmax(-1).tolist()
    assert run_greedy_kernel(xm, [want[0]] + [0] * 6)[1] == want
    # without the NaN rule a negative NaN orders below -inf (a positive NaN's key is above +inf anyway; MLX's
    # bfloat16 conversion drops the sign, so those rows hold positive NaNs only)
    xf = np.array(xm.astype(mx.float32))
    negative_nan = bool(np.any(np.isnan(xf) & np.signbit(xf)))
    assert negative_nan == (dtype != mx.bfloat16)
    broken = mutant(accept.GREEDY, "isnan(v) ? 0xffffffffu : ", "", count=1)
    assert (run_greedy_kernel(xm, [0] * 7, broken)[1] != want) == negative_nan


@needs_cxx
def test_greedy_kernel_reads_nothing_outside_the_logits():
    """Bounds-checked buffers: a kernel that reads one element past its row's end is an error (last row: past the
    buffer's end), not a silently different answer."""
    x = mx.array(softcapped(np.random.default_rng(3), 4, 1000))
    broken = mutant(accept.GREEDY, "i < V; i += int(nt)", "i <= V; i += int(nt)", count=1)
    with pytest.raises(harness.HarnessError, match="out-of-bounds"):
        run_greedy_kernel(x, [0, 0, 0], broken)


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
def logdist(rng, rows, V, sharp=3.0, keep=None):
    z = rng.standard_normal((rows, V)).astype(np.float32) * sharp
    if keep is not None:  # top-k-style filtering: zero probability outside
        thr = np.sort(z, -1)[:, -keep][:, None]
        z = np.where(z >= thr, z, -np.inf)
    m = z.max(-1, keepdims=True)
    return (z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))).astype(np.float32)


def zero_residual_case(p_lp):
    q_lp = p_lp[:2].copy()
    q_lp[0, 0] = p_lp[0, 0] + np.float32(np.log(1.5))  # q_0 >= p_0 everywhere; draft 0 rejected with u close to 1
    return p_lp, q_lp, [0, 1], np.array([0.9999999, 0.5, 0.3], np.float32)


def rejection_cases(rng, V):
    """(p log-probs, q log-probs, drafts, u)."""
    cases = []
    for k in (0, 1, 5, 15):
        p, q = logdist(rng, k + 1, V), logdist(rng, max(k, 1), V)
        drafts = [int(rng.choice(V, p=np.exp(q[j].astype(np.float64)) / np.exp(q[j].astype(np.float64)).sum()))
                  for j in range(k)]
        cases.append((p, q if k else None, drafts, rng.random(k + 1).astype(np.float32)))
    k = 6  # all accepted: q == p on the drafted rows and u small
    p = logdist(rng, k + 1, V)
    cases.append((p, p[:k].copy(), [int(p[j].argmax()) for j in range(k)], np.full(k + 1, 0.25, np.float32)))
    p, q = logdist(rng, 4, V, keep=20), logdist(rng, 3, V)  # none accepted: a draft the target gives no mass
    cases.append((p, q, [int(np.argmin(p[0]))] + [1, 2], np.array([0.5, 0.1, 0.1, 0.9], np.float32)))
    cases.append(zero_residual_case(logdist(rng, 3, V)))  # residual zero everywhere: falls back to p_n
    p, q = logdist(rng, 5, V, keep=7), logdist(rng, 4, V, keep=7)  # filtered on both sides, u = 0
    drafts = [int(np.argmax(q[j])) for j in range(4)]
    cases.append((p, q, drafts, np.zeros(5, np.float32)))
    return cases


def probs(lp):
    """exp as MLX computes it (so the numpy oracle sees the reference's exact probabilities)."""
    return None if lp is None else np.array(mx.exp(mx.array(lp)))


def margs(p, q, drafts, u):
    return mx.array(p), None if q is None else mx.array(q), drafts, mx.array(u)


@pytest.mark.parametrize("V", [1000, 3001])
def test_rejection_reference_matches_oracle(V):
    rng = np.random.default_rng(V)
    for p, q, drafts, u in rejection_cases(rng, V):
        P, Q = probs(p), probs(q)
        ref = accept.rejection_accept_reference(mx.array(P), None if Q is None else mx.array(Q), drafts, mx.array(u))
        assert ref == rejection_oracle(P, Q, drafts, u)


@pytest.mark.parametrize("V", [1000, 3001])
def test_rejection_from_logprobs_equals_reference_on_probabilities(V):
    """The verifier's CPU path (exp only where read, lazily) is the reference on exp(log-probs)."""
    rng = np.random.default_rng(V + 3)
    for p, q, drafts, u in rejection_cases(rng, V):
        full = accept.rejection_accept_reference(mx.exp(mx.array(p)), None if q is None else mx.exp(mx.array(q)),
                                                 drafts, mx.array(u))
        assert accept.rejection_accept_reference_logprobs(*margs(p, q, drafts, u)) == full
    # MLX's exp is elementwise-deterministic: one row / gathered entries equal the full array's
    z = mx.array(rng.standard_normal((5, V)).astype(np.float32) * 10)
    e = np.array(mx.exp(z))
    assert np.array_equal(np.array(mx.exp(z[3])), e[3])
    idx = mx.array(rng.integers(0, V, 5).astype(np.int32))
    assert np.array_equal(np.array(mx.exp(z[mx.arange(5), idx])), e[np.arange(5), np.array(idx)])


def test_rejection_kernel_takes_the_logprobs_as_they_are():
    """No host-side exponentiation or cast of the [k+1, V] / [k, V] rows: the launch's inputs are the caller's
    log-prob arrays themselves."""
    rng = np.random.default_rng(0)
    p, q = mx.array(logdist(rng, 4, 500)).astype(mx.bfloat16), mx.array(logdist(rng, 3, 500))
    call = accept.rejection_accept_logprobs_call(p, q, [1, 2, 3], mx.array([0.1, 0.2, 0.3, 0.4]))
    assert call.inputs[0] is p and call.inputs[1] is q
    assert dict(call.template) == {"TP": mx.bfloat16, "TQ": mx.float32}


@needs_cxx
@pytest.mark.parametrize("V", [1000, 3001])
def test_rejection_kernel_equals_reference(V):
    rng = np.random.default_rng(V + 7)
    cases = rejection_cases(rng, V)
    for _ in range(6):  # random uniforms on the same distributions: other (n, token) paths
        p, q, drafts, _u = cases[2]
        cases.append((p, q, drafts, rng.random(len(drafts) + 1).astype(np.float32)))
    seen_n = set()
    for p, q, drafts, u in cases:
        args = margs(p, q, drafts, u)
        ref = accept.rejection_accept_reference_logprobs(*args)
        assert run_rejection_kernel(*args) == ref
        seen_n.add(ref[0] == len(drafts))
    assert seen_n == {True, False}  # both the correction and the bonus path were exercised


@needs_cxx
def test_rejection_kernel_half_precision_logprobs():
    rng = np.random.default_rng(5)
    for dt in (mx.bfloat16, mx.float16):
        for p, q, drafts, u in rejection_cases(rng, 1200)[1:4]:
            args = (mx.array(p).astype(dt), None if q is None else mx.array(q).astype(dt), drafts, mx.array(u))
            assert run_rejection_kernel(*args) == accept.rejection_accept_reference_logprobs(*args)


@needs_cxx
def test_rejection_zero_residual_falls_back_to_target():
    rng = np.random.default_rng(2)
    p, q, drafts, u = zero_residual_case(logdist(rng, 3, 500, sharp=1.0))
    args = margs(p, q, drafts, u)
    ref = accept.rejection_accept_reference_logprobs(*args)
    assert ref[0] == 0 and ref == rejection_oracle(probs(p), probs(q), drafts, u) == run_rejection_kernel(*args)
    P0 = probs(p)[0].astype(np.float64)
    assert ref[1] == int(np.searchsorted(np.cumsum(P0), 0.3 * P0.sum(), side="right"))  # inverse CDF of p_0 at 0.3


@needs_cxx
def test_rejection_nan_inputs():
    """NaN log-probs: at a draft's entry the draft is rejected (u·q <= p is false); in the drawn row a NaN weighs 0
    (never drawn). Kernel, reference and oracle agree."""
    rng = np.random.default_rng(9)
    V = 800
    p, q = logdist(rng, 4, V), logdist(rng, 3, V)
    drafts = [int(p[0].argmax()), int(p[1].argmax()), 3]
    cases = []
    p1 = p.copy()
    p1[1, drafts[1]] = NAN  # draft 1 rejected; its residual row holds the NaN
    cases.append((p1, q, drafts, np.array([0.2, 0.2, 0.2, 0.5], np.float32)))
    q2 = q.copy()
    q2[0, drafts[0]] = NAN  # draft 0 rejected through q
    q2[0, 10:20] = NAN
    cases.append((p, q2, drafts, np.array([0.2, 0.2, 0.2, 0.999], np.float32)))
    p3 = p.copy()
    p3[3, :50] = NAN  # the bonus row: NaN weighs 0
    q3 = p3[:3].copy()
    cases.append((p3, q3, [int(p3[j].argmax()) for j in range(3)], np.array([0.1, 0.1, 0.1, 0.0], np.float32)))
    for c in cases:
        args = margs(*c)
        ref = accept.rejection_accept_reference_logprobs(*args)
        assert ref == rejection_oracle(probs(c[0]), probs(c[1]), c[2], c[3]) == run_rejection_kernel(*args)
    assert [accept.rejection_accept_reference_logprobs(*margs(*c))[0] for c in cases] == [1, 0, 3]
    assert not np.isnan(cases[2][0][3, accept.rejection_accept_reference_logprobs(*margs(*cases[2]))[1]])


@needs_cxx
def test_rejection_kernel_mutants_are_caught():
    """Deliberately broken kernels give other answers on the test cases (or harness errors)."""
    rng = np.random.default_rng(11)
    cases = [c for c in rejection_cases(rng, 1500) if c[1] is not None]
    good = [accept.rejection_accept_reference_logprobs(*margs(*c)) for c in cases]
    mutants = [
        ("simd_prefix_inclusive_sum", "simd_prefix_exclusive_sum"),      # off by one in the inverse CDF
        ("t < base + w", "t <= base + w"),                                 # the wrong segment at a boundary
        ("wr += GLIMMER_W(pi - qi);", "wr += GLIMMER_W(pi);"),             # no residual
    ]
    caught = []
    for old, new in mutants:
        spec = mutant(accept.REJECTION, old, new)
        try:
            got = [run_rejection_kernel(*margs(*c), spec=spec) for c in cases]
        except harness.HarnessError:
            got = None
        caught.append(got != good)
    assert caught == [True, True, True]


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
        assert tuple(accept.greedy_accept_kernel_arrays(xm, drafts).tolist()) == \
            accept.greedy_accept_reference(xm, drafts)
    xm = mx.array(nan_cases(202048 // 8))
    assert accept.greedy_argmax_call(xm).run_metal()[0].tolist() == mx.argmax(xm, axis=-1, stream=mx.cpu).tolist()
    for p, q, drafts, u in rejection_cases(rng, 25000):
        args = margs(p, q, drafts, u)
        assert tuple(accept.rejection_accept_kernel_arrays(*args).tolist()) == \
            accept.rejection_accept_reference_logprobs(*args)
