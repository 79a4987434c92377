"""`glimmer bench serve`: the percentile and per-level math, the SSE parser (well-formed, truncated, malformed
streams), the load generator against an in-process GlimmerServer on the embedded model, the server subprocess
wrapper, the JSON / PNG / table writers and the command's option errors. mlx_lm.server runs only in the slow test."""

from __future__ import annotations

import http.server
import json
import sys
import threading

import pytest
from typer.testing import CliRunner

from glimmer_mlx.bench.serve import (CHART_SIZE, RequestRecord, ServeBenchError, ServeBenchSettings, ServerProcess,
                                     add_steps, balanced_levels, batch_steps, free_port, parse_sse, percentile,
                                     prompt_for, ratio_line, render_serve_table, request_body, run_level, stream_request,
                                     summarize, table_rows, write_json, write_serve_chart)
from glimmer_mlx.cli import app


# -- math ---------------------------------------------------------------------------------------------------------------

def test_percentile_hand_computed():
    xs = [4, 1, 3, 2]  # sorted 1 2 3 4
    assert percentile(xs, 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile(xs, 95) == pytest.approx(3.85)  # rank 2.85: 3 + 0.85 * (4 - 3)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 4
    assert percentile([10, 20, 30, 40, 50], 25) == pytest.approx(20)  # rank 1 exactly
    assert percentile([10, 20], 95) == pytest.approx(19.5)
    assert percentile([7], 95) == 7
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def _rec(index, sent, ttft, latency, tokens, error=None, src="usage"):
    return RequestRecord(index=index, sent=sent, ttft=ttft, latency=latency, completion_tokens=tokens,
                         tokens_from=src, done=True, finish_reason="length", error=error)


def test_balanced_levels_order_cancels_a_drifting_server():
    """Levels and modes of one server in the order N=1: A B C, N=2: A B C, then N=2: C B A, N=1: C B A (half the
    rounds each): on a server that gets slower with every pass (drift: a warmer cache, a fuller prompt cache,
    another process), identical modes measure the same aggregate tok/s, and so do identical levels — the ratio of
    two levels is of cells measured side by side; measured one after the other they would not be. The wall time
    is the sum of each cell's passes (not the span that holds the others' passes too); records merge by index."""
    calls = []

    def run(mode, n, rounds, first):
        i = len(calls)
        calls.append((mode, n, rounds, first))
        t = 1.0 + 0.2 * i  # each pass 20 % slower than the one before
        start = 10.0 * i
        return [_rec(r * 2 + c, start, 0.1, t, 8) for r in range(first, first + rounds) for c in range(2)]

    out = balanced_levels([1, 2], ["a", "b", "c"], 4, run)
    assert calls == [("a", 1, 2, 0), ("b", 1, 2, 0), ("c", 1, 2, 0), ("a", 2, 2, 0), ("b", 2, 2, 0), ("c", 2, 2, 0),
                     ("c", 2, 2, 2), ("b", 2, 2, 2), ("a", 2, 2, 2), ("c", 1, 2, 2), ("b", 1, 2, 2), ("a", 1, 2, 2)]
    tps = {(n, m): out[n][m]["aggregate_tps"] for n in (1, 2) for m in "abc"}
    assert all(v == pytest.approx(tps[(1, "a")]) for v in tps.values())  # passes 0+11, 1+10, ...: 4.2 s each
    assert out[1]["a"]["wall_s"] == pytest.approx(4.2) and out[1]["a"]["completion_tokens"] == 64
    assert out[2]["b"]["clients"] == 2 and [r["index"] for r in out[2]["b"]["runs"]] == list(range(8))
    assert (out[1]["a"]["order"], out[2]["c"]["order"]) == ([0, 2], [2, 0])
    calls.clear()
    one = balanced_levels([1, 2], ["a", "b"], 1, run)  # one round: one pass, in order
    assert calls == [("a", 1, 1, 0), ("b", 1, 1, 0), ("a", 2, 1, 0), ("b", 2, 1, 0)] and one[1]["b"]["order"] == [1]
    assert one[1]["a"]["aggregate_tps"] > one[2]["a"]["aggregate_tps"]  # what an unbalanced order measures


def test_pass_figures_and_the_ratio_line_pass_by_pass():
    """With passes, each pass's own aggregate tok/s (its tokens over its own wall time), in the order they ran; the
    table's ratio line divides one mode's by another's at each level, in total and pass by pass (first by first,
    second by second), so a ratio is read against how far its cells' passes drift apart."""
    a1 = [_rec(0, 0.0, 0.1, 2.0, 20), _rec(1, 0.0, 0.1, 1.0, 10)]  # 30 tokens in 2 s: 15 tok/s
    a2 = [_rec(2, 10.0, 0.1, 1.0, 30), _rec(3, 10.5, 0.1, 0.5, 0, error="boom")]  # 30 tokens in 1 s (the error's
    # time counts, its tokens do not): 30 tok/s
    s = summarize(a1 + a2, clients=2, passes=[a1, a2])
    assert s["pass_tps"] == [pytest.approx(15.0), pytest.approx(30.0)]
    assert s["aggregate_tps"] == pytest.approx(60 / 3)  # the passes' tokens over the sum of their walls
    assert "pass_tps" not in summarize(a1, clients=2)  # one pass measured as a whole: nothing more to show
    b1 = [_rec(0, 0.0, 0.1, 2.0, 40)]  # 20 tok/s
    b2 = [_rec(1, 5.0, 0.1, 4.0, 40)]  # 10 tok/s
    b = summarize(b1 + b2, clients=1, passes=[b1, b2])
    res = {"results": {"ar": {"2": b}, "auto": {"2": s, "4": s}}}
    # 20 / (80 / 6) = 1.5 in total; 15 / 20 and 30 / 10 pass by pass; no ar at N = 4: not on the line
    assert ratio_line(res, "auto", "ar") == "auto ÷ ar per N: N=2 1.50 (passes 0.75, 3.00)"
    assert ratio_line(res, "ar", "mlx-lm") is None


def test_summarize_hand_computed():
    recs = [_rec(0, 0.0, 0.5, 2.0, 10), _rec(1, 0.0, 1.0, 3.0, 20), _rec(2, 1.0, 1.0, 2.0, 30, src="deltas"),
            _rec(3, 0.5, None, 1.0, 0, error="HTTP 500: boom")]
    s = summarize(recs, clients=2)
    assert (s["clients"], s["requests"], s["ok"], s["errors"]) == (2, 4, 3, 1)
    assert s["wall_s"] == pytest.approx(3.0)  # first sent 0.0, last finished 0.0 + 3.0 (and 1.0 + 2.0)
    assert s["completion_tokens"] == 60  # the error's tokens are not counted
    assert s["aggregate_tps"] == pytest.approx(20.0)
    # per request (tokens - 1) / (latency - ttft): 9 / 1.5 = 6, 19 / 2 = 9.5, 29 / 1 = 29
    assert s["per_request_tps"] == {"median": pytest.approx(9.5), "min": pytest.approx(6.0), "max": pytest.approx(29)}
    assert s["ttft_ms"]["p50"] == pytest.approx(1000.0)  # 500 1000 1000
    assert s["ttft_ms"]["p95"] == pytest.approx(1000.0)
    assert s["latency_ms"]["p50"] == pytest.approx(2000.0)  # 2000 2000 3000
    assert s["latency_ms"]["p95"] == pytest.approx(2900.0)  # rank 1.9
    assert s["tokens_from"] == {"usage": 2, "deltas": 1}
    assert s["error_messages"] == ["request 3: HTTP 500: boom"]
    assert len(s["runs"]) == 4 and s["runs"][3]["ok"] is False
    empty = summarize([_rec(0, 0.0, None, 1.0, 0, error="x")], clients=1)
    assert empty["aggregate_tps"] is None and empty["ttft_ms"]["p50"] is None


def test_prompt_draw_round_robin():
    prompts = {"a": ["a0", "a1"], "b": ["b0"], "c": ["c0", "c1", "c2"]}
    got = [prompt_for(i, prompts) for i in range(7)]
    assert [g[0] for g in got] == ["a", "b", "c", "a", "b", "c", "a"]
    assert [g[2] for g in got] == ["a0", "b0", "c0", "a1", "b0", "c1", "a0"]
    body = request_body("hi", max_tokens=8, temperature=0.0, seed=3, mode="dflash")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["glimmer"] == {"mode": "dflash"} and body["seed"] == 3
    assert "glimmer" not in request_body("hi", max_tokens=8, temperature=0.0, seed=None, mode=None)
    # plain decoding's control: sent as ar, measured as a mode of its own (`ServeBenchSettings.parse` accepts it)
    assert request_body("hi", max_tokens=8, temperature=0.0, seed=3, mode="ar-again")["glimmer"] == {"mode": "ar"}
    assert ServeBenchSettings.parse(modes="ar,ar-again,auto").modes == ["ar", "ar-again", "auto"]


# -- the SSE parser -----------------------------------------------------------------------------------------------------

def _chunk(content=None, finish=None, role=False):
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
    return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk",
                                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                                                        "total_tokens": 17, "prompt_tokens_details":
                                                        {"cached_tokens": 4}}})


