"""Where a served auto's time goes against plain batching (issue 24): one GlimmerServer on the embedded model in this
process (its auto cold: `ab_setup`), its load from the bench's own load generator (`bench.serve.run_requests`) in a
client process of its own per pass — as `glimmer bench serve` runs it, the server's process holds the GIL alone —
N clients, R requests each per pass (64 tokens, greedy), PASSES passes with the modes in alternated order
(A B C, C B A, ...). Prints each mode's aggregate tok/s over ar's, and the batch's steps of each mode by kind —
rows, plain or speculative, whether a prefill ran before it, whether it was queued behind the step before it
(`chained`) and the next behind it (`queued`) — with their median and summed seconds (`BatchGenerator.step_seconds`),
and what the steps where an auto row drafted took against their committed tokens as plain steps of as many rows:
a mode's loss splits into its plain steps' own cost and what its speculative steps and the steps after them took.

Modes: ar, ar2 (plain again: an A/A control), auto; variants of auto, patched on the server's batch chooser for
their passes only: quiet (auto rows never drafting, carrying n-gram lookup only: the rows' bookkeeping alone),
ngauto (auto rows carrying n-gram lookup only), noexplore (auto that never explores a model drafter).

    python benchmarks/serve_steps_ab.py N R PASSES MODES        e.g. 2 24 4 ar,ar2,auto
"""
import collections
import json
import statistics
import subprocess
import sys
import threading

import ab_setup  # noqa: F401  (GLIMMER_MLX_AUTO_LEARNED=off: the server's auto starts cold)

from glimmer_mlx.bench.serve import run_requests, summarize
from glimmer_mlx.bench.settings import load_prompts

if sys.argv[1:2] == ["--client"]:  # one pass of load: port mode N R first_round max_tokens
    port, mode, n, r, first, tokens = sys.argv[2:8]
    recs = run_requests("127.0.0.1", int(port), int(n), int(r), load_prompts(), max_tokens=int(tokens), mode=mode,
                        first_round=int(first))
    s = summarize(recs, int(n))
    print(json.dumps({"tps": s["aggregate_tps"], "errors": s["errors"]}))
    raise SystemExit(0)

from glimmer_mlx.serve import GlimmerServer  # noqa: E402
from glimmer_mlx.session import load_session  # noqa: E402
from glimmer_mlx.speculative import batch as B  # noqa: E402
from glimmer_mlx.speculative.auto import batch as AB  # noqa: E402

N, R, PASSES, MODES = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
VARIANTS = ("quiet", "ngauto", "noexplore")
if "ar" not in MODES or set(MODES) - {"ar", "ar2", "auto", *VARIANTS}:
    raise SystemExit(f"modes: ar and any of ar2, auto, {', '.join(VARIANTS)}")
current = ["warm-up"]
choose, carries, explore, observe = (AB.BatchAuto.choose, AB.BatchAuto.carries, AB.BatchAuto.explore,
                                     B.BatchGenerator._observe)
AB.BatchAuto.choose = lambda self, rows, *a: (
    (0, [(None, 0)] * len(rows)) if current[0] == "quiet" else choose(self, rows, *a))
AB.BatchAuto.carries = lambda self, *a, **k: (
    False if current[0] in ("quiet", "ngauto") else carries(self, *a, **k))
AB.BatchAuto.explore = lambda self, *a, **k: None if current[0] == "noexplore" else explore(self, *a, **k)
steps = collections.defaultdict(list)  # (mode, kind) -> seconds of each step
spec = collections.defaultdict(list)  # (mode, rows) -> (seconds, tokens committed) of each speculative step


def noted_observe(self, st, rows, L, now, committed, queued):
    kind = (rows, "spec" if L > 1 else "plain", "prefill" if self._prefilling > 0 else "",
            "chained" if st.chained else "", "queued" if queued else "")
    seconds = self.step_seconds(st, now)
    steps[(current[0], kind)].append(seconds)
    if L > 1 and committed is not None:
        spec[(current[0], rows)].append((seconds, committed))
    return observe(self, st, rows, L, now, committed, queued)


B.BatchGenerator._observe = noted_observe
server = GlimmerServer(load_session(None), port=0, quiet=True, mode="ar")
server.start_http()
stop = threading.Event()
threading.Thread(target=server.run_jobs, kwargs={"until": stop}, daemon=True).start()


def load(mode: str, rounds: int, first: int, tokens: int = 64) -> dict:
    sent = "ar" if mode.startswith("ar") else "auto"
    out = subprocess.run([sys.executable, __file__, "--client", str(server.port), sent, str(N), str(rounds),
                          str(first), str(tokens)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


for mode in ("auto", "ar"):  # every prompt the passes use, once (1 token): auto's first, as the bench warms them
    load(mode, R * PASSES, 0, tokens=1)
tps = collections.defaultdict(list)
try:
    for p in range(PASSES):
        for mode in MODES if p % 2 == 0 else MODES[::-1]:
            current[0] = mode
            got = load(mode, R, p * R)
            current[0] = "between"
            if got["errors"]:
                raise SystemExit(f"{mode}: {got['errors']} requests failed")
            tps[mode].append(got["tps"])
        print(f"pass {p}: " + " ".join(f"{m} {tps[m][-1]:.1f}" for m in MODES), flush=True)
finally:
    stop.set()
    server.shutdown()
for mode in MODES:
    per = [b / a for a, b in zip(tps["ar"], tps[mode])]
    ratio = statistics.mean(tps[mode]) / statistics.mean(tps["ar"])
    print(f"{mode:9s} {statistics.mean(tps[mode]):6.1f} tok/s; ÷ ar {ratio:.3f} "
          f"(passes {', '.join(f'{x:.2f}' for x in per)})")
for mode in MODES:
    mine = {k[1]: v for k, v in steps.items() if k[0] == mode}
    print(f"{mode}: {sum(len(v) for v in mine.values())} steps, {sum(sum(v) for v in mine.values()):.2f} s")
    for kind, v in sorted(mine.items(), key=lambda kv: -sum(kv[1])):
        if len(v) >= 5 or kind[1] == "spec":
            rows, what, *how = kind
            print(f"  {rows} rows {what:5s} {' '.join(h for h in how if h) or '-':24s} {len(v):5d} steps, median "
                  f"{1e3 * statistics.median(v):6.2f} ms, {sum(v):6.2f} s")
    for rows in sorted({r for m, r in spec if m == mode}):
        v = spec[(mode, rows)]
        plain = mine.get((rows, "plain", "", "chained", "queued"))  # the steady plain step: no prefill before it
        if plain:
            step = statistics.median(plain)
            took, tokens = sum(s for s, _ in v), sum(n for _, n in v)
            print(f"  {rows} rows: {len(v)} drafting steps took {took:.2f} s for {tokens} tokens, as plain steps "
                  f"{tokens / rows * step:.2f} s (the plain steps after them, their wake, are in the table above)")
print("auto's counts:", server.worker.auto_counts())
