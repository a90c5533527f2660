"""The migrations build the schema the models describe, and revert cleanly, on both databases."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from replay_audit.db import migration


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A brand-new, never migrated database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    make: Callable[[], str] = request.getfixturevalue("empty_postgres_database")
    return make()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    head = migration.head_revision()
    migration.upgrade(empty_db_url)
    assert migration.current_revision(empty_db_url) == head
    tables = _tables(empty_db_url)
    assert {"projects", "api_keys", "numerical_configs", "traces", "trace_tags"} <= tables

    migration.downgrade(empty_db_url, "base")
    assert migration.current_revision(empty_db_url) is None
    assert _tables(empty_db_url) <= {"alembic_version"}

    migration.upgrade(empty_db_url)
    assert migration.current_revision(empty_db_url) == head
    assert _tables(empty_db_url) == tables


def test_each_revision_reverts_one_step(empty_db_url: str) -> None:
    migration.upgrade(empty_db_url, "0001")
    assert migration.current_revision(empty_db_url) == "0001"
    migration.upgrade(empty_db_url)
    migration.downgrade(empty_db_url, "0001")
    assert migration.current_revision(empty_db_url) == "0001"
    migration.downgrade(empty_db_url, "base")
    assert migration.current_revision(empty_db_url) is None


def test_migrated_schema_matches_the_models(empty_db_url: str) -> None:
    """What `alembic check` runs in CI: autogenerate finds nothing left to migrate."""
    migration.upgrade(empty_db_url)
    command.check(migration.alembic_config(empty_db_url))  # raises on any difference


def test_0004_backfills_answers_from_the_detail_json(empty_db_url: str) -> None:
    from sqlalchemy import text

    migration.upgrade(empty_db_url, "0003")
    engine = create_engine(empty_db_url)
    semantic = '{"semantic": {"extractor": "gsm8k", "logged_answer": "42", "replay_answer": "41"}}'
    try:
        with engine.begin() as c:
            c.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"),
                {"t": "2026-01-01 00:00:00"},
            )
            c.execute(
                text(
                    "INSERT INTO numerical_configs (id, public_id, content_sha256, config_json,"
                    " dtype, lm_head_dtype, attn_kernel, device, batch_size, created_at) VALUES"
                    " (1, 'nc_1', :h, '{}', 'bf16', 'bf16', 'eager', 'cpu', 1, :t)"
                ),
                {"h": "a" * 64, "t": "2026-01-01 00:00:00"},
            )
            c.execute(
                text(
                    "INSERT INTO traces (id, public_id, project_id, config_id, model_name,"
                    " weights_sha256, vocab_size, decoding, prompt_token_ids, output_token_ids,"
                    " n_prompt_tokens, n_output_tokens, tags, content_sha256, created_at) VALUES"
                    " (1, 'tr_1', 1, 1, 'm', :h, 10, '{}', :b, :b, 1, 1, '[]', :h, :t)"
                ),
                {"h": "b" * 64, "b": b"\x01\x00\x00\x00", "t": "2026-01-01 00:00:00"},
            )
            c.execute(
                text(
                    "INSERT INTO replay_runs (id, public_id, project_id, status, mode, compare,"
                    " request, targets, comparisons, n_traces, n_items, created_at) VALUES"
                    " (1, 'rr_1', 1, 'done', 'decode', 'logged', '{}', '[]', '[]', 1, 2, :t)"
                ),
                {"t": "2026-01-01 00:00:00"},
            )
            for rid, comparison, detail, agree in ((1, 0, semantic, False), (2, 1, "{}", None)):
                c.execute(
                    text(
                        "INSERT INTO replay_results (id, run_id, trace_id, comparison, status,"
                        " semantic_agree, detail, created_at) VALUES"
                        " (:id, 1, 1, :c, 'ok', :agree, :d, :t)"
                    ),
                    {
                        "id": rid,
                        "c": comparison,
                        "agree": agree,
                        "d": detail,
                        "t": "2026-01-01 00:00:00",
                    },
                )
        migration.upgrade(empty_db_url, "0004")
        with engine.connect() as c:
            rows = c.execute(
                text("SELECT answer_extractor, answer_a, answer_b FROM replay_results ORDER BY id")
            ).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [("gsm8k", "42", "41"), (None, None, None)]


def test_0012_rewrites_older_result_layouts_into_the_one_layout(empty_db_url: str) -> None:
    """Results of 0.x releases before 0012 (arm B at the top level with `logged_arm`, single
    steps named logged/replay, semantic answers named logged_answer/replay_answer) carried up
    through every revision are in the one layout the code reads; `resolved_a/b` are NULL (not
    recorded then)."""
    import json

    from sqlalchemy import text

    migration.upgrade(empty_db_url, "0003")
    engine = create_engine(empty_db_url)
    t = "2026-01-01 00:00:00"
    legacy = {
        "mode": "decode",
        "target": {"dtype": "fp16"},
        "environment": {"dtype": "fp16"},
        "logged_environment": {"dtype": "bf16"},
        "margins": [0.5, 0.25],
        "gate_fired_steps": [1],
        "changed_steps": 0,
        "replay_text": "b text",
        "logged_arm": {"target": {"dtype": "bf16"}, "text": "a text", "gate_triggers": 2},
        "single_step": {"step": 1, "logged": {"token": 3}, "replay": {"token": 4}, "disagree": 1},
        "semantic": {"extractor": "gsm8k", "logged_answer": "42", "replay_answer": "41"},
    }
    try:
        with engine.begin() as c:
            c.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"), {"t": t}
            )
            c.execute(
                text(
                    "INSERT INTO numerical_configs (id, public_id, content_sha256, config_json,"
                    " dtype, lm_head_dtype, attn_kernel, device, batch_size, created_at) VALUES"
                    " (1, 'nc_1', :h, '{}', 'bf16', 'bf16', 'eager', 'cpu', 1, :t)"
                ),
                {"h": "a" * 64, "t": t},
            )
            c.execute(
                text(
                    "INSERT INTO traces (id, public_id, project_id, config_id, model_name,"
                    " weights_sha256, vocab_size, decoding, prompt_token_ids, output_token_ids,"
                    " n_prompt_tokens, n_output_tokens, tags, content_sha256, created_at) VALUES"
                    " (1, 'tr_1', 1, 1, 'm', :h, 10, '{}', :b, :b, 1, 1, '[]', :h, :t)"
                ),
                {"h": "b" * 64, "b": b"\x01\x00\x00\x00", "t": t},
            )
            c.execute(
                text(
                    "INSERT INTO replay_runs (id, public_id, project_id, status, mode, compare,"
                    " request, targets, comparisons, n_traces, n_items, created_at) VALUES"
                    " (1, 'rr_1', 1, 'done', 'decode', 'logged', '{}', '[]', '[]', 1, 2, :t)"
                ),
                {"t": t},
            )
            for rid, detail in ((1, json.dumps(legacy)), (2, "{}")):
                c.execute(
                    text(
                        "INSERT INTO replay_results (id, run_id, trace_id, comparison, status,"
                        " detail, created_at) VALUES (:id, 1, 1, :c, 'ok', :d, :t)"
                    ),
                    {"id": rid, "c": rid - 1, "d": detail, "t": t},
                )
        migration.upgrade(empty_db_url, "0012")
        with engine.connect() as c:
            rows = c.execute(
                text("SELECT detail, resolved_a, resolved_b FROM replay_results ORDER BY id")
            ).all()
    finally:
        engine.dispose()
    details = [r[0] if isinstance(r[0], dict) else json.loads(r[0]) for r in rows]
    assert all(r[1] is None and r[2] is None for r in rows)
    d = details[0]
    assert set(d) == {"mode", "single_step", "semantic", "arms"}
    assert d["arms"]["b"]["text"] == "b text" and d["arms"]["b"]["margins"] == [0.5, 0.25]
    assert d["arms"]["b"]["target"] == {"dtype": "fp16"}
    assert d["arms"]["a"]["text"] == "a text" and d["arms"]["a"]["gate_triggers"] == 2
    assert d["arms"]["a"]["environment"] == {"dtype": "bf16"}
    assert d["single_step"] == {"step": 1, "a": {"token": 3}, "b": {"token": 4}, "disagree": 1}
    assert d["semantic"]["answer_a"] == "42" and d["semantic"]["agree"] is False
    assert "logged_answer" not in d["semantic"]
    assert details[1] == {}


def test_0006_gives_webhooks_a_secret_and_scrubs_stored_answers(empty_db_url: str) -> None:
    """Schedules with a webhook get a signing secret; alert attempts written before 0006 (with
    up to 200 characters of the receiver's answer) keep only a status code and error class."""
    import json

    from sqlalchemy import text

    migration.upgrade(empty_db_url, "0005")
    engine = create_engine(empty_db_url)
    t = "2026-01-01 00:00:00"
    leaked = "HTTP 500: internal detail 5f3a"
    log = [
        {"at": t, "ok": False, "error": leaked},
        {"at": t, "ok": False, "error": "ConnectTimeout: timed out"},
        {"at": t, "ok": False, "error": "ConnectError: [Errno 111] Connection refused"},
        {"at": t, "ok": True, "error": None},
    ]
    try:
        with engine.begin() as c:
            c.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"), {"t": t}
            )
            for sid, url in ((1, "https://hooks.example.com/x"), (2, None)):
                c.execute(
                    text(
                        "INSERT INTO audit_schedules (id, public_id, project_id, name, cron,"
                        " status, selection, sample_size, policy, seed, replay, ear_drop_points,"
                        " webhook_url, active_since, created_at, updated_at) VALUES (:id, :pid, 1,"
                        " :name, '0 2 * * *', 'active', '{}', 1, 'uniform', 0, '{}', 5, :url, :t,"
                        " :t, :t)"
                    ),
                    {"id": sid, "pid": f"as_{sid}", "name": f"s{sid}", "url": url, "t": t},
                )
            c.execute(
                text(
                    "INSERT INTO audit_runs (id, public_id, schedule_id, due_at, trigger, status,"
                    " window_start, window_end, n_candidates, n_sampled, flags, created_at)"
                    " VALUES (1, 'ar_1', 1, :t, 'scheduled', 'done', :t, :t, 0, 0, '[]', :t)"
                ),
                {"t": t},
            )
            c.execute(
                text(
                    "INSERT INTO audit_alerts (id, public_id, audit_run_id, url, payload, status,"
                    " attempts, attempt_log, last_error, created_at) VALUES (1, 'al_1', 1,"
                    " 'https://hooks.example.com/x', '{}', 'delivered', 4, :log, :last, :t)"
                ),
                {"log": json.dumps(log), "last": leaked, "t": t},
            )
        migration.upgrade(empty_db_url, "0006")
        with engine.connect() as c:
            secrets = (
                c.execute(text("SELECT webhook_secret FROM audit_schedules ORDER BY id"))
                .scalars()
                .all()
            )
            stored_log, last_error = c.execute(
                text("SELECT attempt_log, last_error FROM audit_alerts")
            ).one()
        migration.downgrade(empty_db_url, "0005")
        migration.upgrade(empty_db_url)
    finally:
        engine.dispose()
    assert secrets[0] is not None and secrets[0].startswith("whsec_") and secrets[1] is None
    stored = json.loads(stored_log) if isinstance(stored_log, str) else stored_log
    assert [(a["status_code"], a["error"], a["ok"]) for a in stored] == [
        (500, "http_5xx", False),
        (None, "timeout", False),
        (None, "connection_refused", False),
        (None, None, True),
    ]
    assert last_error == "http_5xx" and "detail" not in json.dumps(stored)


