"""`glimmer serve` with continuous batching, over HTTP: concurrent clients get what they would get alone, a client
that disconnects frees its row, a 16-client load test, a full queue, and the prompt cache across interleaved
conversations (drafter states kept with its entries).

Each test names, in a comment, the broken implementation it catches."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import glimmer_mlx
from glimmer_mlx.serve import GlimmerServer
from serve_helpers import over_http, script_slow, serve_tiny


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """(server, base_url, model, tokenizer): a tiny target with a tokenizer, a DFlash drafter and an MTP layer,
    served in a background thread (`serve_helpers.serve_tiny`)."""
    for server, base, model, tok, _ in serve_tiny(tiny_checkpoint, tmp_path_factory, seed=23):
        yield server, base, model, tok


def call(base, path, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(base, prompt, **kw):
    status, text = call(base, "/v1/completions", dict(prompt=prompt, **kw))
    assert status == 200, text
    return json.loads(text)


def chat(base, messages, **kw):
    status, text = call(base, "/v1/chat/completions", dict(messages=messages, **kw))
    assert status == 200, text
    return json.loads(text)


def sse(text: str) -> list:
    """The events of an SSE body; asserts the framing, that every event is JSON, and the final [DONE]."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text[:300]
    assert events[-1] == "data: [DONE]", text[-300:]
    return [json.loads(e[6:]) for e in events[:-1]]


def in_threads(fns, timeout=120, stagger=0.0):
    """Run every fn at once in its own thread (released together by a barrier, or started `stagger` seconds apart);
    their results in order (an exception re-raised)."""
    results, errors = [None] * len(fns), []
    start = threading.Barrier(len(fns)) if not stagger else None

    def one(i, fn):
        try:
            if start is not None:
                start.wait()
            results[i] = fn()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a client hung"
    if errors:
        raise errors[0]
    return results


REQUESTS = [("def f0(x):", "ar", 12), ("def f1(x):", "dflash", 16), ("The quick brown", "mtp", 9),
            ("Hello, world!", "ngram", 14), ("import os", "auto", 11), ("for i in range(10):", "dflash", 7),
            ("def add(a, b):", "ar", 16), ("Speculative", "mtp", 13)]


def test_concurrent_clients_get_what_they_get_alone(served):
    """Overlapping greedy requests in every mode (and auto) equal the same requests sent one at a time, text,
    token count and finish reason. Catches: rows of a batch sharing state (a drafter, a sampler, a cache row),
    a job handed another job's chunks (`Row.req.tag`), a row's drafter continuing a prompt-cache entry another row
    owns."""
    server, base, model, tok = served

    def one(prompt, mode, n):
        r = complete(base, prompt, max_tokens=n, temperature=0, glimmer={"mode": mode})
        return r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]

    def client():
        alone = [one(*r) for r in REQUESTS]
        steps_before = dict(server.worker.batch.step_rows)
        together = in_threads([lambda r=r: one(*r) for r in REQUESTS])
        assert together == alone
        grew = {b: n - steps_before.get(b, 0) for b, n in server.worker.batch.step_rows.items()}
        assert any(b >= 2 and n > 0 for b, n in grew.items()), grew  # they did share steps
        for (prompt, _, n), (text, _, count) in zip(REQUESTS, alone):  # and alone is the plain greedy output
            ref = glimmer_mlx.generate(model, prompt, tokenizer=tok, max_tokens=n)
            assert (text, count) == (ref.text, len(ref.tokens))

    over_http(server, client)


