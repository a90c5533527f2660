#!/usr/bin/env bash
# The 1.07 B Llama the provider-audit and TP benchmarks use, trained on a lent GPU (device tool,
# `carry: [".whl"]`): 24 layers, width 2048, TinyLlama's other dimensions, vocabulary 4,096, on
# the image's Python stdlib, MINUTES of training (2.5), into .models/py-24x2048 unless it exists.
#
#   bash benchmarks/gpu_verify.sh train
#
# The provider audit itself is benchmarks/gpu_verify_scale.sh (issue 34); the issue-23 figures
# in BENCHMARKS.md came from this script's former `verify` step and benchmarks/verify.py, both
# replaced by it (`git show 25e6a8d:benchmarks/verify.py` holds that script).
set -u
. benchmarks/_gpu_train.sh
M=.models/py-24x2048
case "${1:-train}" in
    train)
        train_model "$M" wall.txt --layers 24 --hidden 2048 --intermediate 5632 --heads 32 \
            --kv-heads 4 --batch-size 32 --lr 3e-4 --warmup 50 --log-every 50 \
            --minutes "${MINUTES:-2.5}"
        ;;
    *) echo "usage: $0 train (the provider audit: benchmarks/gpu_verify_scale.sh)"; exit 2 ;;
esac
