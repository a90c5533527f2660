"""`benchmarks/verify_scale.py` (issue 34), which runs for real on a lent GPU: its prompt reuse
keeps the halves apart, and the whole benchmark (benign null, its
halves, the simulated providers, saved traces, the cross-platform scan of them) runs at the
smallest size on the bundled model on a CPU."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import verify_scale as vs
from replay_audit.stats.verification import CANDIDATES, STATISTICS
from replay_audit.traces.schemas import TraceCreate

TINY = Path(__file__).resolve().parents[1] / "replay_audit" / "assets" / "tiny-llama"

pytestmark = pytest.mark.slow  # the benchmark end to end, twice


def test_reused_prompts_are_variants_and_halves_split_by_text() -> None:
    texts = [f"def f{i}(x):\n    return x + {i}" for i in range(5)]
    units = vs.prompt_units(texts, 23, chat=False)
    assert len({str(u.prompt) for u in units}) == 23  # every reuse is a distinct prompt
    assert {u.text for u in units} == set(range(5))
    for u in units:
        assert u.half == ("A" if u.text % 2 == 0 else "B")
    chat = vs.prompt_units(texts, 12, chat=True)
    assert len({json.dumps(u.prompt) for u in chat}) == 12
    assert all(isinstance(u.prompt, list) and u.prompt[-1]["role"] == "user" for u in chat)


def test_small_batches_generated_in_several_processes_give_one_processs_tokens() -> None:
    """`--gen-workers`: a small-batch variation generated in two spawned processes, each taking
    whole batches (here batches of 2 prompts of different lengths: left-padded), gives every
    prompt the tokens and trace one process gives, in the same order."""
    texts = [f"def f{i}(x):\n    " + "y = x + 1\n    " * (i % 3) + "return" for i in range(5)]
    units = vs.prompt_units(texts, 6, chat=False)
    variation = vs.Variation("bf16", "sdpa", 2, large=False)
    with vs.generator(TINY, "bf16", "sdpa", "cpu") as g:
        one = vs.generate(g, units, 2, 12, "cpu", keep_traces=True)
    many = vs.generate_parallel(TINY, variation, units, 12, "cpu", 2, keep_traces=True)
    assert len({len(p) for p in one.prompt_ids}) > 1, "a padded batch"
    assert many.units == one.units == units
    assert many.prompt_ids == one.prompt_ids
    assert many.outputs == one.outputs and all(one.outputs)
    assert many.traces == one.traces


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("scale")
    result = vs.main(
        [
            "--model", str(TINY), "--device", "cpu",
            "--benign-tokens", "600", "--max-new-tokens", "8", "--batch", "16",
            "--small-prompts", "4", "--b1-prompts", "2", "--eval-prompts", "8",
            "--draws", "50", "--fa-draws", "100", "--max-budget", "4096",
            "--out", str(out), "--save-traces", str(out / "traces.jsonl.gz"),
            "--sampled", "--sampled-prompts", "4", "--save-null", str(out / "null.npz"),
        ]
    )  # fmt: skip
    return result, out


def test_the_smallest_run_measures_every_part(scale_run: tuple[dict[str, Any], Path]) -> None:
    result, out = scale_run
    assert json.loads((out / "scale.json").read_text())["run"]["device"] == "cpu"
    assert "## Null: thresholds from half A" in (out / "scale.md").read_text()
    benign = result["benign"]
    assert set(benign) == {v.key for v in vs.variations(vs.parser().parse_args(
        ["--model", str(TINY), "--out", str(out), "--batch", "16"]))}  # fmt: skip
    assert sum(v["tokens"] for v in benign.values()) >= 500
    for v in benign.values():
        above = [v["above"][str(t)] for t in vs.TAIL_ULPS]
        assert above == sorted(above, reverse=True) and above[0] <= v["flips"] <= v["tokens"]
    null = result["null"]
    for v in null["per_variation"].values():  # both halves hold every variation
        assert v["tokens_A"] > 0 and v["tokens_B"] > 0
    decisions = set(null["false_alarms"])
    assert set(STATISTICS) | {vs.PER_BUDGET} <= decisions
    for rows in null["false_alarms"].values():
        assert [int(b) for b in rows] == [b for b in vs.FA_BUDGETS if b <= 4096]
        assert all(0.0 <= r["worst"] <= 1.0 for r in rows.values())
    # The decision half A's calibration chose per budget is judged on the same held-out groups
    # as the candidate it chose: its false alarms are that candidate's, budget by budget.
    chosen = {str(c["tokens"]): c["decision"] for c in null["choices"]}
    assert list(chosen) == list(null["false_alarms"][vs.PER_BUDGET])
    assert set(chosen.values()) <= set(CANDIDATES)
    for fa in (null["false_alarms"], null["false_alarms_distinct"]):
        for b, row in fa[vs.PER_BUDGET].items():
            assert row["per_variation"] == fa[chosen[b]][b]["per_variation"]
            assert row["threshold"].startswith(chosen[b])
    # Groups of distinct held-out traces: drawn only where a variation's half B holds the
    # budget, none beyond the largest half.
    largest = max(v["tokens_B"] for v in null["per_variation"].values())
    for b, row in null["false_alarms_distinct"]["outside_tie_band"].items():
        held = {k for k, v in null["per_variation"].items() if v["tokens_B"] >= int(b)}
        assert set(row["per_variation"]) == held == set(row["measured"])
        assert (row["worst"] is None) == (int(b) > largest)
    assert "chose per budget" in (out / "scale.md").read_text()
    sims = result["simulations"]
    assert set(sims) == {
        "4-bit RTN g128", "8-bit RTN g128", "FP8 KV cache (e4m3, scale 1)",
        "temperature 0.3 sent as greedy", "RoPE bug (base 5000)", "swapped checkpoint (10% noise)",
    }  # fmt: skip
    rtn4 = sims["4-bit RTN g128"]
    assert rtn4["outputs_differing"] > 0
    # 4-bit RTN is far from the honest traces: separated at the largest budget
    assert rtn4["mean_deficit_ulps"]["per_budget"]["4096"]["auc"] > 0.9
    # every phase timed (to 10 ms: saving a few traces can take none)
    assert all(v >= 0 for v in result["wall_s"].values()) and result["wall_s"]["total"] > 0
    # sampled traffic: AUC per statistic only (the greedy null's thresholds judge no sample)
    sampled = result["sampled"]
    assert sampled["tokens_honest"] > 0 and set(sampled["auc"]) == set(STATISTICS)
    for row in sampled["auc"].values():
        assert all(set(v) == {"auc"} for v in row["per_budget"].values())
    assert "## Sampled traffic" in (out / "scale.md").read_text()


def test_saved_traces_are_trace_json_and_scan_on_another_platform(
    scale_run: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    _, out = scale_run
    with gzip.open(out / "traces.jsonl.gz", "rt") as f:
        rows = [json.loads(x) for x in f]
    assert rows[0]["header"]["device"] == "cpu"
    assert {r["half"] for r in rows[1:]} == {"A", "B"}
    for r in rows[1:]:
        TraceCreate.model_validate(r["trace"])  # what POST /v1/traces takes
    cross = vs.main(
        [
            "--model", str(TINY), "--device", "cpu", "--scan-traces", str(out / "traces.jsonl.gz"),
            "--scan-max-tokens", "1000", "--cpu-null-prompts", "2", "--max-new-tokens", "8",
            "--batch", "16", "--eval-prompts", "4", "--draws", "50", "--fa-draws", "100",
            "--max-budget", "4096",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert (tmp_path / "cross.md").exists()
    assert cross["traces_from"]["device"] == "cpu"
    assert sum(v["tokens"] for v in cross["tail_here"].values()) > 0
    assert len(cross["nulls"]) == 2  # the saved half A scanned here, and one generated here
    for null in cross["nulls"].values():
        for rows_ in null["false_alarms"].values():
            assert all(0.0 <= r["worst"] <= 1.0 for r in rows_.values())


def test_a_saved_null_measures_the_same_decisions_again(
    scale_run: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """`--save-null` keeps the null's per-token deficits and the alternative's; `--null-from`
    measures the decisions again from them alone (no model): the same false alarms, reach and
    choices as the run that scanned them."""
    result, out = scale_run
    again = vs.main(["--null-from", str(out / "null.npz"), "--out", str(tmp_path), "--draws", "50",
                     "--fa-draws", "100", "--max-budget", "4096"])  # fmt: skip
    assert again["meta"]["claim"] == "bf16" and again["meta"]["device"] == "cpu"
    for key in ("false_alarms", "false_alarms_distinct", "fa_ok_up_to", "choices", "tokens"):
        assert again["null"][key] == result["null"][key], key
    assert (tmp_path / "null.json").exists()
    # The providers' traces too: each one's AUC, power and tokens to a decision as the run had.
    assert set(again["simulations"]) == set(result["simulations"]) != set()
    for name, row in result["simulations"].items():
        kept = {k: v for k, v in row.items() if k in again["simulations"][name]}
        assert again["simulations"][name] == kept, name


def test_a_saved_null_pinned_to_some_variations_measures_only_them(
    scale_run: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """`--null-variations` keeps only the named benign variations (an unknown one is an error
    naming it); `--sim-max-budget` sets the simulations' largest budget."""
    result, out = scale_run
    keep = sorted(result["benign"])[0]
    args = ["--null-from", str(out / "null.npz"), "--out", str(tmp_path), "--draws", "50",
            "--fa-draws", "100", "--max-budget", "4096"]  # fmt: skip
    pinned = vs.main([*args, "--null-variations", keep, "--sim-max-budget", "64"])
    assert set(pinned["null"]["per_variation"]) == {keep} != set(result["null"]["per_variation"])
    for row in pinned["simulations"].values():
        assert [int(b) for b in row["per_budget"]["per_budget"]] == [16, 32, 64]
    with pytest.raises(SystemExit):
        vs.main([*args, "--null-variations", "no/such/b9"])
