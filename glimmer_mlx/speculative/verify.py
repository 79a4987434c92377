"""Lossless acceptance, shared by every drafter: the only place where drafts are accepted or rejected.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then append the target's own token.
Sampling (Leviathan et al. 2023 / Chen et al. 2023): accept draft j with probability min(1, p_j(x_j) / q_j(x_j)); at
the first rejection sample from normalize(max(0, p_j − q_j)); if all drafts are accepted, sample the bonus token from
the last target row. p and q are the target's and the drafter's distributions after the *same* processing
(`sampling.process`). The output distribution is exactly the target's.

Token trees (`tree.TokenTree`; one target forward over the flattened nodes, row i predicting the token after node i):
greedy accepts the deepest path whose every node equals the target's argmax at its parent, then appends the
target's argmax at the path's end. Sampling is SpecInfer's multi-candidate recursive rejection sampling (Miao et al.
2024, "SpecInfer: Accelerating Generative LLM Serving with Tree-based Speculative Inference and Verification",
Algorithm 2 "VerifyStochastic"): at the current node, with p the target's distribution there, the children are
tried in order; child c (token x, drawn from the drafter's q_c) is accepted with probability min(1, p(x) / q_c(x))
and the walk moves on to it with p its own target row; after a rejection p ← normalize(max(0, p − q_c)) before the
next sibling; when every child is rejected (or the node is a leaf) the next token is sampled from that residual.
Each sibling step is one lossless single-draft rejection step against the current residual, so by induction the
emitted token at every depth is distributed exactly as the target's p — provided q_c is the distribution x was
drawn from *given the siblings before it*: for siblings drawn i.i.d. from one q (SpecInfer) every q_c is that q;
for siblings drawn without replacement from q, q_c is q with the earlier siblings' tokens removed and renormalized
(SpecTr, Sun et al. 2023, treats the same case); for a deterministic drafter (n-gram lookup: distinct candidates
chosen without randomness) q_c is the point mass on x, so x is accepted with probability p(x) and the residual is
p with x removed and renormalized — every candidate is accepted with exactly its target probability
(p(x1) + p(x2) + … in all), the most any acceptance rule can give.
"""

from __future__ import annotations

import mlx.core as mx

from ..kernels import greedy_accept, rejection_accept_logprobs
import numpy as np

from ..sampling import Sampler, apply_repetition_penalty, greedy_token, history_rows, history_window, process
from .tree import TokenTree


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


def expected_acceptance(p_logprobs: mx.array, q_logprobs: mx.array | None, drafts: list[int],
                        host: bool | None = None) -> list[tuple[float, float]]:
    """What `verify_sampling` accepts of these drafts on average, its uniforms integrated out (a Rao-Blackwellized
    measure of the drafter's acceptance, for `auto`'s estimates): per draft j, (w_j, w_j · a_j) with
    w_j = Π_{i<j} min(1, p_i(x_i) / q_i(x_i)) the probability the round reaches draft j given the drafts before it,
    and a_j = Σ_x min(p_j(x), q_j(x)) the probability draft j is accepted there, over its own draw. 1 + Σ_j w_j a_j is
    the round's expected tokens given its drafts: an unbiased measure of what its rounds commit, and of each α_j as
    `auto.chooser.AcceptanceStats.update` counts them. q_logprobs None: deterministic drafts (n-gram lookup), q a
    point mass, so both are p_j(x_j). host: computed by numpy (default: where MLX runs on the CPU, whose exp is
    several times slower than numpy's: [7, 202 048] rows took 18 ms against 2.6 ms on a 2-core x86 VM, the
    embedded model's [7, 4 096] 0.37 ms against 0.03) or by MLX on its device (a GPU: one pass over rows it holds)."""
    k = len(drafts)
    if k == 0:
        return []
    if host is None:
        host = mx.default_device().type == mx.DeviceType.cpu
    if host:
        p = np.asarray(_f32(p_logprobs))[:k]
        px = p[np.arange(k), drafts]
        if q_logprobs is None:
            rs = as_ = np.exp(px)
        else:
            q = np.asarray(_f32(q_logprobs))[:k]
            rs = np.exp(np.minimum(px - q[np.arange(k), drafts], 0.0))
            as_ = np.exp(np.minimum(p, q)).sum(axis=1)
        rs, as_ = rs.tolist(), as_.tolist()
    else:
        p = _f32(p_logprobs)[:k]
        idx = mx.array(drafts, dtype=mx.int32)[:, None]
        px = mx.take_along_axis(p, idx, axis=1)[:, 0]
        if q_logprobs is None:
            rs = as_ = mx.exp(px)
        else:
            q = _f32(q_logprobs)[:k]
            rs = mx.exp(mx.minimum(px - mx.take_along_axis(q, idx, axis=1)[:, 0], 0.0))
            as_ = mx.exp(mx.minimum(p, q)).sum(axis=1)
        rs, as_ = mx.stack([rs, as_]).tolist()
    out, w = [], 1.0
    for j in range(k):  # (a NaN, as the verifier treats one at a draft's entry, accepts nothing)
        a, r = as_[j], rs[j]
        out.append((w, w * (min(max(a, 0.0), 1.0) if a == a else 0.0)))
        w *= min(max(r, 0.0), 1.0) if r == r else 0.0
    return out


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


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