def _lines(*events):
    out = []
    for e in events:
        out += [(e + "\n").encode(), b"\n"]
    return out


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_sse_well_formed():
    lines = _lines(_chunk(role=True), _chunk("He"), _chunk("llo"), _chunk(finish="length"), USAGE, "data: [DONE]")
    rec = parse_sse([b": a comment\n", b"event: message\n"] + lines, RequestRecord(sent=0.0), clock=Clock())
    assert rec.ok, rec.error
    assert rec.ttft == 1.0 and rec.latency == 2.0  # the clock ticks at the first content and at [DONE]
    assert (rec.completion_tokens, rec.tokens_from, rec.prompt_tokens, rec.cached_tokens) == (5, "usage", 12, 4)
    assert rec.content_deltas == 2 and rec.chunks == 5 and rec.finish_reason == "length" and rec.done
    assert rec.tps == pytest.approx(4.0)  # (5 - 1) / (2 - 1)


def test_sse_keeps_our_servers_word_on_its_prompt_cache():
    """Our server's last chunk says what its prompt cache did for the request (`glimmer.cache`); the record keeps it,
    a level counts the requests prefilled afresh by reason, and the table says where any were. Anything else in that
    field (mlx-lm sends none) is not a reason."""
    def last(glimmer):
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                      "glimmer": glimmer})

    why = "fresh: prefilled again for the states of its model drafters"
    recs = []
    for i, g in enumerate([{"cache": "reused"}, {"cache": why}, {"cache": why}, {"cache": "fresh: no cached prefix"},
                           {"cache": 5}, "not an object", {}]):
        rec = parse_sse(_lines(_chunk("a"), last(g), USAGE, "data: [DONE]"), RequestRecord(index=i, sent=0.0),
                        clock=Clock())
        assert rec.ok, rec.error
        recs.append(rec)
    assert [r.cache for r in recs] == ["reused", why, why, "fresh: no cached prefix", None, None, None]
    lv = summarize(recs, clients=1)
    assert lv["fresh_prefills"] == {"prefilled again for the states of its model drafters": 2, "no cached prefix": 1}
    assert [r["cache"] for r in lv["runs"]][:2] == ["reused", why]
    assert summarize(recs[:1] + recs[4:], clients=1)["fresh_prefills"] == {}


