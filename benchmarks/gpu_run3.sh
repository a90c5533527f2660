#!/usr/bin/env bash
# Third GPU pass (device tool, `carry: [".whl"]`): decode speed of every engine path on the
# random TinyLlama-shaped model (the piecewise path and its dynamic fallback; the compiled path:
# static cache, torch.compile'd step in the graph), with and without gated C (τ = 1e-3, then τ = 0: every step gated, the worst
# case), then the engine's GPU tests (SKIP_TESTS=1 leaves them out). JSON and logs in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"
D="benchmarks/decode.py --tinyllama --device cuda --tokens 256 --max-cache-len 4096"
timeout ${BENCH_TIMEOUT:-300} python3 $D --repeats ${REPEATS:-7} --dynamic-repeats 1 \
    --variants ${VARIANTS:-dynamic piecewise compiled} --profile compiled \
    > "$OUT/decode.json" 2> "$OUT/decode.log"
echo "decode.py exit $?"
timeout 120 python3 $D --repeats 3 --variants compiled --tau 0 \
    > "$OUT/decode_tau0.json" 2> "$OUT/decode_tau0.log"
echo "decode.py --tau 0 exit $?"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/engine/test_engine_gpu.py \
      --confcutdir=tests/engine -q -p no:cacheprovider -rfE > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?"
  tail -n 5 "$OUT/gpu_tests.log"
fi
grep -v "Loading weights" "$OUT/decode.log" | grep -v "Warning\|warn(" | tail -n 45
echo "--- tau 0 (every step gated):"; tail -n 3 "$OUT/decode_tau0.log"
