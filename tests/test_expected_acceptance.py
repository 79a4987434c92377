"""`verify.expected_acceptance`: what a sampled round's drafts are accepted on average (its uniforms and its drafts'
own draws integrated out), the measure `auto` learns from at T > 0. Oracles: exact enumeration of every draft
sequence with its probability (numpy), and the verifier itself run over many uniforms."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative.auto.chooser import AcceptanceStats
from glimmer_mlx.speculative.verify import expected_acceptance, verify_sampling


def _rows(rng, k, V, sharp=2.0):
    x = rng.standard_normal((k, V)) * sharp
    x[:, rng.integers(0, V)] = -np.inf  # a token each row never proposes (q = 0) nor accepts (p = 0)
    x = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x.astype(np.float32)


def _expected_tokens(out):
    return 1.0 + sum(s for _, s in out)


@pytest.mark.parametrize("host", [True, False])  # numpy, or MLX on its device
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_tokens_are_exact_over_every_draft_sequence(seed, host):
    """Σ over every draft sequence x (probability Π q_j(x_j)) of expected_acceptance's 1 + Σ_j s_j equals the exact
    expected tokens of speculative sampling, Σ_x Π q_j(x_j) (1 + Σ_j Π_{i<=j} min(1, p_i(x_i) / q_i(x_i))), and
    each w_j, s_j averages to P(draft j reached), P(draft j accepted)."""
    rng = np.random.default_rng(seed)
    k, V = 3, 5
    p, q = _rows(rng, k + 1, V), _rows(rng, k, V)
    P, Q = np.exp(p.astype(np.float64)), np.exp(q.astype(np.float64))
    exact_tokens = got_tokens = 0.0
    reach, accept = np.zeros(k), np.zeros(k)
    got_reach, got_accept = np.zeros(k), np.zeros(k)
    for xs in itertools.product(range(V), repeat=k):
        prob = float(np.prod([Q[j, x] for j, x in enumerate(xs)]))
        if prob == 0.0:
            continue
        r = [min(1.0, P[j, x] / Q[j, x]) for j, x in enumerate(xs)]
        run = np.cumprod(r)  # P(drafts 0..j all accepted | these drafts)
        exact_tokens += prob * (1.0 + run.sum())
        reach += prob * np.concatenate([[1.0], run[:-1]])
        accept += prob * run
        out = expected_acceptance(mx.array(p), mx.array(q), list(xs), host=host)
        got_tokens += prob * _expected_tokens(out)
        got_reach += prob * np.array([w for w, _ in out])
        got_accept += prob * np.array([s for _, s in out])
    assert got_tokens == pytest.approx(exact_tokens, rel=1e-5)
    np.testing.assert_allclose(got_reach, reach, rtol=1e-5)
    np.testing.assert_allclose(got_accept, accept, rtol=1e-5)


def test_reach_weights_match_the_verifier_over_its_uniforms():
    """For fixed drafts, how often `verify_sampling` (the real acceptance) reaches and accepts each draft over many
    seeds is what the reach weights say: w_{j+1} = P(drafts 0..j accepted | the drafts)."""
    rng = np.random.default_rng(7)
    k, V = 4, 6
    p, q = _rows(rng, k + 1, V, sharp=1.0), _rows(rng, k, V, sharp=1.0)
    Q = np.exp(q.astype(np.float64))
    drafts = [int(rng.choice(V, p=Q[j] / Q[j].sum())) for j in range(k)]
    out = expected_acceptance(mx.array(p), mx.array(q), drafts)
    n_runs = 4000
    counts = np.zeros(k + 1)
    for s in range(n_runs):
        n, _ = verify_sampling(mx.array(p), mx.array(q), drafts, Sampler(SamplingParams(temperature=1.0), seed=s))
        counts[n] += 1
    at_least = counts[::-1].cumsum()[::-1] / n_runs  # P(n >= j) for j = 0..k
    w = [w for w, _ in out] + [out[-1][0] * min(1.0, np.exp(p[k - 1, drafts[-1]] - q[k - 1, drafts[-1]]))]
    for j in range(1, k + 1):
        se = np.sqrt(w[j] * (1 - w[j]) / n_runs) + 1e-3
        assert abs(at_least[j] - w[j]) < 4 * se, (j, at_least[j], w[j])


@pytest.mark.parametrize("host", [True, False])
def test_deterministic_drafts_are_accepted_with_their_target_probability(host):
    """q None (n-gram lookup's point masses): each draft is accepted with p_j(x_j), reached with the product before."""
    rng = np.random.default_rng(3)
    p = _rows(rng, 4, 7)
    drafts = [1, 2, 3]
    px = [float(np.exp(p[j, x])) for j, x in enumerate(drafts)]
    out = expected_acceptance(mx.array(p), None, drafts, host=host)
    assert out[0] == pytest.approx((1.0, px[0]), rel=1e-5)
    assert out[1] == pytest.approx((px[0], px[0] * px[1]), rel=1e-5)
    assert out[2] == pytest.approx((px[0] * px[1], px[0] * px[1] * px[2]), rel=1e-5)
    assert expected_acceptance(mx.array(p), None, [], host=host) == []


def test_identical_distributions_accept_everything():
    rng = np.random.default_rng(5)
    q = _rows(rng, 3, 9)
    p = np.concatenate([q, _rows(rng, 1, 9)])
    out = expected_acceptance(mx.array(p), mx.array(q), [0, 1, 2])
    for w, s in out:
        assert w == pytest.approx(1.0, abs=1e-5) and s == pytest.approx(1.0, abs=1e-5)


def test_acceptance_stats_learn_the_expected_counts():
    """Fed expectations, the estimates are the ratio of the (decayed) expected counts: fed the exact α's every round
    they converge on them, whatever the coins of those rounds were (here every round reported 0 accepted)."""
    st = AcceptanceStats(3, decay=0.99, prior=(1.0, 2.0))
    alphas = [0.7, 0.4, 0.9]
    for _ in range(600):
        reach, out = 1.0, []
        for a in alphas:
            out.append((reach, reach * a))
            reach *= a
        st.update(3, 0, out)
    np.testing.assert_allclose(st.alphas(), alphas, atol=0.01)
    coins = AcceptanceStats(3, decay=0.99, prior=(1.0, 2.0))
    for _ in range(600):
        coins.update(3, 0)
    assert coins.alphas()[0] < 0.05  # without them: what the coins said


@pytest.mark.parametrize("host", [True, False])
def test_a_nan_accepts_nothing_and_never_reaches_the_estimates(host):
    """A NaN in the target's row (a broken forward) counts as the verifier counts it at a draft's entry — nothing
    accepted from there — instead of poisoning every count the estimates keep."""
    rng = np.random.default_rng(9)
    p, q = _rows(rng, 4, 6), _rows(rng, 3, 6)
    p[1, :] = np.nan
    out = expected_acceptance(mx.array(p), mx.array(q), [0, 1, 2], host=host)
    assert all(np.isfinite(w) and np.isfinite(s) and 0.0 <= s <= w <= 1.0 for w, s in out)
    assert out[1][1] == 0.0 and out[2] == (0.0, 0.0)
