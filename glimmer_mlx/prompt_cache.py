"""Prompt caches reused across conversations: an LRU of KV caches keyed by their token prefix, bounded by a memory
budget, so several agents' growing conversations each prefill only their new turn.

`Session` keeps one conversation's cache; a server with several clients (agents taking turns) would throw that
cache away each time another conversation comes in. `PromptCache` keeps several: after a request the caller
`insert`s the cache with the keys it holds (one hashable per position: the token id, or a key naming an image
row, as `Session` builds them); before the next request it `fetch`es with the new prompt's keys and gets an
independent copy of the entry sharing the longest prefix with them, rewound to that prefix, and prefills only the
rest. The shape follows mlx-lm's `LRUPromptCache` (longest common prefix, prefix entries dropped when the new
one covers them, LRU eviction under a byte budget), with the rules of this project's `KVCache`:

* a fetch reuses at most `len(keys) - 1` positions: the last prompt token is always prefilled, for its logits;
* a sliding-window layer can only rewind by its `max_rewind` spare rows once its window has wrapped, so an entry
  can be cut back only to `Entry.min_keep` positions or more. A fetch picks, among the entries whose common prefix
  with the prompt they can be cut back to, the one with the longest prefix (the most recently used on a tie); an
  entry whose prefix is too short to reach is skipped, never returned rewound to the wrong length. If no entry
  qualifies the fetch is a miss (`unrewindable` counts the fetches where an entry shared a prefix but could not
  be cut back to it and nothing else was found);
* an entry whose keys are a prefix of a new entry's is replaced by it only if the new cache can be rewound to
  that prefix (it then serves every fetch the old one could); a wrapped sliding-window cache cannot, and the
  shorter entry stays. In the same way a new entry that an existing one dominates is not stored.

Entries are stored compacted (each layer's buffers hold only its valid rows) and never handed out: a fetch
returns a copy (`copy_cache`) that the caller may extend or rewind freely. `extra` (a drafter's state, say) is
opaque: it is returned as stored unless `copy_extra` is given, together with the entry's length so the caller can
cut it back to the reused prefix; `extra_nbytes` passed to `insert` is counted in the budget.

Not thread-safe: use it from the model thread only (the thread that runs the forwards), like `Session`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .cache import CacheRewindError, KVCache

__all__ = ["DEFAULT_MAX_ENTRIES", "Entry", "Hit", "PromptCache", "PromptCacheStats", "copy_cache", "lacks", "min_keep",
           "prefix_length"]

DEFAULT_MAX_ENTRIES = 16
_CHUNK = 256  # common-prefix search compares tuples chunk by chunk (in C) before scanning the last chunk


def prefix_length(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two key sequences (tuples compared a chunk at a time: fast on long ones)."""
    n = min(len(a), len(b))
    a, b = tuple(a[:n]), tuple(b[:n])
    i = 0
    while i < n and a[i : i + _CHUNK] == b[i : i + _CHUNK]:
        i += _CHUNK
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _copy_layer(c: KVCache, offset: int | None = None) -> KVCache:
    """A new KVCache with c's settings and positions whose keys/values are new array objects holding c's valid rows
    (those at positions < `offset`, default c.offset: a copy already rewound to `offset`, which the caller has
    checked is possible). They are slices of c's buffers, not copies of their data: an MLX array is never written in
    place while another array shares its buffer (a slice assignment on either cache makes a new array, and writes in
    place only into a buffer nothing else holds), so neither cache ever sees the other's writes; the rows are copied
    once, when the copy first grows or is written into the batch's buffer, instead of twice."""
    offset = c.offset if offset is None else offset
    out = KVCache(window=c.window, max_rewind=c.max_rewind, first_position=c.origin)
    out.start, out.offset = c.start, offset
    if "step" in vars(c):  # a per-instance growth step (the class default otherwise)
        out.step = c.step
    if c.keys is not None:
        rows = offset - c.start
        out.keys, out.values = c.keys[..., :rows, :], c.values[..., :rows, :]
    return out


def copy_cache(cache: list[KVCache], offset: int | None = None) -> list[KVCache]:
    """An independent copy of `cache`: new KVCache objects (same window, max_rewind, origin, start and offset)
    whose keys/values are new arrays holding only the valid rows (`_copy_layer`: slices sharing the original's
    buffers, which MLX never writes in place while shared), so appending to or rewinding the copy never changes the
    original, nor the other way round. Nothing is computed: a prompt-cache hit on a long conversation no longer
    copies its K/V on the model thread before the row's prefill copies them again. offset: copy as if rewound to
    that position first (only the rows below it are kept); raises CacheRewindError (changing nothing) if that rewind
    is impossible."""
    if offset is not None:
        for c in cache:
            c.check_rewind(c.offset - offset)
    return [_copy_layer(c, offset) for c in cache]


