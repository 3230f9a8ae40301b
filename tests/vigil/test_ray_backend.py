"""vigil/ray_backend.py: Ray Train's torch backend without torch in the driver or Ray Train's controller.

The process group it makes on real ranks is every end-to-end job's (tests/e2e, tests/vigil/test_ray_integration);
here: what it picks, and that the processes that only hold the config never load torch.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

from ray.train.v2._internal.util import TrainingFramework

from vigil.ray_backend import RankGroupConfig, _RankContext, _RankGroupBackend, group_backend


def test_the_collective_backend_is_the_one_asked_for_else_by_the_ranks_resources() -> None:
    assert group_backend("gloo", {"GPU": 1}) == "gloo"
    assert group_backend(None, {"CPU": 1}) == "gloo"
    assert group_backend(None, {"CPU": 1, "GPU": 1}) == "nccl"
    assert group_backend("", {"GPU": 0.5}) == "nccl"


def test_the_config_names_its_backend_its_rank_context_and_torch_as_its_framework() -> None:
    cfg = RankGroupConfig()
    assert (cfg.backend, cfg.timeout_s) == ("gloo", 1800)
    assert cfg.backend_cls is _RankGroupBackend and cfg.train_func_context is _RankContext
    assert cfg.framework == TrainingFramework.TORCH
    assert _RankGroupBackend.share_cuda_visible_devices
    back = pickle.loads(pickle.dumps(RankGroupConfig(backend="nccl", timeout_s=60)))
    assert (back.backend, back.timeout_s) == ("nccl", 60)


def test_the_driver_and_an_unpickled_config_load_no_torch() -> None:
    """A fresh interpreter, as the job's driver and Ray Train's controller actor are: building the trainer and
    unpickling its backend config leave torch unloaded (each import of it cost ~2.5 CPU-seconds a job)."""
    code = (
        "import json, os, pickle, sys, tempfile\n"
        "os.environ.update(RAY_TRAIN_V2_ENABLED='1', VIGIL_JOB_ID='job_x', VIGIL_STORAGE_PATH=tempfile.mkdtemp(),"
        " VIGIL_JOB_SPEC=json.dumps({'name': 'x', 'steps': 2}))\n"
        "from vigil.driver import build_trainer, parse_config\n"
        "from vigil.checkpointing import choose, job_root\n"  # what run() takes before fit()
        "from vigil.raytrain import newest_step\n"
        "t = build_trainer(parse_config([]))\n"
        "pickle.loads(pickle.dumps(t.backend_config))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_rank_context_is_rays_torch_context() -> None:
    with _RankContext():  # no CUDA here: it enters and leaves, as Ray's does
        assert "ray.train.torch.config" in sys.modules
