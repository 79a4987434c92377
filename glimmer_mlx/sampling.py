"""Logits processing and sampling, shared by plain decoding and by both sides (p and q) of speculative verification.

Processing order is transformers' (`generate()`'s processor list): repetition penalty on the raw logits, then
temperature, top-k, top-p, min-p. `process` returns normalised log-probabilities with `-inf` on removed tokens, so
"the same processing for p and q" is one function call for both.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx

NEG_INF = float("-inf")


def is_int(v) -> bool:
    """An integer value, and not a bool (which Python counts as one)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Range:
    """An allowed interval (None: unbounded; open ends excluded); integer: whole numbers only."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def __str__(self) -> str:
        if self.hi is None:
            return f"> {self.lo}" if self.lo_open else f">= {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def contains(self, v) -> bool:
        if self.integer and not is_int(v):
            return False
        if not self.integer:
            try:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    return False
            except OverflowError:  # an integer beyond a float's range
                return False
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok


# every sampling parameter's allowed values: the one source for the library, the CLI and the server's requests
RANGES = {
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(0, integer=True),
    "min_p": Range(0.0, 1.0, hi_open=True),
    "repetition_penalty": Range(0.0, lo_open=True),
    "repetition_context_size": Range(1, integer=True),
}
SEED_RANGE = Range(0, 2**63 - 1, integer=True)


class SamplingError(ValueError):
    """A sampling parameter outside its range; `field` names it."""

    def __init__(self, field: str, value):
        r = RANGES[field] if field in RANGES else SEED_RANGE
        kind = "an integer" if r.integer else "a finite number"
        super().__init__(f"'{field}' must be {kind} {r}, got {value!r}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64

    def __post_init__(self):
        for name, r in RANGES.items():
            if not r.contains(getattr(self, name)):
                raise SamplingError(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: mx.array, history: mx.array | None, penalty: float) -> mx.array:
    """transformers' rule on the tokens in `history` ([N, H] ids, or [H] shared by all rows):
    negative scores are multiplied by the penalty, positive ones divided."""
    if penalty == 1.0 or history is None or history.size == 0:
        return logits
    if history.ndim == 1:
        history = mx.broadcast_to(history[None], (logits.shape[0], history.shape[0]))
    picked = mx.take_along_axis(logits, history, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    return mx.put_along_axis(logits, history, picked, axis=-1)


def filter_logits(x: mx.array, params: SamplingParams) -> mx.array:
    """top-k, top-p, min-p on temperature-scaled logits [N, V] (float32); removed entries become -inf."""
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = mx.sort(x, axis=-1)[..., V - params.top_k][..., None]
        x = mx.where(x < kth, NEG_INF, x)
    if params.top_p < 1.0:
        s = mx.sort(x, axis=-1)  # ascending
        cum = mx.cumsum(mx.softmax(s, axis=-1), axis=-1)
        n_removed = mx.minimum(mx.sum(cum <= 1.0 - params.top_p, axis=-1, keepdims=True), V - 1)
        threshold = mx.take_along_axis(s, n_removed, axis=-1)
        x = mx.where(x < threshold, NEG_INF, x)
    if params.min_p > 0.0:
        probs = mx.softmax(x, axis=-1)
        top = mx.max(probs, axis=-1, keepdims=True)
        x = mx.where(probs < params.min_p * top, NEG_INF, x)
    return x


def scaled_logits(logits: mx.array, params: SamplingParams, history: mx.array | None = None) -> mx.array:
    """Raw logits [N, V] (temperature > 0) → the sampling distribution's log-probabilities up to a constant per
    row: penalised, divided by the temperature, filtered."""
    x = apply_repetition_penalty(logits.astype(mx.float32), history, params.repetition_penalty)
    return filter_logits(x if params.temperature == 1.0 else x / params.temperature, params)


def process(logits: mx.array, params: SamplingParams, history: mx.array | None = None) -> mx.array:
    """Raw logits [N, V] → log-probabilities [N, V] of the sampling distribution.

    With temperature 0 (greedy) this is the limit temperature → 0: log of a one-hot on the (penalised) argmax."""
    if params.greedy:
        x = apply_repetition_penalty(logits.astype(mx.float32), history, params.repetition_penalty)
        top = mx.argmax(x, axis=-1, keepdims=True)
        return mx.where(mx.arange(x.shape[-1]) == top, 0.0, NEG_INF).astype(mx.float32)
    x = scaled_logits(logits, params, history)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def history_window(params: SamplingParams, history: list[int], pending: mx.array | None = None) -> mx.array | None:
    """What the repetition penalty sees: the last `repetition_context_size` committed tokens, followed by `pending`
    (a sampled token not read back yet, [1]) when given; None without a penalty."""
    if params.repetition_penalty == 1.0:
        return None
    size = params.repetition_context_size
    h = mx.array(history[-size:], dtype=mx.int32)
    if pending is None:
        return h
    return mx.concatenate([h, pending.reshape(-1).astype(mx.int32)])[-size:]


def history_rows(params: SamplingParams, history: list[int], drafts: list[int], rows: int) -> mx.array | None:
    """[rows, size] windows for scoring a block: row j sees history + drafts[:j] (None without a penalty)."""
    if params.repetition_penalty == 1.0:
        return None
    size = params.repetition_context_size
    seqs = [(history + drafts[:j])[-size:] for j in range(rows)]
    width = max(len(s) for s in seqs)
    if width == 0:
        return None
    # left-pad with the row's first token: repeating a token does not change the penalty (it is set-based)
    return mx.array([[s[0]] * (width - len(s)) + s for s in seqs], dtype=mx.int32)


def greedy_token(logits: mx.array, params: SamplingParams, history: mx.array | None = None) -> mx.array:
    x = apply_repetition_penalty(logits.astype(mx.float32), history, params.repetition_penalty)
    return mx.argmax(x, axis=-1)


_DRAWS: dict = {}  # SamplingParams -> compiled (logits, key) -> (token ids, next key)


def _draw_fn(params: SamplingParams):
    """One compiled graph for a sampled token (key split, temperature, filters, normalisation, the draw): on a
    small model the per-op overhead of these ~10 ops is a measurable share of a decode step (7–9 % here on the
    embedded model's CPU runs), and mx.compile fuses them into a few kernels. Kept per parameter set for the
    process, as mlx-lm keeps its compiled samplers."""
    fn = _DRAWS.get(params)
    if fn is None:
        def draw(logits, key):
            key, sub = mx.random.split(key)
            return mx.random.categorical(scaled_logits(logits, params), axis=-1, key=sub), key  # shift-invariant

        if len(_DRAWS) >= 64:  # a server seeing many distinct settings: keep the memo bounded
            _DRAWS.clear()
        fn = _DRAWS[params] = mx.compile(draw)
    return fn


class Sampler:
    """Seeded sampling: every random draw takes the next key of one chain, so a run is reproducible from `seed`."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def logprobs(self, logits: mx.array, history: mx.array | None = None) -> mx.array:
        return process(logits, self.params, history)

    def __call__(self, logits: mx.array, history: mx.array | None = None) -> mx.array:
        """logits [N, V] → token ids [N]."""
        if self.params.greedy:
            return greedy_token(logits, self.params, history)
        if history is None or self.params.repetition_penalty == 1.0:
            tokens, self._key = _draw_fn(self.params)(logits, self._key)
            return tokens
        return mx.random.categorical(self.logprobs(logits, history), axis=-1, key=self.next_key())

    def uniform(self, shape) -> mx.array:
        return mx.random.uniform(shape=shape, key=self.next_key())
