#!/usr/bin/env bash
# The trainer's GPU path on one CUDA device, through `disttrain run --nproc 1`, so a
# process group (NCCL for CUDA tensors, gloo for host values) exists at world 1 and
# every collective of the trainer (metrics, preemption vote, generation id, guard,
# checkpoint) really runs on it. One row per strategy x precision, plus a kill -9
# mid-run that the automatic restart resumes, and an fp8 run resumed in bf16 (the fp8 rows
# need a GPU of compute capability >= 8.9 and torchao).
#
#   bench/gpu_trainer.sh [OUTDIR]     OUTDIR defaults to $OUT, else bench/results/gpu_trainer
#   GPU_TRAINER_ROWS="ddp_fp32 hf_gpt2_fsdp_bf16" bench/gpu_trainer.sh   only those rows (the probe always runs)
#
# Writes OUTDIR/gpu_trainer.md (the table) and OUTDIR/gpu_trainer.log. Exit 1 if a row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-bench/results/gpu_trainer}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
LOG="$OUTDIR/gpu_trainer.log"
WORK="$(mktemp -d)"
GPT_SHAPE=(--model.n_layer=2 --model.n_embd=128 --model.n_head=4 --model.block_size=128)
TINY=(--data.max_bytes=400000 --train.batch_size=16 --train.steps=40 --train.eval_every=20
      --train.eval_batches=4 --train.log_every=10 --checkpoint.every=10 --parallel.nproc=1
      --parallel.device=${GPU_TRAINER_DEVICE:-cuda})

echo "| run | exit | steps | final held-out loss | seconds |" > "$OUTDIR/gpu_trainer.md"
echo "|---|---|---|---|---|" >> "$OUTDIR/gpu_trainer.md"
status=0
row() {  # NAME [trainer overrides...]; RUN_FLAGS, DISTTRAIN_FAULT, CONFIG and OUT_OF from the environment
    local name="$1"; shift
    # GPU_TRAINER_ROWS="a b": only those rows (a rerun of what failed, in less device time)
    [[ -n "${GPU_TRAINER_ROWS:-}" && " $GPU_TRAINER_ROWS " != *" $name "* ]] && return 0
    # OUT_OF=ROW: the run folder of an earlier row, whose checkpoint this row resumes
    local t0=$SECONDS out="$WORK/${OUT_OF:-$name}" config="${CONFIG:-examples/tiny_gpt.toml}"
    local shape=("${GPT_SHAPE[@]}")
    [[ "$config" != examples/tiny_gpt.toml ]] && shape=()
    # shellcheck disable=SC2086
    timeout 90 "$PY" -m disttrain.cli run --nproc 1 ${RUN_FLAGS:-} -m disttrain.train "$config" \
        "${shape[@]}" "${TINY[@]}" "$@" "--train.out_dir=$out" >> "$LOG" 2>&1
    local rc=$?
    [[ $rc -ne 0 ]] && status=1
    local summary
    summary=$("$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['steps'], '|', round(s['final_heldout_loss'], 4))" \
        "$out/summary.json" 2>/dev/null || echo "- | -")
    echo "| $name | $rc | $summary | $((SECONDS - t0)) |" >> "$OUTDIR/gpu_trainer.md"
    echo "== $name: exit $rc" | tee -a "$LOG"
}

"$PY" - >> "$LOG" 2>&1 <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
PYEOF
cat > "$WORK/probe.py" <<'PYEOF'
import torch, torch.distributed as dist
import disttrain as dt
with dt.distributed() as info:
    host, dev = torch.ones(1), torch.ones(1, device=info.device)
    dist.all_reduce(host); dist.all_reduce(dev)
    print(f"probe: backend {dist.get_backend_config()} host {host.item()} device {dev.item()}")
PYEOF
"$PY" -m disttrain.cli run --nproc 1 "$WORK/probe.py" 2>&1 | tee -a "$LOG" | grep probe || status=1

row ddp_fp32 --parallel.strategy=ddp
row ddp_bf16 --parallel.strategy=ddp --train.precision=bf16
row ddp_fp16 --parallel.strategy=ddp --train.precision=fp16
row zero1_fp32 --parallel.strategy=zero1
row fsdp_bf16 --parallel.strategy=fsdp --train.precision=bf16
row fsdp1_bf16 --parallel.strategy=fsdp1 --train.precision=bf16
RUN_FLAGS="--max-restarts 1" DISTTRAIN_FAULT="kill@backward:rank=0,step=25" row ddp_kill9_resumed --parallel.strategy=ddp
CONFIG=examples/hf_gpt2.toml row hf_gpt2_fsdp_bf16 --parallel.strategy=fsdp --train.precision=bf16
row ddp_fp8 --parallel.strategy=ddp --train.precision=fp8
row fsdp_fp8 --parallel.strategy=fsdp --train.precision=fp8
# fsdp_fp8's step-40 checkpoint, resumed in bf16 for 20 more steps (the state dict is the same)
OUT_OF=fsdp_fp8 row fsdp_fp8_then_bf16 --parallel.strategy=fsdp --train.precision=bf16 --train.steps=60
grep -h "resumed\|complete at" "$LOG" | head -5 >> "$OUTDIR/gpu_trainer.md"
rm -rf "$WORK"
cat "$OUTDIR/gpu_trainer.md"
exit $status
