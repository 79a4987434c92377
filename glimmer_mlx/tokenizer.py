"""tokenizer.json (+ tokenizer_config.json, chat_template.jinja) with a chat template and streaming detokenization.

Stop tokens are the union of `generation_config.json`'s and `config.json`'s `eos_token_id` and the end-of-turn
token (`<|eot|>`) when the vocabulary has one.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .config import ModelConfig

END_OF_TURN_TOKENS = ("<|eot|>", "<|eot_id|>")


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(v) for v in x]


def _token_str(v):
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, tok, *, chat_template: str | None, special: dict, eos_token_ids: set[int]):
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.eos_token_ids = eos_token_ids
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_to_id(self, s: str) -> int | None:
        return self._tok.token_to_id(s)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None,
                            tokenize: bool = False, **kwargs):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja / tokenizer_config.json "
                             "'chat_template'); pass a raw prompt instead")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(msg):
                raise ValueError(f"chat template error: {msg}")

            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Incremental decoding that never emits half a UTF-8 character: text is released once it decodes cleanly."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""  # everything released so far
        self._start = 0  # first token of the current unreleased segment
        self._released = 0  # chars of the current segment already released

    def add(self, token: int) -> str:
        self.tokens.append(token)
        seg = self.tokenizer.decode(self.tokens[self._start :])
        if seg.endswith("\ufffd"):
            return ""
        new = seg[self._released :]
        self._released = len(seg)
        if seg.endswith("\n"):
            self._start, self._released = len(self.tokens), 0
        self.text += new
        return new

    def finalize(self) -> str:
        seg = self.tokenizer.decode(self.tokens[self._start :])
        new = seg[self._released :]
        self.text += new
        self._start, self._released = len(self.tokens), 0
        return new


def load_tokenizer(path: Path, config: ModelConfig | None = None) -> Tokenizer | None:
    tj = path / "tokenizer.json"
    if not tj.exists():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tj))
    tc = {}
    if (path / "tokenizer_config.json").exists():
        tc = json.loads((path / "tokenizer_config.json").read_text())
    template = None
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif isinstance(tc.get("chat_template"), str):
        template = tc["chat_template"]
    special = {k: _token_str(tc.get(k)) for k in ("bos_token", "eos_token")}

    eos: set[int] = set()
    gc = path / "generation_config.json"
    if gc.exists():
        eos.update(_as_list(json.loads(gc.read_text()).get("eos_token_id")))
    if config is not None:
        eos.update(config.text.eos_token_ids)
    for s in (special.get("eos_token"), *END_OF_TURN_TOKENS):
        if s and tok.token_to_id(s) is not None:
            eos.add(tok.token_to_id(s))
    return Tokenizer(tok, chat_template=template, special=special, eos_token_ids=eos)
