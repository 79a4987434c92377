"""`glimmer bench serve`: the server under concurrent load (issue 24).

N streaming clients (a closed loop: each sends its next request when the last one finished) replay the shipped
prompt sets against `glimmer serve` — the decoding mode sent per request in the `glimmer` field, so one server
process serves ar, dflash and auto — and against `mlx_lm.server` on the same weights, both started here as
subprocesses on free loopback ports and stopped at the end. Per request: time to the first content delta (TTFT),
end-to-end latency, completion tokens (the usage chunk's, else the content deltas counted) and whether the stream
was well formed. Per target/mode and N: aggregate tok/s, per-request tok/s, TTFT and latency p50/p95, errors.

The load generator is standard library only (threads + http.client): it holds no MLX state and runs in any thread,
so a test can drive an in-process `GlimmerServer` whose generations run in the main thread."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .report import learned_line
from .settings import CONTROL

SCHEMA = "glimmer-bench-serve/1"
# sent as {"glimmer": {"mode": ...}}; `CONTROL` (ar-again, `--modes ar,ar-again,...`) is plain decoding sent again as
# ar, side by side with it: its ratio to ar at each N is how far two identical modes drift apart in the sitting, what
# auto ÷ ar is read against
OUR_MODES = ("ar", CONTROL, "dflash", "mtp", "ngram", "auto")
MLX_LM = "mlx-lm"
KNOWN_TARGETS = (*OUR_MODES, MLX_LM)
DEFAULT_MODES = ("ar", "dflash", "auto", MLX_LM)
DEFAULT_CLIENTS = (1, 2, 4, 8, 16)
ERROR_SAMPLES = 5  # error messages kept per level (every request's record keeps its own)


class ServeBenchError(RuntimeError):
    """A benchmark that cannot run as asked (bad options, no target could start)."""


# -- statistics ---------------------------------------------------------------------------------------------------------

def percentile(xs: Iterable[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between closest ranks (numpy's default, "linear"):
    rank p/100·(n−1) in the sorted values. None for no values."""
    v = sorted(xs)
    if not v:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    r = p / 100 * (len(v) - 1)
    lo = int(r)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (r - lo)


def _stats_ms(xs: list[float]) -> dict:
    """p50 / p95 / mean / min / max of seconds, in milliseconds (None when empty)."""
    ms = [1000.0 * x for x in xs]
    return {"p50": percentile(ms, 50), "p95": percentile(ms, 95),
            "mean": statistics.fmean(ms) if ms else None, "min": min(ms, default=None), "max": max(ms, default=None)}


