"""The README's "Train your own model" example runs as printed (a world of one, no Ray).

Extracts the section's Python and YAML blocks, writes them as a project in a temporary directory,
imports its ``train_func`` from there and runs it through the rank API with the job spec, as Vigil's
runner does on each rank. So the documented code cannot drift from the API.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from vigil import sdk
from vigil.contract.schemas import JobCreate

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_trains_and_checkpoints(tmp_path: Path) -> None:
    text = README.read_text()
    section = text[text.index("## Train your own model"):text.index("## How it fits together")]
    code = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0]
    spec = JobCreate.model_validate(yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)[0]))
    (tmp_path / "train.py").write_text(code)
    module_spec = importlib.util.spec_from_file_location("readme_train", tmp_path / "train.py")
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    assert spec.entrypoint.split(":")[1] == "train_func"

    summary = sdk.run(module.train_func, sdk.RankContext(rank=0, world_size=1, job_id="readme",
                                                         checkpoint_root=tmp_path / "ckpt"), spec)
    assert summary.final_step == spec.steps
    first, last = summary.losses[1], summary.losses[spec.steps]
    assert first is not None and last is not None and last < first / 10
    assert summary.checkpoints == list(range(spec.checkpoint.interval_steps, spec.steps + 1,
                                             spec.checkpoint.interval_steps))
