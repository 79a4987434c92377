"""`glimmer serve`: a local OpenAI-compatible HTTP server (standard library only).

Endpoints: POST /v1/chat/completions (streaming and not, `tools` / `tool_calls`), POST /v1/completions,
GET /v1/models, GET /health. One model is resident in a `session.Session`; every generation runs in the main thread,
in arrival order (requests queue up; the HTTP threads only parse, validate, tokenize and write), and the session's
prompt cache makes a conversation that grows turn by turn prefill only its new tokens.

Every request is validated before it reaches the model: bad JSON, a wrong content type, unknown fields or roles,
out-of-range values, prompts beyond the context limit, unsupported options (n > 1, logprobs, frequency/presence
penalties, forced tool choice) give a 4xx with an OpenAI-style error object, never a 500 or a crash. Decoding mode
per request: `{"glimmer": {"mode": "ar|dflash|mtp|auto", "block_size": N|"auto"}}` (default: the server's); the
output is the same in every mode (lossless speculative decoding), sampling parameters included.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import queue
import re
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .generate import GenerationStats
from .session import MODES, ContextLengthError, ModeError, Session

MAX_BODY = 32 * 1024 * 1024
MAX_QUEUE = 64
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities",
                  "reasoning_effort"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- validation helpers ---------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(body: dict, name: str, lo: float, hi: float, default, *, lo_open=False, hi_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise APIError(400, f"'{name}' must be a number, got {json.dumps(v)[:40]}", param=name)
    if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise APIError(400, f"'{name}' must be in {rng}, got {v}", param=name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None, default):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise APIError(400, f"'{name}' must be an integer, got {json.dumps(v)[:40]}", param=name)
    if v < lo or (hi is not None and v > hi):
        raise APIError(400, f"'{name}' must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}",
                       param=name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {json.dumps(v)[:40]}", param=name)
    return v


def _decode_data_url(url: str, where: str) -> bytes:
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


class GlimmerServer:
    def __init__(self, session: Session, *, host: str = "127.0.0.1", port: int = 8080, mode: str | None = None,
                 block_size=None, default_max_tokens: int = 2048, model_name: str | None = None,
                 quiet: bool = False, max_queue: int = MAX_QUEUE):
        if session.tokenizer is None:
            raise ValueError("the server needs a checkpoint with a tokenizer (tokenizer.json)")
        if default_max_tokens < 1:
            raise ValueError(f"default max_tokens must be >= 1, got {default_max_tokens}")
        self.session = session
        avail = session.available_modes()
        self.default_mode = mode or next(m for m in ("dflash", "mtp", "ar") if m in avail)
        self.default_block_size = block_size
        session.resolve_mode(self.default_mode, block_size)  # ModeError now; builds `auto` here (main thread)
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name or Path(str(getattr(session, "path", "glimmer"))).name or "glimmer"
        self.created = int(time.time())
        self.quiet = quiet
        self.max_queue = max_queue
        self.jobs: queue.Queue = queue.Queue()
        from .tool_calls import get_parser

        self.template = session.tokenizer.chat_template
        self._get_parser = get_parser
        self._http: threading.Thread | None = None
        self._stopped = threading.Event()
        self._current = None  # the job whose generation is running
        self._closing, self._closed = threading.Lock(), False
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    # The model runs in the thread that calls `serve_forever` / `run_jobs` (the main thread): MLX work done in other
    # threads makes the process abort at exit ("terminate called without an active exception", MLX 0.32). The HTTP
    # threads only parse, validate, tokenize and write.
    def start_http(self) -> threading.Thread:
        """Accept connections in a background thread; the model work runs where `run_jobs` is called."""
        if self._http is None:
            self._http = threading.Thread(target=self.httpd.serve_forever, name="glimmer-http", daemon=True)
            self._http.start()
        return self._http

    def serve_forever(self) -> None:
        """Serve until Ctrl-C (SIGINT) or `shutdown()`; generations run in this thread.

        In the main thread Ctrl-C is a flag, not an exception: a KeyboardInterrupt raised inside the job queue's
        condition wait can leave the queue's lock held, and `shutdown()` then blocks on it forever. The flag stops
        the job loop and cancels the running generation at its next token; a second Ctrl-C raises as usual."""
        self.start_http()
        previous = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame):
                signal.signal(signal.SIGINT, previous)
                self._stopped.set()
                job = self._current
                if job is not None:
                    job.cancel.set()

            previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            self.run_jobs()
        except KeyboardInterrupt:
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            self.shutdown()

    def run_jobs(self, until: threading.Event | None = None) -> None:
        """Run queued generations in this thread, in arrival order, until `until` is set or `shutdown()`."""
        while not self._stopped.is_set() and not (until is not None and until.is_set()):
            try:
                job = self.jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            if job is None or job.cancel.is_set():
                continue
            self._current = job
            try:
                self._run(job)
            except BaseException:  # Ctrl-C mid-generation: tell the waiting request before leaving
                job.events.put(("error", APIError(503, "the server is shutting down", type="server_error")))
                raise
            finally:
                self._current = None

    def shutdown(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self._stopped.set()
        if self._http is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        while True:  # requests still waiting get an answer instead of hanging
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.events.put(("error", APIError(503, "the server is shutting down", type="server_error")))

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    # -- the model work --------------------------------------------------------------------------------------------------
    def _run(self, job) -> None:
        stats = GenerationStats()
        it = None
        try:
            it = self.session.stream(job.ids, stats=stats, **job.kw)
            for chunk in it:
                job.events.put(("chunk", chunk))
                if job.cancel.is_set():
                    break
        except (ContextLengthError, ModeError, ValueError) as e:
            job.events.put(("error", APIError(400, str(e))))
            return
        except Exception as e:  # never let the loop die: report it to this request
            job.events.put(("error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                              type="server_error")))
            return
        finally:
            if it is not None:
                it.close()
        if job.cancel.is_set() and self._stopped.is_set():  # Ctrl-C cut it short: an error, not a cut answer
            job.events.put(("error", APIError(503, "the server is shutting down", type="server_error")))
            return
        job.events.put(("done", stats))

    def submit(self, ids: list[int], kw: dict) -> "_Job":
        if self._stopped.is_set():
            raise APIError(503, "the server is shutting down", type="server_error")
        if self.jobs.qsize() >= self.max_queue:
            raise APIError(503, f"the server is busy: {self.max_queue} requests are waiting", type="server_error")
        job = _Job(ids, kw)
        self.jobs.put(job)
        return job

    # -- request parsing -------------------------------------------------------------------------------------------------
    def _common(self, body: dict, allowed: set[str]) -> dict:
        unknown = sorted(set(body) - allowed - IGNORED_FIELDS)
        if unknown:
            raise APIError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise APIError(400, "'model' must be a string", param="model")
        if body.get("n") not in (None, 1):
            _int(body, "n", 1, None, 1)
            raise APIError(400, "n > 1 is not supported: one choice per request", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            v = _num(body, name, -2.0, 2.0, 0.0)
            if v != 0.0:
                raise APIError(400, f"'{name}' is not supported (use 'repetition_penalty', which glimmer honours in "
                               "every mode)", param=name)
        if body.get("logit_bias") not in (None, {}):
            raise APIError(400, "'logit_bias' is not supported", param="logit_bias")
        kw = dict(
            temperature=_num(body, "temperature", 0.0, 2.0, 0.0),  # default greedy (as mlx-lm's server)
            top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
            top_k=_int(body, "top_k", 0, None, 0),
            min_p=_num(body, "min_p", 0.0, 1.0, 0.0, hi_open=True),
            repetition_penalty=_num(body, "repetition_penalty", 0.0, 100.0, 1.0, lo_open=True),
            seed=_int(body, "seed", 0, 2**63 - 1, None),
        )
        stop = body.get("stop")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = stop
        else:
            raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise APIError(400, f"'stop': at most {MAX_STOP} non-empty strings of <= 256 characters", param="stop")
        kw["stop"] = stops or None
        mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
        if mt is not None and mct is not None and mt != mct:
            raise APIError(400, "give 'max_tokens' or 'max_completion_tokens', not two different values",
                           param="max_tokens")
        name = "max_completion_tokens" if mct is not None else "max_tokens"
        kw["max_tokens"] = _int(body, name, 1, None, None)
        g = body.get("glimmer")
        mode, bs = self.default_mode, self.default_block_size
        if g is not None:
            if not isinstance(g, dict):
                raise APIError(400, "'glimmer' must be an object like {\"mode\": \"dflash\", \"block_size\": 8}",
                               param="glimmer")
            bad = sorted(set(g) - {"mode", "block_size"})
            if bad:
                raise APIError(400, f"unknown 'glimmer' field(s): {', '.join(bad)} (known: mode, block_size)",
                               param="glimmer")
            if "mode" in g:
                if g["mode"] not in MODES:
                    raise APIError(400, f"'glimmer.mode' must be one of {', '.join(MODES)}, got "
                                   f"{json.dumps(g['mode'])[:40]}", param="glimmer.mode")
                mode, bs = g["mode"], None
            if "block_size" in g:
                bs = g["block_size"]
                if not (bs is None or bs == "auto" or _is_int(bs)):
                    raise APIError(400, "'glimmer.block_size' must be an integer or \"auto\"",
                                   param="glimmer.block_size")
        try:
            self.session.check_mode(mode, bs)  # validation only: the model thread prepares the drafter
        except ModeError as e:
            raise APIError(400, str(e), param="glimmer") from None
        kw["mode"], kw["block_size"] = mode, bs
        stream = _bool(body, "stream", False)
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not isinstance(so, dict) or set(so) - {"include_usage"}:
                raise APIError(400, "'stream_options' must be {\"include_usage\": true|false}", param="stream_options")
            include_usage = _bool(so, "include_usage", False)
        return {"kw": kw, "stream": stream, "include_usage": include_usage}

    def _budget(self, kw: dict, n_prompt: int) -> None:
        """Context-length check: the prompt plus max_tokens must fit (a default max_tokens shrinks to fit)."""
        limit = self.session.max_context
        if n_prompt >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt is "
                           f"{n_prompt} tokens", param="messages", code="context_length_exceeded")
        if kw["max_tokens"] is None:
            kw["max_tokens"] = min(self.default_max_tokens, limit - n_prompt)
        elif n_prompt + kw["max_tokens"] > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {n_prompt} prompt "
                           f"tokens + {kw['max_tokens']} max_tokens were requested; lower max_tokens",
                           param="max_tokens", code="context_length_exceeded")

    def parse_chat(self, body: dict) -> dict:
        allowed = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                   "min_p", "repetition_penalty", "seed", "stop", "n", "stream", "stream_options", "tools",
                   "tool_choice", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "logit_bias",
                   "response_format", "glimmer"}
        req = self._common(body, allowed)
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise APIError(400, "'logprobs' is not supported", param="logprobs")
        rf = body.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported (no constrained "
                           "decoding)", param="response_format")
        tools = self._tools(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        messages, images = self._messages(msgs)
        try:
            ids = self.session.encode_messages(messages, tools=tools)
        except ValueError as e:  # a template's raise_exception: the conversation is not valid for this model
            raise APIError(400, f"the messages cannot be rendered with the model's chat template: {e}",
                           param="messages") from None
        n_prompt = len(ids) + sum(it.num_tokens + 1 for it in images)  # each <|patch|> expands to N + 2 tokens
        self._budget(req["kw"], n_prompt)
        req["kw"]["images"] = images or None
        req.update(ids=ids, tools=tools)
        return req

    def _tools(self, body: dict):
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
            name = f.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'",
                               param=f"tools[{i}].function.name")
            if name in names:
                raise APIError(400, f"tools: the name {name!r} is given twice", param=f"tools[{i}].function.name")
            names.add(name)
            if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                               param=f"tools[{i}].function.parameters")
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

    def _content(self, content, where: str, images: list, allow_images: bool):
        """OpenAI content → the template's (str, or a list of text / image parts), collecting images."""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content must be a string or a list of content parts", param=where)
        parts = []
        for j, p in enumerate(content):
            pw = f"{where}.content[{j}]"
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise APIError(400, f"{pw} must be an object with a 'type'", param=pw)
            if p["type"] == "text":
                if not isinstance(p.get("text"), str):
                    raise APIError(400, f"{pw}.text must be a string", param=pw)
                parts.append({"type": "text", "text": p["text"]})
            elif p["type"] == "image_url":
                if not allow_images:
                    raise APIError(400, f"{pw}: images are only accepted in user messages", param=pw)
                iu = p.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                if not isinstance(url, str):
                    raise APIError(400, f"{pw}.image_url.url must be a string", param=pw)
                images.append(self._image(_decode_data_url(url, pw), pw))
                parts.append({"type": "image"})
            else:
                raise APIError(400, f"{pw}: unsupported content part type {p['type']!r} (text, image_url)", param=pw)
        if all(p["type"] == "text" for p in parts):  # text parts only: one string (any template renders it)
            return "".join(p["text"] for p in parts)
        return parts

    def _image(self, data: bytes, where: str):
        from .image_processing import ImageError, preprocess_image
        from .multimodal import require_vision

        try:
            require_vision(self.session.model)
            return preprocess_image(data)
        except (ImageError, ValueError) as e:
            raise APIError(400, f"{where}: {e}", param=where) from None

    def _messages(self, msgs: list):
        from .tool_calls import from_openai_tool_calls

        out, images, call_names = [], [], {}
        for i, m in enumerate(msgs):
            w = f"messages[{i}]"
            if not isinstance(m, dict):
                raise APIError(400, f"{w} must be an object", param=w)
            role = m.get("role")
            if role not in ROLES:
                raise APIError(400, f"{w}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                               param=f"{w}.role")
            extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
            if extra:
                raise APIError(400, f"{w}: unknown field(s) {', '.join(extra)}", param=w)
            if m.get("name") is not None and not isinstance(m["name"], str):
                raise APIError(400, f"{w}.name must be a string", param=f"{w}.name")
            msg = {"role": "system" if role == "developer" else role}
            content = m.get("content")
            if role == "assistant":
                tcs = m.get("tool_calls")
                if content is None and not tcs:
                    raise APIError(400, f"{w}: an assistant message needs 'content' or 'tool_calls'", param=w)
                msg["content"] = None if content is None else self._content(content, w, images, False)
                if tcs is not None:
                    if not isinstance(tcs, list):
                        raise APIError(400, f"{w}.tool_calls must be a list", param=f"{w}.tool_calls")
                    try:
                        msg["tool_calls"] = from_openai_tool_calls(tcs)
                    except ValueError as e:
                        raise APIError(400, f"{w}.{e}", param=f"{w}.tool_calls") from None
                    for tc in msg["tool_calls"]:
                        call_names[tc["id"]] = tc["function"]["name"]
            else:
                if content is None:
                    raise APIError(400, f"{w}.content is required", param=f"{w}.content")
                msg["content"] = self._content(content, w, images, role == "user")
                if role == "tool":
                    cid = m.get("tool_call_id")
                    if cid is not None and not isinstance(cid, str):
                        raise APIError(400, f"{w}.tool_call_id must be a string", param=f"{w}.tool_call_id")
                    msg["name"] = m.get("name") or call_names.get(cid) or "tool"
                    if cid:
                        msg["tool_call_id"] = cid
            if m.get("name") is not None and role != "tool":
                msg["name"] = m["name"]
            out.append(msg)
        return out, images

    def parse_completion(self, body: dict) -> dict:
        allowed = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "seed", "stop", "n", "stream", "stream_options", "echo", "suffix", "best_of", "logprobs",
                   "frequency_penalty", "presence_penalty", "logit_bias", "glimmer"}
        if "max_tokens" not in body:
            body = dict(body, max_tokens=16)  # the completions API's default
        req = self._common(body, allowed)
        if body.get("echo") not in (None, False):
            raise APIError(400, "'echo' is not supported", param="echo")
        if body.get("suffix") is not None:
            raise APIError(400, "'suffix' is not supported", param="suffix")
        if body.get("best_of") not in (None, 1):
            raise APIError(400, "'best_of' other than 1 is not supported", param="best_of")
        if body.get("logprobs") is not None:
            raise APIError(400, "'logprobs' is not supported", param="logprobs")
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        vocab = self.session.model.args.vocab_size
        if isinstance(p, str):
            if not p:
                raise APIError(400, "'prompt' is empty", param="prompt")
            ids = self.session.tokenizer.encode(p)
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"'prompt' token id(s) {bad[:5]} outside the vocabulary [0, {vocab})",
                               param="prompt")
            ids = list(p)
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise APIError(400, "a batch of prompts is not supported: one prompt per request", param="prompt")
        else:
            raise APIError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")
        if not ids:
            raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
        self._budget(req["kw"], len(ids))
        req["ids"] = ids
        return req


