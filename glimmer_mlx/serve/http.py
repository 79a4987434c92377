"""The HTTP side: `APIServer` (a threading HTTP server holding the app, a `GlimmerServer`) and `APIHandler`, one
request per handler: routes, the JSON body, JSON responses, SSE streaming, and the tool calls parsed out of the
model's text. A handler thread parses and validates (through the app), waits on its job's events and writes; it
runs no model work."""

from __future__ import annotations

import json
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..tool_calls import get_parser, to_openai_tool_calls
from .api import APIError, ChatRequest, Request, glimmer_stats, usage
from .worker import Job

MAX_BODY = 32 * 1024 * 1024
ROUTES = "GET /health, /v1/models; POST /v1/chat/completions, /v1/completions"


class APIServer(ThreadingHTTPServer):
    """Serves `APIHandler`s for `app` (the `GlimmerServer`: its session, settings, request parsing and worker)."""
    daemon_threads = True

    def __init__(self, address: tuple[str, int], app):
        self.app = app
        super().__init__(address, APIHandler)


class APIHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "glimmer-mlx"
    timeout = 120  # seconds a client may stall while sending a request
    server: APIServer

    @property
    def app(self):
        return self.server.app

    def log_message(self, fmt, *args):
        self.app.log(f"{self.address_string()} {fmt % args}")

    # -- responses --------------------------------------------------------------------------------------------------
    def send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_api_error(self, e: APIError) -> None:
        self.close_connection = self.close_connection or e.status >= 500 or e.status in (411, 413)
        self.send_json(e.status, e.body())

    def guard(self, fn) -> None:
        try:
            fn()
        except APIError as e:
            self.send_api_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug must not take the server down; the client gets a JSON 500
            self.app.log(f"internal error: {type(e).__name__}: {e}")
            try:
                self.send_api_error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            except OSError:
                self.close_connection = True

    # -- routes -----------------------------------------------------------------------------------------------------
    def do_GET(self):
        self.guard(self.answer_get)

    def do_POST(self):
        self.guard(self.answer_post)

    def not_allowed(self):
        raise APIError(405, f"method {self.command} is not allowed ({ROUTES})")

    def do_other(self):
        self.guard(self.not_allowed)

    do_PUT = do_DELETE = do_PATCH = do_other

    def route_path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def answer_get(self):
        app, path = self.app, self.route_path()
        if path == "/health":
            self.send_json(200, {"status": "ok", "model": app.model_name, "default_mode": app.default_mode,
                                 "modes": app.session.available_modes(), "queued": app.worker.queued(),
                                 "cached_tokens": app.session.cached_tokens,
                                 "max_context": app.session.max_context})
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [self.model_card()]})
        elif path == f"/v1/models/{app.model_name}":
            self.send_json(200, self.model_card())
        elif path in ("/v1/chat/completions", "/v1/completions"):
            raise APIError(405, f"{path} takes POST")
        else:
            raise APIError(404, f"no route {path} ({ROUTES})", type="not_found_error")

    def model_card(self) -> dict:
        app = self.app
        return {"id": app.model_name, "object": "model", "created": app.created, "owned_by": "glimmer-mlx",
                "max_context": app.session.max_context, "modes": app.session.available_modes()}

    def read_body(self) -> dict:
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

    def answer_post(self):
        path = self.route_path()
        if path not in ("/v1/chat/completions", "/v1/completions"):
            if path in ("/health", "/v1/models"):
                raise APIError(405, f"{path} takes GET")
            raise APIError(404, f"no route {path}", type="not_found_error")
        body = self.read_body()
        req = self.app.parse_chat(body) if path == "/v1/chat/completions" else self.app.parse_completion(body)
        job = self.app.submit(req)
        try:
            if req.stream:
                self.send_stream(job, req)
            else:
                self.send_completion(job, req)
        finally:
            job.cancel.set()

    # -- answers ------------------------------------------------------------------------------------------------------
    def tool_parser(self, req: ChatRequest):
        return get_parser(self.app.template, req.tools)

    def send_completion(self, job: Job, req: Request):
        chat = isinstance(req, ChatRequest)
        raw, finish, stats = "", None, None
        for kind, val in job.results():
            if kind == "chunk":
                raw += val.text
                finish = val.finish_reason or finish
            else:
                stats = val
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "created": int(time.time()), "model": self.app.model_name,
                "usage": usage(stats), "glimmer": glimmer_stats(stats)}
        if not chat:
            self.send_json(200, dict(base, object="text_completion", choices=[
                {"index": 0, "text": raw, "finish_reason": finish, "logprobs": None}]))
            return
        parsed = self.tool_parser(req).parse(raw)
        msg = {"role": "assistant", "content": parsed.content if (parsed.content or not parsed.tool_calls) else None}
        if parsed.tool_calls:
            msg["tool_calls"] = to_openai_tool_calls(parsed.tool_calls)
            finish = "tool_calls"
        if parsed.errors:
            base["glimmer"]["tool_call_errors"] = parsed.errors
        self.send_json(200, dict(base, object="chat.completion", choices=[
            {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}]))

    def send_stream(self, job: Job, req: Request):
        chat = isinstance(req, ChatRequest)
        events = job.results()
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
        model_name = self.app.model_name

        def send(choice: dict | None, **extra):
            payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                       "choices": [] if choice is None else [choice], **extra}
            self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
            self.wfile.flush()

        parser = self.tool_parser(req) if chat else None
        if chat:
            send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None})
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
                send({"index": 0, "delta": {"content": vis[len(shown):]}, "finish_reason": None, "logprobs": None})
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
                calls = [dict(c, index=i) for i, c in enumerate(to_openai_tool_calls(parsed.tool_calls))]
                send({"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None, "logprobs": None})
                finish = "tool_calls"
            send({"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}, glimmer=glimmer_stats(stats))
        else:
            send({"index": 0, "text": "", "finish_reason": finish, "logprobs": None}, glimmer=glimmer_stats(stats))
        if req.include_usage:
            send(None, usage=usage(stats))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
