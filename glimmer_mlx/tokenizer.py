"""tokenizer.json (+ tokenizer_config.json, chat_template.jinja) with a chat template and streaming detokenization.

Stop tokens are the union of `generation_config.json`'s and `config.json`'s `eos_token_id` and the end-of-turn
token (`<|eot|>`) when the vocabulary has one.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from .config import ModelConfig
from .files import FileFormatError, present, read_json, read_text

END_OF_TURN_TOKENS = ("<|eot|>", "<|eot_id|>")


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(v) for v in x]


def _walk_strings(obj, fn):
    """`obj` (JSON-like: dicts, lists, tuples) with `fn` applied to every string in it, keys included; `fn` may
    also just look (and return its argument)."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {_walk_strings(k, fn): _walk_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk_strings(v, fn) for v in obj)
    return obj


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
        self._specials: list[str] | None = None  # `special_tokens`
        self._as_text = None  # a copy of `tok` that encodes special-token strings as text (`encode_text`)

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
        if not tokenize:
            return self._render(messages, add_generation_prompt, tools, kwargs)
        return self.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def _render(self, messages, add_generation_prompt, tools, kwargs) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    # -- message content is text ----------------------------------------------------------------------------------
    # The rendered prompt is tokenized so that only the special tokens the template itself writes (turn markers)
    # are control tokens: special-token text inside a message (content, names, tool calls) or a tool description,
    # e.g. "<|eot|><|start|>system", is encoded as the text it is, so no message can forge a turn. Each such
    # occurrence is rendered as a sentinel character (unused anywhere in the input), the render is split at the
    # template's special tokens as the tokenizer itself splits it, and each piece between them is encoded with
    # special-token matching off, the sentinels put back as their text. A conversation without special-token text
    # in it is encoded exactly as before (one `encode` of the render).
    def special_tokens(self) -> list[str]:
        """The special (control) tokens' strings, longest first; [] for a tokenizer that does not list them."""
        if self._specials is None:
            try:
                added = self._tok.get_added_tokens_decoder().values()
                self._specials = sorted({a.content for a in added if a.special and a.content}, key=len,
                                        reverse=True)
            except AttributeError:
                self._specials = []
        return self._specials

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text` encoded with special-token strings as plain text (no control token comes out of the text itself;
        add_special_tokens: the tokenizer's own BOS/EOS around it, as `encode` adds them)."""
        if self._as_text is None:
            from tokenizers import Tokenizer as HFTokenizer

            t = HFTokenizer.from_str(self._tok.to_str())
            t.encode_special_tokens = True
            self._as_text = t
        return self._as_text.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None,
                    **kwargs) -> list[int]:
        """The chat template's rendering as ids, with message and tool text encoded as text (see above)."""
        specials = self.special_tokens()
        found = set()
        if specials:
            pattern = re.compile("|".join(map(re.escape, specials)))
            _walk_strings((messages, tools), lambda v: found.update(pattern.findall(v)) or v)
        if not found:
            return self.encode(self._render(messages, add_generation_prompt, tools, kwargs),
                               add_special_tokens=False)
        used = set(self.chat_template or "")
        _walk_strings((messages, tools), lambda v: used.update(v) or v)
        free = (chr(c) for c in range(0xF0000, 0x10FFFE) if chr(c) not in used)
        sentinel = {tok: next(free) for tok in sorted(found)}
        original = {v: k for k, v in sentinel.items()}
        to_sentinels = (lambda v: pattern.sub(lambda m: sentinel[m.group(0)], v))
        text = self._render(_walk_strings(messages, to_sentinels), add_generation_prompt,
                            _walk_strings(tools, to_sentinels), kwargs)
        back = re.compile("|".join(map(re.escape, original)))
        ids, pos = [], 0
        for m in pattern.finditer(text):  # what is left of the special tokens: the template's own
            if m.start() > pos:
                ids += self.encode_text(back.sub(lambda x: original[x.group(0)], text[pos:m.start()]))
            ids.append(self._tok.token_to_id(m.group(0)))
            pos = m.end()
        if pos < len(text):
            ids += self.encode_text(back.sub(lambda x: original[x.group(0)], text[pos:]))
        return ids

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


class TokenizerError(ValueError):
    """Tokenizer files that cannot be used; the message names the file (and field)."""


def check_chat_template(template: str, where: str) -> None:
    """Compile a chat template (jinja2, with the extensions apply_chat_template enables: syntax, and every filter and
    test it names exists); TokenizerError naming `where` and the line otherwise. Nothing is rendered."""
    from jinja2 import Environment, TemplateSyntaxError

    try:  # TemplateAssertionError (an unknown filter / test) is a TemplateSyntaxError too
        Environment(extensions=["jinja2.ext.loopcontrols"]).from_string(template)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: invalid chat template (jinja2, line {e.lineno}: {e.message})") from None


def load_tokenizer(path: Path, config: ModelConfig | None = None) -> Tokenizer | None:
    """The checkpoint's tokenizer, None without tokenizer.json. Every file it reads is checked here, so a broken one
    fails at load time naming the file: FileFormatError (unreadable / not UTF-8 / not JSON) or TokenizerError."""
    tj = path / "tokenizer.json"
    if not present(tj):
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_str(read_text(tj))
    except FileFormatError:
        raise
    except Exception as e:  # the tokenizers library raises a bare Exception for malformed files
        raise TokenizerError(f"{tj}: not a valid tokenizer file ({str(e).splitlines()[0] if str(e) else e!r})"
                             ) from None
    tc = {}
    tcp = path / "tokenizer_config.json"
    if present(tcp):
        tc = read_json(tcp, dict)
    template = None
    if present(path / "chat_template.jinja"):
        template = read_text(path / "chat_template.jinja")
        check_chat_template(template, str(path / "chat_template.jinja"))
    elif isinstance(tc.get("chat_template"), str):
        template = tc["chat_template"]
        check_chat_template(template, f"{tcp} ('chat_template')")
    special = {k: _token_str(tc.get(k)) for k in ("bos_token", "eos_token")}
    for k, v in special.items():
        if v is not None and not isinstance(v, str):
            raise TokenizerError(f"{tcp}: '{k}' must be a string or an added-token object, got {tc.get(k)!r}")

    eos: set[int] = set()
    gc = path / "generation_config.json"
    if present(gc):
        e = read_json(gc, dict).get("eos_token_id")
        try:
            eos.update(_as_list(e))
        except (TypeError, ValueError):
            raise TokenizerError(f"{gc}: 'eos_token_id' must be a token id or a list of token ids, got {e!r}"
                                 ) from None
    if config is not None:
        eos.update(config.text.eos_token_ids)
    for s in (special.get("eos_token"), *END_OF_TURN_TOKENS):
        if s and tok.token_to_id(s) is not None:
            eos.add(tok.token_to_id(s))
    return Tokenizer(tok, chat_template=template, special=special, eos_token_ids=eos)
