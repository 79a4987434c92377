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

Whenever a rewind is impossible (sliding-window layers keep only `max_rewind` spare rows; a drafter without the
reuse protocol; a changed MTP depth; an interrupted generation that left the cache mid-step) the session starts
over with an empty cache: a full prefill, correct but slower. Each turn's `stats.extra` says what happened:
`cached_tokens`, `prefilled_tokens` and `cache` (the reason for a fresh start, or "reused").
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from .cache import CacheRewindError, rewind_cache
from .generate import DEFAULT_PREFILL_STEP, GenerationChunk, GenerationStats, PlainDecoder, stream_generate
from .sampling import Sampler, SamplingParams

MODES = ("ar", "dflash", "mtp", "auto")
DEFAULT_MAX_REWIND = 128


class ContextLengthError(ValueError):
    """The prompt leaves no room to generate within the context limit."""


class ModeError(ValueError):
    """A decoding mode that this session cannot run (no drafter loaded for it, a bad width)."""


def common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class TurnRecord:
    """What the latest turn did to the cache (for stats and tests)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    reason: str = ""


@dataclass
class PlainRate:
    tokens_per_s: float = 0.0
    source: str = ""  # "ar turn" | "calibration"
    at: float = field(default_factory=time.time)


class Session:
    """One model (and its drafters) with a prompt cache reused across requests.

    drafters: {"dflash": DFlashDrafter, "mtp": MTPDrafter} (either may be missing). max_context: the context limit
    (default: the model's max_position_embeddings). Not thread-safe: serve requests one at a time."""

    def __init__(self, model, tokenizer=None, *, drafters: dict | None = None, max_context: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, max_rewind: int = DEFAULT_MAX_REWIND):
        self.model, self.tokenizer = model, tokenizer
        self.drafters = {k: v for k, v in (drafters or {}).items() if v is not None}
        model_max = int(getattr(model.args, "max_position_embeddings", 0) or 0)
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        if max_context is not None and model_max and max_context > model_max:
            raise ValueError(f"max_context {max_context} exceeds the model's max_position_embeddings {model_max}")
        self.max_context = max_context or model_max or 131_072
        self.prefill_step = prefill_step
        trained = max([getattr(d, "max_drafts", 0) + 1 for d in self.drafters.values()] + [0])
        self.max_rewind = max(max_rewind, 64, trained)
        self.cache = None  # target KV cache
        self.keys: list = []  # what `cache` holds, one key per position
        # id(drafter) -> (signature, keys its state covers, ids of the drafter objects whose state that is)
        self._dstate: dict[int, tuple] = {}
        self._auto = None
        self.last = TurnRecord()
        self.plain_rate: PlainRate | None = None
        self.totals = {"turns": 0, "prompt_tokens": 0, "prefilled_tokens": 0, "generated_tokens": 0}

    # -- modes ------------------------------------------------------------------------------------------------------
    def available_modes(self) -> list[str]:
        out = ["ar"]
        if "dflash" in self.drafters:
            out.append("dflash")
        if "mtp" in self.drafters:
            out.append("mtp")
        out.append("auto")  # n-gram lookup needs no drafter model
        return out

    def auto_drafter(self):
        """`auto`: the per-round strategy of `speculative.auto` over this session's drafters (copies: their own
        state, shared weights) and n-gram lookup; built on first use (it calibrates the verify cost curve once per
        machine and model)."""
        from .speculative.auto import make_auto

        if self._auto is None:
            dflash, mtp = self.drafters.get("dflash"), self.drafters.get("mtp")
            dflash = copy.copy(dflash) if dflash is not None else None
            if mtp is not None:
                mtp = copy.copy(mtp)
                mtp.set_depth(max(2, mtp.head.num_layers))  # auto limits the drafts per round itself
            self._auto = make_auto(self.model, dflash=dflash, mtp=mtp, ngram=True)
        return self._auto

    def check_mode(self, mode: str, block_size=None) -> None:
        """Raise ModeError if this session cannot run `mode` with `block_size`; changes nothing (safe from any
        thread, e.g. a server's request threads while a generation runs)."""
        self.resolve_mode(mode, block_size, prepare=False)

    def resolve_mode(self, mode: str, block_size=None, *, prepare: bool = True):
        """(drafter or None, block_size for make_decoder). Raises ModeError with what is missing. prepare: set the
        drafter up for the turn (MTP depth; `auto` built on first use); False only validates."""
        if mode not in MODES:
            raise ModeError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        if mode == "ar":
            if block_size is not None:
                raise ModeError("block_size is for the speculative modes (dflash, mtp, auto), not ar")
            return None, None
        if mode == "auto":
            if block_size not in (None, "auto"):
                raise ModeError("mode 'auto' chooses the width itself; give block_size only with dflash or mtp")
            return (self.auto_drafter() if prepare else None), None
        drafter = self.drafters.get(mode)
        if drafter is None:
            how = "--draft-model DFLASH_DRAFTER" if mode == "dflash" else "--mtp (MTP layers in the checkpoint) or --mtp-model"
            raise ModeError(f"mode {mode!r} is not available: no {'DFlash drafter' if mode == 'dflash' else 'MTP layers'} "
                            f"loaded (start with {how}); available: {', '.join(self.available_modes())}")
        if block_size is not None and block_size != "auto" and (
                not isinstance(block_size, int) or isinstance(block_size, bool)):
            raise ModeError(f"block_size must be an integer or 'auto', got {block_size!r}")
        if mode == "dflash" and isinstance(block_size, int) and not 2 <= block_size <= drafter.block_size:
            raise ModeError(f"block_size must be in [2, {drafter.block_size}] (the DFlash drafter's trained block "
                            f"size) or 'auto', got {block_size}")
        if mode == "mtp" and isinstance(block_size, int):
            from .speculative.mtp import MAX_DEPTH

            if not 1 <= block_size <= MAX_DEPTH:
                raise ModeError(f"MTP depth (block_size) must be in [1, {MAX_DEPTH}] or 'auto', got {block_size}")
        return self._prepare_drafter(drafter, block_size) if prepare else (None, None)

    def _prepare_drafter(self, drafter, block_size):
        if getattr(drafter, "kind", None) == "mtp":  # depth is drafter state: fix it before the reuse decision
            drafter.set_depth(block_size if isinstance(block_size, int) else drafter.head.num_layers)
        if block_size == "auto":  # auto's per-round width over this drafter (it drives this drafter's state)
            from .speculative.auto import width_auto

            return width_auto(self.model, drafter), None
        return drafter, block_size

    @staticmethod
    def _parts(drafter) -> frozenset:
        """Ids of the drafter objects whose state `drafter` changes (itself, and what a width-auto drives)."""
        return frozenset([id(drafter)] + [id(d) for d in getattr(drafter, "drafters", {}).values()])

    @staticmethod
    def _signature(drafter):
        return (drafter.kind, getattr(drafter, "depth", None))

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
            if not (hasattr(drafter, "rewind_context") and hasattr(drafter, "extend")):
                return self._fresh(f"fresh: the {drafter.kind} drafter cannot extend its state")
            entry = self._dstate.get(id(drafter))
            if entry is None or entry[0] != self._signature(drafter):
                return self._fresh(f"fresh: the {drafter.kind} drafter has no state for this conversation/width")
            k = min(k, common_prefix(entry[1], keys))
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
        return self.tokenizer.encode(text)

    def _expand_images(self, ids: list[int], images):
        from .image_processing import MAX_IMAGE_TOKENS
        from .multimodal import prepare_prompt, process_images

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
    def stream(self, prompt, *, mode: str = "ar", block_size=None, images=None, max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
               repetition_penalty: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
               stats: GenerationStats | None = None) -> Iterator[GenerationChunk]:
        """`stream_generate` on the session's cache: prompt = token ids (or text, with a tokenizer). The cache keeps
        the prompt and the generated tokens for the next request. Closing the iterator early (a client gone, Ctrl-C
        between chunks) keeps the cache valid; an exception in the middle of a step invalidates it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       repetition_penalty=repetition_penalty)  # validate before touching the cache
        drafter, bs = self.resolve_mode(mode, block_size)
        emb = None
        if images:
            ids, emb, keys = self._expand_images(ids, images)
        else:
            keys = list(ids)
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt is {len(ids)} tokens and the context limit is {self.max_context}: no room to generate "
                f"(start a new conversation, shorten it, or raise the limit with --max-context; the model supports "
                f"{getattr(self.model.args, 'max_position_embeddings', '?')})")
        stats = stats if stats is not None else GenerationStats()
        if max_tokens > room:
            stats.extra["max_tokens_clamped"] = room
            max_tokens = room
        reuse, reason = self._reuse(keys, drafter)
        self.last = TurnRecord(len(ids), reuse, len(ids) - reuse, reason)
        stats.extra["cache"] = reason
        holder = {}

        def on_decoder(dec):
            holder["decoder"] = dec

        gen = stream_generate(self.model, ids, tokenizer=self.tokenizer, max_tokens=max_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed, stop=stop, drafter=drafter,
                              block_size=bs, prefill_step_size=self.prefill_step, stats=stats, cache=self.cache,
                              reuse=reuse, input_embeddings=emb, on_decoder=on_decoder)
        # until the generator stops at a chunk boundary the cache may be mid-step: unknown content
        self.keys, consistent, n_gen = [], False, 0
        if drafter is not None:  # this turn changes the state of these drafter objects: no entry may vouch for it
            parts = self._parts(drafter)
            self._dstate = {k: v for k, v in self._dstate.items() if not v[2] & parts}
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
            dec = holder.get("decoder")
            if consistent and dec is not None and len(dec.history) >= len(ids):
                offset = self.cache[0].offset
                self.keys = (keys + list(dec.history[len(ids):]))[:offset]
                if drafter is not None and hasattr(drafter, "context_length"):
                    self._dstate[id(drafter)] = (self._signature(drafter), self.keys[:drafter.context_length()],
                                                 self._parts(drafter))
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
        tokens, text, finish = [], "", None
        for chunk in self.stream(prompt, stats=stats, **kw):
            tokens += chunk.tokens
            text += chunk.text
            finish = chunk.finish_reason
        return tokens, text, finish, stats

    # -- plain-decoding rate (the speedup baseline) ----------------------------------------------------------------
    def calibrate_plain_rate(self, tokens: int = 32, warmup: int = 4) -> PlainRate:
        """Greedy plain decoding of `tokens` tokens after a short prompt on a scratch cache (the session cache is
        untouched); the first `warmup` steps are not timed."""
        args = self.model.args
        bos = getattr(args, "bos_token_id", None)
        prompt = ([bos] if isinstance(bos, int) else []) + [(11 + 7 * i) % args.vocab_size for i in range(15)]
        dec = PlainDecoder(self.model, Sampler(SamplingParams()), self.prefill_step)
        dec.prefill(prompt)
        for _ in range(warmup):
            dec.step(tokens + warmup)
        t0 = time.perf_counter()
        for i in range(tokens):
            dec.step(tokens - i)
        dt = time.perf_counter() - t0
        mx.eval([c.state for c in dec.cache])
        self.plain_rate = PlainRate(tokens / dt if dt > 0 else 0.0, f"calibration ({tokens} greedy tokens)")
        return self.plain_rate


def load_session(model: str | None = None, *, draft_model: str | None = None, mtp: bool = False,
                 mtp_model: str | None = None, dtype: str | None = None, max_context: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, announce=None) -> Session:
    """Load a target and its drafters into a Session. model None = the embedded model, whose DFlash drafter and MTP
    layers are loaded too when present. mtp: MTP layers from the target's checkpoint (or `mtp_model`)."""
    from . import load
    from .embedded import embedded_path, resolve_model
    from .speculative import MTPDrafter, load_drafter

    embedded = model is None
    path = resolve_model(model, announce=announce)
    m, tok = load(path, dtype=dtype)
    drafters = {}
    if embedded and draft_model is None:
        try:
            draft_model = str(embedded_path("dflash"))
        except FileNotFoundError:
            draft_model = None
        if not mtp and mtp_model is None:
            try:
                mtp_model = str(embedded_path("mtp"))
            except FileNotFoundError:
                mtp_model = None
    if draft_model is not None:
        d = load_drafter(draft_model, m)
        drafters[d.kind] = d
    if mtp or mtp_model is not None:
        d = load_drafter(mtp_model if mtp_model is not None else path, m)
        if not isinstance(d, MTPDrafter):
            raise ValueError(f"{mtp_model or path}: MTP needs a checkpoint with MTP layers (num_mtp_layers and mtp.* "
                             "weights); this one is a DFlash drafter")
        drafters["mtp"] = d
    s = Session(m, tok, drafters=drafters, max_context=max_context, prefill_step=prefill_step)
    s.path = path
    return s