# -- one streamed request -----------------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """What one streamed chat completion measured. Times are seconds: `sent` on the load generator's clock
    (time.perf_counter), `ttft` and `latency` relative to `sent`."""
    client: int = 0
    index: int = 0  # the request's number in its level (prompt and seed follow from it)
    category: str | None = None
    prompt: int | None = None  # index in its category
    seed: int | None = None
    sent: float = 0.0
    ttft: float | None = None  # first non-empty content delta
    latency: float | None = None  # the stream's end ([DONE] or EOF)
    completion_tokens: int | None = None
    tokens_from: str | None = None  # "usage" (the usage chunk) | "deltas" (no usage sent: content deltas counted)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cache: str | None = None  # our server's word on its prompt cache for it (`glimmer.cache`: "reused", "fresh: ...")
    content_deltas: int = 0
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen
    status: int | None = None  # HTTP status
    error: str | None = None  # None: a complete, well-formed stream

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tps(self) -> float | None:
        """Per-request decode rate: (tokens − 1) / (latency − TTFT) — the tokens after the first over the time after
        the first content arrived; None with fewer than 2 tokens."""
        if not self.ok or not self.completion_tokens or self.completion_tokens < 2 or self.ttft is None:
            return None
        dt = self.latency - self.ttft
        return (self.completion_tokens - 1) / dt if dt > 0 else None

    def as_dict(self) -> dict:
        return dict(asdict(self), ok=self.ok, tps=self.tps)


def parse_sse(lines: Iterable[bytes], rec: RequestRecord, clock: Callable[[], float] = time.perf_counter) \
        -> RequestRecord:
    """Read an OpenAI chat-completions SSE stream (`data: {json}` events, then `data: [DONE]`) into `rec`: TTFT at
    the first non-empty `delta.content`, latency at [DONE] (or wherever the stream ended), finish_reason, the usage
    chunk's token counts. A malformed stream is recorded, never raised: a `data:` payload that is not JSON (or not an
    object), an error object in the stream, a read that fails (timeout, reset, truncated chunk), no finish_reason,
    no [DONE], data after [DONE] — each sets `rec.error` (the first problem found). SSE comments (`:`) and the
    other SSE fields (event, id, retry) are skipped."""
    def problem(msg: str) -> None:
        if rec.error is None:
            rec.error = msg

    try:
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line or line.startswith(":"):
                continue
            if not line.startswith("data:"):
                if line.split(":", 1)[0] not in ("event", "id", "retry"):
                    problem(f"not an SSE line: {line[:80]!r}")
                continue
            payload = line[5:].strip()
            if rec.done:
                problem("data after [DONE]")
                continue
            if payload == "[DONE]":
                rec.done = True
                rec.latency = clock() - rec.sent
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                problem(f"chunk {rec.chunks + 1} is not JSON: {payload[:80]!r}")
                continue
            rec.chunks += 1
            if not isinstance(chunk, dict):
                problem(f"chunk {rec.chunks} is not a JSON object")
                continue
            if chunk.get("error") is not None:
                err = chunk["error"]
                problem("error in the stream: " + str(err.get("message") if isinstance(err, dict) else err)[:200])
                continue
            for ch in chunk.get("choices") or []:
                if not isinstance(ch, dict):
                    problem(f"chunk {rec.chunks}: a choice is not an object")
                    continue
                delta = ch.get("delta") or {}
                if isinstance(delta, dict) and delta.get("content"):
                    if rec.ttft is None:
                        rec.ttft = clock() - rec.sent
                    rec.content_deltas += 1
                if ch.get("finish_reason") is not None:
                    rec.finish_reason = ch["finish_reason"]
            g = chunk.get("glimmer")
            if isinstance(g, dict) and isinstance(g.get("cache"), str):
                rec.cache = g["cache"][:200]
            u = chunk.get("usage")
            if isinstance(u, dict) and u.get("completion_tokens") is not None:
                rec.completion_tokens, rec.tokens_from = int(u["completion_tokens"]), "usage"
                rec.prompt_tokens = u.get("prompt_tokens")
                rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (OSError, http.client.HTTPException, ValueError) as e:  # timeout, reset, IncompleteRead
        problem(f"reading the stream failed: {type(e).__name__}: {e}"[:240])
    if rec.latency is None:
        rec.latency = clock() - rec.sent
    if rec.completion_tokens is None:  # the server sent no usage: count the content deltas (a delta may hold more
        rec.completion_tokens, rec.tokens_from = rec.content_deltas, "deltas"  # than one token's text)
    if not rec.done:
        problem("the stream ended without [DONE]")
    if rec.finish_reason is None:
        problem("no finish_reason")
    if rec.ttft is None and rec.error is None and rec.completion_tokens:
        problem("tokens counted but no content delta")
    return rec


# -- the load generator -------------------------------------------------------------------------------------------------

def prompt_for(index: int, prompts: dict[str, list[str]]) -> tuple[str, int, str]:
    """(category, index in it, text) of a level's `index`-th request: round robin over the categories, then
    through each category's prompts."""
    cats = list(prompts)
    cat = cats[index % len(cats)]
    j = (index // len(cats)) % len(prompts[cat])
    return cat, j, prompts[cat][j]


def request_body(text: str, *, max_tokens: int, temperature: float, seed: int | None, mode: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if mode is not None:
        body["glimmer"] = {"mode": "ar" if mode == CONTROL else mode}
    return body


def stream_request(host: str, port: int, body: dict, rec: RequestRecord, *, timeout: float = 300.0,
                   headers: dict | None = None) -> RequestRecord:
    """POST /v1/chat/completions and read its stream into `rec` (errors recorded, not raised)."""
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    rec.sent = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=data,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})})
        resp = conn.getresponse()
        rec.status = resp.status
        if resp.status != 200:
            text = resp.read(4096).decode("utf-8", "replace")
            rec.latency = time.perf_counter() - rec.sent
            try:
                msg = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = " ".join(text.split())[:200]
            rec.error = f"HTTP {resp.status}: {msg}"
            return rec
        parse_sse(iter(resp.readline, b""), rec)
    except (OSError, http.client.HTTPException) as e:
        rec.latency = time.perf_counter() - rec.sent
        rec.error = f"request failed: {type(e).__name__}: {e}"[:240]
    finally:
        conn.close()
    return rec


def run_level(host: str, port: int, clients: int, requests_per_client: int, prompts: dict[str, list[str]], *,
              max_tokens: int = 64, temperature: float = 0.0, seed: int | None = 0, mode: str | None = None,
              timeout: float = 300.0, on_request: Callable[[RequestRecord], None] | None = None) -> dict:
    """`clients` threads, each sending `requests_per_client` requests one after another; request k of client c is
    the level's request r·clients + c (its prompt: `prompt_for`; its seed: seed + index, none if seed is None).
    Returns the level's summary (`summarize`) with every request's record. Any thread may call it."""
    return summarize(run_requests(host, port, clients, requests_per_client, prompts, max_tokens=max_tokens,
                                  temperature=temperature, seed=seed, mode=mode, timeout=timeout,
                                  on_request=on_request), clients)


