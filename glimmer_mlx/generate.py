"""Public generation API: `generate` and `stream_generate` (mlx-lm's shape). A request is tokenized and validated
(`runtime.request`), images are encoded into the prompt's embeddings, the decoder comes from `strategy`
(plain decoding, or speculative with `drafter=`), and `runtime.loop.stream` runs it."""

from __future__ import annotations

import time
from typing import Iterator

from .image_processing import MAX_IMAGE_TOKENS
from .multimodal import prepare_prompt
from .runtime.loop import GenerationChunk, GenerationResult, GenerationStats, collect, stop_ids, stream
from .runtime.prefill import DEFAULT_PREFILL_STEP
from .runtime.request import check_request, encode_prompt
from .sampling import Sampler, SamplingParams
from .strategy import make_decoder, make_tree_decoder

__all__ = ["generate", "stream_generate", "GenerationChunk", "GenerationResult", "GenerationStats"]


def stream_generate(model, prompt, *, tokenizer=None, max_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    repetition_context_size: int = 64, seed: int | None = None, stop: list[str] | None = None,
                    drafter=None, block_size=None, prefill_step_size: int = DEFAULT_PREFILL_STEP,
                    stats: GenerationStats | None = None, images=None,
                    image_max_tokens: int | None = None, tree: int | None = None) -> Iterator[GenerationChunk]:
    """Yield chunks of committed tokens and their text; `stats` (if given) is filled in as generation runs.

    prompt: a string (with a tokenizer) or token ids. drafter: a drafter (`load_drafter`, `speculative.auto.
    make_auto`, …) for speculative decoding; block_size: DFlash block size / MTP depth / n-gram drafts, "auto", or
    None (as trained; see `strategy`).

    images: paths / bytes / PIL images / uint8 arrays. The prompt holds one `<|patch|>` per image where it goes
    (none: all images are put first, after a leading BOS); each becomes `<|image_start|> <|patch|>×N
    <|image_end|>` and the prefill runs on embeddings with the image features in place (needs a tokenizer).
    image_max_tokens: per-image token budget (default 4096, transformers' `max_image_tokens`).
    tree: token-tree verification with up to this many draft nodes per round (n-gram lookup, MTP, DFlash; block_size is
    then the most drafts per path), `strategy.make_tree_decoder`."""
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size)
    ids = encode_prompt(prompt, tokenizer)
    check_request(ids, model.args.vocab_size, max_tokens=max_tokens, stop=stop, tokenizer=tokenizer)
    stats = stats if stats is not None else GenerationStats()
    embeddings = None
    if images is not None:
        t_img = time.perf_counter()
        ids, embeddings = prepare_prompt(model, tokenizer, ids, images,
                                         max_tokens=image_max_tokens or MAX_IMAGE_TOKENS)
        stats.extra.update(image_tokens=sum(1 for t in ids if t == model.config.image_token_id),
                           image_encode_time=time.perf_counter() - t_img)
    if tree is not None:
        decoder = make_tree_decoder(model, drafter, Sampler(params, seed), nodes=tree, block_size=block_size,
                                    prefill_step=prefill_step_size)
    else:
        decoder = make_decoder(model, drafter, Sampler(params, seed), block_size=block_size,
                               prefill_step=prefill_step_size)
    yield from stream(decoder, ids, max_tokens=max_tokens, eos=stop_ids(model, tokenizer), tokenizer=tokenizer,
                      stop=stop, stats=stats, input_embeddings=embeddings)


def generate(model, prompt, *, tokenizer=None, **kwargs) -> GenerationResult:
    """Generate from `prompt` (a string, with a tokenizer, or a list of token ids); keyword arguments as
    `stream_generate`. Returns `.tokens` (generated ids, without the stop token), `.text` (when a tokenizer is
    given), `.stats`, `.finish_reason`."""
    stats = kwargs.pop("stats", None) or GenerationStats()
    return collect(stream_generate(model, prompt, tokenizer=tokenizer, stats=stats, **kwargs), stats,
                   with_text=tokenizer is not None)
