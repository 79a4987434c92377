"""The request side of the HTTP API: `ChatRequest` / `CompletionRequest` parsed and validated from a JSON body,
`APIError` (an OpenAI-style error object), and the response parts built from a generation's stats (`usage`,
`glimmer_stats`).

The rules come from where they live: sampling ranges from `sampling.RANGES` / `SEED_RANGE`, the context budget
from `runtime.request.fit_context`, prompt ids from `runtime.request.check_request`, decoding modes from
`strategy.DecodeSpec` and the session's `check_mode`. Parsing renders the chat template and pre-processes images
but runs no model work (it is called from the HTTP threads)."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

from ..image_processing import ImageError, ProcessedImage, preprocess_image
from ..multimodal import require_vision
from ..runtime.loop import GenerationStats
from ..runtime.request import ContextLengthError, check_request, fit_context
from ..sampling import RANGES, SEED_RANGE, Range, SamplingError, SamplingParams, is_int
from ..session import Session
from ..strategy import DecodeSpec, ModeError
from ..tool_calls import from_openai_tool_calls

MAX_JSON_DEPTH = 64  # nesting levels a request body may have (a tool's parameter schema included)
MAX_STOP = 4
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# OpenAI fields accepted and ignored (they change nothing here)
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities",
                  "reasoning_effort"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
COMMON_FIELDS = {"model", "max_tokens", "stop", "n", "stream", "stream_options", "frequency_penalty",
                 "presence_penalty", "logit_bias", "logprobs", "glimmer", "seed", *SAMPLING_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "top_logprobs",
                               "response_format"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
COMPLETION_MAX_TOKENS = 16  # the completions API's default max_tokens
POSITIVE_INT = Range(1, integer=True)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers  # extra response headers (Allow for a 405)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        """The error body as JSON bytes; never raises (a message or param may quote any client text, lone
        surrogates included: ASCII-escaped JSON can hold them)."""
        try:
            return json.dumps(self.body(), ensure_ascii=True).encode("ascii")
        except Exception:  # a non-JSON value slipped into the error: still an OpenAI-shaped body
            return json.dumps({"error": {"message": ascii(self.message), "type": str(self.type), "param": None,
                                         "code": None}}).encode("ascii")


def model_not_found(name: str, served: tuple[str, ...]) -> APIError:
    return APIError(404, f"the model {Shown(name)!r} is not served here; this server serves "
                    f"{', '.join(repr(m) for m in served)} (GET /v1/models)", param="model", code="model_not_found")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error")


class Shown:
    """A request value as an error message quotes it: its repr, clipped (a body may be megabytes)."""

    def __init__(self, value, limit: int = 40):
        r = repr(value)
        self.text = r if len(r) <= limit else r[:limit] + "..."

    def __repr__(self) -> str:
        return self.text


# -- the body as a whole -----------------------------------------------------------------------------------------------

SURROGATE = re.compile("[\ud800-\udfff]")


def field_path(parent: str, key) -> str:
    """`messages[0].content`-style paths for `param` (a key is shown with any lone surrogate backslash-escaped)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    key = key.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{parent}.{key}" if parent else key


def check_json(body) -> None:
    """A parsed body's shape limits: at most `MAX_JSON_DEPTH` levels deep, and no lone surrogate (JSON's
    "\\ud800" escapes decode to one; no tokenizer or UTF-8 writer takes it) in any string, field names included.
    Iterative: a hostile body cannot exhaust the stack here."""
    stack = [(body, "", 1)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            if SURROGATE.search(v):
                raise APIError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate (not valid Unicode text)",
                               param=where or None)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep (at {where})",
                           param=where or None)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            path = field_path(where, k)
            if isinstance(k, str) and SURROGATE.search(k):
                raise APIError(400, f"the field name {path} holds a lone UTF-16 surrogate (not valid Unicode text)",
                               param=path)
            stack.append((x, path, depth + 1))


# -- the fields every endpoint shares -------------------------------------------------------------------------------

def parse_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {Shown(v)!r}", param=name)
    return v


def parse_positive_int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is not None and not POSITIVE_INT.contains(v):
        raise APIError(400, f"'{name}' must be an integer {POSITIVE_INT}, got {Shown(v)!r}", param=name)
    return v


