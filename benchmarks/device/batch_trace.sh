#!/bin/bash
# Issue 24 on a lent NVIDIA H200: what the batch's auto chooser decides step by step (benchmarks/batch_auto_trace.py)
# at N = 1 and 4 rows, with ar and DFlash rows as the same-run baselines, then `glimmer bench serve` (ours: ar and
# auto; mlx-lm's server). Set-up: setup.sh; results under $OUT (the serve folder as one archive).
#   device run: bash benchmarks/device/batch_trace.sh   (carry: .dev)
cd "$(dirname "$0")/../.."
T0=$(date +%s)
source benchmarks/device/setup.sh
echo "setup $(( $(date +%s) - T0 )) s"
for N in ${TRACE_NS:-1 4}; do
    timeout ${TRACE_S:-60} python3 benchmarks/batch_auto_trace.py $N ${TRACE_RUNS:-8} $OUT/trace$N.json 2>&1 | grep --line-buffered -v "^no --"
    echo "N=$N done $(( $(date +%s) - T0 )) s"
done
[ "${SERVE_S:-0}" = 0 ] || {
    timeout $SERVE_S python3 -m glimmer_mlx.cli bench serve --clients 1,2,4,8,16 --modes ${SERVE_MODES:-ar,auto,mlx-lm} \
        --requests 4 --max-tokens 64 --out $OUT/serve > $OUT/serve.log 2>&1; echo "serve rc $?"
    grep -v "^no --" $OUT/serve.log | tail -30
    tar -czf $OUT/serve.tgz -C $OUT serve serve.log && rm -rf $OUT/serve $OUT/serve.log
    echo "serve done $(( $(date +%s) - T0 )) s"
}
