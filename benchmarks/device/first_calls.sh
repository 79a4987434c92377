#!/bin/bash
# A shape's first forward vs its second under MLX's CUDA back-end on a lent NVIDIA H200 (benchmarks/first_calls.py),
# the embedded model and the trained tiny set (.dev/pair), each in a fresh process. Set-up and packing as
# issue20_24.sh.   device run: bash benchmarks/device/first_calls.sh   (carry: .dev)
cd "$(dirname "$0")/../.."
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/mlx-*.whl .dev/mlx_lm-*.whl || exit 3
tar -xJf .dev/rest.tar.xz -C /tmp/site && xz -dc .dev/libmlx.sm90.so.xz > /tmp/site/mlx/lib/libmlx.so || exit 4
ln -sfn "$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")" /tmp/site/nvidia
python3 benchmarks/device/planes.py unpack .dev/emb > /dev/null || exit 5
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GLIMMER_MLX_CACHE_DIR=/tmp/gcache
echo "== embedded"; timeout 80 python3 benchmarks/first_calls.py 2>&1 | grep -v "^no --"
echo "== tiny set"; TREE_SET=.dev/pair timeout 80 python3 benchmarks/first_calls.py 2>&1
