#!/usr/bin/env bash
# The decoding measurements of RESULTS.md's "Decoding on an H100" in one go, on one quiet GPU (~6 minutes):
# the row kernels at decoding sizes, the graphed step under bf16 autocast beside the SSM mixers' torch loops, the
# graphed step of a bf16 copy of each model, both compiled by inductor, and the eager step's kernel profile.
#
#   bash benchmarks/gpu_decode_suite.sh OUT_DIR        # one log per measurement in OUT_DIR, the tables printed
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_decode_suite.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
variants=("transformer matched" "h1 fw-1A" "h1 mamba2")
decode=(python benchmarks/gpu_model.py --lengths --contexts 4096 --decode-steps 32 --variants "${variants[@]}")

python benchmarks/gpu_row_norms.py --rows 1 16 64 256 4096 > "$out/row_kernels.log" 2>&1
"${decode[@]}" --decode-batches 1 64 --graph --torch-steps > "$out/graphed.log" 2>&1
"${decode[@]}" --decode-batches 1 64 --graph --decode-dtype bfloat16 > "$out/graphed_bf16.log" 2>&1
"${decode[@]}" --decode-batches 1 --graph --compile-decode > "$out/compiled.log" 2>&1
"${decode[@]}" --decode-batches 1 --graph --compile-decode --decode-dtype bfloat16 > "$out/compiled_bf16.log" 2>&1
"${decode[@]}" --decode-batches 1 --decode-steps 4 --profile-decode --decode-dtype bfloat16 > "$out/profile_bf16.log" 2>&1
for log in row_kernels graphed graphed_bf16 compiled compiled_bf16; do
    echo "## $log"
    grep "^|" "$out/$log.log" | grep -v "rows x T"
done
grep -h "kernel launches per call" "$out/profile_bf16.log"
