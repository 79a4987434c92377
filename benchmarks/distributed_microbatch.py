"""Micro-batched pipeline verify (issue 25): measured on this machine, projected for two Macs.

`python benchmarks/distributed_microbatch.py [OUT.json]` launches itself on 2 ranks (`mlx.launch -n 2 --backend ring`,
--distributed pp, the embedded target) and, for --pp-microbatch 1 / 2 / 4 in the same run, times (a) one verify
forward of 16 rows after a 64-token context (median of 10), (b) one 256-row prefill chunk, (c) DFlash and plain
decoding tok/s (64 tokens greedy; plain decoding feeds one row: nothing to split, a control), interleaved over 3
sittings (best of each), checking the tokens equal the unsplit run's. Then it prints the
on-paper projection for Muse Glimmer 4-bit over two M-series Macs (`projection`): per stage, a forward of R rows
takes max(weight bytes / memory bandwidth, 2·params·R / FLOP rate), each micro-batch re-reads the stage's weights,
and a hand-over costs the link's per-message latency plus bytes / bandwidth (`info.LINKS`); with S stages and M
micro-batches the wavefront takes M + S − 1 ticks of the slowest micro-batch's stage time plus its hand-overs.

Why one machine gains nothing: both ranks share the same 2 CPU cores (and one memory bus), so stage s + 1 working on
micro-batch m − 1 while stage s works on m only splits the same cores between them; the split adds one evaluation and
one hand-over per micro-batch and shrinks every matrix product."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MICRO = (1, 2, 4)

# two M-series Macs (stated assumptions, not measurements): M4 Max class memory bandwidth and GPU FLOP rate as a
# fraction of peak that quantized GEMMs reach; the link from info.LINKS
MAC = {"name": "M4 Max class (546 GB/s, 17 TFLOP/s peak, 60% reached by 4-bit GEMMs)", "bandwidth": 546e9,
       "flops": 17e12 * 0.6}


def worker(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx

    from glimmer_mlx.distributed import expose_taps, init_group, load_sharded
    from glimmer_mlx.embedded import embedded_path
    from glimmer_mlx.generate import generate
    from glimmer_mlx.strategy import load_drafters

    g = init_group()
    res = {"rank": g.rank()}
    ids = [11 + (7 * i) % 400 for i in range(64)]
    models = {}
    for mb in MICRO:
        m, tok = load_sharded(embedded_path("target"), g, strategy="pp", microbatch=mb)
        d = load_drafters(m, embedded=True)
        expose_taps(m, d.dflash.taps + d.mtp.taps)
        models[mb] = m, d
        res[str(mb)] = {"verify16_ms": [], "prefill256_ms": [], "ar_tok_s": [], "dflash_tok_s": []}
    prompt = tok.encode("def fibonacci(n):")
    for rep in range(3):  # interleaved, best of 3 sittings each: the machine is shared and its load varies
        for mb in MICRO:
            m, d = models[mb]
            r = res[str(mb)]
            verify = []
            for _ in range(12):
                c = m.make_cache()
                mx.eval(m(mx.array([ids]), c))
                t0 = time.perf_counter()
                mx.eval(m(mx.array([ids[:16]]), c))
                verify.append(time.perf_counter() - t0)
            r["verify16_ms"].append(statistics.median(verify[2:]) * 1e3)
            c = m.make_cache()
            t0 = time.perf_counter()
            mx.eval(m(mx.array([[11 + (7 * i) % 400 for i in range(256)]]), c))
            r["prefill256_ms"].append((time.perf_counter() - t0) * 1e3)
            for mode, dr in (("ar", None), ("dflash", d.dflash)):
                generate(m, prompt, max_tokens=4, drafter=dr)
                g_ = generate(m, prompt, max_tokens=64, drafter=dr)
                r[f"{mode}_tok_s"].append(g_.stats.generation_tps)
                r[f"{mode}_tokens"] = g_.tokens
    for mb in MICRO:
        r = res[str(mb)]
        for k in ("verify16_ms", "prefill256_ms"):
            r[k] = min(r[k])
        for k in ("ar_tok_s", "dflash_tok_s"):
            r[k] = max(r[k])
    (out / f"rank{g.rank()}.json").write_text(json.dumps(res))


def projection(rows: int, micro: int, *, stages: int = 2, link: str = "tb5") -> dict:
    """Seconds for one forward of `rows` rows through Muse Glimmer 4-bit split over `stages` Macs, unsplit or in
    `micro` micro-batches (the model in the module docstring; weights and hand-over bytes from info.distributed_plan)."""
    from glimmer_mlx.info import LINKS, distributed_plan

    plan = distributed_plan(hosts=stages, strategy="pp", link=link, drafter=None)
    w = max(r["target_split_bytes"] for r in plan["ranks"])  # a stage's weight bytes
    params = w * 2  # 4-bit: two parameters per byte (scales and biases ignored)
    lk = LINKS[link]
    D = 6656
    sizes = [rows // micro + (i < rows % micro) for i in range(micro)]
    stage = max(w / MAC["bandwidth"], 2 * params * max(sizes) / MAC["flops"])
    hand = lk["latency_us"] * 1e-6 + max(sizes) * D * 2 * 8 / (lk["gbps"] * 1e9)
    ticks = micro + stages - 1
    return {"rows": rows, "micro": micro, "stage_ms": stage * 1e3, "handover_ms": hand * 1e3,
            "seconds": ticks * (stage + hand)}


def main() -> None:
    out_json = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks/results/issue25-pp-microbatch.json"
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"mb-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([launch, "-n", "2", "--backend", "ring", "--", sys.executable, __file__, "worker", str(tmp)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        sys.exit(f"mlx.launch failed ({r.returncode}):\n{r.stderr[-2000:]}")
    ranks = [json.loads((tmp / f"rank{i}.json").read_text()) for i in range(2)]
    base = ranks[0]["1"]
    print("measured here (2 ranks on one 2-core machine, --distributed pp, embedded target), rank 0:")
    print(f"{'micro':>5} {'verify16 ms':>12} {'prefill256 ms':>14} {'ar tok/s':>9} {'dflash tok/s':>13} same")
    for mb in MICRO:
        x = ranks[0][str(mb)]
        same = all(x[k] == base[k] for k in ("ar_tokens", "dflash_tokens"))
        print(f"{mb:>5} {x['verify16_ms']:>12.2f} {x['prefill256_ms']:>14.1f} {x['ar_tok_s']:>9.1f} "
              f"{x['dflash_tok_s']:>13.1f} {same}")
    proj = [projection(rows, mb) for rows in (8, 16, 512) for mb in (1, 2, 4)]
    print(f"\nprojected, Muse Glimmer 4-bit on two Macs over Thunderbolt 5 (TCP), {MAC['name']}:")
    print(f"{'rows':>5} {'micro':>5} {'stage ms':>9} {'hand-over ms':>13} {'forward ms':>11} {'vs unsplit':>10}")
    for p in proj:
        ref = next(q for q in proj if q["rows"] == p["rows"] and q["micro"] == 1)
        print(f"{p['rows']:>5} {p['micro']:>5} {p['stage_ms']:>9.2f} {p['handover_ms']:>13.3f} "
              f"{p['seconds'] * 1e3:>11.2f} {ref['seconds'] / p['seconds']:>9.2f}x")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    for x in ranks:
        for mb in MICRO:
            for k in ("ar_tokens", "dflash_tokens"):
                x[str(mb)].pop(k)
    out_json.write_text(json.dumps({"commit": commit.strip(), "machine": "2 CPU cores, MLX CPU backend, OpenBLAS",
                                    "load_average": os.getloadavg(), "ranks": ranks, "mac_assumptions": MAC,
                                    "projection": proj}, indent=1))
    print(f"\nwrote {out_json}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(Path(sys.argv[2]))
    else:
        main()
