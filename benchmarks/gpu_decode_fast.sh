#!/usr/bin/env bash
# The faithful fast decode on a lent GPU (device tool, `carry: [".whl"]`), about 4 minutes on
# an H100 (`--quick`: about 2): random TinyLlama-shaped model in BF16, batch 1, 256 new tokens.
#   1. tok/s and % of the HBM bound (measured in the same run) of transformers' generate(), a
#      plain transformers KV-cache loop, our dynamic path (the piecewise path's fallback), the
#      piecewise path (CUDA graphs around an eager attention) and the compiled path, gated C on
#      piecewise/compiled;
#   2. first, identity of the piecewise path with generate() on 16 random prompts (48 tokens) in bf16
#      and fp16: tokens, each step's float32 logits bitwise, and the dynamic path's hidden
#      states and logits bitwise (first 24 steps);
#   3. the engine's piecewise GPU tests (SKIP_TESTS=1 leaves them out).
# PROFILE=1 adds the piecewise decode's top kernels (in the JSON and the log: host- or GPU-bound?).
# JSON in $OUT/decode_fast.json (rewritten after each measurement: a run cut short keeps what it
# measured; errors are recorded there, never fatal), logs beside it, a summary on stdout.
#   bash benchmarks/gpu_decode_fast.sh [--quick]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# No CUBLAS_WORKSPACE_CONFIG and no SDPA switch: every path runs as a user's plain generate().
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
QUICK=""; [ "${1:-}" = "--quick" ] && QUICK="--quick"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/env.txt"

timeout ${BENCH_TIMEOUT:-290} python3 benchmarks/decode.py --tinyllama --device cuda --dtype bf16 \
    --tokens ${TOKENS:-256} --repeats ${REPEATS:-5} --dynamic-repeats 1 $QUICK \
    --variants piecewise generate hf_generate hf_kv_loop compiled \
    --gated piecewise compiled --max-cache-len 4096 --hbm \
    --identity bf16 fp16 --identity-first --budget-s ${BUDGET_S:-240} ${PROFILE:+--profile piecewise} \
    --out "$OUT/decode_fast.json" > /dev/null 2> "$OUT/decode_fast.log"
echo "decode.py exit $?"

if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-60} python3 -m pytest -m gpu tests/engine/test_engine_gpu.py \
      --confcutdir=tests/engine -q -p no:cacheprovider -rfE -k "piecewise or self_replay" \
      > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?"; tail -n 5 "$OUT/gpu_tests.log"
fi

python3 - "$OUT/decode_fast.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(d.get("device"), "torch", d.get("torch"), "transformers", d.get("transformers"))
hbm = d.get("hbm", {})
if "bound_tokens_per_s" in hbm:
    print(f"HBM: read {hbm['read_GBps']:.0f} GB/s, copy {hbm['copy_GBps_read_plus_write']:.0f} GB/s,"
          f" {hbm['bytes_per_token'] / 1e9:.2f} GB/token -> bound {hbm['bound_tokens_per_s']:.0f} tok/s")
else:
    print("HBM:", hbm)
print(f"{'path':12s} {'tok/s':>8s} {'%bound':>7s} {'%686':>6s} {'gated C':>8s}  extras / error")
for k in ("hf_generate", "hf_kv_loop", "dynamic", "piecewise", "compiled"):
    v = d.get(k)
    if not isinstance(v, dict):
        continue
    if "tokens_per_s" not in v:
        print(f"{k:12s} {str(v.get('error') or v.get('skipped'))[:150]}")
        continue
    g = v.get("gated_C_tokens_per_s")
    x = v.get("extras", {})
    keep = {a: x[a] for a in ("decoder", "cuda_graph", "piecewise_check", "piecewise_error",
                              "capture_error", "compiled", "static_cache_lens_used") if a in x}
    print(f"{k:12s} {v['tokens_per_s']:8.1f} {v.get('pct_of_measured_bound', float('nan')):6.1f}%"
          f" {v['pct_of_reference_bound']:5.1f}% {'' if g is None else f'{g:8.1f}':>8s}  {keep}")
print("same tokens as generate():", d.get("same_tokens_as_hf_generate"))
for k in ("identity_bf16", "identity_fp16"):
    v = d.get(k, {})
    print(k, v.get("summary") or v.get("error") or v.get("skipped"))
    for i, r in enumerate(v.get("prompts", [])):
        if not (r["token_identical"] and r["logits_bitwise_vs_generate"] and r["logits_bitwise_vs_dynamic"]):
            print("   prompt", i, r)
EOF
grep -v "Loading weights" "$OUT/decode_fast.log" | grep -iv "warn" | tail -n 25
