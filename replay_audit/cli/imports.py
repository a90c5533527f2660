"""`replay-audit import`: logged responses (vLLM/OpenAI-compatible, SGLang, transformers,
lm-eval) -> traces, written as JSONL or posted to a server.

What a response does not carry comes from `--model DIR` (weights_sha256, vocabulary, eos ids,
the tokenizer for lm-eval), `--config-file` (YAML or JSON) and `--config key=value` flags (the
last win): `ImportContext`'s keys, dotted for nested ones (`gpu.sm=9.0`, `model.name=...`,
`decoding.strategy=greedy`, `extras.quant=awq`; lists comma-separated). Anything not given is
recorded as unknown in each trace. A bad item is reported as `FILE:LINE: field: message` and
skipped (exit status 1 at the end); a context the traces cannot do without stops at once
(exit status 2). Torch is imported only for `.pt` files and lm-eval's tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from replay_audit.cli.database import fail
from replay_audit.cli.engine import _progress
from replay_audit.cli.root import app
from replay_audit.formats import IMPORT_FORMATS
from replay_audit.json_value import JsonObject, JsonValue
from replay_audit.words import counted

_LIST_KEYS = frozenset({"tags", "decoding.eos_token_ids"})
_MAX_SHOWN_ERRORS = 20


def _set_dotted(target: JsonObject, key: str, value: JsonValue, where: str) -> None:
    parts = key.split(".")
    if not all(parts):
        fail(f"{where}: {key!r} is not a key")
    node = target
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            fail(f"{where}: {key!r}: {part!r} is not a group of keys")
        node = child
    node[parts[-1]] = value


def _flatten(data: Mapping[str, JsonValue], prefix: str = "") -> Iterator[tuple[str, JsonValue]]:
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "extras":
            yield from _flatten(value, f"{name}.")
        else:
            yield name, value


def _read_config_file(path: Path) -> JsonObject:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    try:
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                fail(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON")
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise their own error types
        fail(f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {e}")
    if not isinstance(data, dict):
        fail(f"{path}: expected a mapping of configuration keys")
    out: JsonObject = {}
    for key, value in _flatten(data):
        _set_dotted(out, key, value, str(path))
    return out


def _json_file(path: Path, what: str = "readable JSON", required: bool = False) -> JsonObject:
    """A JSON file's object ({} for no object, or no file unless `required`; else exit 2)."""
    if not required and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: not {what} ({e})")
    return data if isinstance(data, dict) else {}


def _model_facts(model_dir: Path) -> JsonObject:
    """What the checkpoint says: weights_sha256, vocab_size, eos ids, and its directory's name
    for a log that names no model."""
    from replay_audit.engine.hashing import NoWeightsError, weights_sha256

    try:
        sha = weights_sha256(model_dir)
    except NoWeightsError as e:
        fail(e.message)
    model: JsonObject = {"default_name": model_dir.name, "weights_sha256": sha}
    facts: JsonObject = {"model": model}
    config = _json_file(model_dir / "config.json")
    generation = _json_file(model_dir / "generation_config.json")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int):
        model["vocab_size"] = vocab
    eos = generation.get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is not None:
        facts["decoding"] = {"eos_token_ids": eos if isinstance(eos, list) else [eos]}
    return facts


def _merge(base: JsonObject, over: Mapping[str, JsonValue]) -> JsonObject:
    out = dict(base)
    for key, value in over.items():
        mine = out.get(key)
        if isinstance(value, dict) and isinstance(mine, dict) and key != "extras":
            out[key] = _merge(mine, value)
        else:
            out[key] = value
    return out


def build_context(model: Path | None, config_file: Path | None, flags: list[str]) -> Any:
    """The ImportContext from the checkpoint, then the file, then the flags (exit 2 naming
    the key on a bad value)."""
    from pydantic import ValidationError

    from replay_audit.imports.schemas import ImportContext

    values = _model_facts(model) if model is not None else {}
    if config_file is not None:
        values = _merge(values, _read_config_file(config_file))
    given: JsonObject = {}
    for flag in flags:
        key, sep, raw = flag.partition("=")
        if not sep:
            fail(f"--config {flag!r}: expected key=value")
        key = key.strip()
        value: JsonValue = raw
        if key in _LIST_KEYS:
            value = [v.strip() for v in raw.split(",") if v.strip()]
        elif raw.lower() in ("null", "none", ""):
            value = None
        _set_dotted(given, key, value, "--config")
    values = _merge(values, given)
    try:
        return ImportContext.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        fail(f"configuration key {where}: {err['msg']}")


