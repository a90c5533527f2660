#!/usr/bin/env bash
# The provider audit (issue 23) on a lent GPU (device tool, `carry: [".whl"]`), on a Llama of
# 1.07 B parameters trained here, in steps that each fit one 10-minute device command; what a
# step leaves in .models/ stays on the warm machine for the next.
#
#   bash benchmarks/gpu_verify.sh train    # trains .models/py-24x2048 (24 layers, width 2048,
#                                          # TinyLlama's other dimensions, vocabulary 4,096, on
#                                          # the image's Python stdlib; MINUTES, 2.5) unless it exists
#   bash benchmarks/gpu_verify.sh verify   # benchmarks/verify.py on it: the null, then every
#                                          # simulated provider (TP=2 where two GPUs are visible)
#   bash benchmarks/gpu_verify.sh all      # both
#
# Settings: NULL (prompts of the null, 16), EVAL (prompts of each simulation, 32), TOKENS (new
# tokens per prompt, 128), DRAWS (groups per budget, 300), VERIFY_TIMEOUT (540 s), ONLY (the
# simulations to run), REUSE_NULL=1 (take the null an earlier verify step measured on this warm
# machine, and show its simulations in the tables too: a null and simulations too long for one
# command, measured over several). Results: $OUT/verify.json (written as each simulation
# ends), verify.log, train.log, wall.txt; each step's JSON is kept in $M/verify-runs/.
set -u
. benchmarks/_gpu_train.sh
# NVLink multicast off here and in every rank of the TP=2 provider (KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8
M=.models/py-24x2048
step=${1:-all}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count(), 'GPUs')"
} 2>&1 | tee "$OUT/env.txt"

train() {
    train_model "$M" wall.txt --layers 24 --hidden 2048 --intermediate 5632 --heads 32 \
        --kv-heads 4 --batch-size 32 --lr 3e-4 --warmup 50 --log-every 50 \
        --minutes "${MINUTES:-2.5}"
}

verify() {
    [ -f "$M/model.safetensors" ] || { echo "no model at $M: run the train step first"; return 1; }
    local t0=$SECONDS runs="$M/verify-runs" reuse=()
    mkdir -p "$runs"
    if [ "${REUSE_NULL:-0}" = 1 ]; then
        reuse=(--null "$(ls "$runs"/*.json | head -n 1)" --with-results "$runs"/*.json)
    fi
    timeout "${VERIFY_TIMEOUT:-540}" python3 benchmarks/verify.py --model "$M" --device cuda \
        --prompts "$M/prompts.jsonl" --null-prompts "${NULL:-16}" --eval-prompts "${EVAL:-32}" \
        --max-new-tokens "${TOKENS:-128}" --draws "${DRAWS:-300}" --json "$OUT/verify.json" \
        ${ONLY:+--only $ONLY} "${reuse[@]}" > "$OUT/verify.md" 2> "$OUT/verify.log"
    echo "verify.py exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/wall.txt"
    [ -f "$OUT/verify.json" ] && cp "$OUT/verify.json" "$runs/$(date +%s).json"
    grep -v -i warn "$OUT/verify.log" | tail -n 20; cat "$OUT/verify.md"
}

case "$step" in
    train) train ;;
    verify) verify ;;
    all) train && verify ;;
    *) echo "usage: $0 train|verify|all"; exit 2 ;;
esac
