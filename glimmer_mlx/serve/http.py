"""The HTTP side: `APIServer` (a threading HTTP server holding the app, a `GlimmerServer`) and `APIHandler`, one
request per handler: the request line and headers (parsed here, with limits), the API key, routes, the JSON body,
JSON responses, SSE streaming, and the tool calls parsed out of the model's text. A handler thread parses and
validates (through the app), waits on its job's events and writes; it runs no model work.

Built on the standard library's `http.server`, with its protocol layer replaced where it answers by itself: every
malformed request — a bad or HTTP/0.9 or HTTP/2.0 request line, a request line over `MAX_REQUEST_LINE` bytes (414),
headers over `MAX_HEADER_BYTES` / `MAX_HEADERS` (431), a method other than GET / POST (405 with `Allow`) — gets an
OpenAI-style JSON error with a status line, never an HTML page or a dropped connection. An HTTP/2.0 request line is
a 400 (not 505): this server speaks HTTP/1.1 only, and the error is the client's to fix."""

from __future__ import annotations

import hmac
import ipaddress
import http.client
import io
import json
import re
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..tool_calls import get_parser, to_openai_tool_calls
from .api import MAX_JSON_DEPTH, APIError, ChatRequest, Request, check_json, glimmer_stats, model_not_found, usage
from .worker import Job

MAX_BODY = 32 * 1024 * 1024
MAX_REQUEST_LINE = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024  # all header lines together
MAX_HEADERS = 100
ROUTES = "GET /health, /v1/models; POST /v1/chat/completions, /v1/completions"
ALLOW = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP method (RFC 9110 token)
VERSION = re.compile(r"^HTTP/(\d)\.(\d)$")


