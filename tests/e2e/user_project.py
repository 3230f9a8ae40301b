"""A user's own project for tests/e2e/test_user_code.py: its model, data and loop on the rank API, as
source text written into a temporary folder Vigil knows nothing about; and how a user submits it."""

from __future__ import annotations

import os
from pathlib import Path

from ops.localcluster import LocalCluster
from vigil.contract.client import VigilClient
from vigil.contract.probe import wait_for
from vigil.contract.schemas import JobStatus

# The user's code: nothing in it is Vigil's but the `vigil.*` calls. A data loader that takes ~40 ms a
# batch makes the steps long enough for a fault to land mid-run.
MODEL_PY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x):
        return self.body(x)


class Data:
    """Generated regression data, this rank's shard, a position that is checkpointed."""

    def __init__(self, rank: int, world: int) -> None:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2048, 6, generator=g)
        self.x, self.y = x[rank::world], (x[rank::world] ** 2).sum(dim=1, keepdim=True)
        self.i = 0

    def next(self):
        import time
        time.sleep(0.04)
        j = (self.i * 16) % (len(self.x) - 16)
        self.i += 1
        return self.x[j:j + 16], self.y[j:j + 16]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = int(state["i"])
'''

LOOP = '''
def loop(width, steps, log_dir):
    run = vigil.init()
    torch.manual_seed(0)
    model = Net(width)
    opt = vigil.optimizer(model)
    data = Data(run.rank, run.world_size)
    start = (vigil.restore(model=model, optimizer=opt, data=data) or 0) + 1
    with open(os.path.join(log_dir, f"starts-{run.rank}.txt"), "a") as f:
        f.write(f"{start}\\n")
    for step in range(start, steps + 1):
        with vigil.step(step) as s:
            with s.phase("data"):
                x, y = data.next()
            with s.phase("forward_backward"):
                opt.zero_grad()
                loss = nn.functional.mse_loss(opt.model(x), y)
                loss.backward()
            opt.step()
            s.report(loss=loss.item(), tokens=len(x))
        vigil.checkpoint(step, model=model, optimizer=opt, data=data)
'''

FUNCTION_PY = f'''
import os

import torch
from torch import nn

from mymodel import Data, Net
from vigil import sdk as vigil
{LOOP}

def train_func(config):
    loop(config["width"], vigil.get_session().steps, config["log_dir"])
'''

SCRIPT_PY = f'''
import argparse
import os

import torch
from torch import nn

from mymodel import Data, Net
from vigil import sdk as vigil
{LOOP}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log-dir", required=True)
    a = p.parse_args()
    loop(a.width, a.steps, a.log_dir)
'''


def finish(client: VigilClient, job_id: str, timeout: float = 360) -> None:
    wait_for(lambda: client.get_job(job_id).status.is_terminal(), timeout, f"{job_id} to end", 0.5)
    job = client.get_job(job_id)
    assert job.status == JobStatus.SUCCEEDED, f"{job.status}: {job.message}\n{client.job_logs(job_id).logs[-4000:]}"


def job_writable_dir(cluster: LocalCluster, name: str) -> Path:
    """A folder the cluster's ranks may write (they run as the rank user under a root `vigil up`, which cannot
    enter pytest's 0700 temp folders): under the checkpoint storage, owned like it."""
    assert cluster.storage is not None
    folder = cluster.storage / "test-files" / f"{name}-{os.urandom(4).hex()}"
    folder.mkdir(parents=True)
    st = cluster.storage.stat()
    for d in (folder.parent, folder):
        os.chown(d, st.st_uid, st.st_gid)
    return folder
