#!/usr/bin/env bash
# One prepared run for a single NVIDIA H200 (see bench/gpu_train.py for what and why):
# bf16 GPT of about 1B parameters, sequence 2048, at world 1 through disttrain
# (`fsdp`, which one device runs unsharded) and the same unsharded bf16-autocast step
# written by hand (like for like); tokens/s, MFU, peak memory against `disttrain plan`,
# checkpoint save and cold-load GB/s against the raw disk; then bench/gpu_trainer.sh (the
# trainer's NCCL path) in the time left. Finishes within 8 minutes: each of the four
# variants, eager and compiled, is capped at 150 s (the hand-written eager one, which also
# times the raw disk, took 114 s on the H200), and the trainer's rows get what is left of
# the budget (BENCH_GPU_BUDGET seconds, default 470).
#
#   bench/gpu.sh [--dry-run] [OUTDIR]    OUTDIR defaults to $OUT, else bench/results/gpu_run
#
# Writes OUTDIR/{torch_autocast,disttrain_fsdp}.json, OUTDIR/*.log and OUTDIR/gpu.md (which
# ends with a line `torch X.Y.Z`: the release it ran on).
# --dry-run: the same code on the CPU with a tiny model (the test that keeps it working).
# PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=()
if [[ "${1:-}" == "--dry-run" ]]; then DRY=(--dry-run); shift; fi
OUTDIR="${1:-${OUT:-bench/results/gpu_run}}"
PY="${PYTHON:-python3}"
LIMIT="${BENCH_GPU_VARIANT_TIMEOUT:-150}"
BUDGET="${BENCH_GPU_BUDGET:-470}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if [[ ${#DRY[@]} -gt 0 ]]; then export OMP_NUM_THREADS=1; fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv > "$OUTDIR/nvidia-smi.csv" 2>&1

status=0
VARIANTS=(torch_autocast disttrain_fsdp torch_autocast_compiled disttrain_fsdp_compiled)
# The dry run keeps one compiled variant (the product's path): compiling costs most of its time.
if [[ ${#DRY[@]} -gt 0 ]]; then VARIANTS=(torch_autocast disttrain_fsdp disttrain_fsdp_compiled); fi
for variant in "${VARIANTS[@]}"; do
    echo "== $variant"
    if ! timeout "$LIMIT" "$PY" -m bench.gpu_train --variant "$variant" --out "$OUTDIR" "${DRY[@]}" \
            > "$OUTDIR/$variant.log" 2>&1; then
        echo "$variant failed or timed out; tail of $OUTDIR/$variant.log:"
        tail -n 20 "$OUTDIR/$variant.log"
        status=1
    fi
    rm -rf "${TMPDIR:-/tmp}"/gpu-ckpt-*  # a variant stopped at its cap leaves its checkpoints
done
if [[ ${#DRY[@]} -eq 0 ]]; then
    # The trainer's NCCL path (a process group at world 1), in what is left of the budget.
    left=$((BUDGET - SECONDS))
    if (( left > 30 )); then
        PYTHON="$PY" timeout "$left" bash bench/gpu_trainer.sh "$OUTDIR" || status=1
    else
        echo "gpu_trainer.sh skipped: ${left} s left of the ${BUDGET} s budget" | tee "$OUTDIR/gpu_trainer.md"
    fi
fi
"$PY" -m bench.gpu_train --summarize "$OUTDIR" --command "bench/gpu.sh ${DRY[*]} OUTDIR"
# The image's torch release, for the README's "Supported torch releases".
printf '\ntorch %s\n' "$("$PY" -c 'import torch; print(torch.__version__)')" | tee -a "$OUTDIR/gpu.md"
exit $status
