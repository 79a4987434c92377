"""The stream loop every decoder's tokens go through: EOS, stop strings and `max_tokens` are applied token by token
to whatever a step returns (one token from plain decoding, a block from a speculative round), so speculative output
is cut exactly where plain decoding would stop; text is released as it becomes final; statistics are filled in.

A *decoder* has `mode`, `prefill(ids, input_embeddings=None, reuse=0)`, `step(budget) -> [tokens]`, `history` (every
committed token) and `stats() -> dict`: `runtime.plain.PlainDecoder` and `speculative.engine.SpeculativeDecoder`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx


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


def stop_ids(model, tokenizer) -> set[int]:
    if tokenizer is not None:
        return set(tokenizer.eos_token_ids)
    return set(getattr(model, "eos_token_ids", model.args.eos_token_ids))


class TokenStream:
    """One generation's tokens, block by block: EOS (`eos`), stop strings and `max_tokens` applied token by token,
    text released as it becomes final (what could still start a stop string is held back). `push` returns the
    block's chunk; `finish` is set once the generation is over (and nothing more may be pushed)."""

    def __init__(self, *, max_tokens: int, eos: set[int], tokenizer=None, stop: list[str] | None = None):
        self.max_tokens, self.eos = max_tokens, eos
        self.detok = tokenizer.detokenizer() if tokenizer is not None else None
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.n, self.released, self.finish = 0, 0, None  # released: chars of detok.text handed out so far
        self.stop_hit = False  # a stop string matched: the text is cut there and nothing after it is released

    @property
    def budget(self) -> int:
        """Tokens the generation may still commit."""
        return self.max_tokens - self.n

    def push(self, block: list[int]) -> GenerationChunk:
        if self.finish is not None:
            raise RuntimeError("the generation is finished")
        detok, stop = self.detok, self.stop
        committed, text = [], ""
        for t in block:
            if t in self.eos:
                self.finish = "stop"
                break
            committed.append(t)
            self.n += 1
            if detok is not None:
                seg = detok.add(t)
                if stop and seg:
                    start = max(0, len(detok.text) - len(seg) - self.max_stop + 1)
                    hits = [i for s in stop if (i := detok.text.find(s, start)) >= 0]
                    if hits:
                        cut = min(hits)
                        text += detok.text[self.released:cut]
                        self.released = len(detok.text)
                        self.finish, self.stop_hit = "stop", True
                        break
            if self.n >= self.max_tokens:
                self.finish = "length"
                break
        if detok is not None and not self.stop_hit:
            if self.finish is not None:  # EOS or length: release everything
                detok.finalize()
                safe = len(detok.text)
            else:  # hold back what could still become the start of a stop string
                safe = len(detok.text) - (self.max_stop - 1 if stop else 0)
            if safe > self.released:
                text += detok.text[self.released:safe]
                self.released = safe
        return GenerationChunk(committed, text, self.finish)


def stream(decoder, ids: list[int], *, max_tokens: int, eos: set[int], tokenizer=None, stop: list[str] | None = None,
           stats: GenerationStats | None = None, input_embeddings=None, reuse: int = 0) -> Iterator[GenerationChunk]:
    """Prefill `ids` (the decoder's cache already holding ids[:reuse]) and yield the committed tokens chunk by
    chunk until EOS (`eos`), a stop string or `max_tokens`; `stats` is filled in as generation runs. The request is
    assumed valid (`runtime.request.check_request`)."""
    stats = stats if stats is not None else GenerationStats()
    stats.mode = decoder.mode
    out = TokenStream(max_tokens=max_tokens, eos=eos, tokenizer=tokenizer, stop=stop)
    mx.reset_peak_memory()
    kw = {} if input_embeddings is None else {"input_embeddings": input_embeddings}
    if reuse:
        kw["reuse"] = reuse
    t0 = time.perf_counter()
    decoder.prefill(ids, **kw)
    t1 = None
    while out.finish is None:
        block = decoder.step(out.budget)
        if t1 is None:
            t1 = time.perf_counter()
            stats.prompt_tokens, stats.prompt_time = len(ids), t1 - t0
        chunk = out.push(block)
        stats.generation_tokens = out.n
        stats.generation_time = time.perf_counter() - t1
        yield chunk
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    stats.extra.update(decoder.stats())


def collect(chunks, stats: GenerationStats, with_text: bool) -> GenerationResult:
    """A whole generation from its chunks."""
    tokens, text, finish = [], "", None
    for chunk in chunks:
        tokens += chunk.tokens
        text += chunk.text
        finish = chunk.finish_reason
    return GenerationResult(tokens=tokens, text=text if with_text else None, stats=stats, finish_reason=finish)
