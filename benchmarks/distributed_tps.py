import sys, resource, json
import mlx.core as mx
from glimmer_mlx.embedded import embedded_path
from glimmer_mlx.generate import generate
from glimmer_mlx.strategy import load_drafters
dist = len(sys.argv) > 1
mx.reset_peak_memory()
if dist:
    from glimmer_mlx.distributed import init_group, load_sharded, local_weight_bytes
    g = init_group(); m, tok = load_sharded(embedded_path("target"), g, strategy=sys.argv[1]); r = g.rank()
else:
    from glimmer_mlx import load
    from glimmer_mlx.distributed import local_weight_bytes
    m, tok = load(embedded_path("target")); r = 0
w, peak = local_weight_bytes(m), mx.get_peak_memory()
d = load_drafters(m, embedded=True)
if dist:
    from glimmer_mlx.distributed import expose_taps; expose_taps(m, d.dflash.taps + d.mtp.taps)
ids = tok.encode("Once upon a time, in a small village by the sea, there lived")
out = {"rank": r, "weights": w, "load_peak": peak}
for mode, dr in (("ar", None), ("dflash", d.dflash), ("mtp", d.mtp)):
    generate(m, ids, max_tokens=4, drafter=dr)
    res = generate(m, ids, max_tokens=48, drafter=dr)
    out[mode] = round(res.stats.generation_tps, 1), len(res.tokens)
out["maxrss_MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out), flush=True)
