"""`glimmer serve` on one process vs `--distributed tp|pp` over 2 ranks (issue 25), on this machine.

`python benchmarks/distributed_serve.py [REQUESTS] [OUT.json]`: for each setup (1 process; 2 ranks tp; 2 ranks pp) the
embedded model is served (`--mode mtp`), one warm-up request, then REQUESTS (default 4) sequential completions of 64
greedy tokens per mode (ar, mtp, dflash), timed at the client; the texts are checked equal across setups. One
machine gains nothing (both ranks share the same 2 cores; every layer adds collectives): the figures show the cost of
the lockstep (a broadcast per request, one int per chunk, the per-layer all_sums or stage hand-overs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_distributed_sessions import (GLIMMER, LAUNCH, env, free_port, kill_launch, post, rank_pids,  # noqa: E402
                                      wait_health)

MODES = ("ar", "mtp", "dflash")


def run(setup: str, requests: int) -> dict:
    port = free_port()
    cmd = GLIMMER + ["serve", "--port", str(port), "--mode", "mtp"]
    if setup != "1 process":
        cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--"] + cmd + ["--distributed", setup.split()[-1]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    res = {}
    try:
        wait_health(url, proc)
        body = {"prompt": "Once upon a time", "max_tokens": 64}
        post(url + "/v1/completions", dict(body, max_tokens=8))
        for mode in MODES:
            times, texts = [], set()
            for _ in range(requests):
                t0 = time.perf_counter()
                r = post(url + "/v1/completions", dict(body, glimmer={"mode": mode}))
                times.append(time.perf_counter() - t0)
                texts.add(r["choices"][0]["text"])
                n = r["usage"]["completion_tokens"]
            res[mode] = {"tok_s_best": n / min(times), "tok_s_median": n / sorted(times)[len(times) // 2],
                         "tokens": n, "text": texts.pop() if len(texts) == 1 else None}
    finally:
        if setup == "1 process":
            proc.send_signal(signal.SIGINT)
        else:
            pids = rank_pids(proc.pid)
            if 0 in pids:
                os.kill(pids[0], signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            kill_launch(proc)
    return res


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "benchmarks/results/issue25-serve-distributed.json"
    setups = ["1 process", "2 ranks tp", "2 ranks pp"]
    results = {s: run(s, requests) for s in setups}
    print(f"{'setup':<12}" + "".join(f"{m + ' tok/s':>14}" for m in MODES) + "  same text")
    for s in setups:
        same = all(results[s][m]["text"] == results[setups[0]][m]["text"] is not None for m in MODES)
        print(f"{s:<12}" + "".join(f"{results[s][m]['tok_s_best']:>14.1f}" for m in MODES) + f"  {same}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out.write_text(json.dumps({"commit": commit.strip(), "machine": "2 CPU cores, MLX CPU backend, OpenBLAS (1 thread "
                               "per rank)", "load_average": os.getloadavg(), "requests": requests,
                               "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