def parse_sampling(body: dict) -> tuple[SamplingParams, int | None]:
    """(the sampling parameters, the seed); unset ones take `SamplingParams`' defaults (temperature 0: greedy)."""
    given = {}
    for name in SAMPLING_FIELDS:
        v = body.get(name)
        if v is None:
            continue
        if not RANGES[name].contains(v):
            raise APIError(400, str(SamplingError(name, Shown(v))), param=name)
        given[name] = v if RANGES[name].integer else float(v)
    seed = body.get("seed")
    if seed is not None and not SEED_RANGE.contains(seed):
        raise APIError(400, str(SamplingError("seed", Shown(seed))), param="seed")
    return SamplingParams(**given), seed


def parse_stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"'stop': at most {MAX_STOP} non-empty strings of <= {MAX_STOP_CHARS} characters",
                       param="stop")
    return stops or None


def parse_spec(body: dict, session: Session, default: DecodeSpec) -> DecodeSpec:
    """`{"glimmer": {"mode": ..., "block_size": N|"auto"}}` → the decoding spec (a mode given without a block size
    runs at its own default width, not the server's)."""
    g = body.get("glimmer")
    if g is None:
        return default
    if not isinstance(g, dict):
        raise APIError(400, "'glimmer' must be an object like {\"mode\": \"dflash\", \"block_size\": 8}",
                       param="glimmer")
    bad = sorted(set(g) - {"mode", "block_size"})
    if bad:
        raise APIError(400, f"unknown 'glimmer' field(s): {', '.join(bad)} (known: mode, block_size)",
                       param="glimmer")
    mode, width = default.mode, default.width
    if g.get("mode") is not None:
        mode, width = g["mode"], None
    if "block_size" in g:
        width = g["block_size"]
    try:
        spec = DecodeSpec.parse(mode, width)
        session.check_mode(spec.mode, spec.width)  # validation only: the model thread prepares the drafter
    except ModeError as e:
        raise APIError(400, str(e), param="glimmer") from None
    return spec


def check_unsupported(body: dict, allowed: set[str], served: tuple[str, ...] | None = None) -> None:
    """Unknown fields, and OpenAI options glimmer does not implement, are errors rather than silently ignored.
    `model`: omitted means the served model; given, it must be one of `served` (the ids /v1/models lists), else a
    404 `model_not_found` (as OpenAI answers)."""
    unknown = sorted(set(body) - allowed - IGNORED_FIELDS)
    if unknown:
        raise APIError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise APIError(400, "'model' must be a string", param="model")
    if m is not None and served and m not in served:
        raise model_not_found(m, served)
    n = parse_positive_int(body, "n")
    if n not in (None, 1):
        raise APIError(400, "n > 1 is not supported: one choice per request", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        v = body.get(name)
        if not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)):
            raise APIError(400, f"'{name}' is not supported (use 'repetition_penalty', which glimmer honours in "
                           "every mode)", param=name)
    if body.get("logit_bias") not in (None, {}):
        raise APIError(400, "'logit_bias' is not supported", param="logit_bias")


def parse_max_tokens(body: dict) -> int | None:
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise APIError(400, "give 'max_tokens' or 'max_completion_tokens', not two different values",
                       param="max_tokens")
    return parse_positive_int(body, "max_completion_tokens" if mct is not None else "max_tokens")


def parse_stream_options(body: dict) -> bool:
    """include_usage from `stream_options`."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise APIError(400, "'stream_options' must be {\"include_usage\": true|false}", param="stream_options")
    return parse_bool(so, "include_usage", False)


# -- requests ---------------------------------------------------------------------------------------------------------

@dataclass
class Request:
    """A validated generation request: the prompt's ids and how to generate from them."""
    ids: list[int]
    sampling: SamplingParams
    seed: int | None
    stop: list[str] | None
    max_tokens: int
    spec: DecodeSpec
    stream: bool = False
    include_usage: bool = False

    def generation_kwargs(self) -> dict:
        """`Session.stream`'s keyword arguments (besides the prompt and the stats)."""
        s = self.sampling
        return dict(mode=self.spec.mode, block_size=self.spec.width, max_tokens=self.max_tokens,
                    temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                    repetition_penalty=s.repetition_penalty, seed=self.seed, stop=self.stop)


