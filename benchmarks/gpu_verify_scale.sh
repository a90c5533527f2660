#!/usr/bin/env bash
# Provider audit at scale (issue 34) on one lent H200 (device tool, `carry: [".whl"]`):
# benchmarks/verify_scale.py per checkpoint, each step one 10-minute device command (540 s of
# wall inside it); what a step leaves in /tmp/g and .models/ stays on the warm machine.
#
#   bash benchmarks/gpu_verify_scale.sh smol    # SmolLM2-135M-Instruct at $MODEL (/tmp/g/smollm2,
#                                               # built there by the lead): chat prompts
#   bash benchmarks/gpu_verify_scale.sh train   # trains .models/py-24x2048 (the 1.07 B Llama of
#                                               # gpu_verify.sh, MINUTES 2.5) unless it exists
#   bash benchmarks/gpu_verify_scale.sh llama   # the 1.07 B: stdlib function beginnings
#
# Settings: PROMPTS (a JSONL of "prompt" texts; smol: the bundled 64), BENIGN_TOKENS (benign tokens in all, 1,000,000), TOKENS (new tokens a prompt, 128),
# BATCH (the large batch, 256), SMALL (prompts at batch 8; batch 4 half, 64), B1 (prompts at
# batch 1, 8), EVAL (prompts of each simulated provider, 256), CLAIM_SECONDS (the claimed
# variation's generation at most, 45: the guard that keeps the step inside its command),
# DRAWS (calibration draws, 300), FA_DRAWS (1000), SCAN_BUDGET (positions a scan forward,
# 32768), SAMPLED (1: the sampled-traffic section), STAGE (all; benign: stop after the benign
# scan, keeping it in /tmp/g/work-<step>; rest: the simulations and statistics from there: a
# step too long for one command, as two on the warm machine), TIMEOUT (540).
# Expected walls (H200, from the CPU profile and plain generate() at ~30-40 ms a step at batch
# 256): smol ~400 s (benign ~250, simulations ~60, sampled ~30, statistics ~40), llama ~450 s.
# Results in $OUT (at most 6 files): scale.json, scale.md, traces.jsonl.gz (the benign traces,
# for the CPU-as-auditor run here afterwards: verify_scale.py --scan-traces), <step>.log,
# env.txt, wall.txt.
set -u
. benchmarks/_gpu_train.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8
M=.models/py-24x2048
step=${1:-smol}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count(), 'GPUs')"
} 2>&1 | tee "$OUT/env.txt"

scale() {  # scale NAME MODEL [verify_scale.py options]
    local name=$1 model=$2 t0=$SECONDS
    shift 2
    [ -f "$model/config.json" ] || { echo "no checkpoint at $model"; return 1; }
    mkdir -p /tmp/g
    timeout "${TIMEOUT:-540}" python3 benchmarks/verify_scale.py --model "$model" --device cuda \
        --benign-tokens "${BENIGN_TOKENS:-1000000}" --max-new-tokens "${TOKENS:-128}" \
        --batch "${BATCH:-256}" --small-prompts "${SMALL:-64}" --b1-prompts "${B1:-8}" \
        --eval-prompts "${EVAL:-256}" --claim-seconds "${CLAIM_SECONDS:-45}" \
        --draws "${DRAWS:-300}" --fa-draws "${FA_DRAWS:-1000}" \
        --scan-token-budget "${SCAN_BUDGET:-32768}" ${SAMPLED:+--sampled} \
        ${PROMPTS:+--prompts "$PROMPTS"} \
        --stage "${STAGE:-all}" --work "/tmp/g/work-$name" --tmp /tmp/g \
        --save-traces "$OUT/traces.jsonl.gz" --out "$OUT" "$@" \
        > "$OUT/$name.md" 2> "$OUT/$name.log"
    echo "$name (stage ${STAGE:-all}): exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/wall.txt"
    rm -f "$OUT/$name.md"  # the same as scale.md
    grep -v -i warn "$OUT/$name.log" | grep -E "s \(total|tok/s|stopped" | tail -n 40
    [ -f "$OUT/scale.md" ] && cat "$OUT/scale.md"
    [ -f "$OUT/benign.json" ] && cat "$OUT/benign.json"
    ls -la "$OUT"
}

train() {
    train_model "$M" wall.txt --layers 24 --hidden 2048 --intermediate 5632 --heads 32 \
        --kv-heads 4 --batch-size 32 --lr 3e-4 --warmup 50 --log-every 50 \
        --minutes "${MINUTES:-2.5}"
}

case "$step" in
    smol) scale smol "${MODEL:-/tmp/g/smollm2}" ;;
    train) train ;;
    llama) scale llama "${MODEL:-$M}" --stdlib-prompts "${STDLIB:-1024}" ;;
    *) echo "usage: $0 smol|train|llama"; exit 2 ;;
esac
