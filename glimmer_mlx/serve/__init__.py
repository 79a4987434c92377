"""`glimmer serve`: a local OpenAI-compatible HTTP server (standard library only).

Endpoints: POST /v1/chat/completions (streaming and not, `tools` / `tool_calls`), POST /v1/completions,
GET /v1/models, GET /health. One model is resident in a `session.Session`; generations run in the main thread,
continuously batched (`worker`: up to `max_batch` requests share each target forward, each in its own decoding
mode, speculative ones included; the HTTP threads only parse, validate, tokenize and write), and a prompt cache
across conversations (an LRU under `prompt_cache_bytes`) makes every conversation that grows turn by turn prefill
only its new tokens.

Every request is validated before it reaches the model: bad JSON (too deep, lone surrogates), a wrong content type,
unknown fields or roles, wrongly typed fields, malformed tool schemas, an unknown `model` (404 model_not_found),
out-of-range values, prompts beyond the context limit, unsupported options (n > 1, logprobs, frequency/presence
penalties, forced tool choice), and malformed HTTP (request lines, headers, methods) give a 4xx with an
OpenAI-style error object, never a 500 or a crash. With `api_key`, every endpoint wants `Authorization: Bearer
<key>`; a non-loopback `host` refuses to start without one. A non-streaming client that disconnects cancels its
generation. Decoding mode
per request: `{"glimmer": {"mode": "ar|dflash|mtp|ngram|auto", "block_size": N|"auto"}}` (default: the server's); the
output is the same in every mode (lossless speculative decoding), sampling parameters included.

The package: `api` (requests as dataclasses, their validation, the error object, usage and stats in responses),
`worker` (the job queue and the model thread), `http` (the HTTP server and its request handler); `GlimmerServer`
here puts them together.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

from ..session import Session
from ..strategy import DecodeSpec
from .api import ChatRequest, CompletionRequest, Request
from .http import APIServer, is_loopback
from .solo import SoloWorker
from .worker import DEFAULT_MAX_BATCH, DEFAULT_PROMPT_CACHE_BYTES, Job, Worker

__all__ = ["GlimmerServer", "is_loopback"]

MAX_QUEUE = 64


class GlimmerServer:
    """One session served over HTTP: the HTTP threads parse and validate requests and submit them as jobs; the
    thread that calls `serve_forever` / `run_jobs` runs the generations."""

    def __init__(self, session: Session, *, host: str = "127.0.0.1", port: int = 8080, mode: str | None = None,
                 block_size=None, default_max_tokens: int = 2048, model_name: str | None = None,
                 quiet: bool = False, max_queue: int = MAX_QUEUE, api_key: str | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
                 one_at_a_time: str | None = None):
        """one_at_a_time: decode requests one by one through the session (`solo.SoloWorker`, no batching; the
        reason, shown in /health: `--distributed`); max_batch and prompt_cache_bytes then do not apply."""
        if not is_loopback(host) and not api_key:
            raise ValueError(f"refusing to listen on {host or 'every interface'} without an API key: pass --api-key "
                             "(or set GLIMMER_API_KEY), or bind 127.0.0.1")
        if session.tokenizer is None:
            raise ValueError("the server needs a checkpoint with a tokenizer (tokenizer.json)")
        if not 1 <= max_batch <= 256:
            raise ValueError(f"max_batch must be in [1, 256], got {max_batch}")
        if prompt_cache_bytes < 0:
            raise ValueError(f"the prompt cache budget must be >= 0 bytes, got {prompt_cache_bytes}")
        if default_max_tokens < 1:
            raise ValueError(f"default max_tokens must be >= 1, got {default_max_tokens}")
        self.session = session
        self.default_mode = mode or session.default_mode()
        self.default_spec = DecodeSpec(self.default_mode, block_size)
        # a ModeError now; builds `auto` here (in the main thread, where the model runs)
        session.drafters.resolve(self.default_spec)
        if not one_at_a_time and session.default_mode() == "auto":
            # and wherever a model drafter is loaded, whatever the default mode: built by the first request asking
            # for it, its calibration check and drafter timings (~0.5 s for the embedded set on a 2-core CPU) would
            # stall every row of the running batch and be charged to that request
            session.drafters.batch_auto()
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name or Path(str(getattr(session, "path", "glimmer"))).name or "glimmer"
        self.served_models = (self.model_name,)  # the ids /v1/models lists: what a request's `model` may name
        self.api_key = api_key or None  # every request must send `Authorization: Bearer <api_key>`
        self.created = int(time.time())
        self.quiet = quiet
        self.template = session.tokenizer.chat_template  # what the model's tool calls are parsed by
        if one_at_a_time:
            self.worker = SoloWorker(session, max_queue=max_queue)
            self.health_extra = {"one_at_a_time": one_at_a_time}
        else:
            self.worker = Worker(session, max_queue=max_queue, max_batch=max_batch,
                                 prompt_cache_bytes=prompt_cache_bytes)
            self.health_extra = {}
        self._http: threading.Thread | None = None
        self._closing, self._closed = threading.Lock(), False
        self.httpd = APIServer((host, port), self)
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
        """Serve until Ctrl-C (SIGINT), SIGTERM or `shutdown()`; generations run in this thread.

        In the main thread Ctrl-C is a flag, not an exception: a KeyboardInterrupt raised inside the job queue's
        condition wait can leave the queue's lock held, and `shutdown()` then blocks on it forever. The flag stops
        the job loop and cancels the running generation at its next token; a second Ctrl-C raises as usual. SIGTERM
        (a service manager's or a bench's stop) does the same, so the process exits as it would by itself (what
        `auto` learned is kept: `speculative.auto.learned`); a second one ends it at once."""
        self.start_http()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            def on_signal(signum, frame):
                signal.signal(signum, previous[signum])
                self.worker.interrupt()

            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            self.run_jobs()
        except KeyboardInterrupt:
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.shutdown()

    def run_jobs(self, until: threading.Event | None = None) -> None:
        """Run queued generations in this thread, batched, until `until` is set or `shutdown()`."""
        self.worker.run_jobs(until)

    def shutdown(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.worker.stop()  # no new jobs; those still waiting get an answer instead of hanging
        if self._http is not None:
            self.httpd.shutdown()
        self.httpd.server_close()

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    # -- requests (from the HTTP threads) --------------------------------------------------------------------------
    def parse_chat(self, body: dict) -> ChatRequest:
        return ChatRequest.parse(body, self.session, default_spec=self.default_spec,
                                 default_max_tokens=self.default_max_tokens, served=self.served_models)

    def parse_completion(self, body: dict) -> CompletionRequest:
        return CompletionRequest.parse(body, self.session, default_spec=self.default_spec, served=self.served_models)

    def submit(self, request: Request) -> Job:
        return self.worker.submit(request)