def is_loopback(host: str) -> bool:
    """Does binding `host` keep the server to this machine? ("localhost" and 127.0.0.0/8, ::1; "" and 0.0.0.0 are
    every interface; any other name counts as reachable from elsewhere.)"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class APIServer(ThreadingHTTPServer):
    """Serves `APIHandler`s for `app` (the `GlimmerServer`: its session, settings, request parsing and worker)."""

    # connections waiting to be accepted: socketserver's default of 5 refused a burst of 16 clients
    # (ConnectionResetError) before the accept thread got to them
    request_queue_size = 128
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

    # -- the protocol layer ------------------------------------------------------------------------------------------
    def handle_one_request(self):
        """One request: its line and headers, then `dispatch`. Replaces `BaseHTTPRequestHandler`'s, whose errors
        are HTML pages (and, for an HTTP/0.9 line, have no status line)."""
        self.command, self.path, self.requestline = None, "", ""
        self.request_version = "HTTP/1.1"  # how errors are written until the request line says otherwise
        self.close_connection = True
        self.body_pending = False  # a body the client sent (or will send) that is not read yet
        self.peer_sent_more = False  # bytes after this request (`client_gone`)
        try:
            line = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if not line:
                return
            self.raw_requestline = line
            self.requestline = line[:200].decode("latin-1").rstrip("\r\n")
            if len(line) > MAX_REQUEST_LINE:
                self.protocol_error(APIError(414, f"the request line is longer than {MAX_REQUEST_LINE} bytes",
                                             code="request_line_too_long"))
                return
            if not self.parse_request_line(line) or not self.parse_headers():
                return
            self.dispatch()
            self.wfile.flush()
        except TimeoutError as e:  # a read or a write timed out: drop the connection
            self.log_error("request timed out: %r", e)
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def protocol_error(self, e: APIError, **headers) -> None:
        """An error answered before (or instead of) the request proper; the connection closes after it."""
        self.close_connection = True
        try:
            self.send_json(e.status, e.body(), data=e.encode(), headers=dict(headers, Connection="close"))
        except OSError:
            pass

    def parse_request_line(self, line: bytes) -> bool:
        words = line.decode("latin-1").rstrip("\r\n").split()
        if len(words) != 3:
            self.protocol_error(APIError(400, "bad request line: expected 'METHOD /path HTTP/1.1'",
                                         code="bad_request_line"))
            return False
        command, path, version = words
        m = VERSION.match(version)
        if not m or not TOKEN.match(command):
            self.protocol_error(APIError(400, "bad request line: expected 'METHOD /path HTTP/1.1'",
                                         code="bad_request_line"))
            return False
        if (int(m.group(1)), int(m.group(2))) not in ((1, 0), (1, 1)):
            self.protocol_error(APIError(400, f"{version} is not supported: this server speaks HTTP/1.1",
                                         code="http_version_not_supported"))
            return False
        self.command, self.path, self.request_version = command, path, version
        return True

    def parse_headers(self) -> bool:
        """The header lines (at most `MAX_HEADERS`, `MAX_HEADER_BYTES` in all) into `self.headers`."""
        raw, n = b"", 0
        while True:
            line = self.rfile.readline(MAX_HEADER_BYTES + 1 - len(raw))
            if not line:
                self.close_connection = True
                return False
            if line in (b"\r\n", b"\n"):
                break
            raw += line
            n += 1
            if len(raw) > MAX_HEADER_BYTES or n > MAX_HEADERS:
                self.protocol_error(APIError(431, f"the request headers exceed {MAX_HEADERS} lines or "
                                             f"{MAX_HEADER_BYTES} bytes", code="headers_too_large"))
                return False
            if line[:1] in (b" ", b"\t") or b":" not in line:
                self.protocol_error(APIError(400, "a malformed header line (no 'name:', or a folded line)",
                                             code="bad_header"))
                return False
        try:
            self.headers = http.client.parse_headers(io.BytesIO(raw + b"\r\n"), _class=self.MessageClass)
        except http.client.HTTPException:
            self.protocol_error(APIError(431, f"the request headers exceed {MAX_HEADERS} lines or "
                                         f"{MAX_HEADER_BYTES} bytes", code="headers_too_large"))
            return False
        if len(set(self.headers.get_all("Content-Length") or [])) > 1:
            self.protocol_error(APIError(400, "conflicting Content-Length headers", code="bad_header"))
            return False
        conn = self.headers.get("Connection", "").lower()
        self.close_connection = conn == "close" or (self.request_version == "HTTP/1.0" and conn != "keep-alive")
        te = self.headers.get("Transfer-Encoding")
        self.body_pending = bool(te) or self.headers.get("Content-Length", "0").strip() not in ("", "0")
        return True

    def handle_expect_100(self):  # answered once the request is accepted (see read_body)
        return True

    def send_error(self, code, message=None, explain=None):
        """What `http.server` would answer as an HTML page: a JSON error instead."""
        self.protocol_error(APIError(code, message or explain or self.responses.get(code, ("error",))[0]))

    # -- responses --------------------------------------------------------------------------------------------------
    def send_json(self, status: int, obj: dict, *, data: bytes | None = None, headers: dict | None = None) -> None:
        if data is None:
            data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        headers = dict(headers or {})
        if self.close_connection:
            headers.setdefault("Connection", "close")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_api_error(self, e: APIError, **headers) -> None:
        if self.body_pending or e.status >= 500:
            self.close_connection = True  # the unread body would be read as the next request
        headers = dict(e.headers or {}, **headers)
        self.send_json(e.status, e.body(), data=e.encode(), headers=headers)

    def client_gone(self) -> bool:
        """Has the client closed its connection (EOF on the socket) while it waits for an answer? A client that
        sends more (a pipelined request) is not gone; one that only half-closes its side counts as gone."""
        if self.peer_sent_more:
            return False
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            data = self.connection.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):
            return True
        if data:
            self.peer_sent_more = True
            return False
        return True

    def guard(self, fn) -> None:
        try:
            fn()
        except APIError as e:
            self.send_api_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug must not take the server down; the client gets a JSON 500
            self.app.log(f"internal error: {type(e).__name__}: {e!r}")
            try:
                self.send_api_error(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))
            except OSError:
                self.close_connection = True

    # -- routes -----------------------------------------------------------------------------------------------------
    def dispatch(self):
        """The Host (without an API key), the API key, then the method and the route."""
        if not self.app.api_key and not self.loopback_host():
            self.close_connection = True
            self.send_api_error(APIError(403, "without an API key this server only answers requests addressed to "
                                         "localhost / 127.0.0.1 / [::1] (the Host header); start it with --api-key",
                                         code="host_not_allowed"))
            return
        if not self.authorized():
            self.close_connection = True
            self.send_api_error(APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                         code="invalid_api_key"), **{"WWW-Authenticate": 'Bearer realm="glimmer"'})
            return
        if self.command == "GET":
            self.close_connection = self.close_connection or self.body_pending  # a GET's body is never read
            self.guard(self.answer_get)
        elif self.command == "POST":
            self.guard(self.answer_post)
        else:
            allow = ALLOW.get(self.route_path(), "GET, POST")
            self.close_connection = self.close_connection or self.body_pending
            self.send_api_error(APIError(405, f"method {self.command} is not allowed ({ROUTES})",
                                         code="method_not_allowed"), Allow=allow)

    def loopback_host(self) -> bool:
        """Does the Host header name this machine? A keyless server refuses other names: a web page whose domain
        resolves to 127.0.0.1 (DNS rebinding) is same-origin to the browser, and must not reach the model."""
        host = self.headers.get("Host")
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser
        host = host.strip().lower()
        name = host[1:host.find("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        return is_loopback(name)

    def authorized(self) -> bool:
        key = self.app.api_key
        if not key:
            return True
        scheme, _, token = self.headers.get("Authorization", "").strip().partition(" ")
        given = token.strip().encode("utf-8", "backslashreplace")
        return scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode("utf-8", "backslashreplace"))

    def route_path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def answer_get(self):
        app, path = self.app, self.route_path()
        if path == "/health":
            self.send_json(200, {"status": "ok", "model": app.model_name, "default_mode": app.default_mode,
                                 "modes": app.session.available_modes(), "queued": app.worker.queued(),
                                 "running": app.worker.active(), "max_batch": app.worker.max_batch,
                                 "prompt_cache": app.worker.prompts.stats_dict(),
                                 "max_context": app.session.max_context, "batch_auto": app.worker.auto_counts(),
                                 **app.health_extra})
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [self.model_card()]})
        elif path == f"/v1/models/{app.model_name}":
            self.send_json(200, self.model_card())
        elif path.startswith("/v1/models/"):
            raise model_not_found(path[len("/v1/models/"):], app.served_models)
        elif path in ("/v1/chat/completions", "/v1/completions"):
            raise APIError(405, f"{path} takes POST", code="method_not_allowed", headers={"Allow": "POST"})
        else:
            raise APIError(404, f"no route {path} ({ROUTES})", type="not_found_error")

    def model_card(self) -> dict:
        app = self.app
        return {"id": app.model_name, "object": "model", "created": app.created, "owned_by": "glimmer-mlx",
                "max_context": app.session.max_context, "modes": app.session.available_modes()}

    def read_body(self) -> dict:
        ctype = self.headers.get("Content-Type", "")
        te = self.headers.get("Transfer-Encoding")
        if te is not None:
            raise APIError(411, f"{'chunked' if 'chunked' in te.lower() else 'Transfer-Encoding'} request bodies "
                           "are not supported: send Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError(411, "Content-Length is required")
        if not re.fullmatch(r"[0-9]{1,20}", length.strip()):
            raise APIError(400, f"bad Content-Length {length[:40]!r}: expected a number of bytes")
        n = int(length.strip())
        if n > MAX_BODY:
            raise APIError(413, f"the request body of {n} bytes exceeds the limit of {MAX_BODY} bytes",
                           code="request_too_large")
        if self.headers.get("Expect", "").lower() == "100-continue" and self.request_version == "HTTP/1.1":
            self.send_response_only(100)
            self.end_headers()
            self.wfile.flush()
        raw = self.rfile.read(n)
        if len(raw) < n:
            self.close_connection = True
            raise APIError(400, f"the body ended after {len(raw)} of {n} bytes")
        self.body_pending = False
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError(400, "the body is not valid UTF-8") from None
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "the body is not valid JSON here: it is nested too deeply (the limit is "
                           f"{MAX_JSON_DEPTH} levels)") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        check_json(body)
        return body

    def answer_post(self):
        path = self.route_path()
        if path not in ("/v1/chat/completions", "/v1/completions"):
            if path in ("/health", "/v1/models") or path.startswith("/v1/models/"):
                raise APIError(405, f"{path} takes GET", code="method_not_allowed", headers={"Allow": "GET"})
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
        for kind, val in job.results(gone=self.client_gone):
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
        events = job.results(gone=self.client_gone)
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
            self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8", "backslashreplace")
                             + b"\n\n")
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
            self.wfile.write(b"data: " + e.encode() + b"\n\n")
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