@dataclass
class CompletionRequest(Request):
    """POST /v1/completions: a text prompt or token ids."""

    @classmethod
    def parse(cls, body: dict, session: Session, *, default_spec: DecodeSpec,
              served: tuple[str, ...] | None = None) -> CompletionRequest:
        """Without max_tokens: the completions API's default (16), shrunk to fit the context. `served`: the model
        ids a request may name."""
        check_unsupported(body, COMPLETION_FIELDS, served)
        if body.get("echo") not in (None, False):
            raise APIError(400, "'echo' is not supported", param="echo")
        if body.get("suffix") is not None:
            raise APIError(400, "'suffix' is not supported", param="suffix")
        if body.get("best_of") not in (None, 1):
            raise APIError(400, "'best_of' other than 1 is not supported", param="best_of")
        if body.get("logprobs") is not None:
            raise APIError(400, "'logprobs' is not supported", param="logprobs")
        sampling, seed = parse_sampling(body)
        stop, max_tokens = parse_stop(body), parse_positive_int(body, "max_tokens")
        spec = parse_spec(body, session, default_spec)
        stream, include_usage = parse_bool(body, "stream", False), parse_stream_options(body)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            ids = session.tokenizer.encode(p)
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            ids = list(p)
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise APIError(400, "a batch of prompts is not supported: one prompt per request", param="prompt")
        else:
            raise APIError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")
        max_tokens = budget(session, ids, len(ids), max_tokens, COMPLETION_MAX_TOKENS, stop, "prompt")
        return cls(ids, sampling, seed, stop, max_tokens, spec, stream, include_usage)


