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
# Each model in two commands on one warm machine (the benign stage, then the rest; /tmp/g and
# .models/ stay between them):
#   MODEL=/tmp/g/smollm2 STAGE=benign bash benchmarks/gpu_verify_scale.sh smol   # ~370 s
#   MODEL=/tmp/g/smollm2 STAGE=rest   bash benchmarks/gpu_verify_scale.sh smol   # ~200 s + CPU
#   bash benchmarks/gpu_verify_scale.sh train                                    # ~200 s
#   STAGE=benign bash benchmarks/gpu_verify_scale.sh llama                       # ~400 s
#   STAGE=rest   bash benchmarks/gpu_verify_scale.sh llama                       # ~250 s + CPU
# (estimates for the defaults, from the CPU profile of the phases and plain generate() at
# 30-40 ms a step at batch 256: each large-batch variation ~262,000 tokens, ~9 calls, 40-50 s;
# batch 8, 4 and 1 ~26 s each; scanning 1,400,000 tokens ~10-20 s; the log prints each phase's
# wall as it ends, and `stopped at ... tokens` where CLAIM_SECONDS cut the claimed variation
# short; "+ CPU": the cross-platform scan fills the rest of the command, CROSS=0 skips it).
# 1,400,000 benign tokens: each large-batch variation holds ~131,072 tokens in each half, so
# the null reaches the 131,072 budget there; batch 8, 4 and 1 cannot (8 rows a step: ~300
# tokens/s), their false alarms are measured up to their own tokens. STAGE=all runs both in
# one command: ~570 s at these settings, past the limit (halve BENIGN_TOKENS for it).
#
# Settings: PROMPTS (a JSONL of "prompt" texts; smol: the bundled 64, each reused as chat
# variants), BENIGN_TOKENS (benign tokens in all, 1,400,000), TOKENS (new tokens a prompt, 128),
# BATCH (the large batch, 256), SMALL (prompts at batch 8; batch 4 half, 64), B1 (prompts at
# batch 1, 8), GEN_WORKERS (processes generating each small-batch variation, 1; each takes
# whole batches, so the tokens are one process's: batch 1 is bound by generate()'s host loop
# at ~37 tokens/s on an H200; measured with GEN_WORKERS=8 on the trained 1.07 B: batch 1 at
# 191 tokens/s (5.2x), batch 8 at 759, so SMALL=256 B1=128 GEN_WORKERS=8 BENIGN_TOKENS=1100000
# took 369 s for the llama benign stage), EVAL (prompts of each simulated provider, 256), SAMPLED (1:
# the sampled-traffic section, default; 0: none), SAMPLED_PROMPTS (128), CLAIM_SECONDS (the claimed variation's
# generation at most, 60: the guard that keeps the step inside its command), DRAWS
# (calibration draws, 300), FA_DRAWS (1000), SCAN_BUDGET (positions a scan forward, 32768),
# STDLIB (llama: distinct stdlib function beginnings, 900), STAGE (benign, the default; rest; all),
# TIMEOUT (540).
# Results in $OUT (at most 8 files): the benign stage: benign.json, traces.jsonl.gz (the benign
# traces, for the CPU-as-auditor run here afterwards: verify_scale.py --scan-traces), <step>.log,
# wall.txt (the machine, then each command's wall); the rest: scale.json, scale.md, null.npz (the
# null's per-token deficits: `verify_scale.py --null-from null.npz` measures decisions on a CPU), cross.json,
# cross.md (CROSS=1, default: in the time the rest leaves, the traces of the benign stage
# scanned on this host's CPU against a null of H200 traces scanned there and one generated
# there; CROSS_TOKENS 200,000 at most, CROSS_NULL 8 prompts a variation), <step>.log, wall.txt.
set -u
. benchmarks/_gpu_train.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8
M=.models/py-24x2048
step=${1:-smol}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count(), 'GPUs')"
} 2>&1 | tee "$OUT/wall.txt"

