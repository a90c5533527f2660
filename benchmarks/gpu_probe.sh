#!/usr/bin/env bash
# Issue 32 on a lent GPU: the teacher-forced probe's categories against the from-scratch rule
# (benchmarks/probe_agreement.py) on SmolLM2-135M-Instruct (plain generate() BF16 traces of the
# bundled prompts, replayed in FP16) and on the trained 1.07 B Llama of gpu_e2e.sh (its BF16
# traces from batched generate(), replayed in FP16), in scan and decode modes. SmolLM2's GGUF
# travels in two pieces into /tmp/g first (gpu_logged_stack.sh says how); this call carries
# [".whl", ".whl2"] with gguf's wheel in .whl2. Leaves .models/e2e (the trained model and its
# traces) on the warm machine for `gpu_e2e.sh audit`.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ ! -f /tmp/smollm2/config.json ]; then
    cat /tmp/g/gguf.part* > /tmp/smollm2.gguf || exit 1
    python3 scripts/build_smollm2.py --gguf /tmp/smollm2.gguf --out /tmp/smollm2 > /dev/null \
        2> "$OUT/build.log" || { tail -n 20 "$OUT/build.log"; exit 1; }
fi
MINUTES=${MINUTES:-1.5} bash benchmarks/gpu_e2e.sh prepare > "$OUT/prepare.txt" 2>&1
tail -n 5 "$OUT/prepare.txt"
P="python3 benchmarks/probe_agreement.py --device cuda --logged bf16 --target fp16"
if [ "${PROMPTS:-48}" != 0 ]; then  # PROMPTS=0: SmolLM2 measured already
    timeout ${SMOL_TIMEOUT:-240} $P --model /tmp/smollm2 --prompts ${PROMPTS:-48} \
        --tokens ${TOKENS:-128} --modes scan decode --decode-window 32 --repeat 2 \
        --out "$OUT/probe_smollm2.json" > /dev/null 2> "$OUT/probe_smollm2.log"
    echo "smollm2: exit $?"
fi
timeout ${LLAMA_TIMEOUT:-150} $P --model .models/e2e/model --traces .models/e2e/traces.jsonl \
    --limit ${SCAN_LIMIT:-512} --modes scan --out "$OUT/probe_llama_scan.json" \
    > /dev/null 2> "$OUT/probe_llama_scan.log"; echo "llama scan: exit $?"
timeout ${LLAMA_DECODE_TIMEOUT:-120} $P --model .models/e2e/model --traces .models/e2e/traces.jsonl \
    --limit ${DECODE_LIMIT:-16} --modes decode --decode-window 32 --out "$OUT/probe_llama_decode.json" \
    > /dev/null 2> "$OUT/probe_llama_decode.log"; echo "llama decode: exit $?"
for f in "$OUT"/probe_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d['traces'], {m: (v['flips'], v['categories_agree'], v['seconds']) for m, v in d['modes'].items()})" "$f"
done
