# Sourced by the device scripts (issue20_24.sh, batch_trace.sh, first_calls.sh) from the repository root on a lent
# NVIDIA H200: installs MLX with its CUDA back-end from .dev/ (benchmarks/device/mlx_cuda_slim.py's files) into
# /tmp/site, restores the embedded weights packed by planes.py (.dev/emb), and exports PYTHONPATH and a calibration
# cache folder.
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/mlx-*.whl .dev/mlx_lm-*.whl || exit 3
tar -xJf .dev/rest.tar.xz -C /tmp/site && xz -dc .dev/libmlx.sm90.so.xz > /tmp/site/mlx/lib/libmlx.so || exit 4
ln -sfn "$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")" /tmp/site/nvidia
python3 benchmarks/device/planes.py unpack .dev/emb > /dev/null || exit 5
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GLIMMER_MLX_CACHE_DIR=/tmp/gcache
