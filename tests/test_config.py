"""`config.Settings` is plumbing and imports no domain package, so the settings whose default is a
domain's policy repeat the owner's constant as a plain value: these tests keep the two equal."""

from __future__ import annotations

import pytest

from replay_audit.audits.metrics import DEFAULT_ALPHA, DEFAULT_MIN_N
from replay_audit.config import Settings
from replay_audit.engine.protocol import DEFAULT_SCAN_TOKEN_BUDGET
from replay_audit.replays.domain import (
    DEFAULT_SCAN_FLAG_ULPS,
    LARGE_RUN_DECODE_WINDOW,
    LARGE_RUN_FLAGGED_FRACTION,
    LARGE_RUN_TRACES,
    MAX_SCAN_FLAG_ULPS,
)


def _default(name: str) -> object:
    return Settings.model_fields[name].default


@pytest.mark.parametrize(
    ("field", "owner"),
    [
        ("large_run_traces", LARGE_RUN_TRACES),
        ("large_run_decode_window", LARGE_RUN_DECODE_WINDOW),
        ("large_run_flagged_fraction", LARGE_RUN_FLAGGED_FRACTION),
        ("scan_flag_ulps", DEFAULT_SCAN_FLAG_ULPS),
        ("scan_token_budget", DEFAULT_SCAN_TOKEN_BUDGET),
        ("drift_alpha", DEFAULT_ALPHA),
        ("drift_min_n", DEFAULT_MIN_N),
    ],
)
def test_a_policy_default_is_its_owners_constant(field: str, owner: object) -> None:
    assert _default(field) == owner


def test_the_near_tie_flag_bound_is_the_replays_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLAY_AUDIT_SCAN_FLAG_ULPS", str(MAX_SCAN_FLAG_ULPS))
    assert Settings().scan_flag_ulps == MAX_SCAN_FLAG_ULPS
    monkeypatch.setenv("REPLAY_AUDIT_SCAN_FLAG_ULPS", str(MAX_SCAN_FLAG_ULPS * 1.001))
    with pytest.raises(ValueError, match="less than or equal"):
        Settings()


def test_the_large_run_window_bound_is_the_decode_window_bound() -> None:
    from replay_audit.formats import MAX_DECODE_WINDOW

    limits = Settings.model_fields["large_run_decode_window"].metadata
    assert any(getattr(m, "le", None) == MAX_DECODE_WINDOW for m in limits)


def test_the_large_run_flagged_fraction_is_a_share_above_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION", "0.2")
    assert Settings().large_run_flagged_fraction == 0.2
    for bad in ("0", "1.5", "nan"):
        monkeypatch.setenv("REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION", bad)
        with pytest.raises(ValueError, match="large_run_flagged_fraction"):
            Settings()
