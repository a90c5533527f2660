#!/usr/bin/env bash
# Scan fidelity on a trained model that diverges (issue 13), for a lent GPU (device tool,
# `carry: [".whl"]`; pydantic & co. are not in the device image). Under 6 minutes.
#
#   bash benchmarks/gpu_fidelity.sh [--model DIR]        (default DIR: .models/py-12x768)
#
# DIR missing (a 12x768 checkpoint is too large to carry: train it on the device first with
# scripts/train_tiny_model.py, it stays between calls of a warm machine): a 4-layer width-256
# model is trained here on the CPU for FALLBACK_MINUTES (default 0.8) and used instead; the JSON
# says which model ran. Results: $OUT/fidelity.json (benchmarks/fidelity.py: batched scan vs
# bs=1 scan, the share of decode divergences the scan flags, misses by category, false flags,
# bf16 -> fp16 and fp16 -> bf16), $OUT/fidelity.log, $OUT/env.txt.
set -u
MODEL=.models/py-12x768
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"
BUDGET=${DECODE_BUDGET_S:-100}; LIMIT_S=
if [ ! -f "$MODEL/config.json" ]; then
  echo "no checkpoint in $MODEL: training a 4x256 fallback for ${FALLBACK_MINUTES:-0.8} min" \
      | tee -a "$OUT/env.txt"
  MODEL=/tmp/fidelity-4x256
  timeout 150 python3 scripts/train_tiny_model.py --out "$MODEL" \
      --prompts-out /tmp/fidelity-prompts.jsonl --layers 4 --hidden 256 --intermediate 768 \
      --heads 4 --kv-heads 2 --minutes "${FALLBACK_MINUTES:-0.8}" --threads 16 \
      > "$OUT/train.log" 2>&1
  echo "train exit $?"; tail -n 3 "$OUT/train.log"
  BUDGET=${DECODE_BUDGET_S:-55}; LIMIT_S=170
fi
timeout ${LIMIT_S:-280} python3 benchmarks/fidelity.py --model "$MODEL" --device cuda \
    --limit "${LIMIT:-64}" --tokens "${TOKENS:-96}" --decode-budget-s "$BUDGET" \
    > "$OUT/fidelity.json" 2> "$OUT/fidelity.log"
echo "fidelity.py exit $?"
grep -v "Loading weights" "$OUT/fidelity.log" | tail -n 12
