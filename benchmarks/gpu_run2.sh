#!/usr/bin/env bash
# Second GPU pass: compiled-path decode speed variants with a profile, the scan benchmark, and
# agreement on the committed small model (BF16 vs FP16; BF16 vs FP8-E4M3 head). Results in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/run2.log"
M=replay_audit/assets/tiny-llama; P=replay_audit/assets/prompts.jsonl
D="benchmarks/decode.py --tinyllama --device cuda --tokens 256 --repeats 2 --variants compiled"
python3 $D --max-cache-len 4096 --profile compiled > "$OUT/decode_compiled_4096.json" 2>> "$LOG"
python3 $D --max-cache-len 512 > "$OUT/decode_compiled_512.json" 2>> "$LOG"
python3 $D --max-cache-len 512 --no-deterministic > "$OUT/decode_compiled_512_nodet.json" 2>> "$LOG"
python3 benchmarks/scan.py --tinyllama --device cuda --tokens 256 > "$OUT/scan_tinyllama.json" 2>> "$LOG"
python3 benchmarks/agreement.py --model $M --prompts $P --device cuda --limit ${LIMIT:-64} \
    > "$OUT/agreement_bf16_fp16.json" 2>> "$LOG"
python3 benchmarks/agreement.py --model $M --prompts $P --device cuda --limit ${LIMIT:-64} \
    --a bf16 --b bf16:fp8_e4m3 --configs none C --tau-ulps 0.25 1 2 \
    > "$OUT/agreement_bf16_fp8.json" 2>> "$LOG"
grep -v "Loading weights" "$LOG" | tail -60
