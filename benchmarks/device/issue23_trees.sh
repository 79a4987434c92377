#!/bin/bash
# Issue 23 on a lent NVIDIA H200 (the workplace's `device` run): MLX's CUDA back-end (benchmarks/device/
# mlx_cuda_slim.py's files in .dev/) runs benchmarks/tree_dflash.py on the trained tiny set (.dev/pair, from
# benchmarks/bench_tiny_set.py) and on the embedded model with its v1 DFlash drafter. Results under $OUT.
# The working tree travels only under 64 MiB: for the call, move benchmarks/results and the embedded
# glimmer-tiny-dflash2 and glimmer-tiny-mtp folders out of it (and back after).
#   device run: TINY_N=2 EMB_N=1 bash benchmarks/device/issue23_trees.sh   (carry: .dev)
cd "$(dirname "$0")/../.."
T0=$(date +%s)
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/mlx-*.whl .dev/mlx_lm-*.whl || exit 3
tar -xJf .dev/rest.tar.xz -C /tmp/site && xz -dc .dev/libmlx.sm90.so.xz > /tmp/site/mlx/lib/libmlx.so || exit 4
NV=$(python3 -c "import nvidia, os; print(list(nvidia.__path__)[0])")
ln -sfn "$NV" /tmp/site/nvidia
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "setup $(( $(date +%s) - T0 )) s; nvidia at $NV"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
python3 - <<'PY' 2>&1 | tee $OUT/sanity.log
import time, mlx.core as mx
print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available(), "metal", mx.metal.is_available())
a = mx.random.normal((4096, 4096)); mx.eval(a @ a)
t = time.perf_counter(); [mx.eval(a @ a) for _ in range(10)]; dt = (time.perf_counter() - t) / 10
print(f"fp32 4096^3 matmul {dt*1e3:.2f} ms = {2*4096**3/dt/1e12:.1f} TFLOP/s")
PY
echo "sanity done $(( $(date +%s) - T0 )) s"
timeout ${TINY_S:-200} env TREE_SET=.dev/pair TREE_OUT=$OUT/issue23-cuda-tiny-set.json python3 benchmarks/tree_dflash.py ${TINY_N:-2} 96 2>&1 | tee $OUT/tiny.log | grep -v "^T=" 
echo "tiny done $(( $(date +%s) - T0 )) s"
[ "${EMB_N:-1}" = 0 ] || timeout ${EMB_S:-240} env TREE_DRAFTER=v1 TREE_OUT=$OUT/issue23-cuda-embedded-v1.json python3 benchmarks/tree_dflash.py ${EMB_N:-1} 96 2>&1 | tee $OUT/emb.log | grep -v "^T="
echo "all done $(( $(date +%s) - T0 )) s"