def run_requests(host: str, port: int, clients: int, requests_per_client: int, prompts: dict[str, list[str]], *,
                 max_tokens: int = 64, temperature: float = 0.0, seed: int | None = 0, mode: str | None = None,
                 timeout: float = 300.0, on_request: Callable[[RequestRecord], None] | None = None,
                 first_round: int = 0) -> list[RequestRecord]:
    """`run_level`'s requests (their records, by index); first_round: the level's rounds before this call's (its
    requests are the level's r·clients + c for r from first_round on: a second pass continues the first)."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        try:
            start.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        for r in range(first_round, first_round + requests_per_client):
            index = r * clients + c
            cat, j, text = prompt_for(index, prompts)
            s = None if seed is None else seed + index
            rec = RequestRecord(client=c, index=index, category=cat, prompt=j, seed=s)
            try:
                stream_request(host, port, request_body(text, max_tokens=max_tokens, temperature=temperature,
                                                        seed=s, mode=mode), rec, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a client thread never dies silently: the request is an error
                rec.error = rec.error or f"client failed: {type(e).__name__}: {e}"[:240]
                rec.latency = rec.latency if rec.latency is not None else time.perf_counter() - rec.sent
            with lock:
                records.append(rec)
            if on_request is not None:
                on_request(rec)

    threads = [threading.Thread(target=client, args=(c,), name=f"bench-client-{c}", daemon=True)
               for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records.sort(key=lambda r: r.index)
    return records


def pass_wall(records: list[RequestRecord]) -> float:
    """Seconds from the first request of a pass sent to its last one finished."""
    t0 = min((r.sent for r in records), default=0.0)
    t1 = max((r.sent + (r.latency or 0.0) for r in records), default=0.0)
    return t1 - t0


def summarize(records: list[RequestRecord], clients: int, passes: list[list[RequestRecord]] | None = None) -> dict:
    """One level: aggregate tok/s = the completion tokens of every well-formed request / the wall time from the
    first request sent to the last one finished (with `passes`, the level's requests ran in several passes with
    other modes in between: the sum of each pass's wall time); the median per-request tok/s; TTFT and latency
    p50/p95 (ms) over the well-formed requests; errors (count and the first messages); with `passes`, each pass's
    own aggregate tok/s too (`pass_tps`, in the order they ran): how far one cell's passes drift apart is the noise
    a ratio of two cells is read against."""
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    wall = sum(pass_wall(p) for p in passes) if passes else pass_wall(records)
    tokens = sum(r.completion_tokens or 0 for r in ok)
    tps = [r.tps for r in ok if r.tps is not None]
    src = {}
    for r in ok:
        src[r.tokens_from] = src.get(r.tokens_from, 0) + 1
    return {
        "clients": clients,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(bad),
        "error_messages": [f"request {r.index}: {r.error}" for r in bad[:ERROR_SAMPLES]],
        "wall_s": wall,
        "completion_tokens": tokens,
        "aggregate_tps": tokens / wall if wall > 0 and ok else None,
        "per_request_tps": {"median": statistics.median(tps) if tps else None, "min": min(tps, default=None),
                            "max": max(tps, default=None)},
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "latency_ms": _stats_ms([r.latency for r in ok]),
        "tokens_from": src,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),  # the servers' prompt caches (as reported)
        "fresh_prefills": fresh_prefills(ok),
        "runs": [r.as_dict() for r in records],
        **({"pass_tps": [pass_tps(p) for p in passes]} if passes else {}),
    }


def fresh_prefills(records: list[RequestRecord]) -> dict[str, int]:
    """{why: requests} of the requests our server prefilled without its prompt cache, by the reason it gave
    (`glimmer.cache`, "fresh: ..."); mlx-lm's server gives none."""
    out: dict[str, int] = {}
    for r in records:
        if r.cache and r.cache.startswith("fresh"):
            why = r.cache.split(":", 1)[1].strip() if ":" in r.cache else r.cache
            out[why] = out.get(why, 0) + 1
    return out


def pass_tps(records: list[RequestRecord]) -> float | None:
    """One pass's aggregate tok/s: its well-formed requests' completion tokens over its wall time."""
    ok = [r for r in records if r.ok]
    wall = pass_wall(records)
    return sum(r.completion_tokens or 0 for r in ok) / wall if ok and wall > 0 else None


def ratio_line(res: dict, mode: str, base: str) -> str | None:
    """"auto ÷ ar per N: N=1 1.08 (passes 1.02, 1.15), ..." — `mode`'s aggregate tok/s over `base`'s at each level
    both ran, and the same ratio pass by pass (their passes ran side by side: the first of each, then the second),
    or None where they share no level."""
    a, b = res["results"].get(mode, {}), res["results"].get(base, {})
    parts = []
    for n, d in a.items():
        e = b.get(n)
        if e is None or not d.get("aggregate_tps") or not e.get("aggregate_tps"):
            continue
        item = f"N={n} {d['aggregate_tps'] / e['aggregate_tps']:.2f}"
        pairs = [(x, y) for x, y in zip(d.get("pass_tps") or [], e.get("pass_tps") or []) if x and y]
        if len(pairs) > 1:
            item += " (passes " + ", ".join(f"{x / y:.2f}" for x, y in pairs) + ")"
        parts.append(item)
    return f"{mode} ÷ {base} per N: " + ", ".join(parts) if parts else None


# -- the servers ----------------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` (bound to port 0, read, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_get(host: str, port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


class ServerProcess:
    """A server started as a subprocess on a free loopback port (stdout + stderr to `log`), ready once GET
    `ready_path` answers 200; `stop()` terminates it, then kills it. A context manager."""

    def __init__(self, name: str, argv_for_port: Callable[[int], list[str]], log: Path, *, ready_path: str,
                 host: str = "127.0.0.1"):
        self.name, self.host, self.ready_path, self.log = name, host, ready_path, Path(log)
        self.port = free_port(host)
        self.argv = argv_for_port(self.port)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._log_file = None

    def start(self, timeout: float = 300.0) -> None:
        """Start and wait until ready; ServeBenchError (with the log's tail) if it exits or times out first."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(os.environ))  # LD_PRELOAD etc. inherited
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                tail = _tail(self.log)
                last = tail.splitlines()[-1] if tail.strip() else "no output"
                raise ServeBenchError(f"{self.name} exited with code {self.proc.returncode} before it was ready "
                                      f"({last}); its output ends with:\n{tail}")
            try:
                status, _ = http_get(self.host, self.port, self.ready_path, timeout=2.0)
                if status == 200:
                    self.startup_s = time.perf_counter() - t0
                    return
            except (OSError, http.client.HTTPException):
                pass
            if time.perf_counter() > deadline:
                raise ServeBenchError(f"{self.name} was not ready (GET {self.ready_path}) after {timeout:.0f} s; its "
                                      f"output ends with:\n{_tail(self.log)}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def glimmer_argv(port: int, *, model: str | None = None, draft_model: str | None = None,
                 mtp_model: str | None = None, host: str = "127.0.0.1") -> list[str]:
    """`glimmer serve` as a subprocess; --mode ar (the default for requests without a `glimmer` field: every
    request here names its mode, and auto is built on its first request, not at start-up)."""
    argv = [sys.executable, "-m", "glimmer_mlx.cli", "serve", "--host", host, "--port", str(port), "--mode", "ar"]
    for flag, v in (("--model", model), ("--draft-model", draft_model), ("--mtp-model", mtp_model)):
        if v is not None:
            argv += [flag, v]
    return argv


def mlx_lm_argv(port: int, model: str, host: str = "127.0.0.1") -> list[str]:
    """mlx-lm's server (`python -m mlx_lm server`, the entry point its deprecation note for `-m mlx_lm.server`
    names), its batching flags left at their defaults."""
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--host", host, "--port", str(port)]


def mlx_lm_server_facts() -> dict:
    """mlx-lm's version and its server's batching defaults, read from its source (None where not found): requests
    are decoded in one batch (up to --decode-concurrency) only without a draft model, without --kv-bits, when every
    KV cache of the model can merge, and when the request sends no `seed`."""
    facts = {"version": None, "defaults": {}}
    try:
        from importlib.metadata import version

        facts["version"] = version("mlx-lm")
    except Exception:  # noqa: BLE001
        pass
    try:
        import importlib.util

        spec = importlib.util.find_spec("mlx_lm.server")
        src = Path(spec.origin).read_text() if spec and spec.origin else ""
    except Exception:  # noqa: BLE001
        src = ""
    for flag in ("decode-concurrency", "prompt-concurrency", "prefill-step-size", "prompt-cache-size", "max-tokens"):
        m = re.search(r'"--' + flag + r'",\s*type=\w+,\s*default=([^,\s]+)', src)
        facts["defaults"][flag] = int(m.group(1)) if m and m.group(1).isdigit() else (m.group(1) if m else None)
    facts["batching"] = ("batched decoding (up to --decode-concurrency requests) when the model's caches can merge, "
                         "no draft model, no --kv-bits, and the request has no seed; otherwise one at a time")
    return facts


# -- the sitting ------------------------------------------------------------------------------------------------------

@dataclass
class ServeBenchSettings:
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    clients: list[int] = field(default_factory=lambda: list(DEFAULT_CLIENTS))
    requests: int = 2  # per client per level
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    categories: list[str] | None = None
    request_timeout: float = 300.0
    startup_timeout: float = 300.0

    @classmethod
    def parse(cls, *, modes: str | None = None, clients: str | None = None, **kw) -> ServeBenchSettings:
        """From the command line's strings; ValueError with one clear line for anything out of range."""
        s = cls(**{k: v for k, v in kw.items() if v is not None})
        if modes is not None:
            s.modes = [m.strip() for m in modes.split(",") if m.strip()]
        if clients is not None:
            try:
                s.clients = [int(x) for x in clients.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"--clients: expected comma-separated integers like 1,2,4, got {clients!r}") from None
        s.check()
        return s

    def check(self) -> None:
        if not self.modes:
            raise ValueError("--modes: empty list")
        bad = [m for m in self.modes if m not in KNOWN_TARGETS]
        if bad:
            raise ValueError(f"--modes: unknown {', '.join(bad)} (known: {', '.join(KNOWN_TARGETS)})")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError("--modes: a mode is given twice")
        if not self.clients or any(n < 1 for n in self.clients):
            raise ValueError(f"--clients: every level must be >= 1, got {self.clients}")
        if any(n > 256 for n in self.clients):
            raise ValueError(f"--clients: at most 256 concurrent clients, got {max(self.clients)}")
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.request_timeout <= 0 or self.startup_timeout <= 0:
            raise ValueError("timeouts must be > 0 seconds")

    def as_dict(self) -> dict:
        return asdict(self)


