"""Settings, read from the environment with the `REPLAY_AUDIT_` prefix (or a `.env` file).

Plumbing: this module imports no domain package. A setting whose default is a domain's policy
(`large_run_traces`, `scan_flag_ulps`, `scan_token_budget`, `drift_alpha`, `drift_min_n`)
repeats the owner's constant as a plain value, named beside it, and
`tests/test_config.py` checks that the two agree.

With nothing set, the service runs on the embedded default: a SQLite file under `./var/`, an
in-process job runner and scheduler, and the committed small model as a checkpoint directory.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated, Final, Literal, NamedTuple

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

PACKAGE_DIR: Final = Path(__file__).resolve().parent
#: The committed small Llama checkpoint used by the demo and the tests.
BUNDLED_MODEL_DIR: Final = PACKAGE_DIR / "assets" / "tiny-llama"

#: Largest number of traces in one `POST /v1/traces:batch` (413 above it).
MAX_BATCH_TRACES: Final = 1000
#: Largest prompt + output length of one trace, in tokens (413 above it).
MAX_TRACE_TOKENS: Final = 65536
#: Largest top-k logged per step.
MAX_TOP_K: Final = 20
#: The session secret `.env.example` ships: refused, so a copied example cannot sign sessions
#: with a key everyone has.
SESSION_SECRET_PLACEHOLDER: Final = "change-me-to-a-long-random-string"
#: The benign null of a verification (worker settings and the CLI): prompts, and new tokens a
#: prompt, by default and at most.
DEFAULT_NULL_PROMPTS: Final = 64
DEFAULT_NULL_MAX_NEW_TOKENS: Final = 128
MAX_NULL_PROMPTS: Final = 100_000
MAX_NULL_MAX_NEW_TOKENS: Final = 8192


def normalise_database_url(url: str) -> str:
    """`postgres://` and `postgresql://` both mean psycopg 3 here."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


