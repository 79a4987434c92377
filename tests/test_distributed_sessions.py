"""`glimmer chat|serve|agent --distributed tp|pp` (glimmer_mlx/follower.py, serve/solo.py): rank 0 leads a session,
the other ranks follow it in lockstep.

Fast, in process: rank 0's wire is recorded (`mx.distributed.all_sum` / `all_gather` patched for a fake group) while
a `LeaderSession` runs a chat's worth of operations, then replayed into `follow` on a second session: the follower
must consume exactly the recorded messages and decode exactly what rank 0 decoded, and rank 0's text is the plain
session's (the oracle). The serve worker that decodes one request at a time is checked against `Session.generate`.

Slow, 2 processes over loopback (`mlx.launch -n 2 --backend ring`): the CLI's chat, serve and agent under tp and pp
print / answer exactly what one process does (greedy; MTP and DFlash), rank 0 killed mid-chat ends the follower with
one line, ranks given different models stop with one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = shutil.which("mlx.launch") or (str(Path(sys.executable).parent / "mlx.launch")
                                        if (Path(sys.executable).parent / "mlx.launch").exists() else None)
GLIMMER = [sys.executable, "-m", "glimmer_mlx.cli"]


class FakeGroup:
    def __init__(self, rank, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class Wire:
    """Rank 0's collectives recorded (each returns rank 0's value: the other ranks add zeros; an all_gather of
    identical ranks), then replayed to a follower in the same order."""

    def __init__(self, monkeypatch):
        self.log, self.mp = [], monkeypatch
        self.real_sum, self.real_gather = mx.distributed.all_sum, mx.distributed.all_gather

    def record(self):
        def all_sum(x, group=None, stream=None):
            if not isinstance(group, FakeGroup):
                return self.real_sum(x, group=group)
            v = np.array(x)
            self.log.append(v)
            return mx.array(v)

        self.mp.setattr(mx.distributed, "all_sum", all_sum)
        self.mp.setattr(mx.distributed, "all_gather", lambda x, group=None, stream=None: mx.concatenate([x, x]))

    def replay(self):
        pending = list(self.log)

        def all_sum(x, group=None, stream=None):
            assert pending, "the follower issued a collective rank 0 did not"
            v = pending.pop(0)
            assert v.shape == tuple(x.shape) and v.dtype == np.dtype(str(x.dtype).split(".")[-1]), (v, x)
            return mx.array(v)

        self.mp.setattr(mx.distributed, "all_sum", all_sum)
        return pending


def recording_stream(session, seen):
    """Wrap session.stream to record each request's tokens (a list per request)."""
    inner = session.stream

    def stream(prompt, **kw):
        got = []
        seen.append(got)
        for chunk in inner(prompt, **kw):
            got.extend(chunk.tokens)
            yield chunk

    session.stream = stream


@pytest.fixture(scope="module")
def embedded_sessions():
    from glimmer_mlx.session import load_session

    return [load_session(None) for _ in range(3)]  # leader's, follower's, oracle's