scale() {  # scale NAME MODEL [verify_scale.py options]
    local name=$1 model=$2 t0=$SECONDS
    shift 2
    [ -f "$model/config.json" ] || { echo "no checkpoint at $model"; return 1; }
    mkdir -p /tmp/g
    timeout "${TIMEOUT:-540}" python3 benchmarks/verify_scale.py --model "$model" --device cuda \
        --benign-tokens "${BENIGN_TOKENS:-1400000}" --max-new-tokens "${TOKENS:-128}" \
        --batch "${BATCH:-256}" --small-prompts "${SMALL:-64}" --b1-prompts "${B1:-8}" \
        --gen-workers "${GEN_WORKERS:-1}" \
        --eval-prompts "${EVAL:-256}" --claim-seconds "${CLAIM_SECONDS:-60}" \
        --draws "${DRAWS:-300}" --fa-draws "${FA_DRAWS:-1000}" \
        --scan-token-budget "${SCAN_BUDGET:-32768}" --sampled-prompts "${SAMPLED_PROMPTS:-128}" \
        ${PROMPTS:+--prompts "$PROMPTS"} \
        $([ "${SAMPLED:-1}" = 1 ] && echo --sampled) --stage "${STAGE:-benign}" --work "/tmp/g/work-$name" --tmp /tmp/g \
        $([ "${STAGE:-benign}" != rest ] && echo --save-traces "$OUT/traces.jsonl.gz") \
        $([ "${STAGE:-benign}" != benign ] && echo --save-null "$OUT/null.npz") \
        --out "$OUT" "$@" \
        > "$OUT/$name.md" 2> "$OUT/$name.log"
    echo "$name (stage ${STAGE:-benign}): exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/wall.txt"
    rm -f "$OUT/$name.md"  # the same as scale.md
    if [ "${STAGE:-benign}" != rest ] && [ -f "$OUT/traces.jsonl.gz" ]; then
        cp "$OUT/traces.jsonl.gz" "/tmp/g/traces-$name.jsonl.gz"
    fi
    # The CPU as auditor, on this host's CPU, in the time left: the traces just generated on the
    # H200 scanned there against two CPU nulls (verify_scale.py --scan-traces).
    local left=$(( ${TIMEOUT:-540} - (SECONDS - t0) - 30 ))
    if [ "${STAGE:-benign}" != benign ] && [ "${CROSS:-1}" = 1 ] && [ "$left" -gt 90 ] \
        && [ -f "/tmp/g/traces-$name.jsonl.gz" ]; then
        timeout "$left" python3 benchmarks/verify_scale.py --model "$model" --device cpu \
            --scan-traces "/tmp/g/traces-$name.jsonl.gz" \
            --scan-max-tokens "${CROSS_TOKENS:-200000}" --cpu-null-prompts "${CROSS_NULL:-8}" \
            --max-new-tokens "${TOKENS:-128}" --batch 8 --eval-prompts 8 \
            --time-limit $((left - 90)) --tmp /tmp/g --out "$OUT" \
            > /dev/null 2>> "$OUT/$name.log"
        echo "$name cross-platform (CPU of this host): exit $? in $((SECONDS - t0)) s" \
            | tee -a "$OUT/wall.txt"
        [ -f "$OUT/cross.md" ] && cat "$OUT/cross.md"
    fi
    grep -v -i warn "$OUT/$name.log" | grep -E "s \(total|tok/s|stopped" | tail -n 40
    [ -f "$OUT/scale.md" ] && cat "$OUT/scale.md"
    [ -f "$OUT/benign.json" ] && cat "$OUT/benign.json"
    ls -la "$OUT"
}


case "$step" in
    smol) scale smol "${MODEL:-/tmp/g/smollm2}" ;;
    train) bash benchmarks/gpu_verify.sh train ;;  # its one recipe of the 1.07 B
    llama) scale llama "${MODEL:-$M}" --stdlib-prompts "${STDLIB:-900}" ;;
    *) echo "usage: $0 smol|train|llama"; exit 2 ;;
esac
