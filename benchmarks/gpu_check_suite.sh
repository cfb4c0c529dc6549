#!/usr/bin/env bash
# The GPU checks that CPU runs cannot make, on one quiet GPU, in parts that each fit one device call: `tests`
# (~8 minutes: the kernel tests whose GPU paths the interpreter only emulates: RoPE's backward, the sequential
# passes, the decoding steps, the autotuner, the recomputed mixers), `timings` (~5 minutes: the SSD's state pass;
# training at the 125m and falcon-h1-0.5b shapes, eager, with the update's profile) and `kernels` (~8 minutes: the
# fast-weight rules 2A, 3 and 2 timed against the chunk path; with FLA_WHEELS, a folder
# holding the fla 0.6 and einops wheels, rule 1 against fla's delta rule: accuracy against float64, then time).
# The decoding timings are `gpu_decode_suite.sh`'s.
#
#   bash benchmarks/gpu_check_suite.sh OUT_DIR tests      # one log per step in OUT_DIR, the summaries printed
#   bash benchmarks/gpu_check_suite.sh OUT_DIR timings
#   FLA_WHEELS=wheels/ bash benchmarks/gpu_check_suite.sh OUT_DIR kernels
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check_suite.sh OUT_DIR tests|timings|kernels}
part=${2:?usage: gpu_check_suite.sh OUT_DIR tests|timings|kernels}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
variants=("transformer matched" "h1 fw-1A" "h1 mamba2")

case $part in
tests)
    timeout 520 python -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_rotary_triton.py \
        tests/ops/test_ssd_triton.py tests/ops/test_decoding_steps.py tests/ops/test_triton_autotune.py \
        tests/ops/test_recompute.py tests/ops/test_mixer_recompute.py tests/layers/test_attention.py \
        tests/layers/test_norm_rotary.py tests/models/test_model.py > "$out/tests.log" 2>&1
    tail -n 25 "$out/tests.log"
    ;;
timings)
    timeout 60 python benchmarks/gpu_ssd_pass.py > "$out/ssd_pass.log" 2>&1
    timeout 120 python benchmarks/gpu_model.py --lengths 4096 16384 --contexts --rounds 2 --variants "${variants[@]}" \
        > "$out/train_125m.log" 2>&1
    timeout 150 python benchmarks/gpu_model.py --preset falcon-h1-0.5b --lengths 16384 --contexts --profile-train \
        --variants "${variants[@]}" > "$out/train_500m.log" 2>&1
    for log in ssd_pass train_125m train_500m; do
        echo "## $log"
        grep "^|" "$out/$log.log" | grep -v "| context |"
    done
    grep -h "kernel launches per call\|Self CUDA time total" "$out/train_500m.log"
    ;;
kernels)
    for rule in 2A 3 2; do
        timeout 100 python benchmarks/gpu_fast_weight_triton.py --rules $rule --T 4096 --B 4 \
            > "$out/rule_$rule.log" 2>&1
        grep "^check\|^| $rule " "$out/rule_$rule.log"
    done
    if [ -n "${FLA_WHEELS:-}" ]; then
        pip install -q --no-deps --target "$out/fla" "$FLA_WHEELS"/*.whl > "$out/fla_install.log" 2>&1
        PYTHONPATH=$out/fla:$PYTHONPATH timeout 150 python benchmarks/gpu_fla_accuracy.py > "$out/fla_accuracy.log" 2>&1
        PYTHONPATH=$out/fla:$PYTHONPATH timeout 200 python benchmarks/gpu_fla_compare.py --T 4096 \
            --passes fwd fwd+bwd --no-agreement --cuda-graph --only "ours 1" "fla delta" SDPA > "$out/fla_time.log" 2>&1
        grep -h "^|" "$out/fla_accuracy.log" "$out/fla_time.log"
    fi
    ;;
*)
    echo "gpu_check_suite.sh: the part is 'tests', 'timings' or 'kernels', not '$part'" >&2
    exit 2
    ;;
esac
