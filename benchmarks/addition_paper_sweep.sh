#!/usr/bin/env bash
# The paper protocol's silent choices (batch, peak learning rate), swept side by side on one GPU.
#
#   BUDGET=420 bash benchmarks/addition_paper_sweep.sh          # every setting below, one seed, stop within ~8 min
#   SETTINGS="lm130m 3e-4 256" bash benchmarks/addition_paper_sweep.sh
#   SETTINGS="small 1e-3 480 1024" bash benchmarks/addition_paper_sweep.sh   # 480 packed rows of 1024 tokens
#
# The paper states widths uniform in 1..32 from the first update, lr 1e-3 and the 124M-130M shape, and not the batch
# or the warmup. Each line of $SETTINGS is "size lr batch [pack_length]": one `hybridlm bench addition --protocol
# paper` over $MODELS (one seed) into $SWEEP_OUT/<size>_lr<lr>_b<batch>[_pack<L>], all settings at once; with a
# pack length the batch counts rows of that many tokens packed with whole examples (--pack-length). Every setting is
# resumable like addition_paper.sh (run it again on the same machine to continue); exit status 0 once all are done.
set -u
cd "$(dirname "$0")/.."

SWEEP_OUT=${SWEEP_OUT:-runs/addition_paper_sweep}
MODELS=${MODELS:-transformer,fw-1A.3}
STEPS=${STEPS:-2000}
BUDGET=${BUDGET:-1800}
PYTHON=${PYTHON:-python}
# --compile for padded batches; packed ones train eagerly (their document count, so their shapes, change per update)
COMPILE=${COMPILE---compile}
SETTINGS=${SETTINGS:-"small 1e-3 256
small 3e-4 256
small 1e-4 256
small 1e-3 1024
small 3e-4 1024"}

pids=()
while read -r size lr batch pack; do
    [ -z "$size" ] && continue
    out="$SWEEP_OUT/${size}_lr${lr}_b${batch}${pack:+_pack$pack}"
    mkdir -p "$out"
    compile=$COMPILE
    [ -n "${pack:-}" ] && compile=
    timeout --signal=TERM $((BUDGET + 120)) "$PYTHON" -m hybridlm.cli bench addition --protocol paper $compile \
        --models "$MODELS" --seeds 1 --size "$size" --lr "$lr" --batch-size "$batch" --steps "$STEPS" \
        --pack-length "${pack:-0}" --eval-per-width 64 --device cuda:0 --per-device 2 --time-budget "$BUDGET" \
        --out "$out" \
        >"$out/bench.log" 2>&1 &
    pids+=($!)
done <<<"$SETTINGS"

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