def test_sse_without_usage_counts_deltas():
    rec = parse_sse(_lines(_chunk("a"), _chunk("b"), _chunk("c", finish="stop"), "data: [DONE]"),
                    RequestRecord(), clock=Clock())
    assert rec.ok and (rec.completion_tokens, rec.tokens_from) == (3, "deltas")


def test_sse_truncated_stream_is_an_error():
    rec = parse_sse(_lines(_chunk("a"), _chunk("b")), RequestRecord(), clock=Clock())  # no finish, no [DONE]
    assert not rec.ok and "without [DONE]" in rec.error and rec.latency is not None
    rec = parse_sse(_lines(_chunk("a"), "data: [DONE]"), RequestRecord(), clock=Clock())
    assert rec.error == "no finish_reason"


def test_sse_malformed_lines_are_errors_not_crashes():
    rec = parse_sse(_lines(_chunk("a"), "data: {not json", _chunk(finish="stop"), "data: [DONE]"), RequestRecord(),
                    clock=Clock())
    assert not rec.ok and "not JSON" in rec.error and rec.done  # read to the end all the same
    rec = parse_sse(_lines("data: [1, 2]", "data: [DONE]"), RequestRecord(), clock=Clock())
    assert "not a JSON object" in rec.error
    err = "data: " + json.dumps({"error": {"message": "the model failed", "type": "server_error"}})
    rec = parse_sse(_lines(_chunk("a"), err, "data: [DONE]"), RequestRecord(), clock=Clock())
    assert rec.error == "error in the stream: the model failed"
    rec = parse_sse(_lines(_chunk("a", finish="stop"), "data: [DONE]", _chunk("b")), RequestRecord(), clock=Clock())
    assert rec.error == "data after [DONE]"
    rec = parse_sse([b"garbage\n"] + _lines(_chunk("a", finish="stop"), "data: [DONE]"), RequestRecord(),
                    clock=Clock())
    assert "not an SSE line" in rec.error

    def broken():
        yield (_chunk("a") + "\n").encode()
        raise ConnectionResetError("reset by peer")

    rec = parse_sse(broken(), RequestRecord(), clock=Clock())
    assert not rec.ok and "ConnectionResetError" in rec.error and rec.ttft is not None


