import sys, resource, json, time
import mlx.core as mx
from glimmer_mlx.distributed import local_weight_bytes
path = sys.argv[1]
t = time.perf_counter()
if len(sys.argv) > 2:
    from glimmer_mlx.distributed import init_group, load_sharded
    g = init_group(); m, _ = load_sharded(path, g); r = g.rank()
else:
    from glimmer_mlx import load
    m, _ = load(path); r = 0
dt = time.perf_counter() - t
print(json.dumps({"rank": r, "weights_MiB": local_weight_bytes(m) / 2**20, "mlx_peak_MiB": mx.get_peak_memory() / 2**20,
                  "maxrss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "load_s": round(dt, 2)}), flush=True)