def stream_lines(base_port, body):
    """Open a raw streaming request; returns the socket after the response's first SSE event arrived."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", base_port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    got = b""
    while got.count(b"data: ") < 2:
        chunk = sock.recv(4096)
        assert chunk, got  # closed before the first events
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    return sock


def test_streaming_client_gone_frees_its_row(served, monkeypatch):
    """A streaming client closing its socket after its first chunks: its job leaves `worker.running` and its row
    the batch within seconds (not after its 1000 scripted, slowed tokens), while concurrent clients get complete,
    correct answers. Catches: a cancel that never reaches `BatchGenerator.cancel`, a cancelled row kept in the
    batch (decoded to its end), the other rows disturbed when one leaves mid-batch."""
    server, base, model, tok = served
    produced = []

    def slow(i):
        time.sleep(0.02)
        produced.append(i)

    script_slow(monkeypatch, server, tok, 1000, slow)
    others = REQUESTS[:4]
    refs = [glimmer_mlx.generate(model, p, tokenizer=tok, max_tokens=n).text for p, _, n in others]

    def slow_job_running():
        return any(j.row is not None and j.row.req.max_tokens == 1000 for j in list(server.worker.running))

    def client():
        sock = stream_lines(server.port, {"prompt": "Hello", "max_tokens": 1000, "stream": True})
        assert slow_job_running()

        def other(prompt, mode, n):
            status, text = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": n, "stream": True,
                                                          "glimmer": {"mode": mode}})
            assert status == 200
            ev = sse(text)
            return "".join(e["choices"][0]["text"] for e in ev if e["choices"])

        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", in_threads(
            [lambda r=r: other(*r) for r in others])))
        t.start()
        time.sleep(0.3)  # the others are in the batch with the slow one
        sock.close()
        t0 = time.time()
        while slow_job_running() and time.time() - t0 < 15:
            time.sleep(0.05)
        assert not slow_job_running(), "the gone client's row is still decoding"
        n_gone = len(produced)
        t.join(120)
        assert box["r"] == refs
        t0 = time.time()
        while server.worker.running and time.time() - t0 < 10:
            time.sleep(0.05)
        assert server.worker.running == [] and len(server.worker.batch) == 0
        assert n_gone < 600 and len(produced) <= n_gone + 2, (n_gone, len(produced))

    over_http(server, client)


def test_sixteen_clients_load(served):
    """16 threads, 2 streaming requests each (max_tokens 16, every mode): every response complete and well-formed
    (each SSE event JSON, one finish_reason, [DONE], usage), its text and token count the greedy reference's.
    Catches: chunks lost or duplicated when many rows join and leave at once, a row finishing without its final
    chunk (no finish_reason), usage counting another row's tokens, max_batch rows + a waiting queue deadlocking."""
    server, base, model, tok = served
    modes = ["ar", "dflash", "mtp", "ngram"]
    prompts = [f"def f{i}(x):" for i in range(8)]
    refs = {p: glimmer_mlx.generate(model, p, tokenizer=tok, max_tokens=16) for p in prompts}

    def user(u):
        out = []
        for j in range(2):
            p = prompts[(u + j) % 8]
            status, text = call(base, "/v1/completions", {
                "prompt": p, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                "glimmer": {"mode": modes[(u + j) % 4]}})
            assert status == 200, text
            ev = sse(text)
            finals = [e for e in ev if e["choices"] and e["choices"][0]["finish_reason"]]
            assert len(finals) == 1, ev
            assert ev[-1]["choices"] == [] and "usage" in ev[-1]
            content = "".join(e["choices"][0]["text"] for e in ev if e["choices"])
            out.append((p, content, finals[0]["choices"][0]["finish_reason"], ev[-1]["usage"]))
        return out

    def client():
        # started 10 ms apart, not all at once: 16 simultaneous connects overflow the listen backlog (see
        # test_listen_backlog_takes_sixteen_clients); the requests still overlap (each takes far longer)
        for res in in_threads([lambda u=u: user(u) for u in range(16)], timeout=300, stagger=0.01):
            for p, content, finish, usage in res:
                ref = refs[p]
                assert content == ref.text and finish == ref.finish_reason, p
                assert usage["completion_tokens"] == len(ref.tokens), (p, usage)
                assert usage["prompt_tokens"] == len(tok.encode(p))
                assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    over_http(server, client)
    assert server.worker.running == [] and len(server.worker.batch) == 0


def test_listen_backlog_takes_sixteen_clients(served):
    """`glimmer serve` is meant for 16 concurrent clients (max_batch 16, bench serve): its listen backlog must take
    them connecting at the same moment. Checked on the attribute (deterministic) and by 16 /health calls released
    together. Catches: the socketserver default backlog of 5."""
    server, base, *_ = served
    assert server.httpd.request_queue_size >= 16
    statuses = in_threads([lambda: call(base, "/health")[0] for _ in range(16)])
    assert statuses == [200] * 16


def test_full_queue_is_503(served, monkeypatch):
    """max_queue=2: while the model thread is inside a slow step, requests beyond the two waiting ones get a 503
    (OpenAI error, server_error); the queued ones and the slow one still complete. Catches: a queue bound not
    enforced (or counting running rows), a refused job left running."""
    _, _, model, tok = served
    session = served[0].session
    server = GlimmerServer(session, port=0, quiet=True, mode="ar", default_max_tokens=4, max_queue=2)
    server.start_http()
    base = f"http://127.0.0.1:{server.port}"
    started = threading.Event()

    def slow(i):
        started.set()
        time.sleep(0.4)

    script_slow(monkeypatch, server, tok, 7, slow)

    def client():
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("slow", call(base, "/v1/completions",
                                                                       {"prompt": "Hello", "max_tokens": 7})))
        t.start()
        assert started.wait(30)
        time.sleep(0.05)
        got = in_threads([lambda i=i: call(base, "/v1/completions", {"prompt": f"hi {i}", "max_tokens": 2})
                          for i in range(6)])
        t.join(60)
        statuses = [s for s, _ in got]
        assert statuses.count(503) >= 1 and statuses.count(200) >= 2, statuses
        assert set(statuses) <= {200, 503}
        for s, text in got:
            if s == 503:
                err = json.loads(text)["error"]
                assert err["type"] == "server_error" and "busy" in err["message"]
        assert box["slow"][0] == 200
        assert json.loads(box["slow"][1])["usage"]["completion_tokens"] == 7
        assert call(base, "/v1/completions", {"prompt": "after", "max_tokens": 2})[0] == 200  # not stuck

    try:
        over_http(server, client)
    finally:
        server.shutdown()