def select_prompts(categories: list[str] | None) -> dict[str, list[str]]:
    from .settings import load_prompts

    prompts = load_prompts()
    if categories is None:
        return prompts
    bad = [c for c in categories if c not in prompts]
    if bad:
        raise ValueError(f"--categories: unknown {', '.join(bad)} (shipped: {', '.join(prompts)})")
    return {c: prompts[c] for c in categories}


WARMUP_PROMPT = "Say hello in one short sentence."  # not in the prompt sets: the timed prompts start uncached


def batch_steps(host: str, port: int, timeout: float) -> dict | None:
    """Our server's batch chooser's step counts (GET /health's `batch_auto`: plain and speculative steps, steps that
    explored each option), None where it has none yet or /health does not answer."""
    try:
        status, body = http_get(host, port, "/health", timeout=timeout)
        got = json.loads(body).get("batch_auto") if status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    return got if isinstance(got, dict) else None


def add_steps(into: dict, before: dict | None, after: dict | None) -> None:
    """Add to `into` ({"plain": n, "spec": n, "explored": {option: n}[, "unasked": n]}) the steps between two
    `batch_steps` readings (none before the chooser existed: from 0; an unreadable one after: nothing counted;
    "unasked": the steps a quiet batch did not ask its choice, where the server reports them)."""
    if after is None:
        return
    if after.get("learned_restored") is not None:
        into["learned_restored"] = int(after["learned_restored"])
    before = before or {}
    b_steps, a_steps = before.get("auto_steps", {}), after.get("auto_steps", {})
    for k in ("plain", "spec"):
        into[k] = into.get(k, 0) + int(a_steps.get(k, 0)) - int(b_steps.get(k, 0))
    if "unasked_steps" in after:
        into["unasked"] = into.get("unasked", 0) + int(after["unasked_steps"]) - int(before.get("unasked_steps", 0))
    b_ex, explored = before.get("explored_steps", {}), into.setdefault("explored", {})
    for name, v in after.get("explored_steps", {}).items():
        d = int(v) - int(b_ex.get(name, 0))
        if d:
            explored[name] = explored.get(name, 0) + d