def min_keep(cache: list[KVCache]) -> int:
    """The fewest positions (counted from the caches' origin) `cache` can be rewound to: 0 for full layers and
    sliding-window layers whose window has not wrapped; more once a sliding window has dropped rows. Found with
    `check_rewind` (a binary search: whether a rewind is possible is monotone in its length), so it follows
    cache.py's rule."""
    if not cache:
        return 0
    length = cache[0].offset - cache[0].origin

    def ok(keep: int) -> bool:
        try:
            for c in cache:
                c.check_rewind(c.offset - (c.origin + keep))
        except CacheRewindError:
            return False
        return True

    lo, hi = 0, length  # ok(length) always holds (rewind 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _compact(cache: list[KVCache]) -> None:
    """Shrink each layer's buffers to its valid rows, in place (an owned cache about to be stored)."""
    fresh = []
    for c in cache:
        if c.keys is not None and c.keys.shape[2] != c.rows:
            c.keys = mx.contiguous(mx.array(c.keys[..., : c.rows, :]))
            c.values = mx.contiguous(mx.array(c.values[..., : c.rows, :]))
            fresh += [c.keys, c.values]
    if fresh:
        mx.eval(fresh)


@dataclass
class Entry:
    keys: tuple
    cache: list[KVCache]
    extra: Any
    nbytes: int
    min_keep: int  # the cache can be rewound to any length in [min_keep, len(keys)]


def lacks(extra: Any, other: Any) -> bool | None:
    """Whether `extra` lacks something `other` holds, where both are mappings (a server's drafter states by kind):
    a key of `other` missing from `extra`. None where that cannot be told (either is not a mapping)."""
    if isinstance(extra, Mapping) and isinstance(other, Mapping):
        return not other.keys() <= extra.keys()
    return None


@dataclass
class Hit:
    """What a fetch found: `cache` (a copy the caller owns, rewound to `reused` positions; None on a miss),
    `reused` (positions the caller need not prefill), `extra` (the entry's extra, as inserted) and
    `entry_length` (how many positions the entry held: the extra's state covers up to that many, so the caller
    cuts it back by `entry_length - reused` or to its own context length)."""
    cache: list[KVCache] | None
    reused: int = 0
    extra: Any = None
    entry_length: int = 0

    def __bool__(self) -> bool:
        return self.cache is not None


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reused_tokens: int = 0
    inserts: int = 0
    rejected: int = 0  # inserts not stored: larger than the whole budget
    replaced: int = 0  # entries dropped because a new one covers them (identical or rewindable prefix)
    unrewindable: int = 0  # misses where an entry shared a prefix but its sliding window could not go back to it


