#!/usr/bin/env bash
# Tensor parallel on a lent two-GPU machine (device tool, kind nvidia-h100-x2, carry [".whl"]:
# the wheels gpu_engine.sh carries, transformers matching the CPU venv; the image has torch and
# accelerate). A random TinyLlama-1.1B-shaped Llama in BF16: N prompts generated at TP 1 and at
# TP 2 (transformers' generate() on both ranks, NCCL), the TP-2 traces self-replayed at TP 2 and
# replayed at TP 1 through the replay pipeline; the fraction of outputs TP 2 flips against TP 1,
# and the TP-1 replay's divergences with their categories. JSON and logs in $OUT.
# Defaults TRACES=48, TOKENS=128, cut at BENCH_TIMEOUT=460 s (under 8 minutes in all);
# DEGREES="2 4" on a four-GPU kind; MODEL, a checkpoint on the machine (gpu_verify.sh's trained
# one), instead of the random model. Run on 2x H200 on 2026-11-26 (BENCHMARKS.md).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# NVLink multicast off here and in every rank (the engine sets them too: KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__, torch.cuda.device_count(), 'GPUs')"
} 2>&1 | tee "$OUT/env.txt"
timeout ${BENCH_TIMEOUT:-460} python3 benchmarks/tp.py --device cuda --dtype bf16 ${MODEL:+--model "$MODEL"} \
    --degrees ${DEGREES:-2} --traces ${TRACES:-48} --tokens ${TOKENS:-128} \
    > "$OUT/tp.json" 2> "$OUT/tp.log"
echo "tp.py exit $?"
grep -v Warning "$OUT/tp.log" | tail -n 15; cat "$OUT/tp.json"