def _warmup(host: str, port: int, settings: ServeBenchSettings, mode: str | None) -> RequestRecord:
    rec = RequestRecord(index=-1)
    return stream_request(host, port, request_body(WARMUP_PROMPT, max_tokens=min(settings.max_tokens, 8),
                                                   temperature=settings.temperature, seed=settings.seed, mode=mode),
                          rec, timeout=settings.startup_timeout + settings.request_timeout)


def warm_prompts(host: str, port: int, settings: ServeBenchSettings, prompts: dict[str, list[str]],
                 mode: str | None) -> int:
    """Send every prompt the levels will use once (1 token, untimed), so every target/mode starts its levels with
    the same warm prompt cache (both servers keep one, and the levels replay the same prompts: without this the
    first mode measured pays every cold prefill and the later ones none). Returns how many failed."""
    used = {prompt_for(i, prompts)[2] for i in range(max(settings.clients) * settings.requests)}
    failed = 0
    for text in sorted(used):
        rec = stream_request(host, port, request_body(text, max_tokens=1, temperature=settings.temperature,
                                                      seed=settings.seed, mode=mode),
                             RequestRecord(index=-1), timeout=settings.request_timeout)
        failed += not rec.ok
    return failed


def warm_order(modes: list[str]) -> list[str]:
    """Our modes in the order their prompts are warmed (`warm_prompts`): the plain ones (`ar` and its control
    `CONTROL`, sent as ar) last. One server serves every mode from one prompt cache: an entry a plain request leaves
    serves every mode's prefix, but only a drafting mode's request leaves its drafters' states with it (an entry with
    states is never replaced by the same tokens without them). Warmed plainly first, every prompt's entry lacked
    them, and every auto request on it prefilled it again for them or went without them — which a server running
    auto alone never sees. (With `ar-again` warmed first, as until the thirty-first session, auto's first request
    in a sitting prefilled its prompt again in one of three sittings.)"""
    return sorted(modes, key=lambda m: m in ("ar", CONTROL))


