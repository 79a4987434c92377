"""Key/value caches with one contract for every layer type: `offset`, `update(k, v)`, `rewind(n)`, and for token
trees `update(k, v, tree=...)` + `keep_path(cache, offset, kept_rows)`.

`KVCache(window=None)` keeps every row (global layers). `KVCache(window=W)` is a sliding-window cache for local
layers: it keeps only the rows the window can still see plus `max_rewind` spare rows, so memory stays bounded by
the window *and* the cache can be rewound by up to `max_rewind` tokens at any length, also after the window has
wrapped (unlike mlx-lm's `RotatingKVCache`, which silently refuses to trim once `offset >= max_size`).

`update` returns the keys/values the new queries may attend to together with the boolean mask for them, built from
absolute positions; callers never special-case a cache type.

Token trees (speculative/tree.py): a verify forward appends the flattened tree's L nodes as the next L rows, while a
node's real position is the first row's position + its depth and it sees only the committed context and its own
ancestors (`tree_mask`). Afterwards `keep_path` keeps the accepted path's rows (moved down to be contiguous, in
place) and drops the rest, for full and sliding-window caches alike (also after the window has wrapped).
"""

from __future__ import annotations

import mlx.core as mx

# spare rows a sliding-window layer keeps beyond its window, i.e. how far any cache can rewind at any length: enough
# for a verify block (<= 17 rows here), an MTP drafter's rewind staircase, and a session re-rendering the tail of its
# last answer (the common prefix of two renderings of a conversation can end a few dozen tokens back)
DEFAULT_MAX_REWIND = 128


class CacheRewindError(RuntimeError):
    pass