@dataclass
class ChatRequest(Request):
    """POST /v1/chat/completions: the conversation rendered with the chat template (`ids`), with the tools offered
    and the images it holds."""
    tools: list | None = None
    images: list[ProcessedImage] | None = None

    @classmethod
    def parse(cls, body: dict, session: Session, *, default_spec: DecodeSpec, default_max_tokens: int,
              served: tuple[str, ...] | None = None) -> ChatRequest:
        """Without max_tokens: `default_max_tokens`, shrunk to fit the context. `served`: the model ids a request
        may name."""
        check_unsupported(body, CHAT_FIELDS, served)
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise APIError(400, "'logprobs' is not supported", param="logprobs")
        rf = body.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported (no constrained "
                           "decoding)", param="response_format")
        sampling, seed = parse_sampling(body)
        stop, max_tokens = parse_stop(body), parse_max_tokens(body)
        spec = parse_spec(body, session, default_spec)
        stream, include_usage = parse_bool(body, "stream", False), parse_stream_options(body)
        tools = parse_tools(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        messages, images = parse_messages(msgs, session)
        try:
            ids = session.encode_messages(messages, tools=tools)
        except ValueError as e:  # a template's raise_exception: the conversation is not valid for this model
            raise APIError(400, f"the messages cannot be rendered with the model's chat template: {e}",
                           param="messages") from None
        n_prompt = len(ids) + sum(it.num_tokens + 1 for it in images)  # each <|patch|> expands to N + 2 tokens
        max_tokens = budget(session, ids, n_prompt, max_tokens, default_max_tokens, stop, "messages")
        return cls(ids, sampling, seed, stop, max_tokens, spec, stream, include_usage, tools, images or None)

    def generation_kwargs(self) -> dict:
        return dict(super().generation_kwargs(), images=self.images)


def budget(session: Session, ids: list[int], n_prompt: int, max_tokens: int | None, default: int, stop,
           param: str) -> int:
    """The max_tokens a prompt of `n_prompt` tokens gets (`fit_context`: a default shrinks to fit, an explicit one
    that does not fit is an error), after `check_request`'s checks of the ids (`param`: the field to blame)."""
    try:
        max_tokens = fit_context(n_prompt, max_tokens, session.max_context, default=default)
    except ContextLengthError as e:
        raise APIError(400, str(e), param=e.param, code="context_length_exceeded") from None
    try:
        check_request(ids, session.model.args.vocab_size, max_tokens=max_tokens, stop=stop,
                      tokenizer=session.tokenizer)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    return max_tokens


# -- chat messages and tools ------------------------------------------------------------------------------------------

def parse_tools(body: dict) -> list | None:
    """The tools offered to the model (None: none, or tool_choice "none")."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", param="tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"parameters\": {{...}}}}}}", param=f"tools[{i}]")
        extra = sorted(set(t) - {"type", "function"})
        if extra:
            raise APIError(400, f"tools[{i}]: unknown field(s) {', '.join(extra)}", param=f"tools[{i}]")
        extra = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if extra:
            raise APIError(400, f"tools[{i}].function: unknown field(s) {', '.join(extra)}",
                           param=f"tools[{i}].function")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise APIError(400, f"tools[{i}].function.strict must be a boolean", param=f"tools[{i}].function.strict")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'",
                           param=f"tools[{i}].function.name")
        if name in names:
            raise APIError(400, f"tools: the name {name!r} is given twice", param=f"tools[{i}].function.name")
        names.add(name)
        if f.get("parameters") is not None:
            check_parameters(f["parameters"], f"tools[{i}].function.parameters")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise APIError(400, f"tools[{i}].function.description must be a string",
                           param=f"tools[{i}].function.description")
    if choice in (None, "auto"):
        return tools or None
    if choice == "none":
        return None
    if choice == "required" or isinstance(choice, dict):
        raise APIError(400, "'tool_choice' \"required\" or a named function is not supported (no constrained "
                       "decoding); use \"auto\" or \"none\"", param="tool_choice")
    raise APIError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or a function object",
                   param="tool_choice")


SCHEMA_TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")


def check_parameters(p, where: str) -> None:
    """A function's `parameters`: a JSON Schema object — {} (no parameters), or {"type": "object", "properties":
    {name: schema, ...}, "required": [name, ...], ...}, each property a schema object whose `type` is a JSON Schema
    type (or a list of them). Errors name `where` (tools[i].function.parameters) and what is wrong in it."""
    def bad(what: str):
        return APIError(400, f"{where} must be a JSON Schema object like {{\"type\": \"object\", \"properties\": "
                        f"{{...}}}}: {what}", param=where)

    if not isinstance(p, dict):
        raise bad(f"got {type(p).__name__}")
    if not p:
        return
    if p.get("type") != "object":
        raise bad(f"'type' must be \"object\", got {Shown(p.get('type'))!r}")
    props = p.get("properties", {})
    if not isinstance(props, dict):
        raise bad("'properties' must be an object mapping names to schemas")
    for k, v in props.items():
        if not isinstance(v, dict):
            raise bad(f"properties[{Shown(k)!r}] must be a schema object, got {type(v).__name__}")
        ty = v.get("type")
        tys = ty if isinstance(ty, list) else [ty]
        if ty is not None and not all(isinstance(x, str) and x in SCHEMA_TYPES for x in tys):
            raise bad(f"properties[{Shown(k)!r}].type must be one of {', '.join(SCHEMA_TYPES)} (or a list of them)")
        if v.get("description") is not None and not isinstance(v["description"], str):
            raise bad(f"properties[{Shown(k)!r}].description must be a string")
    req = p.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise bad("'required' must be a list of property names")
    ap = p.get("additionalProperties")
    if ap is not None and not isinstance(ap, (bool, dict)):
        raise bad("'additionalProperties' must be a boolean or a schema object")
    if p.get("description") is not None and not isinstance(p["description"], str):
        raise bad("'description' must be a string")


def check_tool_calls(tcs, w: str) -> None:
    """An assistant message's `tool_calls`, field by field (the parser behind them assumes the shapes)."""
    if not isinstance(tcs, list):
        raise APIError(400, f"{w}.tool_calls must be a list", param=f"{w}.tool_calls")
    for j, tc in enumerate(tcs):
        tw = f"{w}.tool_calls[{j}]"
        if not isinstance(tc, dict):
            raise APIError(400, f"{tw} must be an object", param=tw)
        extra = sorted(set(tc) - {"id", "type", "function", "index"})
        if extra:
            raise APIError(400, f"{tw}: unknown field(s) {', '.join(extra)}", param=tw)
        if tc.get("id") is not None and not isinstance(tc["id"], str):
            raise APIError(400, f"{tw}.id must be a string", param=f"{tw}.id")
        if tc.get("type") not in (None, "function"):
            raise APIError(400, f"{tw}.type must be \"function\"", param=f"{tw}.type")
        if tc.get("index") is not None and not is_int(tc["index"]):
            raise APIError(400, f"{tw}.index must be an integer", param=f"{tw}.index")
        f = tc.get("function")
        if not isinstance(f, dict):
            raise APIError(400, f"{tw}.function must be an object {{\"name\": ..., \"arguments\": ...}}",
                           param=f"{tw}.function")
        extra = sorted(set(f) - {"name", "arguments"})
        if extra:
            raise APIError(400, f"{tw}.function: unknown field(s) {', '.join(extra)}", param=f"{tw}.function")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"{tw}.function.name must be a non-empty string", param=f"{tw}.function.name")
        if f.get("arguments") is not None and not isinstance(f["arguments"], (str, dict)):
            raise APIError(400, f"{tw}.function.arguments must be a JSON string (or an object)",
                           param=f"{tw}.function.arguments")


