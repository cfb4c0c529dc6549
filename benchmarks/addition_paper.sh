#!/usr/bin/env bash
# The fast-weight paper's Table 3 under its own protocol: every row x 3 seeds on one GPU.
#
#   PER_DEVICE=4 bash benchmarks/addition_paper.sh          # until every run is done (~80 GPU-minutes on an H200:
#                                                           # four side by side took ~900 s each)
#   MODELS=fw-1A.2,fw-3A.3 SEEDS=1 PER_DEVICE=2 bash benchmarks/addition_paper.sh   # some rows, seed 0 only
#   ONCE=1 BUDGET=480 bash benchmarks/addition_paper.sh     # one invocation that stops itself within ~9 minutes
#
# Runs, report and figures go to $ADDITION_OUT (default runs/addition_paper: ignored by git, so it stays on the
# machine between invocations). The bench is resumable: a run stopped by the time budget saved a checkpoint and the
# next invocation continues it (a checkpoint of an lm130m run is ~1.5 GB: keep the same machine until it finishes);
# finished runs (runs/<key>.json) are reused. Exit status: 0 all done, 75 runs left (invoke again), others: failure.
# The estimate of the GPU time and the protocol's choices: hybridlm/experiments/README.md ("Protocol paper").
set -u
cd "$(dirname "$0")/.."

ADDITION_OUT=${ADDITION_OUT:-runs/addition_paper}
MODELS=${MODELS:-transformer,retnet,mamba2,fw-1A.1,fw-1A.2,fw-1A.3,fw-3A.3}  # the paper's rows, in its order
SEEDS=${SEEDS:-3}
BUDGET=${BUDGET:-1800}  # seconds per invocation before the running runs checkpoint and stop
PER_DEVICE=${PER_DEVICE:-1}  # runs side by side on the GPU (3 keep an H200 busy at this size)
PYTHON=${PYTHON:-python}

run_once() {
    timeout --signal=TERM $((BUDGET + 120)) "$PYTHON" -m hybridlm.cli bench addition --protocol paper --compile \
        --models "$MODELS" --seeds "$SEEDS" --device cuda:0 --per-device "$PER_DEVICE" --time-budget "$BUDGET" \
        --out "$ADDITION_OUT"
}

if [ -n "${ONCE:-}" ]; then
    run_once
    exit $?
fi
until run_once; status=$?; [ "$status" -ne 75 ]; do :; done
exit "$status"
