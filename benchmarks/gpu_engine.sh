#!/usr/bin/env bash
# The engine on a lent GPU (device tool, `carry: [".whl"]`), in one pass: decode speed of every
# engine path on the random TinyLlama-shaped model (piecewise, the faithful default; compiled:
# static cache, torch.compile'd step in one CUDA graph), with and without gated C (τ = 1e-3, then
# τ = 0: every step gated, the worst case), the scan benchmark, agreement on the committed small
# model (BF16 vs FP16; BF16 vs an FP8-E4M3 head), then the engine's GPU tests. JSON and logs in
# $OUT. SKIP_TESTS=1 leaves the tests out, SKIP_AGREEMENT=1 the scan and agreement.
# (It replaces gpu_run.sh, gpu_run2.sh and gpu_run3.sh, whose passes it runs.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=replay_audit/assets/tiny-llama; P=replay_audit/assets/prompts.jsonl
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"
D="benchmarks/decode.py --tinyllama --device cuda --tokens 256 --max-cache-len 4096"
timeout ${BENCH_TIMEOUT:-300} python3 $D --repeats ${REPEATS:-7} \
    --variants ${VARIANTS:-piecewise compiled hf_generate} --profile compiled \
    > "$OUT/decode.json" 2> "$OUT/decode.log"
echo "decode.py exit $?"
timeout 120 python3 $D --repeats 3 --variants compiled --tau 0 \
    > "$OUT/decode_tau0.json" 2> "$OUT/decode_tau0.log"
echo "decode.py --tau 0 exit $?"
if [ -z "$SKIP_AGREEMENT" ]; then
  python3 benchmarks/scan.py --tinyllama --device cuda --tokens 256 \
      > "$OUT/scan_tinyllama.json" 2> "$OUT/scan_tinyllama.log"
  python3 benchmarks/agreement.py --model $M --prompts $P --device cuda --limit ${LIMIT:-64} \
      > "$OUT/agreement_bf16_fp16.json" 2> "$OUT/agreement.log"
  python3 benchmarks/agreement.py --model $M --prompts $P --device cuda --limit ${LIMIT:-64} \
      --a bf16 --b bf16:fp8_e4m3 --configs none C --tau-ulps 0.25 1 2 \
      > "$OUT/agreement_bf16_fp8.json" 2>> "$OUT/agreement.log"
fi
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/engine/test_engine_gpu.py \
      --confcutdir=tests/engine -q -p no:cacheprovider -rfE > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?"
  tail -n 5 "$OUT/gpu_tests.log"
fi
grep -v "Loading weights" "$OUT/decode.log" | grep -v "Warning\|warn(" | tail -n 45
echo "--- tau 0 (every step gated):"; tail -n 3 "$OUT/decode_tau0.log"