def _is_text(path: Path) -> bool:
    """Whether `path` starts as UTF-8 text (torch.save writes a zip archive: `PK`)."""
    with path.open("rb") as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # a character cut at the end of the block
    return not head.startswith(b"PK")


def _read_items(fmt: str, path: Path) -> Iterator[tuple[str, Any]]:
    """(location, item) of each logged item of `path`."""
    if fmt == "hf" and path.suffix in (".pt", ".pth"):
        from replay_audit.imports.hf_context import load_generate_output

        try:
            yield str(path), load_generate_output(path)
        except Exception as e:  # torch.load raises many kinds: this file fails, not the import
            if _is_text(path):
                why = (
                    "a text file, not what torch.save writes: a JSON log is a .json or .jsonl file"
                )
            else:  # torch's weights-only refusal is long; its "WeightsUnpickler" line says why
                why = ([x for x in str(e).splitlines() if "WeightsUnpickler" in x] or [str(e)])[0]
            yield str(path), _Unreadable(f"not a generate() output loadable safely ({why})")
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        saved = " (a torch.save file: --format hf reads it)" if not _is_text(path) else ""
        fail(f"cannot read {path}: not UTF-8 text, what --format {fmt} reads{saved}")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{path}:{n}", _Unreadable(f"not JSON ({e.msg})")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        yield f"{path}:{e.lineno}", _Unreadable(f"not JSON ({e.msg})")
        return
    if isinstance(data, list) and fmt in ("openai", "hf"):
        for i, item in enumerate(data):
            yield f"{path}[{i}]", item
    else:
        yield str(path), data


class _Unreadable:
    def __init__(self, message: str) -> None:
        self.message = message


def _lm_eval_results(path: Path, results: Path | None) -> JsonObject:
    what = "a readable lm-eval results JSON"
    if results is not None:
        return _json_file(results, what, required=True)
    return _json_file(path.with_name(f"results_{path.stem.rpartition('_')[2]}.json"), what)