class KVCache:
    step = 256
    batched = False  # `BatchKVCache`: several rows of different lengths

    def __init__(self, window: int | None = None, max_rewind: int = DEFAULT_MAX_REWIND, first_position: int = 0):
        self.window = window
        self.max_rewind = max_rewind
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.origin = first_position  # absolute position of the first row this cache will ever hold
        self.offset = first_position  # absolute position of the next row (= tokens seen, when origin is 0)
        self.start = first_position  # absolute position of buffer row 0

    @property
    def rows(self) -> int:
        return self.offset - self.start

    @property
    def retained(self) -> int | None:
        """Rows kept from the past when compacting (None: keep everything)."""
        return None if self.window is None else self.window - 1 + self.max_rewind

    def _reserve(self, L: int, like_k: mx.array, like_v: mx.array) -> None:
        n = self.rows
        cap = 0 if self.keys is None else self.keys.shape[2]
        if n + L <= cap:
            return
        keep = n if self.retained is None else min(n, self.retained)
        if keep + L <= cap:  # sliding window: drop rows the window can no longer see, in place
            self.keys[..., :keep, :] = self.keys[..., n - keep : n, :]
            self.values[..., :keep, :] = self.values[..., n - keep : n, :]
        else:
            new_cap = ((keep + L + self.step - 1) // self.step) * self.step
            B, H, _, Dk = like_k.shape
            nk = mx.zeros((B, H, new_cap, Dk), like_k.dtype)
            nv = mx.zeros((B, H, new_cap, like_v.shape[3]), like_v.dtype)
            if keep:
                nk[..., :keep, :] = self.keys[..., n - keep : n, :]
                nv[..., :keep, :] = self.values[..., n - keep : n, :]
            self.keys, self.values = nk, nv
        self.start += n - keep

    def append(self, k: mx.array, v: mx.array) -> None:
        """Store `k, v` ([B, Hkv, L, D]) as the next L positions."""
        L = k.shape[2]
        self._reserve(L, k, v)
        n = self.rows
        self.keys[..., n : n + L, :] = k
        self.values[..., n : n + L, :] = v
        self.offset += L

    def view(self, from_pos: int = 0):
        """(keys, values, first_position) of the stored rows at absolute positions >= from_pos."""
        lo = max(0, from_pos - self.start)
        return self.keys[..., lo : self.rows, :], self.values[..., lo : self.rows, :], self.start + lo

    def update(self, k: mx.array, v: mx.array, tree=None):
        """Append `k, v` ([B, Hkv, L, D]); return (keys, values, mask) for the L new queries.

        mask is None (attend to everything returned) or a bool array [L, N] (True = attend).
        tree: None (the L rows are consecutive positions), or (depths [L] int, ancestors [L, L] bool) of a token
        tree's flattened nodes (`tree_mask`).
        """
        L = k.shape[2]
        q0 = self.offset  # absolute position of the first new query
        self.append(k, v)
        keys, values, k0 = self.view(0 if self.window is None else q0 - self.window + 1)
        if tree is not None:
            return keys, values, tree_mask(tree[0], tree[1], q0, k0, self.window)
        if L == 1:
            return keys, values, None
        kpos = mx.arange(k0, self.offset)[None, :]
        qpos = mx.arange(q0, self.offset)[:, None]
        mask = kpos <= qpos
        if self.window is not None:
            mask = mask & (kpos > qpos - self.window)
        return keys, values, mask

    def check_rewind(self, n: int) -> None:
        """Raise `CacheRewindError` if `rewind(n)` is not possible; changes nothing."""
        if n < 0 or n > self.offset:
            raise CacheRewindError(f"cannot rewind {n} tokens from a cache holding {self.offset}")
        new_offset = self.offset - n
        if self.window is not None and self.start > self.origin and self.start > new_offset - (self.window - 1):
            raise CacheRewindError(
                f"sliding-window cache (window {self.window}) cannot rewind {n} tokens: it keeps "
                f"{self.max_rewind} spare rows (max_rewind)"
            )
        if new_offset < self.start:
            raise CacheRewindError(f"cannot rewind {n} tokens: the cache holds no rows before position {self.start}")

    def rewind(self, n: int) -> None:
        """Forget the last `n` tokens."""
        self.check_rewind(n)
        self.offset -= n

    def check_keep(self, offset: int, kept_rows: list[int]) -> None:
        """Raise `CacheRewindError` (or ValueError for malformed rows) unless `keep_rows(offset, kept_rows)` is
        possible; changes nothing."""
        n = self.offset - offset
        if not kept_rows or any(b <= a for a, b in zip(kept_rows, kept_rows[1:])) or kept_rows[0] < 0 \
                or kept_rows[-1] >= n:
            raise ValueError(f"kept rows must be increasing row indices in [0, {n}), got {kept_rows}")
        self.check_rewind(n - len(kept_rows))
        if offset < self.start:
            raise CacheRewindError(f"cannot keep rows from position {offset}: the cache starts at {self.start}")

    def keep_rows(self, offset: int, kept_rows: list[int]) -> None:
        """Of the rows at positions >= `offset` keep only `kept_rows` (indices relative to `offset`, increasing),
        moved to positions offset, offset+1, …; the others are forgotten."""
        self.check_keep(offset, kept_rows)
        m = len(kept_rows)
        if kept_rows != list(range(m)):  # else a plain rewind: the kept rows are already in place
            lo = offset - self.start
            idx = mx.array([lo + r for r in kept_rows], dtype=mx.int32)
            self.keys[..., lo : lo + m, :] = mx.take(self.keys, idx, axis=2)
            self.values[..., lo : lo + m, :] = mx.take(self.values, idx, axis=2)
        self.offset = offset + m

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def make_cache(cfg, max_rewind: int = DEFAULT_MAX_REWIND) -> list[KVCache]:
    """One cache per decoder layer of a `TextConfig`."""
    return [
        KVCache(window=cfg.sliding_window if cfg.is_sliding(i) else None, max_rewind=max_rewind)
        for i in range(cfg.num_hidden_layers)
    ]


def rewind_cache(cache: list[KVCache], n: int) -> None:
    """Rewind every layer by `n`, or none of them: a layer that cannot rewind raises before any layer changes
    (otherwise a global layer 0 would be rewound while a later sliding layer refuses, leaving the cache split)."""
    for c in cache:
        c.check_rewind(n)
    for c in cache:
        c.rewind(n)


def keep_path(cache: list[KVCache], offset: int, kept_rows: list[int]) -> None:
    """Commit a token tree's accepted path: in every layer, of the rows at positions >= `offset` (the flattened
    tree's nodes) keep `kept_rows` (the path's node indices, increasing; 0 = the root) as positions offset.., and
    forget the rest. All layers or none: a layer that cannot raises before any layer changes."""
    for c in cache:
        c.check_keep(offset, kept_rows)
    for c in cache:
        c.keep_rows(offset, kept_rows)


def tree_mask(depths: mx.array, ancestors: mx.array, q0: int, k0: int, window: int | None) -> mx.array:
    """[L, N] attention mask of a token tree's L flattened nodes (rows at positions q0.. in the cache, node i at
    real position q0 + depths[i]) against N = q0 - k0 + L keys: the committed context's rows at positions k0..q0-1
    and the tree's rows. A node sees the context and its own ancestors (itself included: `ancestors[i, j]`), and
    on a sliding-window layer only keys less than `window` positions behind its own."""
    d = depths.astype(mx.int32)[:, None]
    ctx = mx.arange(k0, q0, dtype=mx.int32)[None, :]
    if window is None:
        ctx_mask = mx.broadcast_to(mx.array(True), (d.shape[0], q0 - k0))
        own = ancestors
    else:
        ctx_mask = ctx > q0 + d - window
        own = ancestors & (d - depths.astype(mx.int32)[None, :] < window)
    return mx.concatenate([ctx_mask, own], axis=1)


def cache_offset(cache: list[KVCache]) -> int:
    return cache[0].offset if cache else 0


# -- batches (runtime/batch.py): B rows of different lengths in one forward ------------------------------------------

class BatchLayout:
    """The lengths of a batch's rows, shared by every layer's `BatchKVCache`: row b holds positions
    [0, lengths[b]). A forward over [B, L] writes row b's L new keys at positions lengths[b].. in every layer; the
    caller then keeps n of them (`commit(b, n)`: the rows it accepted), so a row that fed a verify block of k + 1
    tokens and accepted n drafts commits n + 1, and the rest is overwritten later (never attended: the masks are
    built from the lengths). Buffer row = position: a row's rows never move."""

    def __init__(self, lengths: list[int] | None = None):
        self.lengths: list[int] = list(lengths or [])
        self._memo: dict = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def commit(self, b: int, n: int) -> None:
        self.lengths[b] += n
        self._memo.clear()

    def rewind(self, b: int, n: int) -> None:
        if not 0 <= n <= self.lengths[b]:
            raise CacheRewindError(f"cannot rewind row {b} by {n} tokens: it holds {self.lengths[b]}")
        self.lengths[b] -= n
        self._memo.clear()

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others leave the batch."""
        self.lengths = [self.lengths[b] for b in rows]
        self._memo.clear()

    def append(self, length: int) -> int:
        """A new row holding positions [0, length); returns its index."""
        self.lengths.append(length)
        self._memo.clear()
        return len(self.lengths) - 1

    def offsets(self) -> mx.array:
        """[B] int32: each row's next position (RoPE offsets)."""
        if "offsets" not in self._memo:
            self._memo["offsets"] = mx.array(self.lengths, dtype=mx.int32)
        return self._memo["offsets"]

    def first_key(self, L: int, window: int | None) -> int:
        """The first key position any of L new queries of any row can see: 0, or with a window the shortest row's
        first query's window start (`update` returns keys from there: the rest no query sees)."""
        return 0 if window is None else max(0, min(self.lengths) - window + 1)

    def mask(self, L: int, window: int | None) -> mx.array | None:
        """[B, 1, L, N − first] bool over the keys [first, N) (`first_key`; N = longest row + L): query j of row b
        (position lengths[b] + j) sees keys at positions <= its own (and, with a window, fewer than `window`
        behind). Every query sees at least its own key, so padded queries stay finite. None where nothing is
        masked: one query a row and every row as long (a batch of one; rows that joined together) — its keys from
        `first_key` are exactly what each query sees (a mask costs the attention a masked path: ~2 % of a 1-row
        step of the embedded model here)."""
        key = (L, window)
        if key in self._memo:
            return self._memo[key]
        lo, n = self.first_key(L, window), self.lengths
        if L == 1 and min(n) == max(n):
            m = None
        else:
            N = max(n) + L
            q = self.offsets()[:, None] + mx.arange(L, dtype=mx.int32)[None, :]
            k = mx.arange(lo, N, dtype=mx.int32)[None, None, :]
            m = k <= q[:, :, None]
            if window is not None:
                m = m & (k > q[:, :, None] - window)
            m = m[:, None]
        self._memo[key] = m
        return m


# rows of several lengths written one slice a row (2 writes a row and layer) up to this many, by one scatter over the
# flattened buffer beyond (its index arithmetic, ~10 ops a layer): a scatter always made a 1-row step of the embedded
# model ~8 % slower than a solo step (a whole 1-row batch step 15 % slower, a 2-row one 7 %), slices at 8 rows ~3 %
# slower than the scatter (`benchmarks/batch_cache_ab.py`)
SLICED_ROWS = 4


class BatchKVCache:
    """One layer's keys/values for the rows of a `BatchLayout` ([B, H, cap, D] buffers, buffer row = position).
    `update(k, v)` writes each row's new keys at its own length (`update`: slices, or one scatter) and returns the
    keys, the values and the mask for the new queries; `offset` is the [B] array of the rows' lengths. A
    sliding-window layer masks by the window but keeps every row (a batch row's memory is its whole length;
    `KVCache` is the bounded one). Rows join from a solo cache (`put_row`) and leave (`remove_rows`, `row_cache`)."""

    step = 256
    batched = True

    def __init__(self, layout: BatchLayout, window: int | None = None):
        self.layout, self.window = layout, window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        return self.layout.offsets()

    @property
    def cap(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, need: int, B: int, H: int, Dk: int, Dv: int, dtype) -> None:
        if need <= self.cap and self.keys is not None and self.keys.shape[0] == B:
            return
        cap = max(self.cap, ((need + self.step - 1) // self.step) * self.step)
        nk, nv = mx.zeros((B, H, cap, Dk), dtype), mx.zeros((B, H, cap, Dv), dtype)
        if self.keys is not None:
            rows, old = min(B, self.keys.shape[0]), self.cap
            nk[:rows, :, :old] = self.keys[:rows]
            nv[:rows, :, :old] = self.values[:rows]
        self.keys, self.values = nk, nv

    def update(self, k: mx.array, v: mx.array, tree=None):
        """Write each row's L new keys at its own length; return the keys and values from `BatchLayout.first_key`
        and the mask for them (`BatchLayout.mask`). Rows of one length are written as one slice; rows of several
        lengths one slice a row up to `SLICED_ROWS` rows, else by one scatter (`benchmarks/batch_cache_ab.py`)."""
        if tree is not None:
            raise ValueError("token trees are not supported inside a batch")
        B, H, L, Dk = k.shape
        lengths = self.layout.lengths
        if B != len(lengths):
            raise ValueError(f"a batch of {B} rows against a layout of {len(lengths)}")
        N = max(lengths) + L
        self._grow(N, B, H, Dk, v.shape[3], k.dtype)
        if min(lengths) == max(lengths):
            n = lengths[0]
            self.keys[:, :, n : n + L] = k
            self.values[:, :, n : n + L] = v
        elif B <= SLICED_ROWS:
            for b, n in enumerate(lengths):
                self.keys[b : b + 1, :, n : n + L] = k[b : b + 1]
                self.values[b : b + 1, :, n : n + L] = v[b : b + 1]
        else:
            self.scatter(k, v)
        lo = self.layout.first_key(L, self.window)
        return self.keys[:, :, lo:N], self.values[:, :, lo:N], self.layout.mask(L, self.window)

    def scatter(self, k: mx.array, v: mx.array) -> None:
        """Write each row's L new keys at its own length by one scatter over the flattened buffer (grown already)."""
        B, H, L, Dk = k.shape
        cap = self.cap
        idx = (mx.arange(B * H, dtype=mx.int32).reshape(B, H, 1) * cap + self.layout.offsets().reshape(B, 1, 1)
               + mx.arange(L, dtype=mx.int32).reshape(1, 1, L)).reshape(-1)
        fk, fv = self.keys.reshape(-1, Dk), self.values.reshape(-1, v.shape[3])
        fk[idx] = k.reshape(-1, Dk)
        fv[idx] = v.reshape(-1, v.shape[3])
        self.keys, self.values = fk.reshape(B, H, cap, Dk), fv.reshape(B, H, cap, v.shape[3])

    def put_row(self, b: int, cache: KVCache) -> None:
        """Copy a solo cache's rows (batch 1) into row b (already counted in the layout, with length
        cache.offset); a sliding-window solo cache may start after 0 (rows the window no longer sees: left zero). An
        empty one (a one-token prompt joining on its only token) still gets its row in the buffers."""
        B = len(self.layout)
        if cache.keys is None:
            if self.keys is not None:
                _, H, _, Dk = self.keys.shape
                self._grow(self.cap, B, H, Dk, self.values.shape[3], self.keys.dtype)
            return
        keys, values, first = cache.view(0)
        _, H, _, Dk = keys.shape
        self._grow(cache.offset, B, H, Dk, values.shape[3], keys.dtype)
        self.keys[b : b + 1, :, first : cache.offset] = keys
        self.values[b : b + 1, :, first : cache.offset] = values

    def remove_rows(self, keep: list[int]) -> None:
        if self.keys is not None:
            idx = mx.array(keep, dtype=mx.int32)
            self.keys, self.values = mx.take(self.keys, idx, axis=0), mx.take(self.values, idx, axis=0)

    def row_cache(self, b: int, max_rewind: int = DEFAULT_MAX_REWIND) -> KVCache:
        """Row b as a solo `KVCache` (new arrays; a sliding-window layer keeps what a solo cache would retain)."""
        n = self.layout.lengths[b]
        c = KVCache(window=self.window, max_rewind=max_rewind)
        lo = 0 if c.retained is None else max(0, n - c.retained)
        if self.keys is not None and n > 0:
            c.keys = mx.array(self.keys[b : b + 1, :, lo:n])
            c.values = mx.array(self.values[b : b + 1, :, lo:n])
            c.start, c.offset = lo, n
        return c

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


class RowsCache:
    """Several rows' own `KVCache`s (one layer each) seen as one batch cache for a single forward (a drafter's rows
    of a server batch: `speculative.mtp.propose_batch`). The forward's [B, L] inputs are right-padded: row b's first
    lengths[b] new keys go into its own cache (the padding's never do); `update` returns every row's keys — its own
    cache's view, padded at the end to the longest — with a [B, 1, L, N] mask from each row's own positions (causal,
    the window), so each row attends exactly as alone. Padded queries see their row's keys (finite, unused)."""

    batched = True

    def __init__(self, caches: list[KVCache], lengths: list[int]):
        self.caches, self.lengths = caches, list(lengths)
        self.window = caches[0].window
        self._q0 = [c.offset for c in caches]

    @property
    def offset(self) -> mx.array:
        """[B] int32: each row's first new position (RoPE offsets)."""
        return mx.array(self._q0, dtype=mx.int32)

    def update(self, k: mx.array, v: mx.array, tree=None):
        if tree is not None:
            raise ValueError("token trees are not supported across rows")
        B, _, L, _ = k.shape
        views = []
        for b, (c, n, q0) in enumerate(zip(self.caches, self.lengths, self._q0)):
            c.append(k[b : b + 1, :, :n], v[b : b + 1, :, :n])
            views.append(c.view(0 if self.window is None else q0 - self.window + 1))
        N = max(kb.shape[2] for kb, _, _ in views)

        def padded(x):
            return x if x.shape[2] == N else mx.pad(x, [(0, 0), (0, 0), (0, N - x.shape[2]), (0, 0)])

        keys = mx.concatenate([padded(kb) for kb, _, _ in views])
        values = mx.concatenate([padded(vb) for _, vb, _ in views])
        i = mx.arange(N, dtype=mx.int32)[None, :]
        k0 = mx.array([k0 for _, _, k0 in views], dtype=mx.int32)[:, None]
        n = mx.array([kb.shape[2] for kb, _, _ in views], dtype=mx.int32)[:, None]
        kpos = mx.where(i < n, k0 + i, 1 << 30)[:, None, :]  # a padded key's position: after every query
        qpos = (mx.array(self._q0, dtype=mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None, :])[:, :, None]
        mask = kpos <= qpos
        if self.window is not None:
            mask = mask & (kpos > qpos - self.window)
        return keys, values, mask[:, None]


def make_batch_cache(cfg) -> tuple[BatchLayout, list[BatchKVCache]]:
    """An empty batch (no rows) for a `TextConfig`: the shared layout and one cache per decoder layer."""
    layout = BatchLayout()
    return layout, [BatchKVCache(layout, window=cfg.sliding_window if cfg.is_sliding(i) else None)
                    for i in range(cfg.num_hidden_layers)]
