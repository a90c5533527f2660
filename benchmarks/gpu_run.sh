#!/usr/bin/env bash
# The engine's GPU tests and benchmarks in one go, for a lent GPU machine (the device tool):
# wheels carried in .whl/ (pydantic & co., transformers matching the CPU venv), results in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=replay_audit/assets/tiny-llama; P=replay_audit/assets/prompts.jsonl
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -m gpu tests/engine/test_engine_gpu.py --confcutdir=tests/engine -q \
    -p no:cacheprovider -rA 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
python3 benchmarks/agreement.py --model $M --prompts $P --device cuda --limit ${LIMIT:-40} \
    > "$OUT/agreement_bf16_fp16.json" 2> "$OUT/agreement_bf16_fp16.err"
python3 benchmarks/agreement.py --model $M --prompts $P --device cuda --limit ${LIMIT:-40} \
    --a bf16 --b bf16:fp8_e4m3 --configs none C --tau-ulps 0.25 1 2 \
    > "$OUT/agreement_bf16_fp8.json" 2> "$OUT/agreement_bf16_fp8.err"
python3 benchmarks/decode.py --tinyllama --device cuda --tokens 256 --repeats 2 \
    > "$OUT/decode_tinyllama.json" 2> "$OUT/decode_tinyllama.err"
python3 benchmarks/scan.py --tinyllama --device cuda --tokens 256 \
    > "$OUT/scan_tinyllama.json" 2> "$OUT/scan_tinyllama.err"
tail -n 3 "$OUT"/*.err