def run_serve_bench(settings: ServeBenchSettings, *, model: str | None = None, draft_model: str | None = None,
                    mtp_model: str | None = None, out_dir=None, progress: Callable | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """The sitting: `glimmer serve` started once for every mode of ours (the mode sent per request), levels by N
    with the modes interleaved within each level; then `mlx_lm.server` on the same weights, every level. Each
    server runs alone (the other is stopped), on a free loopback port, its output in `out_dir`/<name>.log; both are
    stopped on the way out, on error and Ctrl-C too. A target or mode that cannot run is recorded with its reason
    under `skipped` and the rest continue. progress(msg, done, total); log(msg)."""

    if threading.current_thread() is threading.main_thread():  # SIGTERM too unwinds through the finally blocks
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return _run_serve_bench(settings, model=model, draft_model=draft_model, mtp_model=mtp_model,
                                    out_dir=out_dir, progress=progress, log=log)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return _run_serve_bench(settings, model=model, draft_model=draft_model, mtp_model=mtp_model, out_dir=out_dir,
                            progress=progress, log=log)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _run_serve_bench(settings: ServeBenchSettings, *, model, draft_model, mtp_model, out_dir, progress, log) -> dict:
    from ..embedded import resolve_model
    from .runner import machine_fingerprint_info

    say = log or (lambda m: None)
    step = progress or (lambda msg, done=None, total=None: None)
    prompts = select_prompts(settings.categories)
    out_dir = Path(out_dir or "bench-serve")
    host = "127.0.0.1"
    ours = [m for m in settings.modes if m in OUR_MODES]
    lm = MLX_LM in settings.modes
    path = resolve_model(model, announce=say)
    per_level = {n: n * settings.requests for n in settings.clients}
    total = sum(per_level.values()) * len(settings.modes)
    done = [0]
    results: dict[str, dict[str, dict]] = {}
    skipped: dict[str, str] = {}
    targets: dict[str, dict] = {}
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None

    steps: dict[tuple, dict] = {}  # (mode, N) -> our batch chooser's steps during its requests (`batch_steps`)

    def requests(mode_label: str, port: int, n: int, mode: str | None, seed: int | None, rounds: int,
                 first_round: int = 0) -> list[RequestRecord]:
        def on_request(rec):
            done[0] += 1
            step(f"{mode_label}, {n} client(s): request {rec.index + 1}/{per_level[n]}", done[0], total)

        before = batch_steps(host, port, settings.request_timeout) if mode is not None else None
        out = run_requests(host, port, n, rounds, prompts, max_tokens=settings.max_tokens,
                           temperature=settings.temperature, seed=seed, mode=mode,
                           timeout=settings.request_timeout, on_request=on_request, first_round=first_round)
        if mode is not None:
            add_steps(steps.setdefault((mode, n), {}), before, batch_steps(host, port, settings.request_timeout))
        return out

    def skip_all(label: str, why: str) -> None:
        skipped[label] = why
        done[0] += sum(per_level.values())
        say(f"skipping {label}: {why.splitlines()[0]}")

    if ours:
        srv = ServerProcess("glimmer serve", lambda p: glimmer_argv(p, model=model, draft_model=draft_model,
                                                                    mtp_model=mtp_model, host=host),
                            out_dir / "glimmer-serve.log", ready_path="/health", host=host)
        targets["glimmer"] = {"command": srv.argv, "port": srv.port, "model": str(path), "ready": "GET /health",
                              "log": str(srv.log), "modes": ours, "mode_field": '{"glimmer": {"mode": ...}}'}
        try:
            step("starting glimmer serve", done[0], total)
            try:
                srv.start(settings.startup_timeout)
                targets["glimmer"]["startup_s"] = srv.startup_s
            except ServeBenchError as e:
                targets["glimmer"]["error"] = str(e)
                for m in ours:
                    skip_all(m, f"glimmer serve did not start: {e}")
                ours = []
            warmed = set()
            for m in warm_order(ours):
                # untimed; a mode the server cannot run (no drafter) is found here, once
                step(f"warming up {m}", done[0], total)
                w = _warmup(host, srv.port, settings, m)
                if not w.ok:
                    skip_all(m, f"the warm-up request failed: {w.error}")
                    continue
                warm_prompts(host, srv.port, settings, prompts, m)
                warmed.add(m)
            runnable = [m for m in ours if m in warmed]
            for n, by_mode in balanced_levels(settings.clients, runnable, settings.requests,
                                              lambda m, n, rounds, first: requests(m, srv.port, n, m, settings.seed,
                                                                                   rounds, first)).items():
                for m, summary in by_mode.items():
                    results.setdefault(m, {})[str(n)] = {**summary, "batch_steps": steps.get((m, n))}
        finally:
            srv.stop()
    if lm:
        facts = mlx_lm_server_facts()
        srv = ServerProcess("mlx_lm.server", lambda p: mlx_lm_argv(p, path, host=host), out_dir / "mlx-lm-server.log",
                            ready_path="/v1/models", host=host)
        # mlx-lm batches only requests without a seed; a seed changes nothing at temperature 0 (greedy), so none is
        # sent then; at T > 0 each request's seed is sent (and mlx-lm then decodes one request at a time)
        lm_seed = settings.seed if settings.temperature > 0 else None
        targets[MLX_LM] = {"command": srv.argv, "port": srv.port, "model": str(path), "ready": "GET /v1/models",
                           "log": str(srv.log), "version": facts["version"], "flags": "defaults (none given)",
                           "defaults": facts["defaults"], "batching": facts["batching"],
                           "seed_sent": lm_seed is not None,
                           "note": ("no seed sent at temperature 0 (greedy: it changes nothing), so mlx-lm may batch"
                                    if lm_seed is None else "seeds sent (T > 0): mlx-lm serves these one at a time")}
        try:
            step("starting mlx_lm.server", done[0], total)
            try:
                srv.start(settings.startup_timeout)
                targets[MLX_LM]["startup_s"] = srv.startup_s
                step("warming up mlx-lm (loads the model)", done[0], total)
                w = _warmup(host, srv.port, settings, None)  # mlx-lm loads the model on the first request
                if not w.ok:
                    raise ServeBenchError(f"its first request failed ({w.error}); its output ends with:\n"
                                          f"{_tail(srv.log)}")
                targets[MLX_LM]["loaded"] = True
                warm_prompts(host, srv.port, settings, prompts, None)
            except ServeBenchError as e:
                targets[MLX_LM].update(loaded=False, error=str(e))
                skip_all(MLX_LM, f"mlx_lm.server cannot serve {path}: {e}")
            else:
                for n, by_mode in balanced_levels(settings.clients, [MLX_LM], settings.requests,
                                                  lambda m, n, rounds, first: requests(m, srv.port, n, None, lm_seed,
                                                                                       rounds, first)).items():
                    results.setdefault(MLX_LM, {})[str(n)] = by_mode[MLX_LM]
        finally:
            srv.stop()
    if not results:
        raise ServeBenchError("nothing could be measured: " + "; ".join(f"{k}: {v.splitlines()[0]}"
                                                                        for k, v in skipped.items()))
    step("done", total, total)
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["glimmer"] + sys.argv[1:]) if Path(sys.argv[0]).name == "glimmer" else None,
        "machine": machine_fingerprint_info(),
        "model": {"target": str(path), "embedded": model is None, "draft_model": draft_model, "mtp_model": mtp_model},
        "settings": {**settings.as_dict(), "categories": list(prompts),
                     "protocol": "closed loop: each client sends its next request when its last one finished; "
                                 "each server's levels and modes run in a balanced order (half the rounds level "
                                 "by level upward with the modes in the listed order, the rest level by level "
                                 "downward with the modes reversed; `order`: a mode's position in its level in "
                                 "each pass, aggregate tok/s over the two passes' summed wall time); "
                                 "request r of client c is the level's request r*N + c, its prompt round robin over "
                                 "the categories, its seed seed + index (glimmer: always; mlx-lm: only at T > 0); "
                                 "one untimed warm-up request (at most 8 tokens) per target/mode first, then every "
                                 "prompt the levels use once (1 token, untimed): each target/mode starts warm",
                     "definitions": {
                         "aggregate_tps": "completion tokens of the well-formed requests / (last finished - first sent)",
                         "per_request_tps": "(completion tokens - 1) / (latency - TTFT), median over requests",
                         "ttft": "request sent -> first non-empty content delta",
                         "latency": "request sent -> [DONE] (end to end)",
                         "percentiles": "linear interpolation between closest ranks (numpy's default)",
                         "error": "HTTP status other than 200, failed read, a chunk that is not JSON, an error in "
                                  "the stream, no finish_reason or no [DONE]"}},
        "targets": targets,
        "skipped": skipped,
        "load_average": {"before": load_before, "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "results": results,
    }


