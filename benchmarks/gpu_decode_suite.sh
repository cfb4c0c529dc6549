#!/usr/bin/env bash
# The decoding checks and measurements of RESULTS.md's "Decoding on an H100", on one quiet GPU, in four parts that
# each fit one device call: `tests` (~4 minutes warm, up to 8 on a cold machine that compiles every kernel: the step
# kernels, the fast-weight mixer's one-kernel step, the rotation into the cache, the inference norm, the states
# written in place under CUDA graphs, eager and compiled, fused projections, and the serving engine's graphs) and
# `timings` (~6 minutes: the row kernels at decoding sizes, the graphed step under bf16 autocast beside the SSM
# mixers' torch loops, the graphed step of a bf16 copy of each model, both compiled by inductor, and the eager step's
# kernel profile); `fused` (~3 minutes: the graphed bf16 step with its projections apart, then fused as serve, generate
# and chat load a model); `fold` (~4 minutes: the falcon-h1-0.5b shape's graphed step with its muP multipliers kept,
# folded into the weights, then folded with the projections fused); `concurrent` (~3 minutes: the graphed bf16 step
# fused as serve, generate and chat load a model, each hybrid also with its SSM halves on a side stream, at 4K and
# 16K of context, then the falcon-h1-0.5b shape's the same way at 4K).
#
#   bash benchmarks/gpu_decode_suite.sh OUT_DIR tests      # one log per step in OUT_DIR, the summaries printed
#   bash benchmarks/gpu_decode_suite.sh OUT_DIR timings
#   bash benchmarks/gpu_decode_suite.sh OUT_DIR fused
#   bash benchmarks/gpu_decode_suite.sh OUT_DIR fold
#   bash benchmarks/gpu_decode_suite.sh OUT_DIR concurrent
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_decode_suite.sh OUT_DIR tests|timings|fused|fold|concurrent}
part=${2:?usage: gpu_decode_suite.sh OUT_DIR tests|timings|fused|fold|concurrent}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
variants=("transformer matched" "h1 fw-1A" "h1 mamba2")
decode=(python benchmarks/gpu_model.py --lengths --contexts 4096 --decode-steps 32 --variants "${variants[@]}")

case $part in
tests)
    timeout 540 python -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_decoding_steps.py \
        tests/ops/test_short_conv_triton.py tests/ops/test_rotary_triton.py tests/ops/test_rms_norm_triton.py \
        tests/inference/test_generate.py \
        tests/serving/test_graphed_cuda.py tests/layers/test_fast_weight_mixer.py tests/layers/test_mamba2.py \
        > "$out/tests.log" 2>&1
    tail -n 25 "$out/tests.log"
    ;;
timings)
    python benchmarks/gpu_row_norms.py --rows 1 16 64 256 4096 > "$out/row_kernels.log" 2>&1
    "${decode[@]}" --decode-batches 1 64 --graph --torch-steps > "$out/graphed.log" 2>&1
    "${decode[@]}" --decode-batches 1 64 --graph --decode-dtype bfloat16 > "$out/graphed_bf16.log" 2>&1
    "${decode[@]}" --decode-batches 1 --graph --compile-decode > "$out/compiled.log" 2>&1
    "${decode[@]}" --decode-batches 1 --graph --compile-decode --decode-dtype bfloat16 > "$out/compiled_bf16.log" 2>&1
    "${decode[@]}" --decode-batches 1 --decode-steps 4 --profile-decode --decode-dtype bfloat16 \
        > "$out/profile_bf16.log" 2>&1
    for log in row_kernels graphed graphed_bf16 compiled compiled_bf16; do
        echo "## $log"
        grep "^|" "$out/$log.log" | grep -v "rows x T"
    done
    grep -h "kernel launches per call" "$out/profile_bf16.log"
    ;;
fused)
    "${decode[@]}" --decode-batches 1 64 --graph --decode-dtype bfloat16 > "$out/apart_bf16.log" 2>&1
    "${decode[@]}" --decode-batches 1 64 --graph --decode-dtype bfloat16 --fuse-projections \
        > "$out/fused_bf16.log" 2>&1
    for log in apart_bf16 fused_bf16; do
        echo "## $log"
        grep "^|" "$out/$log.log"
    done
    ;;
fold)
    # the falcon-h1-0.5b shape carries Falcon-H1's muP multipliers: its graphed bf16 step, multipliers kept and folded
    h1=(python benchmarks/gpu_model.py --preset falcon-h1-0.5b --lengths --contexts 4096 --decode-steps 32
        --variants "${variants[@]}" --decode-batches 1 --graph --decode-dtype bfloat16)
    "${h1[@]}" > "$out/h1_kept.log" 2>&1
    "${h1[@]}" --fold-multipliers > "$out/h1_folded.log" 2>&1
    "${h1[@]}" --fold-multipliers --fuse-projections > "$out/h1_fused.log" 2>&1
    for log in h1_kept h1_folded h1_fused; do
        echo "## $log"
        grep "^|" "$out/$log.log"
    done
    ;;
concurrent)
    python benchmarks/gpu_model.py --lengths --contexts 4096 16384 --decode-steps 32 --variants "${variants[@]}" \
        --decode-batches 1 8 64 --graph --decode-dtype bfloat16 --fuse-projections --concurrent-mixers \
        > "$out/concurrent_bf16.log" 2>&1
    python benchmarks/gpu_model.py --preset falcon-h1-0.5b --lengths --contexts 4096 --decode-steps 32 \
        --variants "${variants[@]}" --decode-batches 1 --graph --decode-dtype bfloat16 --fold-multipliers \
        --fuse-projections --concurrent-mixers > "$out/h1_concurrent.log" 2>&1
    for log in concurrent_bf16 h1_concurrent; do
        echo "## $log"
        grep "^|" "$out/$log.log"
    done
    ;;
*)
    echo "gpu_decode_suite.sh: the part is 'tests', 'timings', 'fused', 'fold' or 'concurrent', not '$part'" >&2
    exit 2
    ;;
esac