class WorkBudget(NamedTuple):
    """The most token positions one job may process where it runs, and the setting's name."""

    tokens: int
    setting: str


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REPLAY_AUDIT_", env_file=".env", extra="ignore")

    database_url: str = "sqlite:///var/replay-audit.db"
    #: "inprocess" runs jobs in a thread of the API process; "rq" sends them to Redis.
    runner: Literal["inprocess", "rq"] = "inprocess"
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Prepended to every RQ queue name (`gpu`, `cpu`, `audit`), job id and the cron job's name,
    #: so that deployments (or test runs) sharing one Redis never see each other's jobs. The API,
    #: the workers and `rq cron` of one deployment must share it.
    queue_prefix: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_-]*$")
    #: The RQ queue of replay targets that name no `device` (`cuda` goes to `gpu`, `cpu` to
    #: `cpu`). A deployment whose workers are all `replay-audit worker --queue cpu` sets `cpu`,
    #: or its runs wait on a queue nobody serves.
    default_queue: Literal["gpu", "cpu"] = "gpu"
    #: Directories searched (one level deep) for checkpoints, matched by weights_sha256.
    model_dirs: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [BUNDLED_MODEL_DIR])
    #: torch's CPU threads in every process that runs the engine (`serve` and the demo with the
    #: in-process runner, `worker`, `replay` and `generate` without --threads). Unset: torch's
    #: default (one per core), except beside the API (the in-process runner), which leaves it
    #: a core: max(1, cores - 1).
    torch_threads: int | None = Field(default=None, ge=1)
    max_request_bytes: int = 256 * 1024 * 1024
    #: Seconds an API process remembers a key that passed the check, so that a client's
    #: requests cost no query for their key. A revoked key is refused at once by the process
    #: that revoked it and within this many seconds by the others; 0: every request reads the
    #: key row.
    api_key_cache_s: float = Field(default=5.0, ge=0, le=300)
    #: A replay run (or an audit run) selecting at least this many traces and naming no `mode`
    #: is replayed scan-then-decode (see `replays.domain.LARGE_RUN_TRACES`).
    large_run_traces: int = Field(default=1000, ge=1)  # replays.domain.LARGE_RUN_TRACES
    #: The `decode_window` of a large run that names neither a mode nor a window (see
    #: `replays.domain.LARGE_RUN_DECODE_WINDOW`; bound formats.MAX_DECODE_WINDOW).
    large_run_decode_window: int = Field(default=32, ge=0, le=65_536)
    #: The `flagged_fraction` of a large run that names neither a mode nor a fraction: the
    #: share of its flagged traces (by a mismatch or a near-tie) decoded (see
    #: `replays.domain.LARGE_RUN_FLAGGED_FRACTION`, and formats.FLAGGED_FRACTION for why 0.05).
    large_run_flagged_fraction: float = Field(default=0.05, gt=0.0, le=1.0, allow_inf_nan=False)
    #: The `scan_flag_ulps` of scan-then-decode runs that name none (`formats.SCAN_FLAG_ULPS`
    #: says what it does, and why 0). Read where runs are created; each run records its value.
    #: (Default replays.domain.DEFAULT_SCAN_FLAG_ULPS, bound MAX_SCAN_FLAG_ULPS.)
    scan_flag_ulps: float = Field(default=0.0, le=1024.0, allow_inf_nan=False)
    #: Tokens (padding included) per forward of a worker's batched scans.
    #: (Default engine.protocol.DEFAULT_SCAN_TOKEN_BUDGET.)
    scan_token_budget: int = Field(default=16384, ge=1)
    #: Most token positions one screening may decode: its prompts' tokens plus max_new_tokens
    #: each, times the runs of its plan (a batch run counted per copy). A larger request is a
    #: 422 naming `prompts` (docs/screening.md, "Bounded work").
    screening_token_budget: int = Field(default=2_000_000, ge=1)
    #: The same for a screening that runs on a CPU worker, which decodes hundreds of times
    #: slower (2,000,000 positions held a 2-core worker for 44 minutes; this, a few).
    screening_cpu_token_budget: int = Field(default=200_000, ge=1)
    #: Most token positions (prompt + output, every trace) one verification may scan, on a GPU
    #: and on a CPU; a larger selection is a 422 on `filter` (docs/verify.md).
    verification_token_budget: int = Field(default=20_000_000, ge=1)
    verification_cpu_token_budget: int = Field(default=500_000, ge=1)
    #: The benign null a worker measures for a verification (once per checkpoint, platform and
    #: claim, then stored): its prompts (the first of `verify_null_prompts_file`, JSON lines
    #: with a "prompt" each; default the bundled 64) and new tokens a prompt. A null of few
    #: prompts promises a false-alarm rate its next prompts break (docs/verify.md); a stored
    #: null of another shape is measured again.
    verify_null_prompts: int = Field(default=DEFAULT_NULL_PROMPTS, ge=2, le=MAX_NULL_PROMPTS)
    verify_null_max_new_tokens: int = Field(
        default=DEFAULT_NULL_MAX_NEW_TOKENS, ge=1, le=MAX_NULL_MAX_NEW_TOKENS
    )
    verify_null_prompts_file: Path | None = None
    #: Seconds before RQ kills a replay job (RQ's own default of 180 s is too short for a GPU).
    job_timeout_s: int = 3600
    #: Key that signs the web UI's session cookies (any long random string; every API process
    #: of one deployment must share it). Unset: generated once and kept in `session_secret_file`.
    session_secret: SecretStr | None = None
    session_secret_file: Path = Path("var/session-secret")
    #: Seconds a web UI sign-in lasts.
    session_max_age_s: int = 12 * 3600
    #: The audit scheduler. "auto": a thread of `serve` when the runner is in-process, none when
    #: it is RQ (production runs `rq cron replay_audit.audits.cron_config`); or force it.
    scheduler: Literal["auto", "inprocess", "off"] = "auto"
    #: Seconds between scheduler ticks (start due audits, evaluate finished ones, deliver alerts,
    #: reconcile the queue). Due times are whole minutes, so more than 60 makes runs late.
    audit_tick_interval_s: float = Field(default=30.0, gt=0)
    #: Seconds one drift-alert webhook POST may take.
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    #: Seconds between webhook delivery attempts (backoff); one attempt more than entries.
    webhook_retry_intervals_s: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [10, 60, 300], min_length=1
    )
    #: Internal webhook destinations the operator allows: host names, addresses, networks,
    #: comma-separated (`127.0.0.1,10.0.0.0/8,hooks.internal`) or a JSON list. Without them a
    #: webhook reaches public addresses only (see replay_audit/audits/webhook.py).
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: Significance level of the drift rules' tests on counts: a schedule that has not drifted
    #: raises a false alarm on at most this share of its runs, per rule and comparison
    #: (docs/audits.md, "Trend and drift").
    drift_alpha: float = Field(default=0.01, gt=0, lt=1)  # audits.metrics.DEFAULT_ALPHA
    #: Traces a drift test needs on each side (the latest run, the pooled baseline runs).
    drift_min_n: int = Field(default=10, ge=1)  # audits.metrics.DEFAULT_MIN_N
    #: Days traces (with their tags, results and keys) are kept; unset keeps them forever. The
    #: scheduler's tick prunes what is older (`replay-audit prune` does it by hand). On
    #: PostgreSQL whole weekly partitions go, so a trace stays up to 7 days longer.
    retention_days: int | None = Field(default=None, gt=0)
    #: Log lines of `serve`, `worker` and `scheduler`: "text", or "json" (one object a line,
    #: with the request id, project, replay run id and job id where there is one).
    log_format: Literal["text", "json"] = "text"
    #: Prometheus metrics (docs/operations.md): the API's `/metrics` and each worker's metrics
    #: port. Off: neither is served (nothing is counted for anyone to read).
    metrics_enabled: bool = True
    #: Interface of the separate metrics listeners: a worker's, and the API's when
    #: `api_metrics_port` is set. In a container, 0.0.0.0 (reachable on its network only).
    metrics_host: str = "127.0.0.1"
    #: Set: `serve` answers /metrics on metrics_host:api_metrics_port (one listener for all its
    #: processes) and not on the API's own port. Unset: `GET /metrics` on the API's port.
    api_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    #: Set: the API's `GET /metrics` answers only a scrape that sends `Authorization: Bearer
    #: <token>` (Prometheus: `authorization: {credentials_file: ...}`), else a 401; the
    #: separate listeners (api_metrics_port, workers') are for an internal interface.
    metrics_token: SecretStr | None = None
    #: The port of `replay-audit worker`'s metrics (`--metrics-port` overrides it; 0: none).
    #: Each worker on one host needs its own.
    worker_metrics_port: int = Field(default=9101, ge=0, le=65535)
    #: Worker processes `replay-audit worker` runs on its device (`--processes` overrides it),
    #: each taking jobs of its own. Unset: 2 for a GPU worker of one device, 1 for a CPU or
    #: tensor-parallel worker (the measured defaults: cli.worker_group.GPU_WORKER_PROCESSES).
    worker_processes: int | None = Field(default=None, ge=1, le=64)
    #: Live RQ workers `/readyz` needs (any GPU kind); 0: workers are reported, not required.
    ready_min_workers: int = Field(default=0, ge=0)

    @field_validator("database_url")
    @classmethod
    def _normalise(cls, v: str) -> str:
        return normalise_database_url(v)

    @field_validator("session_secret")
    @classmethod
    def _not_the_placeholder(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and v.get_secret_value().strip() == SESSION_SECRET_PLACEHOLDER:
            raise ValueError(
                "still the placeholder of .env.example; set a long random string (python -c "
                '"import secrets; print(secrets.token_urlsafe(32))") or remove the line to have '
                "one generated into REPLAY_AUDIT_SESSION_SECRET_FILE (var/session-secret)"
            )
        return v

    @field_validator("webhook_allowed_hosts", "model_dirs", mode="before")
    @classmethod
    def _split(cls, v: object, info: ValidationInfo) -> object:
        """A list given as a JSON list, or as text: hosts comma-separated, directories
        colon-separated (as PATH)."""
        if not isinstance(v, str):
            return v
        if v.lstrip().startswith("["):
            return json.loads(v)
        if info.field_name == "model_dirs":
            return [p for p in v.split(":") if p]
        return [h.strip() for h in v.split(",") if h.strip()]

    @field_validator("webhook_allowed_hosts")
    @classmethod
    def _check_hosts(cls, v: list[str]) -> list[str]:
        # A typo fails at start-up, not at the first delivery.
        for entry in v:
            try:
                ipaddress.ip_network(entry.strip().strip("[]"), strict=False)
            except ValueError:
                if not re.fullmatch(r"[A-Za-z0-9._-]+", entry.strip()):
                    raise ValueError(
                        f"{entry!r} is not a host name, an address or a network"
                    ) from None
        return v


def work_budget(
    settings: Settings, job: Literal["screening", "verification"], cpu: bool
) -> WorkBudget:
    """The budget of a `job` that runs on a CPU (`cpu`) or a GPU."""
    name = f"{job}_{'cpu_' if cpu else ''}token_budget"
    return WorkBudget(getattr(settings, name), f"REPLAY_AUDIT_{name.upper()}")


def get_settings() -> Settings:
    """The settings from the environment (and `.env`), read now. Not cached: each edge (the
    app factory, a CLI command, a job) reads them once and passes them on, so nothing in the
    process holds settings that a test or a reconfiguration would have to reset."""
    return Settings()