def test_the_follower_replays_exactly_what_rank_0_ran(embedded_sessions, monkeypatch):
    """A chat's worth of operations on rank 0 (MTP greedy, DFlash closed after 3 chunks as on Ctrl-C, a request error
    raised inside the stream, /clear, seeded T = 1 with the seed drawn by rank 0, n-gram reusing the cache, the
    calibration), replayed into `follow`: every message consumed, the same tokens per request, the same cache."""
    from glimmer_mlx.follower import LeaderSession, follow
    from glimmer_mlx.strategy import ModeError

    lead_s, fol_s, oracle = embedded_sessions
    for s in embedded_sessions:
        s.reset()
    wire = Wire(monkeypatch)
    wire.record()
    leader = LeaderSession(lead_s, FakeGroup(0))
    tok = lead_s.tokenizer
    a, b = tok.encode("Once upon a time"), tok.encode("def fibonacci(n):")
    out = []
    out.append(leader.generate(a, mode="mtp", max_tokens=20)[0])
    it = leader.stream(b, mode="dflash", max_tokens=40)
    early = []
    for i, chunk in enumerate(it):
        early += chunk.tokens
        if i == 2:
            break
    it.close()
    out.append(early)
    with pytest.raises(ValueError, match="outside the vocabulary|vocab"):
        leader.generate([lead_s.model.args.vocab_size + 3], max_tokens=4)
    with pytest.raises(ModeError, match="wall-clock"):
        leader.generate(a, mode="auto")
    assert "auto" not in leader.available_modes() and leader.default_mode() == "ar"
    leader.reset()
    out.append(leader.generate(a, max_tokens=12, temperature=1.0)[0])
    out.append(leader.generate(a + out[2] + b, mode="ngram", max_tokens=12)[0])
    leader.calibrate_plain_rate(4)
    leader.stream(a, mode="mtp").close()  # never started: nothing sent, nothing for the followers to run
    lead_keys = list(lead_s.keys)
    leader.close()
    assert leader.closed and lead_s.totals["turns"] == 4  # the bad request never started

    seen = []
    recording_stream(fol_s, seen)
    pending = wire.replay()
    assert follow(fol_s, FakeGroup(1)) == 0
    assert pending == []  # every message consumed, none missing
    assert seen[0] == out[0] and seen[1] == out[1] and seen[3] == out[2] and seen[4] == out[3]
    assert seen[2] == []  # the bad request: dropped at the same point
    assert fol_s.keys == lead_keys and fol_s.cache[0].offset == lead_s.cache[0].offset
    assert fol_s.totals == lead_s.totals
    # the oracle: plain decoding on one process; the DFlash stream stopped after 3 chunks is a prefix of it
    plain = oracle.generate(a, max_tokens=20)[0]
    assert out[0] == plain
    assert out[1] == oracle.generate(b, max_tokens=40)[0][:len(out[1])] and len(out[1]) >= 3
    assert out[3] == oracle.generate(a + out[2] + b, max_tokens=12)[0]