class _Job:
    def __init__(self, ids, kw):
        self.ids, self.kw = ids, kw
        self.events: queue.Queue = queue.Queue()
        self.cancel = threading.Event()


def _usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generation_tokens,
            "total_tokens": stats.prompt_tokens + stats.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": int(stats.extra.get("cached_tokens", 0))}}


def _glimmer_stats(stats: GenerationStats) -> dict:
    d = {"mode": stats.mode, "cached_tokens": stats.extra.get("cached_tokens", 0),
         "prefilled_tokens": stats.extra.get("prefilled_tokens", stats.prompt_tokens),
         "cache": stats.extra.get("cache"), "generation_tps": round(stats.generation_tps, 2),
         "prompt_time": round(stats.prompt_time, 4)}
    if "tau" in stats.extra:
        d["tau"] = round(stats.extra["tau"], 3)
    return d


def _make_handler(server: GlimmerServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "glimmer-mlx"
        timeout = 120  # seconds a client may stall while sending a request

        def log_message(self, fmt, *args):
            server.log(f"{self.address_string()} {fmt % args}")

        # -- responses --------------------------------------------------------------------------------------------
        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: APIError) -> None:
            self.close_connection = self.close_connection or e.status >= 500 or e.status in (411, 413)
            self._json(e.status, e.body())

        def _guard(self, fn) -> None:
            try:
                fn()
            except APIError as e:
                self._error(e)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            except Exception as e:  # a bug must not take the server down; the client gets a JSON 500
                server.log(f"internal error: {type(e).__name__}: {e}")
                try:
                    self._error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
                except OSError:
                    self.close_connection = True

        # -- routes -------------------------------------------------------------------------------------------------
        def do_GET(self):
            self._guard(self._get)

        def do_POST(self):
            self._guard(self._post)

        def _not_allowed(self):
            raise APIError(405, f"method {self.command} is not allowed (GET /health, /v1/models; POST "
                           "/v1/chat/completions, /v1/completions)")

        def _other(self):
            self._guard(self._not_allowed)

        do_PUT = do_DELETE = do_PATCH = _other

        def _route(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/") or "/"

        def _get(self):
            path = self._route()
            if path == "/health":
                self._json(200, {"status": "ok", "model": server.model_name, "default_mode": server.default_mode,
                                 "modes": server.session.available_modes(), "queued": server.jobs.qsize(),
                                 "cached_tokens": server.session.cached_tokens,
                                 "max_context": server.session.max_context})
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [self._model_card()]})
            elif path == f"/v1/models/{server.model_name}":
                self._json(200, self._model_card())
            elif path in ("/v1/chat/completions", "/v1/completions"):
                raise APIError(405, f"{path} takes POST")
            else:
                raise APIError(404, f"no route {path} (GET /health, /v1/models; POST /v1/chat/completions, "
                               "/v1/completions)", type="not_found_error")

        def _model_card(self) -> dict:
            return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "glimmer-mlx",
                    "max_context": server.session.max_context, "modes": server.session.available_modes()}

        def _body(self) -> dict:
            ctype = self.headers.get("Content-Type", "")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raise APIError(411, "chunked request bodies are not supported: send Content-Length")
            length = self.headers.get("Content-Length")
            if length is None:
                raise APIError(411, "Content-Length is required")
            try:
                n = int(length)
            except ValueError:
                raise APIError(400, f"bad Content-Length {length!r}") from None
            if n < 0:
                raise APIError(400, f"bad Content-Length {length!r}")
            if n > MAX_BODY:
                raise APIError(413, f"request body of {n} bytes exceeds the limit of {MAX_BODY}")
            raw = self.rfile.read(n)
            if len(raw) < n:
                self.close_connection = True
                raise APIError(400, f"the body ended after {len(raw)} of {n} bytes")
            if ctype.split(";")[0].strip().lower() != "application/json":
                raise APIError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}")
            try:
                body = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise APIError(400, "the body is not valid UTF-8") from None
            except ValueError as e:
                raise APIError(400, f"the body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object")
            return body

        def _post(self):
            path = self._route()
            if path not in ("/v1/chat/completions", "/v1/completions"):
                if path in ("/health", "/v1/models"):
                    raise APIError(405, f"{path} takes GET")
                raise APIError(404, f"no route {path}", type="not_found_error")
            body = self._body()
            chat = path == "/v1/chat/completions"
            req = server.parse_chat(body) if chat else server.parse_completion(body)
            job = server.submit(req["ids"], req["kw"])
            try:
                if req["stream"]:
                    self._stream(job, req, chat)
                else:
                    self._complete(job, req, chat)
            finally:
                job.cancel.set()

        def _events(self, job):
            while True:
                kind, val = job.events.get()
                if kind == "error":
                    raise val
                yield kind, val
                if kind == "done":
                    return

        def _complete(self, job, req, chat):
            raw, finish, stats = "", None, None
            for kind, val in self._events(job):
                if kind == "chunk":
                    raw += val.text
                    finish = val.finish_reason or finish
                else:
                    stats = val
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            base = {"id": rid, "created": int(time.time()), "model": server.model_name,
                    "usage": _usage(stats), "glimmer": _glimmer_stats(stats)}
            if not chat:
                self._json(200, dict(base, object="text_completion", choices=[
                    {"index": 0, "text": raw, "finish_reason": finish, "logprobs": None}]))
                return
            parsed = server._get_parser(server.template, req.get("tools")).parse(raw)
            msg = {"role": "assistant", "content": parsed.content if (parsed.content or not parsed.tool_calls)
                   else None}
            if parsed.tool_calls:
                from .tool_calls import to_openai_tool_calls

                msg["tool_calls"] = to_openai_tool_calls(parsed.tool_calls)
                finish = "tool_calls"
            if parsed.errors:
                base["glimmer"]["tool_call_errors"] = parsed.errors
            self._json(200, dict(base, object="chat.completion", choices=[
                {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}]))

        def _stream(self, job, req, chat):
            events = self._events(job)
            first = next(events)  # an error before the first token is still a plain JSON error
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            obj = "chat.completion.chunk" if chat else "text_completion"

            def send(choice: dict | None, **extra):
                payload = {"id": rid, "object": obj, "created": created, "model": server.model_name,
                           "choices": [] if choice is None else [choice], **extra}
                self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
                self.wfile.flush()

            parser = server._get_parser(server.template, req.get("tools")) if chat else None
            if chat:
                send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                      "logprobs": None})
            raw, shown, finish, stats = "", "", None, None

            def handle(kind, val):
                nonlocal raw, shown, finish, stats
                if kind == "done":
                    stats = val
                    return
                raw += val.text
                finish = val.finish_reason or finish
                if not chat:
                    if val.text:
                        send({"index": 0, "text": val.text, "finish_reason": None, "logprobs": None})
                    return
                vis = parser.visible(raw)
                if vis.startswith(shown) and len(vis) > len(shown):
                    send({"index": 0, "delta": {"content": vis[len(shown):]}, "finish_reason": None,
                          "logprobs": None})
                    shown = vis

            try:
                handle(*first)
                for kind, val in events:
                    handle(kind, val)
            except APIError as e:  # the generation failed after the headers: report it in the stream
                self.wfile.write(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                return
            if chat:
                parsed = parser.parse(raw)
                if parsed.content.startswith(shown) and len(parsed.content) > len(shown):
                    send({"index": 0, "delta": {"content": parsed.content[len(shown):]}, "finish_reason": None,
                          "logprobs": None})
                if parsed.tool_calls:
                    from .tool_calls import to_openai_tool_calls

                    calls = [dict(c, index=i) for i, c in enumerate(to_openai_tool_calls(parsed.tool_calls))]
                    send({"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None, "logprobs": None})
                    finish = "tool_calls"
                send({"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None},
                     glimmer=_glimmer_stats(stats))
            else:
                send({"index": 0, "text": "", "finish_reason": finish, "logprobs": None},
                     glimmer=_glimmer_stats(stats))
            if req["include_usage"]:
                send(None, usage=_usage(stats))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler
