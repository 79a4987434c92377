"""Lossless acceptance, shared by every drafter: the only place where drafts are accepted or rejected.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then append the target's own token.
Sampling (Leviathan et al. 2023 / Chen et al. 2023): accept draft j with probability min(1, p_j(x_j) / q_j(x_j)); at
the first rejection sample from normalize(max(0, p_j − q_j)); if all drafts are accepted, sample the bonus token from
the last target row. p and q are the target's and the drafter's distributions after the *same* processing
(`sampling.process`). The output distribution is exactly the target's.
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import Sampler, greedy_token, process


def row_histories(history: list[int], drafts: list[int], rows: int, size: int) -> mx.array:
    """[rows, size] token windows: row j sees history + drafts[:j] (for the repetition penalty)."""
    seqs = [(history + drafts[:j])[-size:] for j in range(rows)]
    width = max(len(s) for s in seqs)
    if width == 0:
        return None
    # left-pad with the row's first token: repeating a token does not change the penalty (it is set-based)
    return mx.array([[s[0]] * (width - len(s)) + s for s in seqs], dtype=mx.int32)


def histories_for(sampler: Sampler, history: list[int], drafts: list[int], rows: int):
    p = sampler.params
    if p.repetition_penalty == 1.0:
        return None
    return row_histories(history, drafts, rows, p.repetition_context_size)


def verify_greedy(target_logits: mx.array, drafts: list[int], sampler: Sampler, history: list[int]):
    """target_logits [k+1, V]; returns (n_accepted, next_token)."""
    k = len(drafts)
    sel = greedy_token(target_logits, sampler.params, histories_for(sampler, history, drafts, k + 1)).tolist()
    n = 0
    while n < k and drafts[n] == sel[n]:
        n += 1
    return n, sel[n]


def verify_sampling(p_logprobs: mx.array, q_logprobs: mx.array, drafts: list[int], sampler: Sampler):
    """p_logprobs [k+1, V] (target, processed), q_logprobs [k, V] (drafter, processed, the distributions the drafts
    were sampled from); returns (n_accepted, next_token)."""
    k = len(drafts)
    if k == 0:
        return 0, int(mx.random.categorical(p_logprobs[0], key=sampler.next_key()).item())
    d = mx.array(drafts, dtype=mx.int32)[:, None]
    lp = mx.take_along_axis(p_logprobs[:k], d, axis=-1)[:, 0]
    lq = mx.take_along_axis(q_logprobs, d, axis=-1)[:, 0]
    u = sampler.uniform((k,))
    accept = mx.log(u) <= lp - lq  # u <= p/q
    # number of leading accepts
    n = int(mx.sum(mx.cumprod(accept.astype(mx.int32))).item())
    if n == k:
        return n, int(mx.random.categorical(p_logprobs[k], key=sampler.next_key()).item())
    residual = mx.maximum(mx.exp(p_logprobs[n]) - mx.exp(q_logprobs[n]), 0.0)
    total = mx.sum(residual)
    # total == 0 only when p_n == q_n, where a rejection has probability 0; fall back to p_n for safety
    logits = mx.where(total > 0, mx.log(residual), p_logprobs[n])
    return n, int(mx.random.categorical(logits, key=sampler.next_key()).item())


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
        h = mx.array((history + drafts)[-params.repetition_context_size:], dtype=mx.int32)
        if params.greedy:
            drafts.append(int(greedy_token(q_logits[j : j + 1], params, h).item()))
        else:
            qj = process(q_logits[j : j + 1], params, h)
            rows.append(qj)
            drafts.append(int(mx.random.categorical(qj[0], key=sampler.next_key()).item()))
    return drafts, (mx.concatenate(rows) if rows else None)


def target_distribution(target_logits: mx.array, sampler: Sampler, history: list[int], drafts: list[int]):
    return process(target_logits, sampler.params, histories_for(sampler, history, drafts, target_logits.shape[0]))
