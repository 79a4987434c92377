"""N-gram prompt lookup (Saxena 2023; vLLM's `ngram` speculator): draft by copying what followed the latest earlier
occurrence of the context's last n tokens (n from `max_n` down to `min_n`). No model, no taps, near-zero cost; it
pays when the output quotes or edits its input (summaries with quotes, code edits, structured data, repetition).

A continuation that runs into the context's end is copied on as an overlapping copy (LZ77's): an earlier occurrence
ending P tokens before the end predicts that the last P tokens repeat, so the draft continues with them again, as
many times as the drafts asked need. Without it a loop of period P (a repeated line, a table's rows, a model stuck
repeating itself) could never draft more than P tokens a round.

Drafts are deterministic, so at temperature > 0 the drafter's q is a point mass on each draft: rejection sampling
accepts draft x with probability p(x) and on rejection samples from normalize(max(0, p − onehot(x))) — p with x
removed — which is still exactly the target's distribution (verify.verify_sampling does this given the one-hot q).

Trees (`propose_tree`): several distinct continuations of the matched suffix — what followed each earlier occurrence
of the context's last n tokens, longest n first and the latest occurrence first, so the first path is the chain's
draft — merged into a trie within a node budget (`tree.TokenTree.from_paths`). The candidates are deterministic:
each node's q is the point mass on its token (verify.verify_tree_sampling with q None).
"""

from __future__ import annotations

import mlx.core as mx

from .tree import TokenTree


BULK = 16  # `NGramIndex.extend` by more tokens than this indexes them n by n (a pass per token is faster for a few)
SCAN_PER_PATH = 4  # occurrences of an n-gram looked at per continuation wanted (a frequent one has thousands)
# the option `auto` prices an offer as (`NGramDrafter.offer`): one per matched n-gram size, and one for an offer that
# goes on with a copy the output already follows
OPTION = "ngram@{}"
RUN = OPTION.format("run")


class NGramIndex:
    """Latest and previous end position of every n-gram (n in [min_n, max_n]) of a growing token list.

    An n-gram "ending at e" covers tokens[e-n:e]; what followed it starts at tokens[e]. The context's own suffix is
    always the latest occurrence, so lookup uses the one before it."""

    def __init__(self, min_n: int = 1, max_n: int = 4, all_ends: bool = False):
        """all_ends: also keep every end position of every n-gram (`continuations`, for trees)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.all_ends = all_ends
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}
        self.prev: dict[tuple, int] = {}
        self.ends: dict[tuple, list[int]] = {}

    def reset(self, ids: list[int]) -> None:
        self.tokens, self.last, self.prev, self.ends = [], {}, {}, {}
        self.extend(ids)

    def extend(self, new: list[int]) -> None:
        if len(new) > BULK:
            return self._extend_bulk(new)
        toks, last, prev = self.tokens, self.last, self.prev
        for t in new:
            toks.append(int(t))
            e = len(toks)
            for n in range(self.min_n, min(self.max_n, e) + 1):
                key = tuple(toks[e - n:])
                old = last.get(key)
                if old is not None:
                    prev[key] = old
                last[key] = e
                if self.all_ends:
                    self.ends.setdefault(key, []).append(e)

    def _extend_bulk(self, new: list[int]) -> None:
        """`extend` by many tokens (a prompt): for each n, the n-grams ending at the new positions in one pass, in
        order — the same index in half the time of a pass per token (~0.4 ms for 400 tokens here)."""
        toks = self.tokens
        first = len(toks) + 1  # the first end position added
        toks.extend(int(t) for t in new)
        end = len(toks)
        last, prev, ends = self.last, self.prev, self.ends
        for n in range(self.min_n, min(self.max_n, end) + 1):
            lo = max(first, n)  # the n-grams ending at e in [lo, end]
            keys = zip(*(toks[lo - n + i:end - n + 1 + i] for i in range(n)))
            for e, key in enumerate(keys, start=lo):
                old = last.get(key)
                if old is not None:
                    prev[key] = old
                last[key] = e
                if self.all_ends:
                    ends.setdefault(key, []).append(e)

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
                return self.copy(start, k), n
        return [], 0

    def copy(self, start: int, k: int) -> list[int]:
        """k tokens copied from position `start` on; past the context's end the copy reads its own output (the last
        e − start tokens repeating: module docstring)."""
        out = self.tokens[start:start + k]
        period = len(self.tokens) - start
        while len(out) < k:
            out.append(out[len(out) - period])
        return out

    def continuations(self, depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (each up to `depth` tokens) of the context's suffix: what followed
        the earlier occurrences of its last n tokens, n from max_n down, latest occurrence first (needs all_ends)."""
        if not self.all_ends:
            raise RuntimeError("NGramIndex.continuations needs an index built with all_ends=True")
        toks = self.tokens
        e = len(toks)
        out, seen = [], set()
        if depth <= 0:
            return out
        for n in range(min(self.max_n, e), self.min_n - 1, -1):
            ends = self.ends.get(tuple(toks[e - n:]), ())
            for start in reversed(ends[-(SCAN_PER_PATH * limit + 1):]):  # the latest ones: bounded work per round
                if start >= e:
                    continue  # the suffix itself
                c = tuple(self.copy(start, depth))
                # a continuation that is a prefix of one already taken adds no node
                if c and not any(s[:len(c)] == c for s in seen):
                    seen.add(c)
                    out.append(list(c))
                    if len(out) >= limit:
                        return out
        return out


