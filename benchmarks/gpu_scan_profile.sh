#!/usr/bin/env bash
# What caps the batched scan (issue 24): `benchmarks/scan.py --profile` on a lent GPU (device
# tool, one H100 or H200, `carry: [".whl"]`), about 2 minutes, under 4 with a slow start.
#
#   bash benchmarks/gpu_scan_profile.sh
#
# A random TinyLlama-1.1B-shaped Llama (benchmarks/_models.py) built on the GPU, 64 traces of
# 512 tokens (32 prompt + 480 output, uniform random logged tokens: the scan's cost does not
# depend on them), scanned by `Engine.scan_batch` in each of $DTYPES (default bf16) at each of
# $BUDGETS tokens a forward (default "32768 16384": one forward of 64 rows, and the service's
# default budget, two forwards of 32). Each: 2 warm-up batches, the median wall time of 5
# plain batches, then 3 batches under torch.profiler (CPU and CUDA activity). Per run, in $OUT:
# scan_profile_<dtype>_<budget>.json (share of GPU time by kernel class, GPU idle share of the
# wall time, TFLOP/s of the GEMMs and of the whole step, FLOPs per traced token from the model's
# shape and the share of --peak-flops (989e12, an H100 SXM's dense bf16; an H200's is the same),
# the top 15 kernels), every run's table in scan_profile.log, and the first run's chrome trace
# as scan_trace.json.gz (https://ui.perfetto.dev opens it): at most 4 runs fit the device
# tool's 8 files. Each run is cut at RUN_TIMEOUT seconds (100).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"
trace="--profile-trace $OUT/scan_trace.json.gz"
for dtype in ${DTYPES:-bf16}; do
    for budget in ${BUDGETS:-32768 16384}; do
        name=scan_profile_${dtype}_${budget}
        t0=$SECONDS
        timeout "${RUN_TIMEOUT:-100}" python3 benchmarks/scan.py --tinyllama --device cuda \
            --dtype "$dtype" --batch 64 --tokens 512 --prompt-len 32 --token-budget "$budget" \
            --logged random --profile $trace > "$OUT/$name.json" 2> /tmp/$name.log
        echo "$name: exit $?, $((SECONDS - t0)) s" | tee -a "$OUT/scan_profile.log"
        grep -v -e '^USDT' -e Warning -e warn /tmp/$name.log | tail -n 32 \
            | tee -a "$OUT/scan_profile.log"
        trace=""
    done
done