# -- token trees ---------------------------------------------------------------------------------------------------

def tree_history_rows(params, history: list[int], tree: TokenTree) -> mx.array | None:
    """[N, size] repetition-penalty windows for a tree's rows: node i sees history + the tokens of its path (the
    tree form of `sampling.history_rows`, padded the same way); None without a penalty."""
    if params.repetition_penalty == 1.0:
        return None
    size = params.repetition_context_size
    seqs = [(history + tree.path_tokens(i))[-size:] for i in range(len(tree))]
    width = max(len(s) for s in seqs)
    if width == 0:
        return None
    return mx.array([[s[0]] * (width - len(s)) + s for s in seqs], dtype=mx.int32)


def verify_tree_greedy(target_logits: mx.array, tree: TokenTree, sampler: Sampler, history: list[int]):
    """target_logits [N, V] over the tree's nodes; returns (accepted nodes root-first without the root, next token).

    The deepest path whose every node is the target's argmax at its parent (siblings are distinct tokens, so at
    most one child can match), then the target's argmax at the path's end."""
    p = sampler.params
    x = apply_repetition_penalty(target_logits.astype(mx.float32), tree_history_rows(p, history, tree),
                                 p.repetition_penalty)
    best = mx.argmax(x, axis=-1).tolist()
    path, node = [], 0
    while True:
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)
        node = nxt


def tree_target_distribution(target_logits: mx.array, sampler: Sampler, history: list[int], tree: TokenTree):
    """The target's processed log-probabilities [N, V] at every node (node i's history: history + its path)."""
    return process(target_logits, sampler.params, tree_history_rows(sampler.params, history, tree))


def sibling_residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """SpecInfer's update after sibling x (drawn from q; None: a point mass on x) is rejected:
    normalize(max(0, p − q))."""
    r = p.copy()
    if q is None:
        r[x] = 0.0
    else:
        r = np.maximum(r - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else r


def sample_row(p: np.ndarray, u: float) -> int:
    """Inverse CDF of p (float64, sums to 1 up to rounding) at u in [0, 1): never a token of zero probability."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return min(i, len(p) - 1)


def verify_tree_sampling(p_logprobs: mx.array, tree: TokenTree, q_logprobs: mx.array | None, sampler: Sampler):
    """Multi-candidate recursive rejection sampling (SpecInfer; module docstring). p_logprobs [N, V]: the target's
    processed log-probabilities at each node; q_logprobs: [N, V] or a list of N rows ([V] or [1, V]; None for a
    deterministic node, a point mass), row c (c >= 1) the processed distribution node c's token was drawn from
    given its earlier siblings; or None when every node is a deterministic candidate. Returns (accepted nodes
    root-first without the root, next token). Exact arithmetic in float64."""
    u = np.array(sampler.uniform((len(tree),)), dtype=np.float64)  # at most N - 1 sibling tests + 1 final draw
    ui, node, path = 0, 0, []
    p = np.exp(np.array(p_logprobs[0].astype(mx.float32), dtype=np.float64))
    while True:
        moved = False
        for c in tree.children[node]:
            x = tree.tokens[c]
            row = None if q_logprobs is None else q_logprobs[c]
            q = None if row is None else np.exp(np.array(row.reshape(-1).astype(mx.float32), dtype=np.float64))
            qx = 1.0 if q is None else q[x]
            accept = p[x] > 0 and u[ui] * qx <= p[x]
            ui += 1
            if accept:
                path.append(c)
                node, moved = c, True
                p = np.exp(np.array(p_logprobs[c].astype(mx.float32), dtype=np.float64))
                break
            p = sibling_residual(p, q, x)
        if not moved:
            return path, sample_row(p, u[ui])