def test_auto_is_built_when_the_server_starts_where_a_model_drafter_is_loaded(served, monkeypatch):
    """A server whose default mode is ar, with model drafters loaded, builds `auto` (its calibration check and its
    drafters' timings) before it serves, not on the first request asking for it, where the build would stall the
    running batch and be charged to that request; a server without a model drafter builds nothing at start.
    Catches: auto built on a request again (the first auto request calls `make_auto`), or built for every server."""
    import glimmer_mlx.strategy as strategy
    from glimmer_mlx.session import Session

    _, _, model, tok = served
    loaded = served[0].session.drafters
    real, built = strategy.make_auto, []
    monkeypatch.setattr(strategy, "make_auto", lambda *a, **k: built.append(1) or real(*a, **k))
    GlimmerServer(Session(model, tok, max_context=1024), port=0, quiet=True, mode="ar").shutdown()
    assert built == []
    session = Session(model, tok, drafters={"dflash": loaded.dflash, "mtp": loaded.mtp}, max_context=1024)
    server = GlimmerServer(session, port=0, quiet=True, mode="ar", default_max_tokens=4)
    assert built == [1]
    server.start_http()
    base = f"http://127.0.0.1:{server.port}"
    try:
        got = over_http(server, lambda: complete(base, "def f(x):", max_tokens=6, glimmer={"mode": "auto"}))
    finally:
        server.shutdown()
    assert got["glimmer"]["mode"] == "auto" and got["usage"]["completion_tokens"] == 6
    assert built == [1]


def test_more_conversations_than_batch_rows_cycle_through_the_prompt_cache(served):
    """20 conversations taken in turn, twice (clients cycling through more conversations than the batch has rows —
    and more than a 16-entry LRU holds): on the second cycle every request continues its own first turn (cached
    = prompt - 1). Catches: a prompt cache bounded at 16 entries for a 16-row batch (an LRU under a cyclic load
    misses every time: each second-cycle request prefilled in full)."""
    server, base, model, tok = served
    prompts = [f"Conversation {i}: tell me something about the number {i * 7}." for i in range(20)]

    def client():
        for cycle in range(2):
            for text in prompts:
                u = complete(base, text, max_tokens=1, temperature=0)["usage"]
                if cycle == 1:
                    assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1, (text, u)

    over_http(server, client)


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_interleaved_conversations_reuse_the_prompt_cache(served, mode):
    """A turn 1, B turn 1, A turn 2, B turn 2: each turn 2 reuses its own conversation's cache (cached_tokens > 0:
    more than the chat template's shared opening), in dflash with the drafter state kept with the entry; the
    outputs equal a fresh server's (no prompt cache). Catches: a prompt cache holding one conversation only (B
    evicting A), an entry inserted under the wrong keys (the generated tokens cut off or shifted: a miss, or
    a hit on wrong keys that changes the output), a dflash row continuing without the drafter state (a fresh
    prefill: cached 0)."""
    server, base, model, tok = served
    convs = {"A": [{"role": "user", "content": "Tell me about foxes."}],
             "B": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]}
    follow = {"A": "And dogs?", "B": "Now subtract."}

    def turn(b, msgs):
        return chat(b, msgs, max_tokens=10, temperature=0, glimmer={"mode": mode})

    seconds = {}

    def client():
        first = {}
        for name in ("A", "B"):
            first[name] = turn(base, convs[name])
        for name in ("A", "B"):
            msgs = convs[name] + [first[name]["choices"][0]["message"], {"role": "user", "content": follow[name]}]
            r = turn(base, msgs)
            u = r["usage"]
            full = len(tok.apply_chat_template(convs[name], add_generation_prompt=True, tokenize=True))
            assert u["prompt_tokens_details"]["cached_tokens"] >= full, (name, u, r["glimmer"])
            assert r["glimmer"]["prefilled_tokens"] == u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
            seconds[name] = (msgs, r["choices"][0]["message"]["content"])

    over_http(server, client)
    fresh = GlimmerServer(server.session, port=0, quiet=True, mode="ar", default_max_tokens=16)
    fresh.start_http()
    fbase = f"http://127.0.0.1:{fresh.port}"
    try:
        def check():
            for name, (msgs, content) in seconds.items():
                r = turn(fbase, msgs)
                assert r["choices"][0]["message"]["content"] == content, name

        over_http(fresh, check)
    finally:
        fresh.shutdown()
