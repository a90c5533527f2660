# Sourced by the gpu_*.sh scripts that train their checkpoint on the lent GPU (device tool,
# `carry: [".whl"]`): the carried wheels installed, the offline environment, $OUT, and
# `train_model`. The script sets nothing before sourcing it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

# train_model DIR WALL [scripts/train_tiny_model.py options: shape, lr, warmup, minutes...]:
# a Llama trained on the image's Python stdlib into DIR (its held-out prompts in
# DIR/prompts.jsonl), unless DIR holds both already; its wall time appended to $OUT/WALL.
train_model() {
    local dir=$1 wall=$2
    shift 2
    if [ -f "$dir/model.safetensors" ] && [ -f "$dir/prompts.jsonl" ]; then
        echo "reusing $dir"; return 0
    fi
    local t0=$SECONDS
    python3 scripts/train_tiny_model.py --device cuda --amp bf16 --threads 8 "$@" \
        --out "$dir" --prompts-out "$dir/prompts.jsonl" 2>&1 | tee "$OUT/train.log" | tail -25
    echo "train: $((SECONDS - t0)) s" | tee -a "$OUT/$wall"
}
