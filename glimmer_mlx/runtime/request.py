"""What a generation request must satisfy before it touches the model: the prompt's ids, max_tokens, stop strings,
and the context budget. One source for these rules: `generate`, the session (chat, agent) and the server's request
parsing all call them."""

from __future__ import annotations

from ..sampling import is_int


class ContextLengthError(ValueError):
    """The prompt (plus the tokens asked for) does not fit the context limit. `param`: the request field to blame
    ("messages" when the prompt alone is too long, "max_tokens" when it is the tokens asked for)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def encode_prompt(prompt, tokenizer) -> list[int]:
    """A text prompt (needs a tokenizer) or token ids → a list of ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def check_request(ids: list[int], vocab_size: int, *, max_tokens: int, stop=None, tokenizer=None) -> None:
    """Raise ValueError naming what is wrong: an empty prompt, ids outside the vocabulary, max_tokens < 1, stop
    strings without a tokenizer to match them."""
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")


def fit_context(n_prompt: int, max_tokens: int | None, limit: int, *, default: int | None = None,
                clamp: bool = False) -> int:
    """How many tokens a request of `n_prompt` prompt tokens may generate within a context of `limit` tokens.

    max_tokens None: `default` (None: all the room there is), shrunk to fit. A max_tokens beyond the room is shrunk
    when `clamp` (a chat turn: the answer is cut at the limit and says so), else a ContextLengthError (an API
    request: the client asked for more than can be given). A prompt that leaves no room is always an error."""
    if n_prompt >= limit:
        raise ContextLengthError(f"the prompt is {n_prompt} tokens and the maximum context length is {limit} "
                                 "tokens: no room to generate", "messages")
    room = limit - n_prompt
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room and not clamp:
        raise ContextLengthError(f"the maximum context length is {limit} tokens, but {n_prompt} prompt tokens "
                                 f"+ {max_tokens} max_tokens were requested; lower max_tokens", "max_tokens")
    return min(max_tokens, room)
