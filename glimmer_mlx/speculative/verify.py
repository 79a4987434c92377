"""Lossless acceptance, shared by every drafter: the only place where drafts are accepted or rejected.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then append the target's own token.
Sampling (Leviathan et al. 2023 / Chen et al. 2023): accept draft j with probability min(1, p_j(x_j) / q_j(x_j)); at
the first rejection sample from normalize(max(0, p_j − q_j)); if all drafts are accepted, sample the bonus token from
the last target row. p and q are the target's and the drafter's distributions after the *same* processing
(`sampling.process`). The output distribution is exactly the target's.
"""

from __future__ import annotations

import mlx.core as mx

from ..kernels import greedy_accept, rejection_accept_logprobs
from ..sampling import Sampler, apply_repetition_penalty, greedy_token, history_rows, history_window, process


def verify_greedy(target_logits: mx.array, drafts: list[int], sampler: Sampler, history: list[int]):
    """target_logits [k+1, V]; returns (n_accepted, next_token) (fused argmax + compare: `kernels.greedy_accept`)."""
    k = len(drafts)
    p = sampler.params
    x = apply_repetition_penalty(target_logits.astype(mx.float32), history_rows(p, history, drafts, k + 1),
                                 p.repetition_penalty)  # greedy_token's input
    return greedy_accept(x, drafts)


def verify_sampling(p_logprobs: mx.array, q_logprobs: mx.array, drafts: list[int], sampler: Sampler):
    """p_logprobs [k+1, V] (target, processed), q_logprobs [k, V] (drafter, processed, the distributions the drafts
    were sampled from); returns (n_accepted, next_token).

    One draw of k+1 uniforms: u_j * q_j(d_j) <= p_j(d_j) accepts draft j; the last uniform picks the correction from
    normalize(max(0, p_n - q_n)) (or the bonus from p_k) by inverse CDF over exact integer weights
    (`kernels.rejection_accept`, fused on Metal; see metal_kernels/rejection_accept.metal)."""
    u = sampler.uniform((len(drafts) + 1,))
    return rejection_accept_logprobs(p_logprobs, q_logprobs, drafts, u)


def draft_tokens(q_logits: mx.array, sampler: Sampler, history: list[int]):
    """Choose k drafts from raw draft logits [k, V]. Returns (drafts, q_logprobs or None).

    Greedy: argmax rows (with the repetition penalty seeing earlier drafts). Sampling: each row sampled from its
    processed distribution, which is returned for verification."""
    params = sampler.params
    k = q_logits.shape[0]
    if params.repetition_penalty == 1.0:
        if params.greedy:
            return greedy_token(q_logits, params).tolist(), None
        q = process(q_logits, params)
        return mx.random.categorical(q, axis=-1, key=sampler.next_key()).tolist(), q
    # the penalty depends on earlier drafts: choose row by row
    drafts, rows = [], []
    for j in range(k):
        h = history_window(params, history + drafts)
        if params.greedy:
            drafts.append(int(greedy_token(q_logits[j : j + 1], params, h).item()))
        else:
            qj = process(q_logits[j : j + 1], params, h)
            rows.append(qj)
            drafts.append(int(mx.random.categorical(qj[0], key=sampler.next_key()).item()))
    return drafts, (mx.concatenate(rows) if rows else None)


def target_distribution(target_logits: mx.array, sampler: Sampler, history: list[int], drafts: list[int]):
    return process(target_logits, sampler.params, history_rows(sampler.params, history, drafts, target_logits.shape[0]))
