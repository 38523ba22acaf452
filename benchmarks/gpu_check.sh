#!/bin/bash
# The GPU paths a CPU machine cannot run, in one short script for a lent GPU (one GPU is enough):
#   1. the tests marked `cuda` (pytest -m cuda), log in $OUT/cuda.log;
#   2. benchmarks/bench_plan.py --device cuda: the planner against MemTracker and the CUDA caching
#      allocator's own peak, $OUT/plan_vs_cuda.json;
#   3. `paratrain train` on the GPU through NCCL for each strategy that runs on one GPU, bf16 and fp16
#      (GradScaler), zero3 --offload, --compile, a checkpoint and its resume (sync and async), doctor,
#      bench comm on NCCL and plan: one JSON line per command (rc, wall time, its --json summary) in
#      $OUT/matrix.jsonl.
# Run from the repository root:  OUT=/tmp/gpu bash benchmarks/gpu_check.sh
# Knobs: NOTESTS=1 skips 1 and 2; ONLY="name name ..." runs those commands of 3 alone; DEADLINE=S skips the
# commands of 3 that would start after S seconds; DEV=cpu PY=.venv/bin/python is a dry run on the CPU.
DEV=${DEV:-cuda}; OUT=${OUT:-/tmp/paratrain-gpu-check}; mkdir -p $OUT
PY=${PY:-python3}; case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")";; esac  # the runs cd elsewhere
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
BK=gloo; [ $DEV = cuda ] && BK=nccl
{ nvidia-smi -L; $PY -c "import torch;print(torch.__version__, torch.cuda.device_count(), torch.version.cuda)"; } > $OUT/env.txt 2>&1
if [ $DEV = cuda ] && [ -z "$NOTESTS" ]; then
  timeout 240 $PY -m pytest -m cuda -p no:cacheprovider -rA tests > $OUT/cuda.log 2>&1
  timeout 200 $PY benchmarks/bench_plan.py --device cuda --nproc 1 --models mlp llama-small --quick --steps 4 --timeout 90 --json $OUT/plan_vs_cuda.json > $OUT/plan.log 2>&1
fi
W=$(mktemp -d -t paratrain-gpu-check.XXXXXX)  # the runs' directories
run() {  # name, args...
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if [ $SECONDS -gt ${DEADLINE:-500} ]; then echo "{\"name\": \"$name\", \"skipped\": \"deadline\"}" >> $OUT/matrix.jsonl; return; fi
  local s=$(date +%s.%N)
  (cd $W && timeout 100 $PY -m paratrain "$@" > $W/$name.out 2> $W/$name.err); local rc=$?
  local e=$(date +%s.%N)
  $PY - "$name" "$rc" "$W/$name.out" "$W/$name.err" "$s" "$e" "$*" >> $OUT/matrix.jsonl <<'PYEOF'
import json, sys
name, rc, out, err, s, e, args = sys.argv[1:]
lines = [l for l in open(out).read().splitlines() if l.strip()]
try: j = json.loads(lines[-1])
except Exception: j = None
if isinstance(j, dict):
    j = {k: v for k, v in j.items() if k not in ("param_sha256",)}
    if isinstance(j.get("losses"), list): j["losses"] = j["losses"][:2] + j["losses"][-2:]
print(json.dumps({"name": name, "rc": int(rc), "wall_s": round(float(e) - float(s), 1), "args": args,
  "json": j, "stdout_tail": "" if j else "\n".join(lines[-8:]), "stderr_tail": open(err).read()[-1500:] if int(rc) else ""}))
PYEOF
}
T="train --model llama-debug --data python-stdlib --seq-len 64 --batch-size 8 --steps 8 --json --nproc-per-node 1 --device $DEV --backend $BK --seed 1 --set data.max_bytes=1000000"
run ddp_bf16   $T --strategy ddp --precision bf16 --run-dir r_ddp_bf16
run dp_bf16    $T --strategy dp --precision bf16 --run-dir r_dp_bf16
run zero1_bf16 $T --strategy zero1 --precision bf16 --run-dir r_z1
run zero2_bf16 $T --strategy zero2 --precision bf16 --run-dir r_z2
run zero3_bf16 $T --strategy zero3 --precision bf16 --run-dir r_z3
run zero3_off  $T --strategy zero3 --precision bf16 --offload --run-dir r_z3off
if [ $DEV = cuda ]; then
run single_fp16 $T --strategy single --precision fp16 --run-dir r_s16
run ddp_fp16    $T --strategy ddp --precision fp16 --run-dir r_d16
run zero3_fp16  $T --strategy zero3 --precision fp16 --run-dir r_z316
fi
run ddp_compile $T --strategy ddp --precision bf16 --compile --run-dir r_comp
run ckpt_a  $T --strategy zero3 --ckpt-every 4 --run-dir r_ck
run ckpt_b  ${T/--steps 8/--steps 12} --strategy zero3 --resume auto --run-dir r_ck
run ckpt_async ${T} --strategy ddp --ckpt-every 4 --async-checkpoint --run-dir r_cka
run doctor doctor --json --nproc-per-node 1
run comm bench comm --nproc-per-node 1 --backend $BK --device $DEV --sizes 4KB..16MB --factor 16 --iters 5 --warmup 2 --json
run plan plan --model llama-debug --strategy ddp --batch-size 8 --seq-len 64 --precision bf16 --gpus 1 --json
rm -rf "$W"
ls -la $OUT
