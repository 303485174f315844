#!/usr/bin/env bash
# Device check on one GPU through the real agent (`elastic-harness run`: torchelastic agent,
# zygote, memory tier), not plain torchrun. Issue 35 item 5. From the repo root:
#   timeout 540 bash docs/devcheck/run.sh          # OUT=dir keeps logs and figures.json
# Uses the machine's own torch (any release in elastic-harness's range, CUDA build); this
# checkout on PYTHONPATH, nothing installed. Each run is bounded by `timeout`; about 6 min.
# NOT YET RUN ON A GPU: written in a session without one (issue 35); expect small fixes.
# DEVICE=cpu runs the same checks on CPU/gloo (the plumbing, not the GPU paths; no gpu_check):
# green on torch 2.13.0+cpu, 2 busy cores, ~6 min (PATH with a venv's python3 first).
# Prints one JSON object (figures.py): each check's verdict, the recovery of a worker killed
# and restored from the memory tier phase by phase (NCCL init is in process_group: the
# harness passes device_id, so init_process_group creates the communicator eagerly), its
# share of the restart, and the snapshot copy's GB/s (gpu_check.py).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/eh-devcheck}; mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/eh-devcheck.XXXXXX"); trap 'rm -rf "$W"' EXIT
EH="python3 -m elastic_harness"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "nccl", torch.distributed.is_nccl_available())'
run() {  # NAME JOB [flags]: one harness run, bounded; its log in $OUT/NAME.log
  local name=$1 job=$2; shift 2
  timeout 200 $EH run "$job" --run-dir "$W/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -E '^(finished|failure|job failed)' "$OUT/$name.log" | cut -c1-200
}
DEVICE=${DEVICE:-cuda}
LM=(--nproc-per-node 1 --set device=$DEVICE --set train.steps=60 --set checkpoint.every_steps=50)
# 1. DDP over NCCL: a worker killed at step 30 is restored from the memory tier (CUDA tensors
#    copied to the agent's host memory), and ends bit-identical to an uninterrupted run.
run ddp_ref jobs/quickstart.yaml "${LM[@]}"
run ddp_kill jobs/quickstart.yaml "${LM[@]}" --chaos kill-worker:0@30
# 2. FSDP2 with bf16 autocast, killed at step 30: bit-identical too.
FS=("${LM[@]}" --set parallelism=fsdp --set train.precision=bf16)
run fsdp_ref jobs/quickstart.yaml "${FS[@]}"
run fsdp_kill jobs/quickstart.yaml "${FS[@]}" --chaos kill-worker:0@30
# 3. The GPU checkpoint (world size 1, its final step 60) resumed on CPU at world size 2.
cp -a "$W/ddp_ref" "$W/to_cpu" && rm -f "$W/to_cpu/summary.json"
run to_cpu jobs/quickstart.yaml --nproc-per-node 2 --set device=cpu --set train.steps=70 \
  --set checkpoint.every_steps=50
# 3b. In place on NCCL (docs/in-place.md): two ranks need two GPUs (NCCL refuses two ranks on
# one device). The survivor keeps its pid (the recovery event) and the result is bit-identical.
if [[ $DEVICE == cuda ]] && (( $(python3 -c 'import torch; print(torch.cuda.device_count())') >= 2 )); then
  run inplace_ref jobs/mlp.yaml --nproc-per-node 2 --set device=cuda
  run inplace_kill jobs/mlp.yaml --nproc-per-node 2 --set device=cuda --chaos kill-worker:1@20
  grep -h '"event": "recovery"' "$W/inplace_kill/events.jsonl" || echo "no recovery event: not in place"
else
  echo "in place on NCCL: skipped (needs 2 GPUs)"
fi
# 4. The memory tier's copy of a ~1 GB state: device-to-host GB/s, restore bit-identical.
if [[ $DEVICE == cuda ]]; then
  timeout 150 python3 docs/devcheck/gpu_check.py --mb 1024 > "$OUT/d2h.json" 2> "$OUT/d2h.log" || echo "gpu_check rc=$?"
fi
python3 docs/devcheck/figures.py "$W" "$OUT/d2h.json" | tee "$OUT/figures.json"
echo "leftovers in /dev/shm: $(ls /dev/shm | grep -c eh- || true)"
