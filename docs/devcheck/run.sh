#!/usr/bin/env bash
# Device check (GPU machine, torch 2.11+cu130 there; our agent needs torch 2.13's LaunchConfig,
# so the user's script runs under that torch's plain torchrun: standalone mode, storage resume).
set -u
export PYTHONPATH=$PWD:$PWD/docs/devcheck PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
O=${OUT:-/tmp/devout}; mkdir -p $O
python3 -c 'import torch,transformers;print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'
W=$(mktemp -d); P=29600
ev() { python3 - "$1" <<'PY'
import json,sys
evs=[json.loads(l) for l in open(sys.argv[1]+"/events.jsonl")]
pick=lambda k:[e for e in evs if e["event"]==k]
print(json.dumps({"faults":[e.get("step") for e in pick("fault")],
 "resumes":[(e.get("source"),e.get("step"),e.get("world_size"),e.get("device")) for e in pick("resume")],
 "finish":[(e.get("step"),e.get("loss"),(e.get("digest") or "")[:16]) for e in pick("finish")],
 "saves":len(pick("checkpoint"))}))
PY
}
run() { local name=$1 n=$2; shift 2; P=$((P+7)); local t0=$(date +%s.%N)
  timeout 170 python3 -m torch.distributed.run --nproc-per-node $n --max-restarts 2 --rdzv-backend c10d \
    --rdzv-endpoint 127.0.0.1:$P --log-dir $W/$name-tr jobs/hf_lm.py --run-dir $W/$name "$@" > $O/$name.log 2>&1
  local rc=$?; echo "== $name rc=$rc wall=$(python3 -c "print(round($(date +%s.%N)-$t0,1))")"; ev $W/$name
  [ $rc = 0 ] || grep -v '^\s*$' $O/$name.log | grep -iv warn | tail -n 12 | cut -c1-300; }
K="--set chaos=[{kind: kill-worker, target: 0, at_step: 27}]"
run bf16_ref 1
run bf16_kill 1 --set "chaos=[{kind: kill-worker, target: 0, at_step: 27}]"
run fp16_ref 1 --set train.precision=fp16 --parallelism ddp
run fp16_kill 1 --set train.precision=fp16 --parallelism ddp --set "chaos=[{kind: kill-worker, target: 0, at_step: 33}]"
# a checkpoint written on the GPU (world 1) resumed on CPU at world size 2
cp -a $W/bf16_ref $W/to_cpu && run to_cpu 2 --set device=cpu --set train.steps=70
timeout 120 python3 docs/devcheck/gpu_check.py --mb 2048 > $O/d2h.json && python3 -c "import json;d=json.load(open('$O/d2h.json'));print({k:v for k,v in d.items() if 'GBps' in k or 'ident' in k or 'regist' in k or 'error' in k})"
rm -rf $W; ls /dev/shm | grep -c eh- || true
