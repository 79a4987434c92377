"""A resident model with a prompt cache that survives across requests: chat turns and server requests prefill only
the tokens that changed.

`Session` owns the target's KV cache and the list of what it holds, one *key* per position (the token id; for an
image position a key naming the image content and the row, since every image row has the same placeholder id). A
new request's keys are compared with the cached ones; the cache is rewound to the longest common prefix and only the
rest is prefilled. The prefix match is on token ids, not text: a re-rendered conversation need not reproduce the
generated tokens exactly (BPE merges across the message boundary), and then the cache is simply rewound a little
further.

Speculative modes: each drafter keeps its own state of the context (DFlash: its context K/V cache + pending target
taps; MTP: per-depth caches + target hidden rows), recorded here with the keys it covers. Before a turn the
drafter's `rewind_context(k)` cuts its state back and says from which position p <= k it needs the target's taps
again; the target is rewound to p and prefilled from there (with taps), and `extend` hands the new taps to the
drafter. So the drafter continues exactly where a fresh prefill would have put it, without re-running the prompt.
The decoding mode of each turn goes through `strategy` (`Drafters.resolve`), the request's checks through
`runtime.request`, the tokens through `runtime.loop`: the session adds only the cache.

Whenever a rewind is impossible (sliding-window layers keep only `max_rewind` spare rows; a drafter's first turn; a
changed MTP depth; an interrupted generation that left the cache mid-step) the session starts
over with an empty cache: a full prefill, correct but slower. Each turn's `stats.extra` says what happened:
`cached_tokens`, `prefilled_tokens` and `cache` (the reason for a fresh start, or "reused").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .cache import DEFAULT_MAX_REWIND, CacheRewindError, rewind_cache
from .embedded import resolve_model
from .image_processing import MAX_IMAGE_TOKENS
from .loading import load
from .multimodal import prepare_prompt, process_images
from .runtime.loop import GenerationChunk, GenerationStats, collect, stop_ids, stream
from .runtime.plain import plain_token_seconds
from .runtime.prefill import DEFAULT_PREFILL_STEP, prefill
from .runtime.request import ContextLengthError, check_request, encode_prompt, fit_context
from .sampling import Sampler, SamplingParams
from .strategy import (MAX_NGRAM_DRAFTS, MODES, DecodeSpec, Drafters, ModeError, build_decoder, check_tree,
                       load_drafters)

__all__ = ["Session", "load_session", "common_prefix", "ContextLengthError", "ModeError", "MODES"]


def common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Prepared:
    """A checked request (`Session.prepare`): what a decoder needs, before any cache is touched."""
    ids: list[int]
    keys: list  # one prompt-cache key per position (image rows: a key naming the image and the row)
    input_embeddings: object  # mx.array [1, len(ids), D] with images in place, or None
    sampler: Sampler
    mode: str
    drafter: object  # the session's drafter for `mode` (None: plain decoding)
    drafts: int | None  # drafts per round
    budget: int  # max_tokens, clamped to the context
    stop: list[str] | None
    stats: GenerationStats
    tree: int | None = None  # token-tree nodes per round (None: chains)


@dataclass
class PlainRate:
    tokens_per_s: float = 0.0
    source: str = ""  # "latest ar turn" | "calibration (N greedy tokens)"



class Session:
    """One model (and its drafters) with a prompt cache reused across requests.

    drafters: a `strategy.Drafters`, or a mapping {"dflash": DFlashDrafter, "mtp": MTPDrafter} (either may be
    missing). max_context: the context limit (default: the model's max_position_embeddings). Not thread-safe: serve
    requests one at a time."""

    def __init__(self, model, tokenizer=None, *, drafters: Drafters | dict | None = None,
                 max_context: int | None = None, prefill_step: int = DEFAULT_PREFILL_STEP,
                 max_rewind: int = DEFAULT_MAX_REWIND):
        self.model, self.tokenizer = model, tokenizer
        if not isinstance(drafters, Drafters):
            drafters = Drafters(model, **{k: v for k, v in (drafters or {}).items() if v is not None})
        self.drafters = drafters
        model_max = int(getattr(model.args, "max_position_embeddings", 0) or 0)
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        if max_context is not None and model_max and max_context > model_max:
            raise ValueError(f"max_context {max_context} exceeds the model's max_position_embeddings {model_max}")
        self.max_context = max_context or model_max or 131_072
        self.prefill_step = prefill_step
        self.max_rewind = max(max_rewind, MAX_NGRAM_DRAFTS + 1)  # a verify round rewinds up to its drafts
        self.cache = None  # target KV cache
        self.keys: list = []  # what `cache` holds, one key per position
        # id(drafter) -> (keys its state covers, ids of the drafter objects whose state that is)
        self._dstate: dict[int, tuple] = {}
        self.plain_rate: PlainRate | None = None
        self.totals = {"turns": 0, "prompt_tokens": 0, "prefilled_tokens": 0, "generated_tokens": 0}

    # -- modes ------------------------------------------------------------------------------------------------------
    def available_modes(self) -> list[str]:
        return self.drafters.available_modes()

    def default_mode(self) -> str:
        return self.drafters.default_mode()

    def auto_drafter(self):
        """`auto` over this session's drafters (`strategy.Drafters.auto`)."""
        return self.drafters.auto()

    def check_mode(self, mode: str, block_size=None) -> None:
        """Raise ModeError if this session cannot run `mode` with `block_size`; changes nothing (safe from any
        thread, e.g. a server's request threads while a generation runs)."""
        self.drafters.check(DecodeSpec(mode, block_size))

    # -- the cache ----------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the cached conversation (the next request prefills from scratch)."""
        self.cache, self.keys = None, []
        self._dstate.clear()

    @property
    def cached_tokens(self) -> int:
        return len(self.keys)

    def _fresh(self, reason: str) -> tuple[int, str]:
        self.cache = self.model.make_cache(max_rewind=self.max_rewind)
        self.keys = []
        return 0, reason

    def _reuse(self, keys: list, drafter) -> tuple[int, str]:
        """Rewind the caches to what `keys` shares with them; returns (positions kept, reason)."""
        if self.cache is None:
            return self._fresh("fresh: no cached conversation")
        k = min(common_prefix(self.keys, keys), len(keys) - 1)
        if drafter is not None:
            entry = self._dstate.get(id(drafter))
            if entry is None:
                return self._fresh(f"fresh: the {drafter.kind} drafter has no state for this conversation")
            k = min(k, common_prefix(entry[0], keys))
            if k == 0:
                return self._fresh("fresh: nothing in common with the cached conversation")
            try:
                k = drafter.rewind_context(k)
            except CacheRewindError as e:
                self._dstate.pop(id(drafter), None)
                return self._fresh(f"fresh: {e}")
        if k == 0:
            return self._fresh("fresh: nothing in common with the cached conversation")
        try:
            rewind_cache(self.cache, self.cache[0].offset - k)
        except CacheRewindError as e:
            return self._fresh(f"fresh: {e}")
        self.keys = self.keys[:k]
        return k, "reused"

    # -- prompts --------------------------------------------------------------------------------------------------------
    def encode_messages(self, messages: list[dict], tools=None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass token ids")
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None,
                                                      tokenize=True)
        if tools:
            raise ValueError("this checkpoint has no chat template: tools cannot be described to the model")
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
        return self.tokenizer.encode_text(text, add_special_tokens=True)  # no message can write a control token

    def _expand_images(self, ids: list[int], images):
        items = process_images(images, max_tokens=MAX_IMAGE_TOKENS)
        ids, emb = prepare_prompt(self.model, self.tokenizer, ids, items)
        image_id = self.model.config.image_token_id
        keys, it, j = [], iter(items), 0
        current = None
        for t in ids:
            if t == image_id:
                if current is None or j >= current.num_tokens:
                    current, j = next(it), 0
                keys.append(("image", current.key, j))
                j += 1
            else:
                keys.append(t)
        return ids, emb, keys

    # -- generation -----------------------------------------------------------------------------------------------------
    def prepare(self, prompt, *, mode: str = "ar", block_size=None, images=None, max_tokens: int = 256,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                repetition_penalty: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                stats: GenerationStats | None = None, tree: int | None = None) -> Prepared:
        """A request checked and made ready to decode, without touching the cache: its ids (images expanded), the
        per-position keys the prompt cache matches on, the sampler, the drafter and drafts per round (paths at
        most that deep with `tree` nodes of token trees per round: dflash, mtp, ngram), and the token budget
        (max_tokens clamped to the context: `stats.extra["max_tokens_clamped"]`)."""
        ids = encode_prompt(prompt, self.tokenizer)
        check_request(ids, self.model.args.vocab_size, max_tokens=max_tokens, stop=stop, tokenizer=self.tokenizer)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                repetition_penalty=repetition_penalty)  # raises before the cache is touched
        if tree is not None:
            check_tree(mode, tree, block_size)
        drafter, drafts = self.drafters.resolve(DecodeSpec(mode, block_size))
        emb = None
        if images:
            ids, emb, keys = self._expand_images(ids, images)
        else:
            keys = list(ids)
        stats = stats if stats is not None else GenerationStats()
        budget = fit_context(len(ids), max_tokens, self.max_context, clamp=True)
        if budget < max_tokens:
            stats.extra["max_tokens_clamped"] = budget
        return Prepared(ids, keys, emb, Sampler(params, seed), mode, drafter, drafts, budget, stop, stats, tree)

    def stream(self, prompt, *, stats: GenerationStats | None = None, **kw) -> Iterator[GenerationChunk]:
        """Generate on the session's cache: prompt = token ids (or text, with a tokenizer); the keyword arguments
        are `prepare`'s. The cache keeps the prompt and the generated tokens for the next request. Closing the
        iterator early (a client gone, Ctrl-C between chunks) keeps the cache valid; an exception in the middle of a
        step invalidates it. A max_tokens beyond the context limit is clamped to it
        (`stats.extra["max_tokens_clamped"]`)."""
        r = self.prepare(prompt, stats=stats, **kw)
        ids, keys, emb, drafter, drafts, budget, stop, stats = (r.ids, r.keys, r.input_embeddings, r.drafter,
                                                                r.drafts, r.budget, r.stop, r.stats)
        reuse, reason = self._reuse(keys, drafter)
        stats.extra.update(cache=reason, cached_tokens=reuse, prefilled_tokens=len(ids) - reuse)
        decoder = build_decoder(self.model, drafter, r.sampler, drafts=drafts,
                                prefill_step=self.prefill_step, cache=self.cache, tree=r.tree)
        gen = stream(decoder, ids, max_tokens=budget, eos=stop_ids(self.model, self.tokenizer),
                     tokenizer=self.tokenizer, stop=stop, stats=stats, input_embeddings=emb, reuse=reuse)
        # until the generator stops at a chunk boundary the cache may be mid-step: unknown content
        self.keys, consistent, n_gen = [], False, 0
        if drafter is not None:  # this turn changes the state of these drafter objects: no entry may vouch for it
            parts = {id(d) for d in drafter.parts()}
            self._dstate = {k: v for k, v in self._dstate.items() if not v[1] & parts}
        try:
            while True:
                consistent = False
                try:
                    chunk = next(gen)
                except StopIteration:
                    consistent = True
                    break
                consistent = True
                n_gen += len(chunk.tokens)
                yield chunk
        finally:
            gen.close()
            if consistent and len(decoder.history) >= len(ids):
                offset = self.cache[0].offset
                self.keys = (keys + list(decoder.history[len(ids):]))[:offset]
                if drafter is not None:
                    self._dstate[id(drafter)] = (self.keys[:drafter.context_length()],
                                                 frozenset(id(d) for d in drafter.parts()))
            else:
                self.cache, self.keys = None, []
            self.totals["turns"] += 1
            self.totals["prompt_tokens"] += len(ids)
            self.totals["prefilled_tokens"] += len(ids) - reuse
            self.totals["generated_tokens"] += n_gen
            if drafter is None and stats.generation_tokens >= 8 and stats.generation_time > 0:
                self.plain_rate = PlainRate(stats.generation_tps, "latest ar turn")

    def generate(self, prompt, **kw):
        """Non-streaming `stream`: returns (tokens, text, finish_reason, stats)."""
        stats = kw.pop("stats", None) or GenerationStats()
        r = collect(self.stream(prompt, stats=stats, **kw), stats, with_text=True)
        return r.tokens, r.text, r.finish_reason, stats

    # -- plain-decoding rate (the speedup baseline) ----------------------------------------------------------------
    def calibrate_plain_rate(self, tokens: int = 32) -> PlainRate:
        """The plain loop's speed (greedy, `runtime.plain.plain_token_seconds`) after a short prompt on a scratch
        cache (the session cache is untouched)."""
        args = self.model.args
        bos = getattr(args, "bos_token_id", None)
        prompt = ([bos] if isinstance(bos, int) else []) + [(11 + 7 * i) % args.vocab_size for i in range(15)]
        cache = self.model.make_cache()
        prefill(self.model, cache, prompt, self.prefill_step)
        dt = plain_token_seconds(self.model, cache, n=tokens)
        self.plain_rate = PlainRate(1.0 / dt if dt > 0 else 0.0, f"calibration ({tokens} greedy tokens)")
        return self.plain_rate


def load_session(model: str | None = None, *, draft_model: str | None = None, mtp_model: str | None = None,
                 dtype: str | None = None, max_context: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, announce=None) -> Session:
    """Load a target and its drafters into a Session (`strategy.load_drafters`). model None = the embedded model,
    whose DFlash drafter and MTP layers are loaded too. draft_model: a DFlash drafter (or MTP layers); mtp_model:
    MTP layers; a target with its own MTP layers gets them without asking."""
    path = resolve_model(model, announce=announce)
    m, tok = load(path, dtype=dtype)
    drafters = load_drafters(m, dflash=draft_model, mtp=mtp_model, embedded=model is None, log=announce)
    s = Session(m, tok, drafters=drafters, max_context=max_context, prefill_step=prefill_step)
    s.path = path
    return s