def test_0008_adds_token_pieces_keeping_traces_stored_before(empty_db_url: str) -> None:
    """A trace stored before 0008 has no pieces (null) and keeps everything else; pieces are
    stored after it; down to 0006 drops the column and keeps the trace, and up again works."""
    from sqlalchemy import text

    migration.upgrade(empty_db_url, "0006")
    engine = create_engine(empty_db_url)
    try:
        with engine.begin() as c:
            c.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"),
                {"t": "2026-01-01 00:00:00"},
            )
            c.execute(
                text(
                    "INSERT INTO numerical_configs (id, public_id, content_sha256, config_json,"
                    " dtype, lm_head_dtype, attn_kernel, device, batch_size, created_at) VALUES"
                    " (1, 'nc_1', :h, '{}', 'bf16', 'bf16', 'eager', 'cpu', 1, :t)"
                ),
                {"h": "a" * 64, "t": "2026-01-01 00:00:00"},
            )
            c.execute(
                text(
                    "INSERT INTO traces (id, public_id, project_id, config_id, model_name,"
                    " weights_sha256, vocab_size, decoding, prompt_token_ids, output_token_ids,"
                    " n_prompt_tokens, n_output_tokens, tags, content_sha256, created_at) VALUES"
                    " (1, 'tr_1', 1, 1, 'm', :h, 10, '{}', :b, :b, 1, 1, '[]', :h, :t)"
                ),
                {"h": "b" * 64, "b": b"\x01\x00\x00\x00", "t": "2026-01-01 00:00:00"},
            )
        migration.upgrade(empty_db_url, "0008")
        with engine.begin() as c:
            assert c.execute(text("SELECT output_token_pieces FROM traces")).scalar() is None
            c.execute(text("UPDATE traces SET output_token_pieces = :p"), {"p": '[" a", [226]]'})
        migration.downgrade(empty_db_url, "0006")
        with engine.connect() as c:
            assert c.execute(text("SELECT public_id FROM traces")).scalar() == "tr_1"
        engine.dispose()
        columns = {col["name"] for col in inspect(engine).get_columns("traces")}
        assert "output_token_pieces" not in columns
        migration.upgrade(empty_db_url, "0008")
        with engine.connect() as c:
            assert c.execute(text("SELECT output_token_pieces FROM traces")).scalar() is None
    finally:
        engine.dispose()


