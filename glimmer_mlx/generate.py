"""Public generation API: prefill, the decode loop, stop handling and statistics.

A *decoder* produces tokens: `PlainDecoder` one per step, the speculative engine a block per round. This module
owns everything that must behave identically for both: EOS, stop strings and `max_tokens` are applied token by
token to whatever a step returns, so speculative output is cut exactly where plain decoding would stop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from .sampling import Sampler, SamplingParams

DEFAULT_PREFILL_STEP = 512


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    peak_memory_gb: float = 0.0
    mode: str = "ar"
    extra: dict = field(default_factory=dict)  # decoder-specific (speculative: rounds, τ, histogram, …)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time if self.generation_time > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("prompt_tokens", "prompt_time", "generation_tokens", "generation_time",
                                            "peak_memory_gb", "mode")}
        d.update(prompt_tps=self.prompt_tps, generation_tps=self.generation_tps, **self.extra)
        return d

    def line(self) -> str:
        s = (f"prompt: {self.prompt_tokens} tok, {self.prompt_tps:.1f} tok/s | generation: {self.generation_tokens} "
             f"tok, {self.generation_tps:.1f} tok/s | peak memory {self.peak_memory_gb:.2f} GB")
        if "image_tokens" in self.extra:
            s += f" | images: {self.extra['image_tokens']} tok, encoded in {self.extra['image_encode_time']:.2f} s"
        if "tau" in self.extra:
            s += f" | τ {self.extra['tau']:.2f} over {self.extra['rounds']} rounds"
        return s


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str | None
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) | "length"


@dataclass
class GenerationChunk:
    tokens: list[int]  # tokens committed by this chunk
    text: str  # newly released text ("" without a tokenizer)
    finish_reason: str | None = None


def prefill(model, cache, ids: list[int], step: int = DEFAULT_PREFILL_STEP, taps=None, input_embeddings=None):
    """Run the prompt through the model in chunks; return the last position's logits [1, V] (and taps for all
    positions when `taps` is given). input_embeddings: the prompt's normed embeddings [1, len(ids), D] to feed
    instead of the ids (images: placeholder rows replaced by image features); `ids` still give the length."""
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    if input_embeddings is not None and input_embeddings.shape[1] != len(ids):
        raise ValueError(f"input_embeddings cover {input_embeddings.shape[1]} positions, the prompt has {len(ids)}")
    arr = mx.array(ids, dtype=mx.int32)[None]
    tapped_all = []
    for s in range(0, len(ids), step):
        chunk = arr[:, s : s + step]
        last = s + step >= len(ids)
        kw = {} if input_embeddings is None else {"input_embeddings": input_embeddings[:, s : s + step]}
        out = model(chunk, cache, taps=taps, last=1 if (last and taps is None) else None, **kw)
        if taps is not None:
            logits, tapped = out
            tapped_all.append(tapped)
        else:
            logits = out
        if not last:
            mx.eval([c.state for c in cache] + ([t for t in tapped_all[-1]] if taps is not None else []))
    if taps is None:
        return logits[:, -1]
    joined = [mx.concatenate([t[i] for t in tapped_all], axis=1) for i in range(len(taps))]
    return logits[:, -1], joined


class PlainDecoder:
    """One target step per token; the next step is queued (async_eval) before the current token is read back."""

    mode = "ar"

    def __init__(self, model, sampler: Sampler, prefill_step: int = DEFAULT_PREFILL_STEP, cache=None):
        self.model, self.sampler, self.prefill_step = model, sampler, prefill_step
        self.cache = cache if cache is not None else model.make_cache()
        self.history: list[int] = []
        self._next = None

    def _hist(self, pending: mx.array | None = None) -> mx.array | None:
        p = self.sampler.params
        if p.repetition_penalty == 1.0:
            return None
        h = mx.array(self.history[-p.repetition_context_size :], dtype=mx.int32)
        if pending is not None:
            h = mx.concatenate([h, pending.reshape(-1).astype(mx.int32)])[-p.repetition_context_size :]
        return h

    def prefill(self, ids: list[int], input_embeddings=None, reuse: int = 0) -> None:
        """reuse: the cache already holds ids[:reuse] (a session's prompt cache); only the rest is prefilled."""
        self.history = list(ids)
        emb = None if input_embeddings is None else input_embeddings[:, reuse:]
        logits = prefill(self.model, self.cache, ids[reuse:], self.prefill_step, input_embeddings=emb)
        self._next = self.sampler(logits, self._hist())
        mx.async_eval(self._next)

    def step(self, budget: int) -> list[int]:
        y = self._next
        if budget > 1:  # queue the following token before blocking on this one
            logits = self.model(y.reshape(1, 1), self.cache)[:, -1]
            self._next = self.sampler(logits, self._hist(y))
            mx.async_eval(self._next)
        else:
            self._next = None
        t = int(y.item())
        self.history.append(t)
        return [t]

    def stats(self) -> dict:
        return {}


def _stop_ids(model, tokenizer) -> set[int]:
    if tokenizer is not None:
        return set(tokenizer.eos_token_ids)
    return set(getattr(model, "eos_token_ids", model.args.eos_token_ids))


def stream_generate(model, prompt, *, tokenizer=None, max_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    repetition_context_size: int = 64, seed: int | None = None, stop: list[str] | None = None,
                    drafter=None, block_size=None, prefill_step_size: int = DEFAULT_PREFILL_STEP,
                    stats: GenerationStats | None = None, images=None,
                    image_max_tokens: int | None = None, cache=None, reuse: int = 0, input_embeddings=None,
                    on_decoder=None) -> Iterator[GenerationChunk]:
    """Yield chunks of committed tokens and their text; `stats` (if given) is filled in as generation runs.

    images: paths / bytes / PIL images / uint8 arrays. The prompt holds one `<|patch|>` per image where it goes
    (none: all images are put first, after a leading BOS); each becomes `<|image_start|> <|patch|>×N
    <|image_end|>` and the prefill runs on embeddings with the image features in place (needs a tokenizer).
    image_max_tokens: per-image token budget (default 4096, transformers' `max_image_tokens`).

    Prompt-cache reuse (`session.Session` drives these): cache = a target cache to continue from, holding the
    prompt's first `reuse` tokens (and, with a drafter, a drafter state covering them: see `drafter.extend`); only
    the rest is prefilled. input_embeddings: the (already expanded) prompt's embeddings [1, len(prompt), D] instead
    of `images`. on_decoder(decoder) is called once the decoder exists (the session reads what its cache holds)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    vocab = model.args.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    if not 0 <= reuse < max(len(ids), 1) or (reuse and cache is None):
        raise ValueError(f"reuse={reuse} needs a cache and must leave at least one of the {len(ids)} prompt tokens "
                         "to prefill")
    if input_embeddings is not None and images is not None:
        raise ValueError("give images or input_embeddings, not both")
    embeddings = input_embeddings
    if images is not None:
        from .image_processing import MAX_IMAGE_TOKENS
        from .multimodal import prepare_prompt

        t_img = time.perf_counter()
        ids, embeddings = prepare_prompt(model, tokenizer, ids, images,
                                         max_tokens=image_max_tokens or MAX_IMAGE_TOKENS)
        image_time = time.perf_counter() - t_img
    sampler = Sampler(params, seed)
    if drafter is None:
        if block_size is not None:
            raise ValueError("block_size needs a drafter")
        decoder = PlainDecoder(model, sampler, prefill_step_size, cache=cache)
    else:
        from .speculative.engine import make_decoder

        decoder = make_decoder(model, drafter, sampler, block_size=block_size, prefill_step=prefill_step_size,
                               cache=cache)
    if on_decoder is not None:
        on_decoder(decoder)
    stats = stats if stats is not None else GenerationStats()
    stats.mode = decoder.mode
    stop_ids = _stop_ids(model, tokenizer)
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    stop = [s for s in (stop or []) if s]
    max_stop = max((len(s) for s in stop), default=0)
    mx.reset_peak_memory()

    if cache is not None:
        stats.extra.update(cached_tokens=reuse, prefilled_tokens=len(ids) - reuse)
    if images is not None:
        stats.extra.update(image_tokens=sum(1 for t in ids if t == model.config.image_token_id),
                           image_encode_time=image_time)
    kw = {} if embeddings is None else {"input_embeddings": embeddings}
    if reuse:
        kw["reuse"] = reuse
    t0 = time.perf_counter()
    decoder.prefill(ids, **kw)
    n, released, finish, t1 = 0, 0, None, None  # released: chars of detok.text handed out so far
    stop_hit = False  # a stop string matched: the text is cut there and nothing after it is released
    while finish is None:
        block = decoder.step(max_tokens - n)
        if t1 is None:
            t1 = time.perf_counter()
            stats.prompt_tokens, stats.prompt_time = len(ids), t1 - t0
        committed, text = [], ""
        for t in block:
            if t in stop_ids:
                finish = "stop"
                break
            committed.append(t)
            n += 1
            if detok is not None:
                seg = detok.add(t)
                if stop and seg:
                    start = max(0, len(detok.text) - len(seg) - max_stop + 1)
                    hits = [i for s in stop if (i := detok.text.find(s, start)) >= 0]
                    if hits:
                        cut = min(hits)
                        text += detok.text[released:cut]
                        released = len(detok.text)
                        finish, stop_hit = "stop", True
                        break
            if n >= max_tokens:
                finish = "length"
                break
        if detok is not None and not stop_hit:
            if finish is not None:  # EOS or length: release everything
                detok.finalize()
                safe = len(detok.text)
            else:  # hold back what could still become the start of a stop string
                safe = len(detok.text) - (max_stop - 1 if stop else 0)
            if safe > released:
                text += detok.text[released:safe]
                released = safe
        stats.generation_tokens = n
        stats.generation_time = time.perf_counter() - t1
        yield GenerationChunk(committed, text, finish)
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    stats.extra.update(decoder.stats())


def generate(model, prompt, *, tokenizer=None, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, min_p: float = 0.0, seed: int | None = None, drafter=None, block_size=None,
             **kwargs) -> GenerationResult:
    """Generate from `prompt` (a string, with a tokenizer, or a list of token ids).

    Returns `.tokens` (generated ids, without the stop token), `.text` (when a tokenizer is given), `.stats`.
    """
    stats = GenerationStats()
    tokens, text, finish = [], "", None
    for chunk in stream_generate(model, prompt, tokenizer=tokenizer, max_tokens=max_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, drafter=drafter,
                                 block_size=block_size, stats=stats, **kwargs):
        tokens += chunk.tokens
        text += chunk.text
        finish = chunk.finish_reason
    return GenerationResult(tokens=tokens, text=text if tokenizer is not None else None, stats=stats,
                            finish_reason=finish)
