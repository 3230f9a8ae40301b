"""A launched script rank's Vigil context (:mod:`vigil.launch`), as the child reads it: the JSON file named by
:data:`CONTEXT_ENV` (:func:`launched`), and the rank context, job spec and ``config`` made from it and
torchrun's environment (:func:`context_from_env`).

Its own module, apart from :mod:`vigil.launch`: :mod:`vigil.sdk` opens a launched rank's session from it,
and :mod:`vigil.launch` drives that session, so neither of those two imports the other back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONTEXT_ENV = "VIGIL_RANK_CONTEXT"
"""Path of the JSON file with the child's Vigil context (:func:`vigil.launch.write_context` writes it)."""


def launched() -> dict[str, Any] | None:
    """This process's context when it is a launched script rank, else None."""
    path = os.environ.get(CONTEXT_ENV)
    if not path:
        return None
    try:
        return dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{CONTEXT_ENV}={path}: unreadable ({e})") from e


def ensure_process_group() -> None:
    """The process group from torchrun's environment, unless the script made one (gloo on CPU, NCCL on GPU)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def context_from_env(ctx: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(RankContext, JobCreate, config)`` of a launched rank; makes the process group if needed."""
    import torch.distributed as dist

    from vigil.contract.checkpoint_layout import as_location
    from vigil.contract.schemas import JobCreate
    from vigil.rank.context import RankContext
    from vigil.telemetry import RankTelemetry

    ensure_process_group()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    rc = RankContext(
        rank=rank, world_size=world, job_id=ctx["job_id"], node_id=ctx["node_id"],
        telemetry=RankTelemetry(ctx["socket_path"]), checkpoint_root=as_location(ctx["checkpoint_root"]),
        restore_dir=Path(ctx["restore_dir"]) if ctx.get("restore_dir") else None,
        report_interval=int(ctx["report_interval"]),
        fault_file=Path(ctx["fault_file"]) if ctx.get("fault_file") else None,
        optimizer_hooks=False,  # this module's hooks forward to the session
    )
    return rc, JobCreate.model_validate(ctx["spec"]), dict(ctx.get("config") or {})
