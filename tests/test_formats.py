"""The vocabulary (`replay_audit/formats.py`): each name set spelled once, and every surface
that takes a run option (API, schedules, screenings, CLI) derives it from the one definition."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import typer.main

from replay_audit import formats
from replay_audit.formats import (
    BODY_DTYPES,
    CONTROL_FRACTION,
    CONTROL_SEED,
    COVER,
    FLAGGED_FRACTION,
    FORMATS,
    HEAD_DTYPES,
    MAX_NEW_TOKENS,
    SCAN_FLAG_ULPS,
    SDPA_BACKENDS,
    TOP_K,
    WEIGHT_DTYPES,
    RunOption,
    body_dtype,
)

NAME_SETS = [
    (formats.BodyDType, formats.BODY_DTYPES),
    (formats.HeadDType, formats.HEAD_DTYPES),
    (formats.WeightDType, formats.WEIGHT_DTYPES),
    (formats.Mode, formats.MODES),
    (formats.Screen, formats.SCREENS),
    (formats.InterventionKind, formats.INTERVENTION_KINDS),
    (formats.Category, formats.CATEGORIES),
    (formats.CacheKind, formats.CACHE_KINDS),
    (formats.MarginSource, formats.MARGIN_SOURCES),
    (formats.Device, formats.DEVICES),
    (formats.LoggedDevice, formats.LOGGED_DEVICES),
    (formats.AttnKernel, formats.ATTN_KERNELS),
    (formats.ImportFormat, formats.IMPORT_FORMATS),
]


@pytest.mark.parametrize(("literal", "names"), NAME_SETS)
def test_each_tuple_is_its_literal_type(literal: Any, names: tuple[str, ...]) -> None:
    assert names == get_args(literal)
    assert len(set(names)) == len(names)


def test_the_dtype_sets_nest_and_every_head_format_has_its_numbers() -> None:
    assert set(BODY_DTYPES) < set(HEAD_DTYPES) < set(WEIGHT_DTYPES)
    assert tuple(FORMATS) == HEAD_DTYPES
    assert [f.name for f in FORMATS.values() if f.body_ok] == list(BODY_DTYPES)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("torch.bfloat16", "bf16"),
        ("bfloat16", "bf16"),
        ("bf16", "bf16"),
        ("float", "fp32"),
        ("torch.float32", "fp32"),
        ("half", "fp16"),
        ("float16", "fp16"),
        ("float8_e4m3fn", None),
        ("int8", None),
        (None, None),
    ],
)
def test_body_dtype_reads_torch_and_checkpoint_spellings(name: object, expected: str) -> None:
    assert body_dtype(name) == expected


def test_the_torch_names_are_torchs() -> None:
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend

    from replay_audit.engine.loading import TORCH_DTYPES

    assert {d: str(t) for d, t in TORCH_DTYPES.items()} == {
        d: f"torch.{FORMATS[d].torch_name}" for d in BODY_DTYPES
    }
    for f in FORMATS.values():
        assert isinstance(getattr(torch, f.torch_name), torch.dtype)
    for backend in SDPA_BACKENDS.values():
        assert hasattr(SDPBackend, backend.torch_backend)
        assert callable(getattr(torch.backends.cuda, backend.enable_switch))


def _bounds(option: RunOption[Any]) -> tuple[Any, Any]:
    return (option.ge if option.ge is not None else option.gt, option.le)


@pytest.mark.parametrize(
    ("model", "field", "option"),
    [
        ("replay_audit.replays.schemas:ReplayCreate", "top_k", TOP_K),
        ("replay_audit.replays.schemas:ReplayCreate", "control_fraction", CONTROL_FRACTION),
        ("replay_audit.replays.schemas:ReplayCreate", "control_seed", CONTROL_SEED),
        ("replay_audit.replays.schemas:ReplayCreate", "scan_flag_ulps", SCAN_FLAG_ULPS),
        ("replay_audit.replays.schemas:ReplayCreate", "flagged_fraction", FLAGGED_FRACTION),
        ("replay_audit.audits.schemas:ScheduleReplay", "top_k", TOP_K),
        ("replay_audit.audits.schemas:ScheduleReplay", "control_fraction", CONTROL_FRACTION),
        ("replay_audit.audits.schemas:ScheduleReplay", "control_seed", CONTROL_SEED),
        ("replay_audit.audits.schemas:ScheduleReplay", "scan_flag_ulps", SCAN_FLAG_ULPS),
        ("replay_audit.audits.schemas:ScheduleReplay", "flagged_fraction", FLAGGED_FRACTION),
        ("replay_audit.screenings.schemas:ScreeningCreate", "max_new_tokens", MAX_NEW_TOKENS),
        ("replay_audit.screenings.schemas:ScreeningCreate", "cover", COVER),
    ],
)
def test_the_request_schemas_take_a_run_options_bounds(
    model: str, field: str, option: RunOption[Any]
) -> None:
    import importlib

    module, name = model.split(":")
    schema = getattr(importlib.import_module(module), name).model_json_schema()
    prop = schema["properties"][field]
    prop = next((p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"), prop)
    low = prop.get("minimum", prop.get("exclusiveMinimum"))
    assert (low, prop.get("maximum")) == _bounds(option)
    assert prop.get("description", schema["properties"][field].get("description")) == option.help


@pytest.mark.parametrize(
    ("command", "param", "option"),
    [
        ("replay", "top_k", TOP_K),
        ("replay", "control_fraction", CONTROL_FRACTION),
        ("replay", "control_seed", CONTROL_SEED),
        ("replay", "scan_flag_ulps", SCAN_FLAG_ULPS),
        ("replay", "flagged_fraction", FLAGGED_FRACTION),
        ("screen", "max_new_tokens", MAX_NEW_TOKENS),
        ("screen", "cover", COVER),
    ],
)
def test_the_cli_flags_take_a_run_options_bounds(
    command: str, param: str, option: RunOption[Any]
) -> None:
    from replay_audit.cli import app

    group: Any = typer.main.get_command(app)
    p = next(p for p in group.commands[command].params if p.name == param)
    assert (p.min, p.max) == _bounds(option)
    if option.default is not None and param not in ("scan_flag_ulps", "flagged_fraction"):
        assert p.default == option.default


def test_sampling_json_is_what_a_trace_logs_and_a_recipe_reads_back() -> None:
    """`SamplingJson` names the fields a trace's `decoding.sampling` is validated with, and a
    recipe's JSON with a seed and a device is one that reads back to the recipe."""
    from replay_audit.engine.protocol import SamplingRecipe
    from replay_audit.traces.schemas import SamplingSpec

    assert set(formats.SamplingJson.__annotations__) == set(SamplingSpec.model_fields)
    recipe = SamplingRecipe("vllm", 0.7, top_k=5, top_p=0.9)
    logged: formats.SamplingJson = {**recipe.to_json(), "seed": 3, "device": "cuda"}
    assert SamplingSpec.model_validate(logged).model_dump() == logged
    assert SamplingRecipe.from_json(logged) == recipe
    assert SamplingRecipe.from_json({"sampler": "transformers", "temperature": 1}) == (
        SamplingRecipe("transformers", 1.0)
    )
