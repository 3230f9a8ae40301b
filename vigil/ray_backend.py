"""Ray Train's torch backend for Vigil's jobs, with no ``import torch`` outside the ranks.

Ray's own :class:`ray.train.torch.TorchConfig` lives in a module that imports torch at its top, and Ray Train
unpickles the backend config in two processes that never touch a tensor: the job's driver (``python -m
vigil``) and Ray Train's controller actor. Each paid for one torch import (about 2.5 CPU-seconds on this
project's 2-core CI machine, at every job start) only to name the class.

:class:`RankGroupConfig` is a :class:`ray.train.backend.BackendConfig` whose module imports no torch. Its
backend does what Ray's does for a CPU or GPU group of ranks: rank 0 picks the rendezvous address, every rank
gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), then each joins the process group
through ``env://``. The work on the ranks is Ray's own functions (``ray.train.torch.config``), imported there,
where torch is loaded anyway; so is the context each rank's function runs in (the CUDA device set). TPU slices,
which Ray's backend also handles, are not offered by Vigil.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.util import TrainingFramework

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_ENV = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"
"""Ray Train's variable (and default, :data:`SHUTDOWN_TIMEOUT_DEFAULT_S`) for how long the ranks may take to
leave their process group when the group stops."""
SHUTDOWN_TIMEOUT_DEFAULT_S = 30


@dataclass
class RankGroupConfig(BackendConfig):
    """How the ranks' process group is made: ``backend`` (``gloo``, or ``nccl`` when the ranks have GPUs;
    None picks by the workers' resources) and the collectives' ``timeout_s``."""

    backend: str | None = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return _RankGroupBackend

    @property
    def train_func_context(self) -> type[Any]:
        return _RankContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH


class _RankContext:
    """Ray's torch context around each rank's function (it sets the rank's CUDA device), imported on the rank."""

    def __enter__(self) -> Any:
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc: object) -> bool:
        return bool(self._inner.__exit__(*exc))


def _rank_env(addr: str, port: int) -> None:
    """On a rank: torchrun's environment, and the rendezvous at rank 0's ``addr:port``."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    _set_torch_distributed_env_vars()


def _join(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    """On a rank: join the process group (Ray's function, as Ray's backend calls it)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(backend=backend, world_rank=world_rank, world_size=world_size,
                               init_method="env://", timeout_s=timeout_s)


def _leave(destroy_process_group: bool) -> None:
    """On a rank: leave the process group and free the CUDA cache (Ray's function)."""
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


def group_backend(backend: str | None, resources: dict[str, float]) -> str:
    """The collective backend: the one asked for, else ``nccl`` for ranks with GPUs and ``gloo`` without."""
    if backend:
        return backend
    return "nccl" if resources.get("GPU", 0) > 0 else "gloo"


class _RankGroupBackend(Backend):
    """Ray Train's hooks around a worker group's life (:class:`ray.train.backend.Backend`)."""

    share_cuda_visible_devices: bool = True  # as Ray's torch backend: ranks of one node see each other's GPUs

    def on_start(self, worker_group: Any, backend_config: RankGroupConfig) -> None:
        backend = group_backend(backend_config.backend, worker_group.get_resources_per_worker())
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_rank_env, addr=addr, port=port)
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(i, _join, backend=backend, world_rank=i, world_size=size,
                                                   timeout_s=backend_config.timeout_s) for i in range(size)])

    def on_shutdown(self, worker_group: Any, backend_config: RankGroupConfig) -> None:
        futures = worker_group.execute_async(_leave, destroy_process_group=len(worker_group) > 1)
        timeout = float(os.environ.get(SHUTDOWN_TIMEOUT_ENV, SHUTDOWN_TIMEOUT_DEFAULT_S))
        try:
            ray.get(futures, timeout=timeout)
        except GetTimeoutError:
            log.warning("the ranks did not leave their process group within %g s", timeout)