def test_0010_keeps_every_row_and_files_it_under_its_traces_week(empty_db_url: str) -> None:
    """Traces, tags and results written before 0010 survive it (in their trace's week
    partition on PostgreSQL, with their keys in trace_keys) and survive its downgrade."""
    from sqlalchemy import text

    migration.upgrade(empty_db_url, "0006")
    engine = create_engine(empty_db_url)
    t = "2026-01-07 10:00:00"  # a Wednesday: the week of Monday 2026-01-05
    postgres = engine.dialect.name == "postgresql"
    try:
        with engine.begin() as c:
            c.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"), {"t": t}
            )
            c.execute(
                text(
                    "INSERT INTO numerical_configs (id, public_id, content_sha256, config_json,"
                    " dtype, lm_head_dtype, attn_kernel, device, batch_size, created_at) VALUES"
                    " (1, 'nc_1', :h, '{}', 'bf16', 'bf16', 'eager', 'cpu', 1, :t)"
                ),
                {"h": "a" * 64, "t": t},
            )
            for i in (1, 2):
                c.execute(
                    text(
                        "INSERT INTO traces (id, public_id, project_id, config_id, model_name,"
                        " weights_sha256, vocab_size, decoding, prompt_token_ids,"
                        " output_token_ids, n_prompt_tokens, n_output_tokens, tags,"
                        " external_id, content_sha256, created_at) VALUES (:i, :p, 1, 1, 'm',"
                        " :h, 10, '{}', :b, :b, 1, 1, '[\"x\"]', :e, :c, :t)"
                    ),
                    {
                        "i": i,
                        "p": f"tr_{i}",
                        "h": "b" * 64,
                        "b": b"\x01\x00\x00\x00",
                        "e": f"ext-{i}",
                        "c": str(i) * 64,
                        "t": t,
                    },
                )
                c.execute(text("INSERT INTO trace_tags (trace_id, tag) VALUES (:i, 'x')"), {"i": i})
            c.execute(
                text(
                    "INSERT INTO replay_runs (id, public_id, project_id, status, mode, compare,"
                    " request, targets, comparisons, n_traces, n_items, created_at) VALUES"
                    " (1, 'rr_1', 1, 'done', 'decode', 'logged', '{}', '[]', '[]', 2, 2, :t)"
                ),
                {"t": t},
            )
            c.execute(
                text(
                    "INSERT INTO replay_results (id, run_id, trace_id, comparison, status,"
                    " detail, created_at) VALUES (1, 1, 2, 0, 'ok', '{}', :t)"
                ),
                {"t": t},
            )
        migration.upgrade(empty_db_url)
        with engine.connect() as c:
            keys = c.execute(text("SELECT public_id, external_id FROM trace_keys ORDER BY 1")).all()
            moved = c.execute(
                text(
                    "SELECT r.trace_created_at = t.created_at, t.created_at"
                    " FROM replay_results r JOIN traces t ON t.id = r.trace_id"
                )
            ).all()
            tags = c.scalar(
                text(
                    "SELECT count(*) FROM trace_tags g JOIN traces t"
                    " ON t.id = g.trace_id AND t.created_at = g.trace_created_at"
                )
            )
            where = (
                {
                    table: c.scalar(text(f"SELECT DISTINCT tableoid::regclass::text FROM {table}"))
                    for table in ("traces", "trace_tags", "replay_results")
                }
                if postgres
                else {}
            )
        migration.downgrade(empty_db_url, "0006")
        with engine.connect() as c:
            after_downgrade = [
                c.scalar(text(f"SELECT count(*) FROM {table}"))
                for table in ("traces", "trace_tags", "replay_results")
            ]
        migration.upgrade(empty_db_url)
        with engine.connect() as c:
            after_upgrade = c.scalar(text("SELECT count(*) FROM trace_keys"))
    finally:
        engine.dispose()
    assert [tuple(k) for k in keys] == [("tr_1", "ext-1"), ("tr_2", "ext-2")]
    assert len(moved) == 1 and moved[0][0] is not False and moved[0][0] in (True, 1)
    assert tags == 2
    if postgres:
        assert where == {
            "traces": "traces_p20260105",
            "trace_tags": "trace_tags_p20260105",
            "replay_results": "replay_results_p20260105",
        }
    assert after_downgrade == [2, 2, 1] and after_upgrade == 2