# -- output -----------------------------------------------------------------------------------------------------------

def balanced_levels(levels: list[int], modes: list[str], rounds: int, run) -> dict[int, dict[str, dict]]:
    """Every level for several modes of one server, in a balanced order: with two or more rounds per client, half
    the rounds go level by level upward with the modes in order (N=1: A B C, N=2: A B C, ...), the other half level
    by level downward with the modes reversed (..., N=2: C B A, N=1: C B A), so neither a mode nor a level measured
    later (a warmer or a more loaded machine, a fuller prompt cache, a drift) is always the same one: the ratios
    people read off the table (a mode over another, N=8 over N=1) are of cells measured side by side; with one
    round, one pass in order. run(mode, clients, rounds, first_round) → records. Returns {N: {mode: summary
    (`summarize` over both passes, its wall the two passes' sum), with "order": the mode's position in its level in
    each pass}}."""
    first = rounds - rounds // 2
    passes: dict[tuple, list] = {(n, m): [] for n in levels for m in modes}
    for n in levels:
        for m in modes:
            passes[(n, m)].append(run(m, n, first, 0))
    if rounds > first:
        for n in reversed(levels):
            for m in reversed(modes):
                passes[(n, m)].append(run(m, n, rounds - first, first))
    out: dict[int, dict[str, dict]] = {}
    for n in levels:
        for i, m in enumerate(modes):
            ps = passes[(n, m)]
            records = sorted((r for p in ps for r in p), key=lambda r: r.index)
            out.setdefault(n, {})[m] = {**summarize(records, n, ps),
                                        "order": [i] if len(ps) == 1 else [i, len(modes) - 1 - i]}
    return out


