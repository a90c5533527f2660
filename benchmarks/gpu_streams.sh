#!/usr/bin/env bash
# Faithful decode overlapped (issue 24), on a lent GPU (device tool, `carry: [".whl"]`): K
# piecewise decodes in one process on K CUDA streams (benchmarks/decode_streams.py), random
# TinyLlama-shaped model in BF16, 256 tokens each. JSON in $OUT, a summary on stdout.
#   bash benchmarks/gpu_streams.sh   (SKIP_STREAMS=1: the processes only; PROCS="2 4": their K)
if ls .whl/*.whl >/dev/null 2>&1; then  # else the image's own transformers
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # the engine's own default
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
[ -z "$SKIP_STREAMS" ] && timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/decode_streams.py --tinyllama --device cuda \
    --streams ${STREAMS:-1 2 4 8} --tokens ${TOKENS:-256} --repeats ${REPEATS:-3} \
    --out "$OUT/streams.json" > /dev/null 2> "$OUT/streams.log"
[ -z "$SKIP_STREAMS" ] && grep -v "Loading weights\|Warning\|warn(" "$OUT/streams.log" | tail -n 20

# The same K as K processes (one decode each, separate host interpreters: no shared GIL) under
# CUDA MPS where the image has it (kernels of several processes run together), else time-sliced.
MPS=""
if [ -z "$NO_MPS" ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && MPS=1
fi
for K in ${PROCS:-2 4 8}; do
  at=$(python3 -c "import time; print(time.time() + ${WARM_S:-60})")
  for i in $(seq $K); do
    python3 benchmarks/decode_streams.py --tinyllama --device cuda --tokens ${TOKENS:-256} \
        --repeats 2 --start-at $at --seed $i $PROC_ARGS > "/tmp/proc_${K}_$i.json" 2>/dev/null &
  done
  wait
  python3 - /tmp $K "${MPS:-0}" <<'PY'
import json, sys, glob
runs = [json.loads(open(f).read().strip().splitlines()[-1]) for f in glob.glob(f"{sys.argv[1]}/proc_{sys.argv[2]}_*.json")]
span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
same = sum(r["same_as_generate"] for r in runs)
first = sorted(r["first_differs"] for r in runs if r["first_differs"] is not None)
print(f"processes K={sys.argv[2]} mps={sys.argv[3]}: {sum(r['tokens'] for r in runs) / span:.1f} tok/s aggregate ({len(runs)} ran, {same} token-identical to generate(); first differing step of the others: {first})")
PY
done
[ -n "$MPS" ] && echo quit | nvidia-cuda-mps-control
