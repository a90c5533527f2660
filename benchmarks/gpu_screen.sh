#!/usr/bin/env bash
# The screening on a lent GPU (device tool, `carry: [".whl"]`), in steps that each fit one
# 10-minute device command; what a step leaves in .models/ stays on the warm machine for the next.
#
#   bash benchmarks/gpu_screen.sh train    # trains .models/py-12x768 (12 layers, width 768, on
#                                          # the image's Python stdlib, ~5 min) unless it exists
#   bash benchmarks/gpu_screen.sh screen   # screens it on cuda (resumable: run it again if it
#                                          # stopped at its time limit); report.json/.html in $OUT
#   bash benchmarks/gpu_screen.sh all      # both, for a machine with time to spare
#
# Settings: MINUTES (training budget, 3), PROMPTS (16), TOKENS (48 new tokens per prompt),
# KNOBS (comma-separated `--knobs`, default all), REFERENCE (`--reference-dtype`: fp32, bf16 or
# fp16; default the checkpoint's own dtype, fp32 here; with bf16 the SDPA flash and cuDNN
# backends, which have no fp32 kernel, can run; its state and report go to their own names,
# e.g. `REFERENCE=bf16 KNOBS=attn_kernel bash benchmarks/gpu_screen.sh screen`), SCREEN_TIMEOUT (seconds one screen command may
# run before it stops and leaves the rest for the next call, 540). About 25 runs x PROMPTS x
# TOKENS decode steps at ~15 ms each on the dynamic-cache path, plus loads and one compile.
# Every step's wall time goes to $OUT/screen_wall.txt.
set -u
. benchmarks/_gpu_train.sh
M=.models/py-12x768
REFERENCE=${REFERENCE:-}
S=.models/screen-py-12x768${REFERENCE:+-ref-$REFERENCE}
step=${1:-all}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"

train() {
    train_model "$M" screen_wall.txt --layers 12 --hidden 768 --intermediate 2048 --heads 12 \
        --kv-heads 4 --batch-size 32 --lr 1e-3 --warmup 200 --log-every 200 \
        --minutes "${MINUTES:-3}"
}

screen() {
    [ -f "$M/model.safetensors" ] || { echo "no model at $M: run the train step first"; return 1; }
    local t0=$SECONDS sfx=${REFERENCE:+-ref-$REFERENCE}
    timeout "${SCREEN_TIMEOUT:-540}" python3 -m replay_audit screen --model "$M" \
        --prompts "$M/prompts.jsonl" --device cuda --limit "${PROMPTS:-16}" \
        --max-new-tokens "${TOKENS:-48}" ${KNOBS:+--knobs "$KNOBS"} \
        ${REFERENCE:+--reference-dtype "$REFERENCE"} --out "$S" \
        2> "$OUT/screen$sfx.err"
    local rc=$?
    echo "screen${REFERENCE:+ (reference $REFERENCE)}: $((SECONDS - t0)) s (exit $rc)" \
        | tee -a "$OUT/screen_wall.txt"
    ls "$S/state" | wc -l | xargs echo "stored state files:"
    if [ $rc -eq 124 ]; then
        echo "stopped at its time limit: run 'bash benchmarks/gpu_screen.sh screen' again to resume"
    fi
    cp "$S"/report.json "$OUT/report$sfx.json" 2>/dev/null
    cp "$S"/report.html "$OUT/report$sfx.html" 2>/dev/null
    tail -n 5 "$OUT/screen$sfx.err"
    return $rc
}

case "$step" in
    train) train ;;
    screen) screen ;;
    all) train && screen ;;
    *) echo "usage: $0 train|screen|all"; exit 2 ;;
esac