def write_json(res: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    return path


def _f(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def table_rows(res: dict) -> list[list[str]]:
    """target/mode, N, aggregate tok/s, per-request tok/s, TTFT p50/p95, latency p50/p95 (ms), errors."""
    rows = []
    for mode, levels in res["results"].items():
        for n, d in levels.items():
            rows.append([mode, n, _f(d["aggregate_tps"]), _f(d["per_request_tps"]["median"]),
                         _f(d["ttft_ms"]["p50"], ".0f"), _f(d["ttft_ms"]["p95"], ".0f"),
                         _f(d["latency_ms"]["p50"], ".0f"), _f(d["latency_ms"]["p95"], ".0f"),
                         f"{d['errors']}/{d['requests']}"])
    return rows


TABLE_COLUMNS = ("target/mode", "N", "agg tok/s", "req tok/s", "TTFT p50 ms", "TTFT p95 ms", "lat p50 ms",
                 "lat p95 ms", "errors")


def render_serve_table(res: dict) -> list:
    """A rich Table (target/mode × N) and a dim note on skipped targets and mlx-lm's server."""
    from rich.table import Table
    from rich.text import Text

    m, s = res["machine"], res["settings"]
    t = Table(title=f"{Path(res['model']['target']).name} served — {s['max_tokens']} tokens, {s['requests']} "
                    f"request(s) per client, T={s['temperature']:g} — {m.get('chip')}, mlx {m.get('mlx')}")
    for c in TABLE_COLUMNS:
        t.add_column(c, justify="left" if c == "target/mode" else "right", no_wrap=True)
    for row in table_rows(res):
        t.add_row(*row)
    out = [t]
    notes = [f"skipped {k}: {v.splitlines()[0]}" for k, v in res.get("skipped", {}).items()]
    lm = res.get("targets", {}).get(MLX_LM)
    if lm and lm.get("loaded"):
        notes.append(f"mlx-lm {lm.get('version')} server, flags {lm.get('flags')} (decode concurrency "
                     f"{lm['defaults'].get('decode-concurrency')}); {lm.get('note')}")
    if "ar" in res["results"]:  # our modes ran side by side, pass by pass; mlx-lm's server after ours
        lines = [ratio_line(res, m, "ar") for m in res["results"] if m not in ("ar", MLX_LM)]
        lm_line = ratio_line(res, "ar", MLX_LM)
        notes += [x for x in lines if x] + ([lm_line + " (mlx-lm's passes ran after ours)"] if lm_line else [])
    steps = [(n, st) for n, st in ((n, d.get("batch_steps")) for n, d in res["results"].get("auto", {}).items()) if st]
    spec = [f"N={n} {st.get('spec', 0)}/{st.get('spec', 0) + st.get('plain', 0)}"
            + (f" ({st['unasked']} unasked)" if "unasked" in st else "") for n, st in steps]
    if spec:
        notes.append("auto's speculative batch steps (of all its steps): " + ", ".join(spec)
                     + ("; unasked: plain steps a quiet batch took without asking its choice"
                        if any("unasked" in st for _, st in steps) else ""))
    restored = {st["learned_restored"] for _, st in steps if "learned_restored" in st}
    if restored:  # `speculative.auto.learned`: a server starts from the estimates the last process on its model kept
        notes.append(learned_line("our auto server", max(restored)))
    fresh = [f"{mode} N={n} {sum(d['fresh_prefills'].values())}/{d['ok']}" for mode, lv in res["results"].items()
             for n, d in lv.items() if d.get("fresh_prefills")]
    if fresh:  # a mode that prefilled prompts the others found cached started its requests behind theirs
        whys = sorted({w for lv in res["results"].values() for d in lv.values() for w in d.get("fresh_prefills") or {}})
        notes.append("prompts our server prefilled afresh (of the requests): " + ", ".join(fresh) + " — "
                     + "; ".join(whys))
    errs = [(mode, n, d["error_messages"]) for mode, lv in res["results"].items() for n, d in lv.items()
            if d["error_messages"]]
    for mode, n, msgs in errs[:4]:
        notes.append(f"{mode} N={n}: {msgs[0]}")
    if notes:
        out.append(Text("\n".join(notes), style="dim"))
    return out


COLORS = [(120, 120, 120), (40, 110, 190), (200, 80, 30), (60, 150, 60), (30, 160, 170), (150, 60, 160)]
MLX_LM_COLOR = (190, 40, 140)
CHART_SIZE = (760, 620)


def write_serve_chart(res: dict, path) -> Path:
    """Two panels, one line per target/mode over N (log2-spaced): aggregate tok/s, then p95 end-to-end latency.
    Pillow's default font; no plotting library. CHART_SIZE pixels."""
    from PIL import Image, ImageDraw, ImageFont

    W, H = CHART_SIZE
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    series = list(res["results"].items())
    ns = sorted({int(n) for _, lv in series for n in lv})
    colors = {}
    for i, (mode, _) in enumerate(series):
        colors[mode] = MLX_LM_COLOR if mode == MLX_LM else COLORS[i % len(COLORS)]
    left, right, top, pad = 70, 150, 16, 16
    panel_h = (H - top - 2 * pad) // 2
    title = f"glimmer bench serve: {Path(res['model']['target']).name}, {res['settings']['max_tokens']} tokens"
    g.text((pad, 4), title, fill="black", font=font)
    panels = [("aggregate tok/s", lambda d: d["aggregate_tps"]),
              ("p95 end-to-end latency (ms)", lambda d: d["latency_ms"]["p95"])]
    for k, (label, get) in enumerate(panels):
        y0 = top + pad + k * panel_h
        x0, x1 = left, W - right
        y_top, y_bot = y0 + 18, y0 + panel_h - 36
        g.text((x0, y0), label, fill="black", font=font)
        vals = [get(d) for _, lv in series for d in lv.values() if get(d) is not None]
        vmax = max(vals, default=1.0) * 1.1 or 1.0
        g.rectangle([x0, y_top, x1, y_bot], outline=(180, 180, 180))
        for frac in (0, 0.25, 0.5, 0.75, 1.0):  # y grid and labels
            y = y_bot - int((y_bot - y_top) * frac)
            g.line([x0, y, x1, y], fill=(230, 230, 230))
            g.text((pad, y - 6), f"{vmax * frac:.0f}" if vmax >= 10 else f"{vmax * frac:.2f}", fill="black",
                   font=font)

        def x_of(n, x0=x0, x1=x1):
            if len(ns) == 1:
                return (x0 + x1) // 2
            i = ns.index(n)
            return x0 + 20 + int((x1 - x0 - 40) * i / (len(ns) - 1))

        for n in ns:
            g.text((x_of(n) - 4, y_bot + 4), str(n), fill="black", font=font)
        g.text(((x0 + x1) // 2 - 40, y_bot + 18), "concurrent clients N", fill="black", font=font)
        for mode, lv in series:
            pts = [(x_of(int(n)), y_bot - int((y_bot - y_top) * get(d) / vmax))
                   for n, d in sorted(lv.items(), key=lambda kv: int(kv[0])) if get(d) is not None]
            if len(pts) > 1:
                g.line(pts, fill=colors[mode], width=2)
            for x, y in pts:
                g.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colors[mode])
        for i, (mode, _) in enumerate(series):  # legend, right of the panel
            ly = y_top + 4 + 16 * i
            g.rectangle([x1 + 12, ly + 2, x1 + 24, ly + 10], fill=colors[mode])
            g.text((x1 + 30, ly), mode, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
