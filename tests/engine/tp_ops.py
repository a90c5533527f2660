"""Operations the tensor-parallel tests run on every rank (`TpGroup.run`). A module of its
own, imported as `tests.engine.tp_ops`: the ranks import an operation by its module's name,
and pytest imports a test module under another."""

from __future__ import annotations

import os

from replay_audit.engine.tensor_parallel import RankState


def rank_of(state: RankState) -> int:
    """This rank's number: a result that differs between the ranks."""
    return state.placement.rank


def environment_of(state: RankState, names: list[str]) -> dict[str, str | None]:
    """The values of `names` in this rank's environment."""
    return {n: os.environ.get(n) for n in names}


def fail_on_rank_1(state: RankState) -> None:
    """Fails on rank 1 alone: the ranks may no longer be in step."""
    if state.placement.rank == 1:
        raise RuntimeError("rank 1 alone")


def takes(state: RankState, value: object) -> int:
    """Runs on every rank that could read its argument."""
    return 0


def keys_of(state: RankState) -> list[str]:
    """The keys of what this rank holds."""
    return sorted(state.objects)


def in_process_group(state: RankState) -> tuple[bool, int]:
    """Whether this rank is in a process group, and its world size."""
    import torch.distributed as dist

    return dist.is_initialized(), dist.get_world_size()
