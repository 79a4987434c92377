"""N-gram prompt lookup (Saxena 2023; vLLM's `ngram` speculator): draft by copying what followed the latest earlier
occurrence of the context's last n tokens (n from `max_n` down to `min_n`). No model, no taps, near-zero cost; it
pays when the output quotes or edits its input (summaries with quotes, code edits, structured data, repetition).

Drafts are deterministic, so at temperature > 0 the drafter's q is a point mass on each draft: rejection sampling
accepts draft x with probability p(x) and on rejection samples from normalize(max(0, p − onehot(x))) — p with x
removed — which is still exactly the target's distribution (verify.verify_sampling does this given the one-hot q).
"""

from __future__ import annotations

import mlx.core as mx


class NGramIndex:
    """Latest and previous end position of every n-gram (n in [min_n, max_n]) of a growing token list.

    An n-gram "ending at e" covers tokens[e-n:e]; what followed it starts at tokens[e]. The context's own suffix is
    always the latest occurrence, so lookup uses the one before it."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}
        self.prev: dict[tuple, int] = {}

    def reset(self, ids: list[int]) -> None:
        self.tokens, self.last, self.prev = [], {}, {}
        self.extend(ids)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(int(t))
            e = len(toks)
            for n in range(self.min_n, min(self.max_n, e) + 1):
                key = tuple(toks[e - n:])
                old = self.last.get(key)
                if old is not None:
                    self.prev[key] = old
                self.last[key] = e

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest matching earlier n-gram, and that n (0: no match)."""
        toks = self.tokens
        e = len(toks)
        if k <= 0:
            return [], 0
        for n in range(min(self.max_n, e), self.min_n - 1, -1):
            key = tuple(toks[e - n:])
            start = self.prev.get(key) if self.last.get(key) == e else self.last.get(key)
            if start is not None and start < e:
                return toks[start:start + k], n
        return [], 0


class NGramDrafter:
    """Prompt-lookup drafter (speculative.protocol.Drafter); it needs no taps and no model."""

    kind = "ngram"
    width_name = "n-gram drafts"
    taps: tuple = ()
    measured_tau = None

    def __init__(self, vocab_size: int, max_drafts: int = 8, min_n: int = 1, max_n: int = 4):
        if not isinstance(max_drafts, int) or isinstance(max_drafts, bool) or not 1 <= max_drafts <= 64:
            raise ValueError(f"n-gram max_drafts must be an int in [1, 64], got {max_drafts!r}")
        self.vocab_size, self.max_drafts = vocab_size, max_drafts
        self.index = NGramIndex(min_n, max_n)

    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        self.index.reset(ids)

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        self.index.extend(new_tokens)

    # -- prompt-cache reuse (session.Session): the index is rebuilt from the new prompt ---------------------------
    def context_length(self) -> int:
        return max(0, len(self.index.tokens) - 1)

    def rewind_context(self, keep: int) -> int:
        return max(0, min(keep, self.context_length()))

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        self.index.reset(ids)

    def parts(self) -> tuple:
        return (self,)

    def stats(self) -> dict:
        return {}

    def peek(self, k: int) -> tuple[list[int], int]:
        """What `propose` would draft now (at most k tokens) and the matched n-gram size, without side effects."""
        return self.index.lookup(min(k, self.max_drafts))

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        toks = self.index.tokens
        if not toks or toks[-1] != anchor:
            raise RuntimeError("n-gram drafter out of sync with the committed tokens")
        drafts, _ = self.peek(k)
        if not drafts or sampler.params.greedy:
            return drafts, None
        return drafts, point_mass_logprobs(drafts, self.vocab_size)


def point_mass_logprobs(drafts: list[int], vocab_size: int) -> mx.array:
    """[k, V] log-probabilities of one-hot distributions on each draft (0 at the draft, -inf elsewhere)."""
    k = len(drafts)
    hot = mx.arange(vocab_size)[None, :] == mx.array(drafts, dtype=mx.int32)[:, None]
    return mx.where(hot, mx.zeros((k, vocab_size)), mx.full((k, vocab_size), -mx.inf))