def decode_data_url(url: str, where: str) -> bytes:
    m = re.match(r"^data:image/[A-Za-z0-9.+-]+;base64,(.*)$", url, re.DOTALL)
    if not m:
        if url.startswith(("http://", "https://")):
            raise APIError(400, f"{where}: image URLs are not fetched (the server has no network access); send the "
                           "image inline as a data:image/...;base64 URL", param=where)
        raise APIError(400, f"{where}: expected a data:image/...;base64,... URL", param=where)
    try:
        return base64.b64decode(m.group(1), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the base64 image data is malformed", param=where) from None


def parse_image(data: bytes, where: str, session: Session) -> ProcessedImage:
    try:
        require_vision(session.model)
        return preprocess_image(data)
    except (ImageError, ValueError) as e:
        raise APIError(400, f"{where}: {e}", param=where) from None


def parse_content(content, where: str, images: list, allow_images: bool, session: Session):
    """OpenAI content → the template's (str, or a list of text / image parts), collecting images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts",
                       param=f"{where}.content")
    parts = []
    for j, p in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise APIError(400, f"{pw} must be an object with a 'type'", param=pw)
        if p["type"] == "text":
            if not isinstance(p.get("text"), str):
                raise APIError(400, f"{pw}.text must be a string", param=f"{pw}.text")
            parts.append({"type": "text", "text": p["text"]})
        elif p["type"] == "image_url":
            if not allow_images:
                raise APIError(400, f"{pw}: images are only accepted in user messages", param=pw)
            iu = p.get("image_url")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if not isinstance(url, str):
                raise APIError(400, f"{pw}.image_url.url must be a string", param=pw)
            images.append(parse_image(decode_data_url(url, pw), pw, session))
            parts.append({"type": "image"})
        else:
            raise APIError(400, f"{pw}: unsupported content part type {p['type']!r} (text, image_url)", param=pw)
    if all(p["type"] == "text" for p in parts):  # text parts only: one string (any template renders it)
        return "".join(p["text"] for p in parts)
    return parts


def parse_messages(msgs: list, session: Session) -> tuple[list[dict], list[ProcessedImage]]:
    """OpenAI messages → the chat template's messages (tool calls with mapping arguments, tool results named after
    their call), and the images they hold in order."""
    out, images, call_names = [], [], {}
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{w} must be an object", param=w)
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"{w}.role must be one of {', '.join(ROLES)}, got {Shown(role)!r}",
                           param=f"{w}.role")
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
        if extra:
            raise APIError(400, f"{w}: unknown field(s) {', '.join(extra)}", param=w)
        for name in ("name", "tool_call_id", "refusal"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise APIError(400, f"{w}.{name} must be a string", param=f"{w}.{name}")
        if m.get("tool_calls") is not None and role != "assistant":
            raise APIError(400, f"{w}: only assistant messages have 'tool_calls'", param=f"{w}.tool_calls")
        msg = {"role": "system" if role == "developer" else role}
        content = m.get("content")
        if role == "assistant":
            tcs = m.get("tool_calls")
            if content is None and not tcs:
                raise APIError(400, f"{w}: an assistant message needs 'content' or 'tool_calls'", param=w)
            msg["content"] = None if content is None else parse_content(content, w, images, False, session)
            if tcs is not None:
                check_tool_calls(tcs, w)
                try:
                    msg["tool_calls"] = from_openai_tool_calls(tcs)
                except ValueError as e:
                    raise APIError(400, f"{w}.{e}", param=f"{w}.tool_calls") from None
                for tc in msg["tool_calls"]:
                    call_names[tc["id"]] = tc["function"]["name"]
        else:
            if content is None:
                raise APIError(400, f"{w}.content is required", param=f"{w}.content")
            msg["content"] = parse_content(content, w, images, role == "user", session)
            if role == "tool":
                cid = m.get("tool_call_id")
                msg["name"] = m.get("name") or call_names.get(cid) or "tool"
                if cid:
                    msg["tool_call_id"] = cid
        if m.get("name") is not None and role != "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return out, images


# -- responses --------------------------------------------------------------------------------------------------------

def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generation_tokens,
            "total_tokens": stats.prompt_tokens + stats.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": int(stats.extra.get("cached_tokens", 0))}}


def glimmer_stats(stats: GenerationStats) -> dict:
    d = {"mode": stats.mode, "cached_tokens": stats.extra.get("cached_tokens", 0),
         "prefilled_tokens": stats.extra.get("prefilled_tokens", stats.prompt_tokens),
         "cache": stats.extra.get("cache"), "generation_tps": round(stats.generation_tps, 2),
         "prompt_time": round(stats.prompt_time, 4)}
    if "tau" in stats.extra:
        d["tau"] = round(stats.extra["tau"], 3)
    return d
