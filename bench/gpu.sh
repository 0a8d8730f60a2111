#!/usr/bin/env bash
# One prepared run for a single NVIDIA H200 or H100 (see bench/gpu_train.py for what and why),
# bounded to finish within 8 minutes (BENCH_GPU_BUDGET seconds, default 470: each variant
# is capped at BENCH_GPU_VARIANT_TIMEOUT, default 150 s, and at what is left of the budget).
#
# Default: a bf16 GPT of about 1B parameters, sequence 2048, at world 1 through disttrain
# (`fsdp`, which one device runs unsharded) and the same unsharded bf16-autocast step
# written by hand (like for like), eager and compiled; tokens/s, MFU, peak memory against
# `disttrain plan`, checkpoint save and cold-load GB/s against the raw disk; then
# bench/gpu_trainer.sh (the trainer's NCCL path) in the time left. (The hand-written eager
# variant, which also times the raw disk, took 114 s on the H200.)
#
# --fp8: bf16 compiled through disttrain (the baseline; it also times disttrain's
# checkpoint and the raw disk, same machine, same process), fp8 compiled through
# disttrain (`dt.wrap(precision="fp8")`, its checkpoint too), and the same fp8 step by hand
# with torchao; then the trainer's fp8 rows (gpu_trainer.sh: ddp_fp8, fsdp_fp8 and an fp8
# run resumed in bf16) in the time left. Needs a GPU of compute capability >= 8.9 and
# torchao: on a machine that cannot fetch it, `python3 -m pip download --no-deps -d
# .gpu_deps 'torchao>=0.18'` beforehand and bring .gpu_deps along; the script installs the
# wheel from there into .gpu_deps/site when python cannot import torchao.
#
#   bench/gpu.sh [--fp8] [--dry-run] [OUTDIR]    OUTDIR defaults to $OUT, else bench/results/gpu_run
#
# Writes OUTDIR/<variant>.json, OUTDIR/*.log and OUTDIR/gpu.md (which ends with a line
# `torch X.Y.Z`: the release it ran on).
# --dry-run: the same code on the CPU with a tiny model (the test that keeps it working;
# fp8 through torchao's emulation; with --fp8 it also runs the default set's eager pair, so
# one call covers every dry-run variant). PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=() FP8=()
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --dry-run) DRY=(--dry-run) ;;
        --fp8) FP8=(--fp8) ;;
        *) echo "bench/gpu.sh: unknown option $1; use --fp8 and/or --dry-run" >&2; exit 2 ;;
    esac
    shift
done
FLAGS=("${FP8[@]}" "${DRY[@]}")
OUTDIR="${1:-${OUT:-bench/results/gpu_run}}"
PY="${PYTHON:-python3}"
LIMIT="${BENCH_GPU_VARIANT_TIMEOUT:-150}"
BUDGET="${BENCH_GPU_BUDGET:-470}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if [[ ${#DRY[@]} -gt 0 ]]; then export OMP_NUM_THREADS=1; fi
if [[ ${#FP8[@]} -gt 0 ]] && ! "$PY" -c "import torchao" 2>/dev/null && compgen -G ".gpu_deps/torchao-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-deps --no-index --target .gpu_deps/site .gpu_deps/torchao-*.whl
    export PYTHONPATH="$PWD/.gpu_deps/site:$PYTHONPATH"
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap \
    --format=csv > "$OUTDIR/nvidia-smi.csv" 2>&1

status=0
VARIANTS=(torch_autocast disttrain_fsdp torch_autocast_compiled disttrain_fsdp_compiled)
RAW_DISK=torch_autocast  # the variant that times the raw disk beside its checkpoint
TRAINER_ROWS="${GPU_TRAINER_ROWS:-}"
# The dry run keeps one compiled variant (the product's path): compiling costs most of its time.
if [[ ${#DRY[@]} -gt 0 ]]; then VARIANTS=(torch_autocast disttrain_fsdp disttrain_fsdp_compiled); fi
if [[ ${#FP8[@]} -gt 0 ]]; then
    VARIANTS=(disttrain_fsdp_compiled disttrain_fp8_compiled torchao_fp8_compiled)
    # The dry run adds the default run's eager pair: one CPU call proves both variant sets
    # (the compiled bf16 variant, the most costly to start, is in both).
    if [[ ${#DRY[@]} -gt 0 ]]; then VARIANTS=(torch_autocast disttrain_fsdp "${VARIANTS[@]}"); fi
    RAW_DISK=disttrain_fsdp_compiled TRAINER_ROWS="${GPU_TRAINER_ROWS:-ddp_fp8 fsdp_fp8 fsdp_fp8_then_bf16}"
fi
for variant in "${VARIANTS[@]}"; do
    left=$((BUDGET - SECONDS - 15))  # 15 s kept for the summary
    cap=$(( LIMIT < left ? LIMIT : left ))
    if (( cap < 30 )); then
        echo "$variant skipped: ${left} s left of the ${BUDGET} s budget"
        status=1
        continue
    fi
    echo "== $variant (at most ${cap} s)"
    extra=()
    [[ "$variant" == "$RAW_DISK" ]] && extra=(--raw-disk)
    if ! timeout "$cap" "$PY" -m bench.gpu_train --variant "$variant" --out "$OUTDIR" "${DRY[@]}" "${extra[@]}" \
            > "$OUTDIR/$variant.log" 2>&1; then
        echo "$variant failed or timed out; tail of $OUTDIR/$variant.log:"
        tail -n 20 "$OUTDIR/$variant.log"
        status=1
    fi
    rm -rf "${TMPDIR:-/tmp}"/gpu-ckpt-*  # a variant stopped at its cap leaves its checkpoints
done
if [[ ${#DRY[@]} -eq 0 ]]; then
    # The trainer's NCCL path (a process group at world 1), in what is left of the budget.
    left=$((BUDGET - SECONDS - 15))
    if (( left > 30 )); then
        GPU_TRAINER_ROWS="$TRAINER_ROWS" PYTHON="$PY" timeout "$left" bash bench/gpu_trainer.sh "$OUTDIR" || status=1
    else
        echo "gpu_trainer.sh skipped: ${left} s left of the ${BUDGET} s budget" | tee "$OUTDIR/gpu_trainer.md"
    fi
fi
"$PY" -m bench.gpu_train --summarize "$OUTDIR" --command "bench/gpu.sh ${FLAGS[*]} OUTDIR"
# The image's torch release, for the README's "Supported torch releases".
printf '\ntorch %s\n' "$("$PY" -c 'import torch; print(torch.__version__)')" | tee -a "$OUTDIR/gpu.md"
exit $status
