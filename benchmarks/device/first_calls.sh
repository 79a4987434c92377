#!/bin/bash
# A shape's first forward vs its second under MLX's CUDA back-end on a lent NVIDIA H200 (benchmarks/first_calls.py),
# the embedded model and the trained tiny set (.dev/pair), each in a fresh process. Set-up: setup.sh.
#   device run: bash benchmarks/device/first_calls.sh   (carry: .dev)
cd "$(dirname "$0")/../.."
source benchmarks/device/setup.sh
echo "== embedded"; timeout 80 python3 benchmarks/first_calls.py 2>&1 | grep -v "^no --"
echo "== tiny set"; TREE_SET=.dev/pair timeout 80 python3 benchmarks/first_calls.py 2>&1