class _Importer:
    """Turns items into traces, reporting and counting the bad ones."""

    def __init__(
        self, fmt: str, context: Any, tokenizer: Any, task: str | None, results_file: Path | None
    ) -> None:
        from replay_audit.imports.tokenization import Vocabulary

        self.fmt, self.context, self.tokenizer = fmt, context, tokenizer
        self.vocabulary = Vocabulary(tokenizer) if tokenizer is not None else None
        self.task, self.results_file = task, results_file
        self.failed = self.skipped = self.empty = self.dropped = 0
        #: Traces stored but not replayable (not greedy), by decoding strategy.
        self.unreplayable: Counter[str] = Counter()

    def checked(self, where: str, traces: Iterable[Any]) -> Iterator[Any]:
        """The traces, each whose logged top-k was not kept, or that no replay can run (not
        greedy), warned of by name and counted."""
        from replay_audit.formats import EXTRA_PROCESSORS, processors_not_applied
        from replay_audit.imports.generation import dropped_top_k

        for trace in traces:
            name = trace.external_id or where
            reason = dropped_top_k(trace)
            if reason is not None:
                self.dropped += 1
                if self.dropped <= _MAX_SHOWN_ERRORS:
                    typer.secho(f"{where}: {name}: top-k not kept: {reason}", err=True, fg="yellow")
            strategy = trace.decoding.strategy
            if strategy != "greedy":
                self.unreplayable[strategy] += 1
                if self.unreplayable.total() <= _MAX_SHOWN_ERRORS:
                    why = processors_not_applied(trace.config.extras.get(EXTRA_PROCESSORS))
                    typer.secho(
                        f"{where}: {name}: stored, but only greedy traces replay: "
                        f"decoding.strategy {strategy!r}{why}",
                        err=True,
                        fg="yellow",
                    )
            yield trace

    def report(self, where: str, message: str) -> None:
        self.failed += 1
        if self.failed <= _MAX_SHOWN_ERRORS:
            typer.secho(f"{where}: {message}", err=True, fg=typer.colors.RED)

    def traces(self, files: list[Path]) -> Iterator[Any]:
        from replay_audit.exceptions import ReplayAuditError
        from replay_audit.imports.generation import build_trace, check_context
        from replay_audit.imports.lm_eval import (
            NotAGeneration,
            context_from_results,
            merge_filters,
            parse_lm_eval_sample,
            task_from_filename,
        )
        from replay_audit.imports.schemas import ImportContext
        from replay_audit.imports.service import traces_from_item
        from replay_audit.imports.sniff import format_hint

        for path in files:
            context, results, task = self.context, {}, None
            if self.fmt == "lm-eval":
                results = _lm_eval_results(path, self.results_file)
                task = self.task or task_from_filename(path.name)
                if task is None:
                    first = next(iter(_read_items(self.fmt, path)), (None, None))[1]
                    hint = format_hint(first, self.fmt)
                    fail(f"{path}: not named samples_<task>_<date>.jsonl; give --task{hint}")
                # The run's own record (dtype as loaded, batch size, device) under the flags.
                merged = _merge(
                    context_from_results(results), context.model_dump(exclude_unset=True)
                )
                context = ImportContext.model_validate(merged)
                try:
                    check_context(context)
                except ReplayAuditError as e:
                    fail(f"{path}: {e.message} (its results JSON does not say it either)")
            items: Iterable[tuple[str, Any]] = _read_items(self.fmt, path)
            if self.fmt == "lm-eval":  # one line per (doc, filter): one generation each
                items = merge_filters(list(items))
            for where, item in items:
                if isinstance(item, _Unreadable):
                    self.report(where, item.message)
                    continue
                try:
                    if self.fmt == "lm-eval":
                        assert task is not None
                        empty: list[str] = []
                        gens = parse_lm_eval_sample(
                            item,
                            task=task,
                            tokenizer=self.tokenizer,
                            results=results,
                            path="sample",
                            skipped=empty,
                        )
                        self.empty += len(empty)
                        lm = (build_trace(g, context, "lm-eval") for g in gens)
                        yield from self.checked(where, lm)
                    else:
                        hf = self.fmt == "hf" and isinstance(item, dict)
                        traces = traces_from_item(
                            self.fmt,  # type: ignore[arg-type]
                            self.hf_defaults(item) if hf else item,
                            context,
                            vocabulary=self.vocabulary,
                        )
                        yield from self.checked(where, traces)
                except NotAGeneration:
                    self.skipped += 1
                except ReplayAuditError as e:
                    self.report(where, e.message + format_hint(item, self.fmt))

    def hf_defaults(self, item: dict[str, Any]) -> dict[str, Any]:
        """A saved generate() output completed from the checkpoint: its eos ids (rows end at
        the first) and pad id (left padding, where the call's mask was not saved)."""
        eos = self.context.decoding.eos_token_ids
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return {
            **({"eos_token_ids": eos} if eos else {}),
            **({"pad_token_id": pad} if isinstance(pad, int) else {}),
            **item,
        }


