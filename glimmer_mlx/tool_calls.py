"""Tool calls in a model's own output format: parsing (tolerant, never raising), streaming-safe visible text, and
conversions to and from the OpenAI message format.

    parser = get_parser(tokenizer.chat_template)        # format chosen from the chat template
    msg = parser.parse(generated_text)                   # ParsedMessage(content, tool_calls, errors, reasoning)
    shown = parser.visible(text_so_far)                  # answer prefix safe to print while streaming

Formats are pluggable: `register_format(name, parser_class, detect)` adds one; `get_parser` picks the first
registered format whose `detect(chat_template)` is true, else the JSON fallback.

Muse format (mlx-lm's `muse_spark`): the generation prompt ends with `<|start|>assistant`; the model writes a
header and its message, possibly several messages in one turn:

    to=self<|message|>REASONING<|eom|>
    <|start|>assistant to=functions<|message|><atem:function_calls><atem:invoke name="F">
        <atem:parameter name="ARG">VALUE</atem:parameter>...</atem:invoke>...</atem:function_calls><|eot|>
    <|start|>assistant to=user<|message|>ANSWER<|eot|>

Parameter values are JSON-decoded when they are valid JSON, else kept as stripped text (`ToolCall.raw_arguments`
keeps the exact text, for string parameters such as file contents). A malformed call is never executed and never
raises: it becomes a message in `ParsedMessage.errors`, meant to go back to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

MAX_ERRORS = 20  # errors reported per message (a degenerate output can hold thousands of broken tags)
_SNIPPET = 60  # characters of offending text quoted in an error


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=new_call_id)
    raw_arguments: dict = field(default_factory=dict)  # parameter name -> exact text as written (Muse format)


@dataclass
class ParsedMessage:
    content: str  # the user-visible answer as written: headers, reasoning and tool-call markup removed (several
    #               visible messages are joined by a blank line)
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed call or markup problem
    reasoning: str = ""  # hidden reasoning (Muse `to=self` messages, `<think>` blocks)


def _snip(s: str) -> str:
    s = s.strip()
    return repr(s if len(s) <= _SNIPPET else s[:_SNIPPET] + "…")


def tool_names(tools) -> set[str] | None:
    """Names from a tool list: strings, {"name": ...}, or OpenAI {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    names = set()
    for t in tools:
        if isinstance(t, str):
            names.add(t)
        elif isinstance(t, dict):
            f = t.get("function") if isinstance(t.get("function"), dict) else t
            if isinstance(f.get("name"), str):
                names.add(f["name"])
        elif isinstance(getattr(t, "name", None), str):
            names.add(t.name)
    return names


def _decode_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.strip()


def _held_back(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker (text to hold back while
    streaming, since it may still become that marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolParser(ABC):
    """Base class of a format: `parse(text)` -> ParsedMessage, `visible(text_so_far)` -> streaming-safe answer
    prefix. A format implements `_parse` (may leave errors in the result, must not raise) and `visible`."""

    name = "base"

    def __init__(self, tools=None):
        self.tools = tools

    def parse(self, text: str, tools=None) -> ParsedMessage:
        """Parse a complete model output. Never raises on any input string."""
        if not isinstance(text, str):
            return ParsedMessage(content="", errors=[f"model output is {type(text).__name__}, not text"])
        try:
            msg = self._parse(text)
        except RecursionError:  # pragma: no cover - the scanners are iterative; a last guard
            return ParsedMessage(content="", errors=["the tool-call markup is too deeply nested to parse"])
        names = tool_names(tools if tools is not None else self.tools)
        if names is not None:
            kept = []
            for c in msg.tool_calls:
                if c.name in names:
                    kept.append(c)
                else:
                    msg.errors.append(f"unknown tool {c.name!r}; available tools: {', '.join(sorted(names))}")
            msg.tool_calls = kept
        if len(msg.errors) > MAX_ERRORS:
            n = len(msg.errors) - MAX_ERRORS
            msg.errors = msg.errors[:MAX_ERRORS] + [f"... and {n} more error(s)"]
        return msg

    @abstractmethod
    def visible(self, text_so_far: str) -> str:
        """The answer text that is safe to show while the output is still streaming: no header, reasoning,
        tool-call markup or partial tag. Each call's result extends the previous one's (for a growing input), and
        on the complete output it equals `parse(text).content`."""

    @abstractmethod
    def _parse(self, text: str) -> ParsedMessage:
        """The format's parse of a complete output (tool-name filtering and error capping are done by `parse`)."""


# ----------------------------------------------------------------------------------------------- Muse format

MUSE_CALLS_OPEN, MUSE_CALLS_CLOSE = "<atem:function_calls>", "</atem:function_calls>"
_INVOKE_OPEN, _INVOKE_CLOSE = "<atem:invoke", "</atem:invoke>"
_PARAM_OPEN, _PARAM_CLOSE = "<atem:parameter", "</atem:parameter>"
_START, _MESSAGE = "<|start|>", "<|message|>"
_TERMINATORS = ("<|eom|>", "<|eot|>", "<|end|>", "<|call|>", "<|return|>", "<|end_of_text|>")
_MAX_HEADER = 200  # a header longer than this (or with a newline) is not a header: the text is headerless
_REASONING = {"self", "analysis", "thinking", "reasoning"}
_VISIBLE = {"user", "commentary", "final", "all"}
_TAG_ATTRS = re.compile(r"""(\w+)\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_SPECIAL = re.compile(r"<\|[a-z_]{1,20}\|>")


def _attrs(tag_inner: str) -> dict[str, str]:
    return {m.group(1): m.group(2) if m.group(2) is not None else m.group(3) for m in _TAG_ATTRS.finditer(tag_inner)}


def _recipient(header: str) -> str | None:
    m = re.search(r"\bto=([^\s<>]+)", header)
    return m.group(1) if m else None


def _headerish(s: str) -> bool:
    """Could `s` (no `<|message|>` yet) still become a header?"""
    if len(s) > _MAX_HEADER or "\n" in s:
        return False
    s = s.lstrip()
    return s.startswith("to=") or "to=".startswith(s)


def _muse_segments(text: str):
    """Split an assistant turn into its messages. Yields (header, body, state): state "ok" (header read),
    "headerless" (text without a header: all of it is the body), "partial" (the output ends inside a header or
    role), and stops at a `<|start|>` that opens another role's turn (the model writing a user/tool turn)."""
    pieces = text.split(_START)
    for i, seg in enumerate(pieces):
        last = i == len(pieces) - 1
        if i > 0:
            m = re.match(r"\s*([A-Za-z_]+)", seg)
            if m is None or m.end() == len(seg):
                role = m.group(1) if m else ""
                if last and "assistant".startswith(role):  # "<|start|>assis" at the end: still streaming
                    yield None, "", "partial"
                return
            if m.group(1) != "assistant":
                return  # another role's turn: the assistant turn is over
            seg = seg[m.end():]
        idx = seg.find(_MESSAGE)
        if 0 <= idx <= _MAX_HEADER and "\n" not in seg[:idx]:
            yield seg[:idx], seg[idx + len(_MESSAGE):], "ok"
        elif idx < 0 and last and seg.strip() and _headerish(seg):
            yield seg, "", "partial"
        elif i == 0:
            yield None, seg, "headerless"
        else:  # "<|start|>assistant" then text without a header: take the text as the message
            yield "", seg, "ok"


def _cut_terminator(body: str) -> tuple[str, bool]:
    """Body up to the first end-of-message token; (body, terminated)."""
    cut = min((i for t in _TERMINATORS if (i := body.find(t)) >= 0), default=-1)
    return (body, False) if cut < 0 else (body[:cut], True)


def _parse_invoke_body(body: str, name: str, errors: list[str]) -> ToolCall | None:
    """Parameters of one invoke; None (with errors) when its markup is broken: such a call must not run."""
    args, raw, pos, ok = {}, {}, 0, True
    while True:
        j = body.find("<", pos)
        gap = body[pos:] if j < 0 else body[pos:j]
        if gap.strip():
            errors.append(f"invoke {name!r}: unexpected text {_snip(gap)} between parameters "
                          f"(expected <atem:parameter name=\"...\">VALUE</atem:parameter>)")
            ok = False
        if j < 0:
            break
        if not body.startswith(_PARAM_OPEN, j):
            end = body.find(">", j)
            tag = body[j:end + 1] if end >= 0 else body[j:]
            errors.append(f"invoke {name!r}: unexpected markup {_snip(tag)} (only <atem:parameter> tags may appear "
                          f"inside <atem:invoke>)")
            ok = False
            if end < 0:
                break
            pos = end + 1
            continue
        gt = body.find(">", j)
        if gt < 0:
            errors.append(f"invoke {name!r}: unclosed <atem:parameter tag {_snip(body[j:])}")
            return None
        attrs = _attrs(body[j + len(_PARAM_OPEN):gt])
        close = body.find(_PARAM_CLOSE, gt + 1)
        if close < 0:
            pname = attrs.get("name", "?")
            errors.append(f"invoke {name!r}: parameter {pname!r} is not closed with </atem:parameter> "
                          f"(output truncated?)")
            return None
        pname = attrs.get("name")
        value = body[gt + 1:close]
        if not pname:
            errors.append(f"invoke {name!r}: a parameter has no name attribute: {_snip(body[j:gt + 1])}")
            ok = False
        elif pname in args:
            errors.append(f"invoke {name!r}: parameter {pname!r} given twice")
            ok = False
        else:
            args[pname] = _decode_value(value)
            raw[pname] = value
        pos = close + len(_PARAM_CLOSE)
    if not ok:
        return None
    return ToolCall(name=name, arguments=args, raw_arguments=raw)


def _parse_calls_block(block: str, closed: bool, errors: list[str]) -> list[ToolCall]:
    """The inside of <atem:function_calls>...</atem:function_calls>."""
    calls, pos = [], 0
    if not closed:
        errors.append("<atem:function_calls> is not closed with </atem:function_calls> (output truncated?); "
                      "only complete invokes were read")
    while True:
        j = block.find(_INVOKE_OPEN, pos)
        gap = block[pos:] if j < 0 else block[pos:j]
        if gap.strip():
            errors.append(f"unexpected text {_snip(gap)} inside <atem:function_calls> (expected "
                          f"<atem:invoke name=\"...\"> elements); it was ignored")
        if j < 0:
            return calls
        gt = block.find(">", j)
        if gt < 0:
            errors.append(f"unclosed <atem:invoke tag {_snip(block[j:])} (output truncated?)")
            return calls
        inner = block[j + len(_INVOKE_OPEN):gt]
        if inner and not inner[0].isspace():  # "<atem:invokeX": not an invoke tag
            errors.append(f"unexpected markup {_snip(block[j:gt + 1])} inside <atem:function_calls>")
            pos = gt + 1
            continue
        name = _attrs(inner).get("name", "").strip()
        # the invoke ends at the first </atem:invoke> not inside a parameter value
        k, end = gt + 1, -1
        while True:
            p = block.find(_PARAM_OPEN, k)
            e = block.find(_INVOKE_CLOSE, k)
            if p < 0 or 0 <= e < p:  # no parameter opens before the next </atem:invoke>
                end = e
                break
            pc = block.find(_PARAM_CLOSE, p)
            if pc < 0:
                pname = _attrs(block[p:block.find(">", p) + 1 or None]).get("name", "?")
                errors.append(f"invoke {name or '?'!r}: parameter {pname!r} is not closed with </atem:parameter> "
                              f"(output truncated?); the call was not run")
                return calls
            k = pc + len(_PARAM_CLOSE)
        if end < 0:
            errors.append(f"invoke {name or '?'!r} is not closed with </atem:invoke> (output truncated?); "
                          f"it was not run")
            return calls
        if not name:
            errors.append(f"an <atem:invoke> has no name attribute: {_snip(block[j:gt + 1])}; it was not run")
        else:
            call = _parse_invoke_body(block[gt + 1:end], name, errors)
            if call is not None:
                calls.append(call)
            else:
                errors.append(f"invoke {name!r} was not run because its markup is malformed")
        pos = end + len(_INVOKE_CLOSE)


def _split_calls(body: str, errors: list[str] | None):
    """Split a message body into (text outside call blocks, calls). errors=None: only the text (streaming)."""
    text, calls, pos = [], [], 0
    while True:
        j = body.find(MUSE_CALLS_OPEN, pos)
        if j < 0:
            text.append(body[pos:])
            return "".join(text), calls
        text.append(body[pos:j])
        start = j + len(MUSE_CALLS_OPEN)
        close = body.find(MUSE_CALLS_CLOSE, start)
        if errors is not None:
            calls += _parse_calls_block(body[start:] if close < 0 else body[start:close], close >= 0, errors)
        if close < 0:
            return "".join(text), calls
        pos = close + len(MUSE_CALLS_CLOSE)


def _clean(s: str) -> str:
    return _SPECIAL.sub("", s)


class MuseToolParser(ToolParser):
    """`<atem:function_calls>` calls inside `to=...<|message|>` messages (Muse Spark / Glimmer)."""

    name = "muse"

    def _parse(self, text: str) -> ParsedMessage:
        errors: list[str] = []
        content, reasoning, calls = [], [], []
        for header, body, state in _muse_segments(text):
            if state == "partial":
                errors.append("the output ended inside a message header (truncated?)")
                break
            body, _ = _cut_terminator(body)
            to = _recipient(header) if header is not None else None
            if to in _REASONING:
                reasoning.append(body.strip())
                continue
            outside, found = _split_calls(body, errors)
            calls += found
            if to is None or to in _VISIBLE:
                content.append(_clean(outside))
                continue
            # a message to a tool: to=functions (atem block) or to=functions.NAME / to=NAME with a JSON body
            if MUSE_CALLS_OPEN in body:
                if outside.strip():
                    errors.append(f"unexpected text {_snip(outside)} outside <atem:function_calls> in a message "
                                  f"to={to}; it was ignored")
                continue
            fname = to.split(".", 1)[1] if to.startswith("functions.") else None if to == "functions" else to
            if fname is None:
                errors.append(f"a message to=functions holds no <atem:function_calls> block: {_snip(body)}")
                continue
            try:
                args = json.loads(body) if body.strip() else {}
            except ValueError:
                errors.append(f"a message to={to} holds neither <atem:function_calls> nor a JSON object of "
                              f"arguments: {_snip(body)}")
                continue
            if not isinstance(args, dict):
                errors.append(f"the arguments of {fname!r} must be a JSON object, got {type(args).__name__}")
                continue
            calls.append(ToolCall(name=fname, arguments=args))
        return ParsedMessage(content="\n\n".join(c for c in content if c.strip()), tool_calls=calls, errors=errors,
                             reasoning="\n\n".join(r for r in reasoning if r))

    def visible(self, text_so_far: str) -> str:
        parts = []
        for header, body, state in _muse_segments(text_so_far):
            if state == "partial":
                break
            body, terminated = _cut_terminator(body)
            to = _recipient(header) if header is not None else None
            if to is not None and to not in _VISIBLE:
                continue
            outside, _ = _split_calls(body, None)
            if not terminated:  # hold back what may still become a tag or a special token
                hold = _held_back(outside, (MUSE_CALLS_OPEN, _START, *_TERMINATORS))
                if hold == 0:
                    m = re.search(r"<\|[a-z_]{0,20}\|?$", outside)
                    hold = len(outside) - m.start() if m else 0
                outside = outside[:len(outside) - hold]
            parts.append(_clean(outside))
        return "\n\n".join(p for p in parts if p.strip())


# ---------------------------------------------------------------------------------------------- JSON fallback

_TC_OPEN, _TC_CLOSE = "<tool_call>", "</tool_call>"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _json_call(obj, errors: list[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        errors.append(f"a tool call must be a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}")
        return None
    f = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = f.get("name")
    if not isinstance(name, str) or not name.strip():
        errors.append(f"a tool call has no \"name\": {_snip(json.dumps(obj)[:200])}")
        return None
    args = f.get("arguments", f.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            errors.append(f"tool call {name!r}: \"arguments\" is a string that is not valid JSON: {_snip(args)}")
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        errors.append(f"tool call {name!r}: \"arguments\" must be a JSON object, got {type(args).__name__}")
        return None
    call_id = obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else new_call_id()
    return ToolCall(name=name.strip(), arguments=args, id=call_id)


def _json_calls(payload: str, errors: list[str], where: str) -> list[ToolCall]:
    try:
        obj = json.loads(payload)
    except ValueError as e:
        errors.append(f"{where}: invalid JSON ({e.msg} at char {e.pos}): {_snip(payload)}")
        return []
    objs = obj if isinstance(obj, list) else [obj]
    return [c for o in objs if (c := _json_call(o, errors)) is not None]


def _strip_think(text: str) -> tuple[str, str, bool]:
    """(text without think blocks, reasoning, inside an unclosed think block at the end)."""
    reasoning = []
    close = text.find(_THINK_CLOSE)
    opened = text.find(_THINK_OPEN)
    if close >= 0 and (opened < 0 or opened > close):  # the template opened <think> in the prompt
        reasoning.append(text[:close])
        text = text[close + len(_THINK_CLOSE):]
    out, pos = [], 0
    while True:
        j = text.find(_THINK_OPEN, pos)
        if j < 0:
            out.append(text[pos:])
            return "".join(out), "\n".join(r.strip() for r in reasoning if r.strip()), False
        out.append(text[pos:j])
        e = text.find(_THINK_CLOSE, j)
        if e < 0:
            reasoning.append(text[j + len(_THINK_OPEN):])
            return "".join(out), "\n".join(r.strip() for r in reasoning if r.strip()), True
        reasoning.append(text[j + len(_THINK_OPEN):e])
        pos = e + len(_THINK_CLOSE)


_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)
_CALL_START = re.compile(r'^\[?\s*\{\s*"(name|function)"')


def _unfence(text: str) -> str:
    m = _FENCE.match(text)
    return m.group(1).strip() if m else text


def _bare_call(text: str) -> bool | None:
    """Is `text` a bare JSON tool call (an object with "name"/"function", or a list of them)? None: it starts
    like JSON that is not complete yet, so it cannot be told (while streaming)."""
    if not text.startswith(("{", "[")):
        return False
    if _CALL_START.match(text):
        return True
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if text[end:].strip():
        return False  # JSON followed by prose: an answer that quotes JSON
    objs = obj if isinstance(obj, list) else [obj]
    return bool(objs) and all(isinstance(o, dict) and ("name" in o or "function" in o) for o in objs)


def _tool_call_blocks(body: str) -> tuple[str, list[str], str | None]:
    """(the text outside `<tool_call>…</tool_call>` blocks, the blocks' payloads in order, the payload of a last
    block never closed — None if every block was closed)."""
    out, blocks, pos = [], [], 0
    while True:
        j = body.find(_TC_OPEN, pos)
        if j < 0:
            out.append(body[pos:])
            return "".join(out), blocks, None
        out.append(body[pos:j])
        e = body.find(_TC_CLOSE, j)
        if e < 0:
            return "".join(out), blocks, body[j + len(_TC_OPEN):]
        blocks.append(body[j + len(_TC_OPEN):e])
        pos = e + len(_TC_CLOSE)


class JsonToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes/Qwen style), or an output that is
    nothing but a JSON call object / list of them (optionally in a ```json fence)."""

    name = "json"

    def _parse(self, text: str) -> ParsedMessage:
        errors: list[str] = []
        body, reasoning, _ = _strip_think(text)
        for t in _TERMINATORS:
            body = body.replace(t, "")
        outside, blocks, unclosed = _tool_call_blocks(body)
        calls = [c for b in blocks for c in _json_calls(b.strip(), errors, "<tool_call>")]
        if unclosed is not None:
            errors.append(f"<tool_call> is not closed with </tool_call> (output truncated?): {_snip(unclosed)}; "
                          "it was not run")
        content = outside.strip()
        if not calls and _TC_OPEN not in body:
            bare = _unfence(content)
            if _bare_call(bare):
                calls = _json_calls(bare, errors, "JSON tool call")
                content = ""
        return ParsedMessage(content=content, tool_calls=calls, errors=errors, reasoning=reasoning)

    def visible(self, text_so_far: str) -> str:
        body, _, _ = _strip_think(text_so_far)
        text = _tool_call_blocks(body)[0]
        for t in _TERMINATORS:
            text = text.replace(t, "")
        text = text[:len(text) - _held_back(text, (_TC_OPEN, _THINK_OPEN, *_TERMINATORS))]
        text = text.strip()
        # an output that is (or may still become) a bare JSON call is not shown
        if text and (text.startswith("```") or "```".startswith(text)):  # maybe a fenced JSON call
            head, nl, rest = text[3:].partition("\n")
            if not nl:
                return "" if "json".startswith(head.strip()) else text
            if head.strip() in ("", "json"):
                closed = "```" in rest
                return text if closed and _bare_call(_unfence(text)) is False else ""
            return text
        return "" if _bare_call(text) is not False else text


# --------------------------------------------------------------------------------------------------- registry

_FORMATS: list[tuple[str, type[ToolParser], Callable[[str], bool]]] = []


def register_format(name: str, parser: type[ToolParser], detect: Callable[[str], bool], *,
                    first: bool = False) -> None:
    """Add a tool-call format: `detect(chat_template)` says whether a template uses it. `first` puts it ahead of
    the formats registered before. Re-registering a name replaces it."""
    _FORMATS[:] = [f for f in _FORMATS if f[0] != name]
    entry = (name, parser, detect)
    _FORMATS.insert(0, entry) if first else _FORMATS.append(entry)


def formats() -> list[str]:
    return [f[0] for f in _FORMATS] + ["json"]


register_format("muse", MuseToolParser, lambda t: MUSE_CALLS_OPEN in t or "to=functions" in t)


def get_parser(chat_template: str | None, tools=None, *, format: str | None = None) -> ToolParser:
    """The parser for the tool-call format a chat template uses (the JSON fallback when none is recognised).
    format: force a registered format by name ("muse", "json", ...). tools: names/specs; calls to other tools
    become errors."""
    if format is not None:
        for name, cls, _ in _FORMATS:
            if name == format:
                return cls(tools)
        if format == "json":
            return JsonToolParser(tools)
        raise ValueError(f"unknown tool-call format {format!r}; known: {', '.join(formats())}")
    for _, cls, detect in _FORMATS:
        try:
            hit = bool(chat_template) and detect(chat_template)
        except Exception:  # a broken third-party detector must not break parsing
            hit = False
        if hit:
            return cls(tools)
    return JsonToolParser(tools)


# -------------------------------------------------------------------------------------------- message helpers

def to_openai_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """OpenAI API `tool_calls` (arguments as a JSON string)."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]


def from_openai_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """OpenAI `tool_calls` -> the chat template's form (arguments as a mapping). Raises ValueError with the
    offending call when arguments are not a JSON object (client input, not model output)."""
    out = []
    for i, tc in enumerate(tool_calls or []):
        if not isinstance(tc, dict):
            raise ValueError(f"tool_calls[{i}] must be an object, got {type(tc).__name__}")
        f = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool_calls[{i}] has no function name")
        args = f.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"tool_calls[{i}] ({name}): arguments are not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"tool_calls[{i}] ({name}): arguments must be a JSON object, got {type(args).__name__}")
        out.append({"type": "function", "id": tc.get("id") or new_call_id(),
                    "function": {"name": name, "arguments": args}})
    return out


def assistant_message(calls: list[ToolCall], content: str | None = None) -> dict:
    """The assistant turn for the chat template (arguments as mappings)."""
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name,
                                                                          "arguments": c.arguments}}
                             for c in calls]
    return msg


def tool_result_message(call: ToolCall | str, content: str, call_id: str | None = None) -> dict:
    """A tool's result for the chat template: {"role": "tool", "name": F, "content": ...}."""
    name = call.name if isinstance(call, ToolCall) else call
    cid = call.id if isinstance(call, ToolCall) else call_id
    msg = {"role": "tool", "name": name, "content": content}
    if cid:
        msg["tool_call_id"] = cid
    return msg


def neutralize_special_tokens(text: str) -> str:
    """Break chat-format special tokens (`<|eot|>`, `<|start|>`, ...) in untrusted text (a file's contents, a
    command's output) before it goes into a prompt, so that it cannot end its message or forge a turn: `<|x|>`
    becomes `<\u200c|x|>` (a zero-width non-joiner). Call tags need no change: prompt text is never parsed."""
    return re.sub(r"<\|(?=[a-z_]{1,20}\|>)", "<\u200c|", text)