class FakeHandler(http.server.BaseHTTPRequestHandler):
    """Answers POSTs with whatever `self.server.reply` says: (status, body bytes)."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = self.server.reply
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_stream_request_over_http_records_errors(fake_server):
    port = fake_server.server_address[1]
    body = request_body("hi", max_tokens=4, temperature=0.0, seed=0, mode=None)
    fake_server.reply = (200, b"".join(_lines(_chunk("x"), "data: {oops", _chunk(finish="stop"), "data: [DONE]")))
    rec = stream_request("127.0.0.1", port, body, RequestRecord())
    assert rec.status == 200 and not rec.ok and "not JSON" in rec.error
    fake_server.reply = (400, json.dumps({"error": {"message": "bad max_tokens"}}).encode())
    rec = stream_request("127.0.0.1", port, body, RequestRecord())
    assert rec.error == "HTTP 400: bad max_tokens"
    fake_server.reply = (200, b"".join(_lines(_chunk("x"), _chunk(finish="length"), USAGE)))  # then EOF, no [DONE]
    level = run_level("127.0.0.1", port, 2, 2, {"a": ["p"]}, max_tokens=4)
    assert level["requests"] == 4 and level["errors"] == 4 and level["aggregate_tps"] is None
    assert "without [DONE]" in level["error_messages"][0]
    rec = stream_request("127.0.0.1", free_port(), body, RequestRecord(), timeout=5)  # nothing listens there
    assert not rec.ok and rec.error.startswith("request failed")


# -- the load generator against glimmer's server ----------------------------------------------------------------------

def test_load_generator_against_in_process_server(monkeypatch, tmp_path):
    from glimmer_mlx.bench.settings import load_prompts
    from glimmer_mlx.serve import GlimmerServer
    from glimmer_mlx.session import load_session

    monkeypatch.setenv("GLIMMER_MLX_CACHE_DIR", str(tmp_path))
    session = load_session(None)  # the embedded model, its drafters
    server = GlimmerServer(session, port=0, quiet=True, mode="ar")
    server.start_http()
    done, box = threading.Event(), {}

    def clients():  # no MLX work here: the generations run in the main thread (run_jobs)
        try:
            box["ar"] = run_level("127.0.0.1", server.port, 2, 2, load_prompts(), max_tokens=8, mode="ar")
            box["dflash"] = run_level("127.0.0.1", server.port, 1, 1, load_prompts(), max_tokens=8, mode="dflash")
            box["before auto"] = batch_steps("127.0.0.1", server.port, 30)  # no auto request yet: no chooser
            box["auto"] = run_level("127.0.0.1", server.port, 1, 1, load_prompts(), max_tokens=8, mode="auto")
            box["after auto"] = batch_steps("127.0.0.1", server.port, 30)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=clients)
    t.start()
    try:
        server.run_jobs(until=done)
        t.join()
    finally:
        server.shutdown()
    if "error" in box:
        raise box["error"]
    lv = box["ar"]
    assert (lv["requests"], lv["ok"], lv["errors"]) == (4, 4, 0), lv["error_messages"]
    assert [r["index"] for r in lv["runs"]] == [0, 1, 2, 3]
    assert [r["category"] for r in lv["runs"]] == ["code", "math", "chat", "json"]  # round robin
    assert all(r["cache"] == "reused" or r["cache"].startswith("fresh") for r in lv["runs"])  # the server's word
    for r in lv["runs"]:
        assert r["tokens_from"] == "usage" and 1 <= r["completion_tokens"] <= 8
        assert r["done"] and r["finish_reason"] in ("length", "stop")
        assert 0 < r["ttft"] <= r["latency"]
        assert r["prompt_tokens"] > 0 and r["seed"] == r["index"]
    assert lv["completion_tokens"] == sum(r["completion_tokens"] for r in lv["runs"])
    assert lv["aggregate_tps"] > 0 and lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p95"]
    assert lv["latency_ms"]["p50"] <= lv["latency_ms"]["p95"]
    assert box["dflash"]["ok"] == 1  # the mode field reaches the server (a dflash request runs on the same server)
    # /health's batch_auto: none before an auto request; the auto request's steps after it (each of the batch's steps
    # plain or speculative: at least one, at most one per token of its 8 — a cached prompt's first token is sampled
    # by a batch step too)
    assert box["before auto"] is None and box["auto"]["ok"] == 1
    steps = {}
    add_steps(steps, box["before auto"], box["after auto"])
    tokens = box["auto"]["completion_tokens"]
    assert 1 <= steps["plain"] + steps["spec"] <= tokens and isinstance(steps["explored"], dict), steps
    assert 0 <= steps["unasked"] <= steps["plain"], steps
    assert box["after auto"]["learned_restored"] is None  # the suite's autos keep nothing (tests/conftest.py)


def test_batch_step_deltas_hand_computed():
    """`add_steps`: the steps between two /health readings, summed over a mode's runs; a reading before the chooser
    existed counts from 0, an unreadable one after counts nothing."""
    into = {}
    add_steps(into, None, {"auto_steps": {"plain": 5, "spec": 2}, "explored_steps": {"dflash": 1}})
    add_steps(into, {"auto_steps": {"plain": 9, "spec": 2}, "explored_steps": {"dflash": 1}},
              {"auto_steps": {"plain": 12, "spec": 6}, "explored_steps": {"dflash": 3, "mtp": 1}})
    add_steps(into, {"auto_steps": {"plain": 12, "spec": 6}}, None)
    assert into == {"plain": 8, "spec": 6, "explored": {"dflash": 3, "mtp": 1}}
    # a server that reports the steps a quiet batch did not ask its choice (`BatchAuto.asks`): their delta too
    add_steps(into, {"auto_steps": {"plain": 12, "spec": 6}, "unasked_steps": 40},
              {"auto_steps": {"plain": 30, "spec": 6}, "unasked_steps": 52})
    add_steps(into, None, {"auto_steps": {"plain": 4}, "unasked_steps": 3})
    assert into == {"plain": 30, "spec": 6, "explored": {"dflash": 3, "mtp": 1}, "unasked": 15}
    # where the server's auto started from (`speculative.auto.learned`): the estimates it restored, when it keeps any
    add_steps(into, {"auto_steps": {}}, {"auto_steps": {}, "learned_restored": None})
    assert "learned_restored" not in into
    add_steps(into, {"auto_steps": {}}, {"auto_steps": {}, "learned_restored": 12})
    assert into["learned_restored"] == 12


# -- the server subprocess wrapper ------------------------------------------------------------------------------------

def test_server_process_start_ready_stop(tmp_path):
    srv = ServerProcess("http.server", lambda p: [sys.executable, "-m", "http.server", str(p), "--bind", "127.0.0.1",
                                                  "--directory", str(tmp_path)],
                        tmp_path / "srv.log", ready_path="/")
    with srv:
        srv.start(timeout=20)
        assert srv.startup_s is not None and srv.proc.poll() is None
    assert srv.proc.poll() is not None  # stopped on the way out
    dead = ServerProcess("dies", lambda p: [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                         tmp_path / "dead.log", ready_path="/")
    with dead, pytest.raises(ServeBenchError, match="exited with code 3(.|\n)*no model here"):
        dead.start(timeout=20)


# -- writers and options --------------------------------------------------------------------------------------------

def _result():
    levels = {}
    for mode, rate in (("ar", 1.0), ("dflash", 1.5), ("mlx-lm", 0.8)):
        levels[mode] = {str(n): summarize([_rec(i, 0.0, 0.1, rate * (1 + i), 8) for i in range(n)], n)
                        for n in (1, 2, 4)}
    levels["ar"]["4"]["errors"] = 1
    return {"schema": "glimmer-bench-serve/1", "machine": {"chip": "test", "mlx": "0"},
            "model": {"target": "/x/glimmer-tiny"}, "settings": {"max_tokens": 8, "requests": 1, "temperature": 0.0},
            "targets": {"mlx-lm": {"loaded": True, "version": "0.32.2", "flags": "defaults", "note": "n",
                                   "defaults": {"decode-concurrency": 32}}},
            "skipped": {"auto": "the warm-up request failed: HTTP 400: no drafter"}, "results": levels}


def test_json_png_and_table_writers(tmp_path):
    from PIL import Image
    from rich.console import Console

    res = _result()
    p = write_json(res, tmp_path / "out" / "bench-serve.json")
    assert json.loads(p.read_text()) == json.loads(json.dumps(res))
    png = write_serve_chart(res, tmp_path / "out" / "bench-serve.png")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == CHART_SIZE
    rows = table_rows(res)
    assert len(rows) == 9 and rows[0][:2] == ["ar", "1"] and rows[2][-1] == "1/4"
    con = Console(record=True, width=200)
    for part in render_serve_table(res):
        con.print(part)
    text = con.export_text()
    assert "skipped auto" in text and "mlx-lm 0.32.2" in text and "dflash" in text
    assert "speculative batch steps" not in text  # no auto results: no line
    # our modes over ar at each level (one pass each here: no pass ratios), ar over mlx-lm's server
    assert "dflash ÷ ar per N: N=1 0.67, N=2 0.67, N=4 0.67" in text
    assert "ar ÷ mlx-lm per N: N=1 0.80, N=2 0.80, N=4 0.80 (mlx-lm's passes ran after ours)" in text
    auto = {n: {**d, "batch_steps": {"plain": 10, "spec": k, "explored": {}}}
            for (n, d), k in zip(res["results"]["ar"].items(), (3, 1, 0))}
    con = Console(record=True, width=200)
    for part in render_serve_table(dict(res, results={**res["results"], "auto": auto})):
        con.print(part)
    assert "auto's speculative batch steps (of all its steps): N=1 3/13, N=2 1/11, N=4 0/10" in con.export_text()
    auto["1"]["batch_steps"]["unasked"] = 6  # a quiet batch's unasked steps, where the server reports them
    con = Console(record=True, width=200)
    for part in render_serve_table(dict(res, results={**res["results"], "auto": auto})):
        con.print(part)
    assert "N=1 3/13 (6 unasked), N=2 1/11, N=4 0/10; unasked: plain steps a quiet batch" in con.export_text()
    assert "prefilled afresh" not in con.export_text()  # every prompt found cached (or no word on it): no line
    assert "started from" not in con.export_text()  # a server that keeps no learned estimates: no line
    for n, said in ((0, "started from its drafters' own estimates"), (48, "started from what earlier runs learned "
                                                                          "(48 estimates;")):
        auto["1"]["batch_steps"]["learned_restored"] = n
        con = Console(record=True, width=300)
        for part in render_serve_table(dict(res, results={**res["results"], "auto": auto})):
            con.print(part)
        assert said in con.export_text()
    del auto["1"]["batch_steps"]["learned_restored"]
    auto["1"]["fresh_prefills"] = {"prefilled again for the states of its model drafters": 1}
    auto["2"]["fresh_prefills"] = {"no cached prefix": 2}
    con = Console(record=True, width=300)
    for part in render_serve_table(dict(res, results={**res["results"], "auto": auto})):
        con.print(part)
    assert ("prompts our server prefilled afresh (of the requests): auto N=1 1/1, auto N=2 2/2 — no cached prefix; "
            "prefilled again for the states of its model drafters") in con.export_text()
    one = dict(res, results={"ar": {"1": res["results"]["ar"]["1"]}})  # one point: no line, still a chart
    with Image.open(write_serve_chart(one, tmp_path / "one.png")) as im:
        assert im.size == CHART_SIZE


def test_settings_and_cli_option_errors():
    s = ServeBenchSettings.parse(modes="ar,mlx-lm", clients="1,2,4", requests=3)
    assert s.modes == ["ar", "mlx-lm"] and s.clients == [1, 2, 4] and s.requests == 3 and s.max_tokens == 64
    for kw, msg in ((dict(modes="ar,nope"), "unknown nope"), (dict(clients="1,x"), "comma-separated integers"),
                    (dict(clients="0,2"), ">= 1"), (dict(requests=0), "--requests"), (dict(max_tokens=0),
                    "--max-tokens"), (dict(modes="ar,ar"), "twice"), (dict(temperature=-1.0), "--temperature")):
        with pytest.raises(ValueError, match=msg):
            ServeBenchSettings.parse(**kw)
    runner = CliRunner()
    for args, msg in ((["--clients", "1,x"], "comma-separated"), (["--modes", "foo"], "unknown foo"),
                      (["--categories", "nope"], "unknown nope"), (["--requests", "0"], "--requests")):
        r = runner.invoke(app, ["bench", "serve", *args])
        assert r.exit_code == 1 and msg in r.output, r.output


@pytest.mark.slow
def test_bench_serve_end_to_end_with_mlx_lm(tmp_path):
    """Both servers as subprocesses (mlx_lm.server too): one level, one request each."""
    r = CliRunner().invoke(app, ["bench", "serve", "--clients", "1,2", "--modes", "ar,mlx-lm", "--requests", "1",
                                 "--max-tokens", "8", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "bench-serve.json").read_text())
    assert set(res["results"]) == {"ar", "mlx-lm"} and res["targets"]["mlx-lm"]["loaded"]
    assert all(d["errors"] == 0 for lv in res["results"].values() for d in lv.values())
    assert (tmp_path / "bench-serve.png").exists()