@app.command("import")
def import_(
    files: Annotated[list[Path], typer.Argument(help="Logged responses (.jsonl, .json, .pt).")],
    format: Annotated[
        str, typer.Option("--format", help="openai (vllm is an alias), sglang, hf or lm-eval.")
    ],
    out: Annotated[Path | None, typer.Option(help="Write the traces here (JSONL).")] = None,
    post: Annotated[
        str | None, typer.Option(help="Send the traces to this server (e.g. http://host:8000).")
    ] = None,
    key: Annotated[
        str | None, typer.Option(envvar="REPLAY_AUDIT_API_KEY", help="API key for --post.")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="The checkpoint directory: weights_sha256, vocab, eos ids, tokenizer."),
    ] = None,
    config: Annotated[
        list[str] | None, typer.Option("--config", help="key=value (repeatable).")
    ] = None,
    config_file: Annotated[
        Path | None, typer.Option(help="YAML or JSON file of configuration keys.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, max=1000, help="Traces per POST.")] = 500,
    task: Annotated[
        str | None, typer.Option(help="lm-eval task name (default: file name).")
    ] = None,
    results: Annotated[
        Path | None, typer.Option(help="lm-eval results JSON (default: next to the samples).")
    ] = None,
) -> None:
    """Import logged responses as traces (docs/import.md says what each source needs)."""
    if format == "vllm":
        typer.echo(
            "--format vllm: vLLM writes OpenAI-compatible responses (and its offline "
            "RequestOutput), read by --format openai",
            err=True,
        )
        format = "openai"
    if format not in IMPORT_FORMATS:
        fail(f"--format must be one of {', '.join(IMPORT_FORMATS)}; got {format!r}")
    if (out is None) == (post is None):
        fail("give one of --out FILE or --post URL")
    if post is not None and not key:
        fail("--post needs --key (or REPLAY_AUDIT_API_KEY)")
    for f in files:
        if not f.is_file():
            fail(f"{f}: no such file")
    if format == "lm-eval" and model is None:
        fail(
            "--format lm-eval needs --model DIR: the samples carry text, re-tokenised with "
            "the checkpoint's tokenizer"
        )
    context = build_context(model, config_file, config or [])
    from replay_audit.exceptions import ReplayAuditError
    from replay_audit.imports.generation import check_context

    if format != "lm-eval":  # lm-eval's results JSON may still give the dtype (per file)
        try:
            check_context(context)
        except ReplayAuditError as e:
            fail(e.message)
    tokenizer = None
    if model is not None:  # reads ids from the text of logs that carry none
        from replay_audit.engine.loading import load_tokenizer

        tokenizer = load_tokenizer(model)
        if tokenizer is None and format == "lm-eval":
            fail(f"{model} has no tokenizer")
    importer = _Importer(format, context, tokenizer, task, results)
    written = 0
    with _progress(spinner=True) as bar:
        progress = bar.add_task("import", total=None)
        traces = importer.traces(files)
        if out is not None:
            with out.open("w", encoding="utf-8") as sink:
                for trace in traces:
                    sink.write(trace.model_dump_json() + "\n")
                    written += 1
                    bar.advance(progress)
            summary = f"wrote {counted(written, 'trace')} to {out}"
        else:
            assert post is not None and key is not None
            from replay_audit.client import SendError, post_traces

            try:
                stats = post_traces(
                    post,
                    key,
                    traces,
                    batch_size=batch_size,
                    on_batch=lambda r: bar.advance(progress, len(r)),
                )
            except SendError as e:
                fail(str(e))
            for error in stats.errors[:_MAX_SHOWN_ERRORS]:
                typer.secho(
                    f"server: {error.get('field', '')}: {error.get('detail', error)}",
                    err=True,
                    fg=typer.colors.RED,
                )
            importer.failed += stats.rejected
            written = stats.created + stats.duplicates
            summary = (
                f"posted {counted(written, 'trace')} to {post}: {stats.created} new, "
                f"{stats.duplicates} already stored, {stats.rejected} refused"
            )
    if importer.skipped:
        summary += f"; {importer.skipped} loglikelihood samples skipped (not generations)"
    if importer.empty:
        summary += (
            f"; {importer.empty} empty responses skipped (cut at an `until` string "
            "or eos before any text: no tokens to replay)"
        )
    if importer.unreplayable:
        by = ", ".join(f"{k} {v}" for k, v in sorted(importer.unreplayable.items()))
        n = importer.unreplayable.total()
        summary += f"; {counted(n, 'trace')} cannot be replayed (decoding.strategy: {by})"
    if importer.dropped:
        summary += f"; {counted(importer.dropped, 'trace')} without their logged top-k (see above)"
    if importer.failed:
        summary += f"; {counted(importer.failed, 'item')} failed (see above)"
    typer.echo(summary)
    if importer.failed:
        raise typer.Exit(code=1)