class PromptCache:
    """An LRU of prompt caches keyed by their key sequences, holding at most `max_bytes` (the entries' KV bytes +
    the `extra_nbytes` given) in at most `max_entries` entries. Not thread-safe (model thread only)."""

    def __init__(self, max_bytes: int, max_entries: int = DEFAULT_MAX_ENTRIES,
                 copy_extra: Callable[[Any], Any] | None = None):
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(f"max_bytes must be >= 0 and max_entries >= 1, got {max_bytes}, {max_entries}")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.copy_extra = copy_extra
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()  # least recently used first
        self._nbytes = 0
        self.stats = PromptCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (read only)."""
        return list(self._entries.values())

    def stats_dict(self) -> dict:
        """Counters and sizes for a server's /health or stats."""
        return {**self.stats.__dict__, "entries": len(self), "nbytes": self._nbytes, "max_bytes": self.max_bytes,
                "max_entries": self.max_entries}

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        self._entries.clear()
        self._nbytes = 0

    def _drop(self, k: tuple) -> Entry:
        e = self._entries.pop(k)
        self._nbytes -= e.nbytes
        return e

    def insert(self, keys: Sequence[Hashable], cache: list[KVCache], extra: Any = None, extra_nbytes: int = 0) -> bool:
        """Store `cache` (taking ownership: the caller must not use it again) holding `keys`, one per position from
        its origin. Entries it covers (identical keys, or a prefix it can be rewound to) are replaced; then least
        recently used entries are evicted until the budget holds. Returns whether it was stored (not when empty,
        larger than the whole budget, or covered by an existing entry — as long or longer, when it has no `extra` —
        which is then marked most recently used)."""
        keys = tuple(keys)
        if not cache or not keys:
            return False
        c0 = cache[0]
        if any(c.offset != c0.offset or c.origin != c0.origin for c in cache):
            raise ValueError("the layers of a cache hold different positions (an interrupted step?)")
        if len(keys) != c0.offset - c0.origin:
            raise ValueError(f"{len(keys)} keys for a cache holding {c0.offset - c0.origin} positions")
        self.stats.inserts += 1
        # an existing entry covering this one: as long or longer (it can be rewound to this one's length), and this
        # one brings no extra. A state is never dropped: in a server serving several modes, a plain request whose
        # conversation came out the same as an auto request's replaced that entry and its drafters' states, and the
        # next auto request on it prefilled the whole conversation again for them or went without them
        # Likewise an entry with identical keys whose extra holds every state this one's does (mappings, as a
        # server's drafter states by kind: by their keys): a row that stopped carrying a drafter must not replace
        # the conversation's entry that still has its state
        for k, e in reversed(self._entries.items()):
            if (extra is None and len(k) >= len(keys) and k[: len(keys)] == keys and e.min_keep <= len(keys)) \
                    or (k == keys and lacks(e.extra, extra) is False):
                self._entries.move_to_end(k)
                return False
        _compact(cache)
        nbytes = sum(c.nbytes for c in cache) + int(extra_nbytes)
        if nbytes > self.max_bytes:
            self.stats.rejected += 1
            return False
        keep = min_keep(cache)
        # a shorter entry this one extends is replaced, unless it holds states this one lacks (a fetch that needs
        # them still finds them there, and prefills only the rest)
        for k in [k for k, e in self._entries.items() if len(k) <= len(keys) and keys[: len(k)] == k and keep <= len(k)
                  and (k == keys or e.extra is None or (extra is not None and not lacks(extra, e.extra)))]:
            self._drop(k)
            self.stats.replaced += 1
        self._entries[keys] = Entry(keys, cache, extra, nbytes, keep)
        self._nbytes += nbytes
        while self._nbytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1
        return True

    def _best(self, keys: Sequence[Hashable], usable: Callable[[Any], bool] | None) -> tuple[Entry | None, int, bool]:
        """(the entry `fetch` would take, the positions it would reuse, whether a longer one could not be rewound)."""
        keys = tuple(keys)
        cap = len(keys) - 1
        best, best_k, blocked = None, 0, False
        for k, e in reversed(self._entries.items()):  # most recently used first: it wins ties
            n = min(prefix_length(k, keys), cap)
            if n <= best_k or (usable is not None and not usable(e.extra)):
                continue
            if n < e.min_keep:
                blocked = True
                continue
            best, best_k = e, n
        return best, best_k, blocked

    def reusable(self, keys: Sequence[Hashable], usable: Callable[[Any], bool] | None = None) -> tuple[int, Any]:
        """(positions, extra) of what `fetch` would hand out now — nothing copied, nothing counted, no entry marked
        used: (0, None) for a miss."""
        best, n, _ = self._best(keys, usable)
        return (n, best.extra) if best is not None else (0, None)

    def fetch(self, keys: Sequence[Hashable], usable: Callable[[Any], bool] | None = None) -> Hit:
        """The entry sharing the longest prefix with `keys` that it can be rewound to (at most len(keys) - 1
        positions: one is left to prefill for the logits), as a copy rewound to that prefix, and marks the entry
        most recently used. usable: only entries whose `extra` it accepts (e.g. those holding a drafter's state).
        A miss (nothing usable in common) is `Hit(None, 0, None, 0)`, falsy."""
        best, best_k, blocked = self._best(keys, usable)
        if best is not None:
            try:
                copy = copy_cache(best.cache, best.cache[0].origin + best_k)
            except CacheRewindError:  # min_keep says otherwise: never hand out a wrong cache
                copy = None
            if copy is not None:
                self._entries.move_to_end(best.keys)
                self.stats.hits += 1
                self.stats.reused_tokens += best_k
                extra = best.extra if self.copy_extra is None or best.extra is None else self.copy_extra(best.extra)
                return Hit(copy, best_k, extra, len(best.keys))
        self.stats.misses += 1
        if blocked:
            self.stats.unrewindable += 1
        return Hit(None, 0, None, 0)