def test_a_follower_that_loses_rank_0_says_so_in_one_line(embedded_sessions, monkeypatch, capsys):
    from glimmer_mlx.follower import follow

    def gone(x, group=None, stream=None):
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(mx.distributed, "all_sum", gone)
    assert follow(embedded_sessions[1], FakeGroup(1)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1: lost contact with rank 0 ([ring] connection to a peer was lost); exiting")
    assert err.count("\n") == 1


def test_one_request_at_a_time_worker_answers_as_the_session_does(embedded_sessions):
    """serve's worker under --distributed (here on a plain session): each job decoded alone through Session.stream,
    the same tokens as Session.generate; a full queue is a 503; /health's fields; a cancelled job stops early."""
    import threading

    from glimmer_mlx.serve.api import APIError
    from glimmer_mlx.serve.solo import SoloWorker

    s, _, oracle = embedded_sessions
    s.reset()
    tok = s.tokenizer

    class Req:
        def __init__(self, text, **kw):
            self.ids, self.kw = tok.encode(text), dict(mode="ar", max_tokens=10) | kw

        def generation_kwargs(self):
            return dict(self.kw)

    w = SoloWorker(s, max_queue=2)
    jobs = [w.submit(Req("Once upon a time", mode="mtp")), w.submit(Req("def f(x):", mode="dflash"))]
    with pytest.raises(APIError) as e:
        w.submit(Req("x"))
    assert e.value.status == 503 and "one request decoded at a time" in str(e.value)
    assert w.queued() == 2 and w.max_batch == 1 and w.active() == 0
    until = threading.Event()

    def stop_when_done():  # the clients: read each job's events until its end, then stop the worker
        for j in jobs:
            j.got = []
            while not j.got or j.got[-1][0] not in ("done", "error"):
                j.got.append(j.events.get())
        until.set()

    th = threading.Thread(target=stop_when_done)
    th.start()
    w.run_jobs(until)
    th.join()
    for j, text in zip(jobs, ["Once upon a time", "def f(x):"]):
        assert j.got[-1][0] == "done"
        toks = [t for kind, c in j.got[:-1] for t in c.tokens]
        assert toks == oracle.generate(tok.encode(text), max_tokens=10)[0]
    assert w.prompts.stats_dict()["cached_tokens"] == s.cached_tokens > 0
    w.stop()
    with pytest.raises(APIError):
        w.submit(Req("x"))


@pytest.mark.parametrize("args", [["chat", "--pp-microbatch", "2"], ["serve", "--pp-microbatch", "2"],
                                  ["agent", "x", "--pp-microbatch", "2", "--distributed", "tp"],
                                  ["chat", "--mode", "auto", "--distributed", "tp"]])
def test_cli_options_that_cannot_run_distributed_fail_in_one_line(args):
    r = subprocess.run(GLIMMER + args, capture_output=True, text=True, timeout=60, env=env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1
    assert ("--pp-microbatch needs --distributed pp" in lines[0] if "--pp-microbatch" in args
            else "no distributed backend could be initialised" in lines[0])


# -- two processes ---------------------------------------------------------------------------------------------------

needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed (MLX's distributed launcher)")


def env():
    return dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))


CHAT_IN = ("Tell me a story\n/clear\nHello there\n/mode auto\n/mode dflash 4\nWhat now?\n/mode ngram\n"
           "Tell me a story\n/exit\n")


def run_chat(args, distributed=None, timeout=180):
    cmd = GLIMMER + ["chat", "--no-calibrate", "--no-stats", "-m", "16"] + args
    if distributed:
        cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--"] + cmd + ["--distributed", distributed]
    return subprocess.run(cmd, input=CHAT_IN, capture_output=True, text=True, timeout=timeout, env=env())


@pytest.mark.slow  # ~15-30 s each: a launch of two ranks
@needs_launch
@pytest.mark.parametrize("strategy, extra", [("tp", []), ("pp", []), ("pp", ["--pp-microbatch", "2"])])
def test_cli_chat_over_two_ranks_prints_what_one_process_prints(strategy, extra):
    """Greedy, MTP then DFlash then n-gram turns, a /clear, a refused /mode auto: rank 0's terminal output is the
    single process's, bar the modes line (no auto) and the refusal; also with micro-batched pipeline forwards."""
    one = run_chat(["--mode", "mtp"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_chat(["--mode", "mtp"] + extra, strategy)
    assert two.returncode == 0 and "error: rank" not in two.stderr, two.stderr[-3000:]
    want = one.stdout.replace("ar, dflash, mtp, ngram, auto", "ar, dflash, mtp, ngram")
    want = want.replace("you › mode auto\n", "you › error: --distributed: 'auto' chooses rounds from wall-clock "
                        "timings measured on each rank, which differ between ranks; give --mode ar|dflash|mtp|ngram "
                        "and an integer --block-size\n")
    assert two.stdout == want
    assert one.stdout.count("you ›") == 9 and len(one.stdout) > 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of mlx.launch's local ranks (its child processes, by their MLX_RANK)."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            environ = (p / "environ").read_bytes().split(b"\0")
            stat = (p / "stat").read_text()
        except OSError:
            continue
        ranks = [e for e in environ if e.startswith(b"MLX_RANK=")]
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ranks and ppid == launcher_pid:  # this launcher's own children only
            out[int(ranks[0].split(b"=")[1])] = int(p.name)
    return out


def kill_launch(proc) -> None:
    """A launch that failed its test: its ranks first (killing mlx.launch alone leaves them running)."""
    if proc.poll() is None:
        for pid in rank_pids(proc.pid).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_health(url, proc, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the server did not start")


@pytest.mark.slow
@needs_launch
@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_cli_serve_over_two_ranks_answers_what_one_process_answers(strategy):
    """Completions and chat completions in ar / MTP / DFlash (greedy) equal the single process's session, also after
    a streaming client left mid-answer; /health says one request at a time; Ctrl-C on rank 0 stops every rank cleanly (exit 0, no error line)."""
    from glimmer_mlx.session import load_session

    port = free_port()
    proc = subprocess.Popen([LAUNCH, "-n", "2", "--backend", "ring", "--"] + GLIMMER +
                            ["serve", "--port", str(port), "--mode", "mtp", "--distributed", strategy],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_health(url, proc)
        assert health["max_batch"] == 1 and health["running"] == 0
        assert health["one_at_a_time"] == (f"--distributed {strategy} over 2 ranks: one request decoded at a time "
                                           f"(no batching across ranks)")
        assert "auto" not in health["modes"]
        got = {}
        for mode in ("ar", "mtp", "dflash"):
            r = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20,
                                               "glimmer": {"mode": mode}})
            got[mode] = r["choices"][0]["text"]
        r = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                                "max_tokens": 16})
        got["chat"] = r["choices"][0]["message"]["content"]
        # a streaming client that leaves after 3 events: rank 0 stops the stream there, every rank with it, and the
        # next request (which continues the cached prompt) is still the single process's answer
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "glimmer": {"mode": "dflash"}}).encode(),
            headers={"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=120)
        for _ in range(3):
            resp.readline()
        resp.close()
        r = post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20, "glimmer": {"mode": "mtp"}})
        got["after_cancel"] = r["choices"][0]["text"]
        try:
            post(url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "glimmer": {"mode": "auto"}})
            raise AssertionError("auto was accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 400 and "wall-clock" in e.read().decode()
        os.kill(rank_pids(proc.pid)[0], signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "error: rank" not in err, err[-3000:]
    finally:
        kill_launch(proc)
    s = load_session(None)
    want = s.generate(s.tokenizer.encode("Once upon a time"), max_tokens=20)[1]
    assert got["ar"] == got["mtp"] == got["dflash"] == got["after_cancel"] == want and want
    ids = s.encode_messages([{"role": "user", "content": "Hello there"}])
    from glimmer_mlx.tool_calls import get_parser

    assert got["chat"] == get_parser(s.tokenizer.chat_template).parse(s.generate(ids, max_tokens=16)[1]).content


@pytest.mark.slow
@needs_launch
def test_cli_agent_over_two_ranks_runs_what_one_process_runs(tmp_path):
    """Two agent steps (greedy, MTP; a tool call, its result fed back): rank 0's transcript of model replies is the
    single process's."""
    def agent(distributed, name):
        ws = tmp_path / name
        ws.mkdir()
        cmd = GLIMMER + ["agent", "List the files", "--workspace", str(ws), "--max-steps", "2", "--max-tokens", "24",
                         "--mode", "mtp", "--transcript", str(tmp_path / f"{name}.jsonl")]
        if distributed:
            cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--"] + cmd + ["--distributed", distributed]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env(), stdin=subprocess.DEVNULL)
        assert "error: rank" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
        recs = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return [x["text"] for x in recs if x.get("type") == "model_output"], r

    want, one = agent(None, "one")
    got, two = agent("tp", "two")
    assert len(want) == 2 and got == want
    # the step limit (exit code 2) on rank 0 as on one process (mlx.launch itself exits 0 and names it); rank 1: 0
    assert one.returncode == 2 and "Node with rank 0 exited with code 2" in two.stderr
    assert "rank 1 exited" not in two.stderr


@pytest.mark.slow
@needs_launch
def test_rank_0_killed_mid_chat_ends_the_follower_with_one_line():
    proc = subprocess.Popen([LAUNCH, "-n", "2", "--backend", "ring", "--"] + GLIMMER +
                            ["chat", "--no-calibrate", "-m", "2000", "--mode", "ar", "--distributed", "tp"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env())
    try:
        proc.stdin.write("Tell me a very long story\n")
        proc.stdin.flush()
        t0 = time.monotonic()
        while len(rank_pids(proc.pid)) < 2 and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        time.sleep(12)  # loaded and generating (2000 tokens take far longer)
        pids = rank_pids(proc.pid)
        os.kill(pids[0], signal.SIGKILL)
        t1 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t1
    finally:
        kill_launch(proc)
    lines = [x for x in err.splitlines() if x.startswith("error: rank 1:")]
    assert len(lines) == 1, err[-3000:]
    assert "lost contact" in lines[0] or "stopped by the launcher" in lines[0]
    assert took < 20 and "Traceback" not in err


@pytest.mark.slow
@needs_launch
def test_ranks_given_different_models_stop_with_one_line(tiny_checkpoint):
    other, _ = tiny_checkpoint(seed=3, tokenizer=True)
    from glimmer_mlx.embedded import embedded_path

    script = (f'if [ "$MLX_RANK" = 1 ]; then M={other}; else M={embedded_path("target")}; fi; '
              f'exec {sys.executable} -m glimmer_mlx.cli chat --model "$M" --no-calibrate --distributed tp')
    r = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", "bash", "-c", script], input="/exit\n",
                       capture_output=True, text=True, timeout=120, env=env())
    assert "error: --distributed: ranks disagree on the model: rank(s) [1] differ from rank 0" in r.stderr, \
        r.stderr[-3000:]
    assert "Traceback" not in r.stderr