class NGramDrafter:
    """Prompt-lookup drafter (speculative.protocol.Drafter); it needs no taps and no model."""

    kind = "ngram"
    width_name = "n-gram drafts"
    taps: tuple = ()
    measured_tau = None

    def __init__(self, vocab_size: int, max_drafts: int = 8, min_n: int = 1, max_n: int = 4, trees: bool = False):
        """trees: keep what `propose_tree` needs (every occurrence of every n-gram)."""
        if not isinstance(max_drafts, int) or isinstance(max_drafts, bool) or not 1 <= max_drafts <= 64:
            raise ValueError(f"n-gram max_drafts must be an int in [1, 64], got {max_drafts!r}")
        self.vocab_size, self.max_drafts = vocab_size, max_drafts
        self._index = NGramIndex(min_n, max_n, all_ends=trees)
        self._unindexed: list[int] = []  # tokens accepted since the index was last read (`index`)
        self._offered = None  # (position, drafts) of the latest `offer`
        self._copy = None  # ... and of the latest one at an earlier position than now

    @property
    def index(self) -> NGramIndex:
        """The index of every token accepted so far. Accepted tokens are indexed when it is next read, not as they
        come: a batch row that is not asked for a draft every step (`auto.batch.BatchAuto.asks`) indexes a few
        steps' tokens at once, the same work in one pass rather than a pass after every step's forward (8 auto rows
        of the embedded model on this repository's CPU: their `accept` 80-93 µs a step against plain rows' 17, 30 with
        the tokens indexed when asked; out of the loop a token costs ~1.6 µs)."""
        if self._unindexed:
            new, self._unindexed = self._unindexed, []
            self._index.extend(new)
        return self._index

    def _restart(self, ids: list[int]) -> None:
        self._unindexed = []
        self._index.reset(ids)
        self._offered = self._copy = None

    def fork(self) -> "NGramDrafter":
        """The same drafter with its own, empty index (a batch row's)."""
        ix = self._index  # (its settings only: the tokens still to index stay this drafter's)
        return NGramDrafter(self.vocab_size, self.max_drafts, ix.min_n, ix.max_n, trees=ix.all_ends)

    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        self._restart(ids)

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        self._unindexed.extend(new_tokens)

    # -- prompt-cache reuse (session.Session): the index is rebuilt from the new prompt ---------------------------
    def context_length(self) -> int:
        return max(0, len(self.index.tokens) - 1)

    def rewind_context(self, keep: int) -> int:
        return max(0, min(keep, self.context_length()))

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        self._restart(ids)

    def parts(self) -> tuple:
        return (self,)

    def stats(self) -> dict:
        return {}

    def peek(self, k: int) -> tuple[list[int], int]:
        """What `propose` would draft now (at most k tokens) and the matched n-gram size, without side effects."""
        return self.index.lookup(min(k, self.max_drafts))

    def offer(self, k: int) -> tuple[list[int], str]:
        """What `propose` would draft now (at most k tokens) and the option `auto` prices it as: `RUN` where it goes
        on with a copy the output already follows — the tokens committed since the latest earlier offer are that
        offer's drafts, and this one's first draft is its next — else the matched n-gram size's (`OPTION`). A copy
        confirmed that way is right far more often than a fresh match (`auto.multiplex.NGRAM_RUN_ALPHA`). Asked
        again at the same position it answers the same."""
        drafts, m = self.peek(k)
        p = len(self.index.tokens)
        last = self._offered
        if last is not None and last[0] < p:
            self._copy, last = last, None
        if not drafts:
            return drafts, ""
        name = RUN if self._runs(p, drafts[0]) else OPTION.format(m)
        if last is None or len(drafts) > len(last[1]):
            self._offered = (p, drafts)
        return drafts, name

    def _runs(self, p: int, first: int) -> bool:
        """Whether an offer at position `p` whose first draft is `first` goes on with the latest earlier offer."""
        if self._copy is None:
            return False
        q, drafts = self._copy
        c = p - q
        return 0 < c < len(drafts) and drafts[c] == first and self.index.tokens[q:p] == drafts[:c]

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        toks = self.index.tokens
        if not toks or toks[-1] != anchor:
            raise RuntimeError("n-gram drafter out of sync with the committed tokens")
        drafts, _ = self.peek(k)
        if not drafts or sampler.params.greedy:
            return drafts, None
        return drafts, point_mass_logprobs(drafts, self.vocab_size)


    def enable_trees(self) -> None:
        """Keep every occurrence of every n-gram from now on (`propose_tree`); the index is rebuilt once."""
        if not self.index.all_ends:
            self.index.all_ends = True
            self.index.reset(self.index.tokens)

    def propose_tree(self, anchor: int, pos: int, depth: int, budget: int, sampler, history: list[int]):
        """A token tree rooted at the anchor: distinct continuations of the matched suffix (at most `depth` tokens
        each, capped at max_drafts), merged within `budget` nodes besides the root. Returns (tree, None): the
        candidates are deterministic, each node's q a point mass on its token."""
        toks = self.index.tokens
        if not toks or toks[-1] != anchor:
            raise RuntimeError("n-gram drafter out of sync with the committed tokens")
        depth = min(depth, self.max_drafts)
        paths = self.index.continuations(depth, limit=budget)
        return TokenTree.from_paths(anchor, paths, budget, max_depth=depth), None


def point_mass_logprobs(drafts: list[int], vocab_size: int) -> mx.array:
    """[k, V] log-probabilities of one-hot distributions on each draft (0 at the draft, -inf elsewhere)."""
    k = len(drafts)
    hot = mx.arange(vocab_size)[None, :] == mx.array(drafts, dtype=mx.int32)[:, None]
    return mx.where(hot, mx.zeros((k, vocab_size)), mx.full((k, vocab_size), -mx.inf))
