"""A tensor-parallel rank: `python -m replay_audit.engine.tp_rank`, started by
`tensor_parallel.TpGroup` (never by hand), which says in its environment who it is and where
to join."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

from replay_audit.engine.tensor_parallel import (
    ENV_CONTROL_FD,
    ENV_DEVICE,
    ENV_PARENT_PID,
    ENV_THREADS,
    ENV_TIMEOUT_S,
    DeviceType,
    RankState,
    TpPlacement,
    die_with_parent,
    follow,
)


def main() -> int:
    env = os.environ
    die_with_parent(int(env[ENV_PARENT_PID]))
    conn = Connection(int(env[ENV_CONTROL_FD]))
    try:
        import torch
        import torch.distributed as dist

        device_type: DeviceType = "cuda" if env[ENV_DEVICE] == "cuda" else "cpu"
        placement = TpPlacement(int(env["RANK"]), int(env["WORLD_SIZE"]), device_type)
        torch.set_num_threads(int(env[ENV_THREADS]))
        if device_type == "cuda":
            torch.cuda.set_device(placement.rank)
        timeout = timedelta(seconds=float(env[ENV_TIMEOUT_S]))
        conn.send(("started", ""))
        store = dist.TCPStore(  # type: ignore[attr-defined]
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            placement.degree,
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            placement.backend,
            store=store,
            rank=placement.rank,
            world_size=placement.degree,
            timeout=timeout,
            device_id=placement.device if device_type == "cuda" else None,
        )
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", ""))
    try:
        follow(conn, RankState(placement))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