def test_0014_lets_a_batch_size_be_unknown_and_keeps_the_traces(empty_db_url: str) -> None:
    """After 0014 a configuration's batch size may be NULL (and a trace has chat messages);
    down to 0012 the unknown batch sizes read 1 again and NOT NULL holds; traces survive both."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    config = (
        "INSERT INTO numerical_configs (id, public_id, content_sha256, config_json, dtype,"
        " lm_head_dtype, attn_kernel, device, batch_size, created_at) VALUES"
        " (:id, :p, :h, '{}', 'bf16', 'bf16', 'eager', 'cpu', :bs, '2026-01-05 00:00:00')"
    )
    migration.upgrade(empty_db_url, "0012")
    engine = create_engine(empty_db_url)
    try:
        with engine.begin() as c:
            c.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"),
                {"t": "2026-01-05 00:00:00"},
            )
            c.execute(text(config), {"id": 1, "p": "nc_1", "h": "a" * 64, "bs": 4})
            c.execute(
                text(
                    "INSERT INTO traces (id, public_id, project_id, config_id, model_name,"
                    " weights_sha256, vocab_size, decoding, prompt_token_ids, output_token_ids,"
                    " n_prompt_tokens, n_output_tokens, tags, content_sha256, created_at) VALUES"
                    " (1, 'tr_1', 1, 1, 'm', :h, 10, '{}', :b, :b, 1, 1, '[]', :h, :t)"
                ),
                {"h": "b" * 64, "b": b"\x01\x00\x00\x00", "t": "2026-01-05 00:00:00"},
            )
        migration.upgrade(empty_db_url)
        with engine.begin() as c:
            c.execute(text(config), {"id": 2, "p": "nc_2", "h": "c" * 64, "bs": None})
            c.execute(
                text("UPDATE traces SET prompt_messages = :m"),
                {"m": '[{"role": "user", "content": "hi"}]'},
            )
        migration.downgrade(empty_db_url, "0012")
        with engine.begin() as c:
            rows = c.execute(text("SELECT id, batch_size FROM numerical_configs ORDER BY id"))
            assert rows.all() == [(1, 4), (2, 1)]
            assert c.execute(text("SELECT config_id FROM traces")).scalar() == 1
        with pytest.raises(IntegrityError), engine.begin() as c:
            c.execute(text(config), {"id": 3, "p": "nc_3", "h": "d" * 64, "bs": None})
        engine.dispose()
        assert "prompt_messages" not in {
            col["name"] for col in inspect(engine).get_columns("traces")
        }
    finally:
        engine.dispose()


def test_0017_links_audit_runs_to_verifications_keeping_runs_and_alerts(
    empty_db_url: str,
) -> None:
    """0017 adds `audit_schedules.verify` and `audit_runs.verification_id` (a foreign key, SET
    NULL when the verification goes) without copying `audit_runs`: on SQLite, with foreign keys
    on, a copy would drop the table and cascade to its alerts. Down to 0016 both columns go and
    the runs and alerts stay."""
    from sqlalchemy import text

    from replay_audit.db.engine import create_db_engine

    t = {"t": "2026-01-05 00:00:00"}
    migration.upgrade(empty_db_url, "0016")
    engine = create_db_engine(empty_db_url)  # foreign keys on, as the service runs SQLite
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"), t)
            c.execute(
                text(
                    "INSERT INTO audit_schedules (id, public_id, project_id, name, cron, status,"
                    " selection, sample_size, policy, seed, replay, ear_drop_points,"
                    " active_since, created_at, updated_at) VALUES (1, 'as_1', 1, 'n',"
                    " '0 2 * * *', 'active', '{}', 8, 'uniform', 0, '{}', 5, :t, :t, :t)"
                ),
                t,
            )
            c.execute(
                text(
                    "INSERT INTO audit_runs (id, public_id, schedule_id, due_at, trigger, status,"
                    " window_start, window_end, n_candidates, n_sampled, flags, created_at)"
                    " VALUES (1, 'ar_1', 1, :t, 'manual', 'done', :t, :t, 8, 8, '[]', :t)"
                ),
                t,
            )
            c.execute(
                text(
                    "INSERT INTO audit_alerts (id, public_id, audit_run_id, url, payload, status,"
                    " attempts, attempt_log, created_at) VALUES (1, 'al_1', 1,"
                    " 'https://hooks.example.com/x', '{}', 'delivered', 1, '[]', :t)"
                ),
                t,
            )
            c.execute(
                text(
                    "INSERT INTO verifications (id, public_id, project_id, status, model_sha256,"
                    " request, selection, attempts, created_at) VALUES (1, 'ver_1', 1, 'done',"
                    " :h, '{}', '{}', 1, :t)"
                ),
                t | {"h": "a" * 64},
            )
        migration.upgrade(empty_db_url)
        with engine.begin() as c:
            assert c.execute(text("SELECT count(*) FROM audit_alerts")).scalar() == 1
            c.execute(text('UPDATE audit_schedules SET verify = \'{"group_by": "tag"}\''))
            c.execute(text("UPDATE audit_runs SET verification_id = 1"))
        with engine.begin() as c:
            c.execute(text("DELETE FROM verifications"))
            assert c.execute(text("SELECT verification_id FROM audit_runs")).scalar() is None
            assert c.execute(text("SELECT count(*) FROM audit_runs")).scalar() == 1
        engine.dispose()
        migration.downgrade(empty_db_url, "0016")
        with engine.begin() as c:
            assert c.execute(text("SELECT count(*) FROM audit_alerts")).scalar() == 1
            assert c.execute(text("SELECT count(*) FROM audit_runs")).scalar() == 1
        engine.dispose()
        inspector = inspect(engine)
        assert "verification_id" not in {c["name"] for c in inspector.get_columns("audit_runs")}
        assert "verify" not in {c["name"] for c in inspector.get_columns("audit_schedules")}
        assert inspector.get_foreign_keys("audit_runs") and all(
            fk["referred_table"] != "verifications"
            for fk in inspector.get_foreign_keys("audit_runs")
        )
        migration.upgrade(empty_db_url)  # and up again
    finally:
        engine.dispose()
