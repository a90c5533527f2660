"""The run row's lock (`repository.lock_run`, taken by every job that finishes) on PostgreSQL:
`FOR NO KEY UPDATE`, so a job finishing never waits for another job's window of results, whose
foreign key to the run holds `FOR KEY SHARE` on its row until that window commits (with `FOR
UPDATE` the two queued on each other: on an H200 four workers of a scan-only audit spent 6.8%
of their time in `lock_run`). Two finishing jobs still take turns: their locks conflict."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from replay_audit.db.unit_of_work import session_scope
from replay_audit.replays import repository
from tests.conftest import empty_all_tables
from tests.replays.test_result_rows import _ok_row, _run_and_traces


def test_a_finishing_job_does_not_wait_for_another_jobs_window(
    postgres_database_url: str,
) -> None:
    url = postgres_database_url
    try:
        run_id, (trace_id,) = _run_and_traces(url, 1)
        with session_scope(url) as window:  # another job's window, not committed yet
            repository.insert_results_of(window, run_id, [(trace_id, [_ok_row(0)])])
            window.flush()
            with session_scope(url) as finishing:
                finishing.execute(text("SET LOCAL lock_timeout = '2s'"))
                run = repository.lock_run(finishing, run_id)  # FOR UPDATE: lock_timeout here
                assert run.id == run_id
                with session_scope(url) as other:  # a second finisher waits for the first
                    other.execute(text("SET LOCAL lock_timeout = '200ms'"))
                    with pytest.raises(OperationalError, match="lock timeout"):
                        repository.lock_run(other, run_id)
                    other.rollback()
    finally:
        empty_all_tables(url)
