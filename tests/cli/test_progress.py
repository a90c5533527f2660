"""Issue 33: a long CLI command shows its progress with a rate and an estimate of the time left,
and a spinner while a checkpoint loads (`generate`, `replay`, `screen`, `import` use these)."""

from __future__ import annotations

import io
import time

from rich.console import Console

from replay_audit.cli.engine import _loading, _progress


def _render(bar: object) -> str:
    out = io.StringIO()
    Console(file=out, width=160, force_terminal=False).print(bar.get_renderable())  # type: ignore[attr-defined]
    return out.getvalue()


def test_a_bar_says_its_rate_and_the_time_left() -> None:
    with _progress() as bar:
        task = bar.add_task("replay in bf16", total=10)
        for _ in range(4):
            time.sleep(0.05)
            bar.advance(task)
        line = _render(bar)
    assert "replay in bf16" in line and "4/10" in line
    assert "/s" in line and "left" in line  # the rate, then the estimate
    assert "0:00:0" in line.split("left")[1]  # the time left, h:mm:ss


def test_a_spinner_where_the_total_is_unknown_has_no_estimate() -> None:
    with _progress(spinner=True) as bar:
        bar.add_task("import", total=None)
        line = _render(bar)
    assert "import" in line and "left" not in line


def test_a_load_shows_a_spinner_naming_what_loads() -> None:
    with _loading("smollm2 in bf16") as status:
        assert "loading smollm2 in bf16" in str(status.status)
