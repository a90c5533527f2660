"""docs/import.md stays true: its Python examples compile, its YAML context validates, and the
keys of its field-mapping table's `config.extras` column are the ones an import writes."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import yaml

from replay_audit import formats
from replay_audit.imports import generation, schemas
from replay_audit.imports.schemas import ImportContext

DOC = (Path(__file__).parents[2] / "docs" / "import.md").read_text()


def test_the_python_examples_compile() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
    assert len(blocks) >= 2
    for block in blocks:
        ast.parse(block)


def test_the_yaml_context_validates() -> None:
    [block] = re.findall(r"<<'EOF'\n(.*?)EOF", DOC, flags=re.S)
    context = ImportContext.model_validate(yaml.safe_load(block))
    assert context.dtype == "bf16" and context.logprobs_mode == "raw_logprobs"
    assert context.gpu is not None and context.gpu.sm == "9.0"


def test_the_extras_keys_named_are_the_ones_written() -> None:
    for key in (
        schemas.EXTRA_FORMAT,
        schemas.EXTRA_LOGPROBS_MODE,
        formats.EXTRA_TOP_K_VALUES,
        schemas.EXTRA_UNKNOWN,
        schemas.EXTRA_TOKENIZATION,
        formats.EXTRA_TOKEN_IDS_SOURCE,
        generation.EXTRA_TOP_K_SOURCE,
        generation.EXTRA_LOGPROBS_MODE_SOURCE,
        formats.EXTRA_PROCESSORS,
        "filters",
    ):
        assert f"`{key}`" in DOC or f"extras.{key}" in DOC, key


def test_the_doc_shows_a_command_for_every_format_and_its_commands_parse() -> None:
    import typer

    from replay_audit.cli import app

    [block] = re.findall(r"## Commands, source by source\n.*?```bash\n(.*?)```", DOC, flags=re.S)
    lines = block.replace("\\\n", " ").splitlines()
    commands = [shlex.split(c) for c in lines if c.startswith("replay-audit")]
    assert {c[c.index("--format") + 1] for c in commands} == {*formats.IMPORT_FORMATS, "vllm"}
    group = typer.main.get_command(app)
    command = group.commands["import"]  # type: ignore[attr-defined]
    options = {o for p in command.params for o in p.opts}
    for c in commands:
        assert c[:2] == ["replay-audit", "import"] and "--model" in c and "--out" in c
        assert {a for a in c if a.startswith("--")} <= options, c
