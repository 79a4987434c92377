"""The server under load in one process (issue 24): a GlimmerServer on the embedded model and the bench's own load
generator (`bench.serve.run_level`), each level N run ar, auto, auto, ar (2 requests per client, 64 tokens, greedy);
prints each run's aggregate tok/s and how many of the batch's steps auto made speculative. (The client threads share
the process with the server: absolute figures are below `glimmer bench serve`'s; compare within a level.)

    python benchmarks/serve_inprocess_ab.py 1,4,8,16
"""
import threading, sys
import ab_setup  # noqa: F401  (sets GLIMMER_MLX_AUTO_LEARNED=off: every auto here starts cold)
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.bench.serve import run_level
from glimmer_mlx.serve import GlimmerServer
from glimmer_mlx.session import load_session
session = load_session(None)
server = GlimmerServer(session, port=0, quiet=True, mode="ar")
server.start_http()
stop = threading.Event()
th = threading.Thread(target=server.run_jobs, kwargs={"until": stop}, daemon=True); th.start()
P = load_prompts()
ba = session.drafters.batch_auto()
for mode in ("ar", "auto"):
    run_level("127.0.0.1", server.port, 8, 1, P, max_tokens=8, mode=mode)
res = {"ar": [], "auto": []}
for N in [int(x) for x in sys.argv[1].split(",")]:
    for mode in ("ar", "auto", "auto", "ar"):
        before = dict(ba.steps)
        lv = run_level("127.0.0.1", server.port, N, 2, P, max_tokens=64, mode=mode)
        res[mode].append(lv["aggregate_tps"])
        print(N, mode, "agg %.1f" % lv["aggregate_tps"], "spec steps", ba.steps["spec"] - before["spec"], flush=True)
stop.set(); server.shutdown()
