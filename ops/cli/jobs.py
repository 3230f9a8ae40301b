"""Jobs: ``vigil submit | jobs | logs | cancel``, the job file reader and the progress bar that
``submit --follow`` and ``vigil up`` show."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from importlib import resources
from pathlib import Path

from ops.cli.common import client_for
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import JobCreate, JobPublic, JobStatus
from vigil.contract.settings import get_settings

DEMO_JOB = "demo.yaml"


def load_job_file(path: Path, overrides: dict[str, object] | None = None) -> JobCreate:
    """Read and validate a job spec file (YAML or JSON), with ``overrides`` set over its top-level
    fields (``working_dir`` from ``--working-dir``); ``ValueError`` names the field and the rule."""
    import yaml
    from pydantic import ValidationError

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read job spec ({exc})") from exc
    if not isinstance(raw, dict):
        # A file that holds no mapping is a bad value to the user, like every other refusal here:
        # callers catch ValueError for all of them.
        raise ValueError(f"{path}: a job spec must be a mapping, got {type(raw).__name__}")  # noqa: TRY004
    try:
        return JobCreate.model_validate({**raw, **(overrides or {})})
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc'])) or '<spec>'}: {e['msg']}" for e in exc.errors()]
        raise ValueError(f"{path}: invalid job spec\n  " + "\n  ".join(lines)) from None


def demo_job_spec() -> JobCreate:
    """The bundled demo job (``controller/examples/demo.yaml``) that ``vigil up`` runs."""
    text = resources.files("controller").joinpath("examples", DEMO_JOB).read_text()
    import yaml

    return JobCreate.model_validate(yaml.safe_load(text))


def follow_job(client: VigilClient, job_id: str, stop: threading.Event | None = None,
               interval: float = 1.0) -> JobPublic:
    """Show a progress bar of the job's steps until it ends (or ``stop`` is set); returns the last view."""
    import httpx
    from tqdm import tqdm

    job = client.get_job(job_id)
    with tqdm(total=job.spec.steps, desc=f"{job.name} [{job.status.value}]", unit="step", dynamic_ncols=True) as bar:
        while True:
            try:
                job = client.get_job(job_id)
            except httpx.TransportError as exc:  # a busy or restarting controller: keep following
                bar.set_postfix_str(f"controller unreachable ({type(exc).__name__}), retrying")
                if stop is not None and stop.wait(interval):
                    return job
                time.sleep(0 if stop is not None else interval)
                continue
            done = job.last_step or 0  # steps are numbered 1..steps
            bar.set_description(f"{job.name} [{job.status.value}]")
            if job.last_loss is not None:
                bar.set_postfix(loss=f"{job.last_loss:.3f}")
            bar.update(max(0, min(done, job.spec.steps) - bar.n))
            if job.status.is_terminal() or (stop is not None and stop.is_set()):
                return job
            time.sleep(interval)


def cmd_submit(args: argparse.Namespace) -> int:
    package = None
    overrides: dict[str, object] = {}
    if args.working_dir:  # packed first: the spec names the package by its hash, and is checked with it
        from controller.packages import REF_PREFIX, PackageError, pack_directory

        try:
            package = pack_directory(Path(args.working_dir), args.exclude or (),
                                     max_bytes=get_settings().max_package_bytes)
        except (PackageError, OSError) as exc:
            print(f"submit: {exc}", file=sys.stderr)
            return 2
        overrides["working_dir"] = REF_PREFIX + hashlib.sha256(package).hexdigest()
    try:
        spec = load_job_file(Path(args.file), overrides)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    with client_for(args) as client:
        try:
            if package is not None:
                uploaded = client.upload_package(package)
                print(f"uploaded {args.working_dir} as {uploaded.ref} ({uploaded.files} files, {uploaded.size} bytes)",
                      file=sys.stderr)
            job = client.submit_job(spec)
        except ApiError as exc:
            print(f"submit refused: {exc}", file=sys.stderr)
            return 2
        print(job.id)
        if args.follow:
            job = follow_job(client, job.id)
            print(f"{job.id} {job.status.value}" + (f": {job.message}" if job.message else ""))
            return 0 if job.status == JobStatus.SUCCEEDED else 1
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        jobs = client.list_jobs(limit=args.limit)
    if args.json:
        print(json.dumps([j.model_dump(mode="json") for j in jobs.data], indent=2))
        return 0
    print(f"{'ID':<18} {'STATUS':<10} {'STEP':>11} {'LOSS':>8}  {'OPTIMIZER':<16} NAME")
    for j in jobs.data:
        step = f"{j.last_step or 0}/{j.spec.steps}"
        loss = f"{j.last_loss:.4f}" if j.last_loss is not None else "-"
        print(f"{j.id:<18} {j.status.value:<10} {step:>11} {loss:>8}  {j.spec.optimizer.kind:<16} {j.name}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        try:
            out = client.job_logs(args.job, tail_bytes=args.tail_bytes)
            if out.truncated:
                print(f"[the last {len(out.logs.encode())} of {out.total_bytes} bytes; --tail-bytes for more]",
                      file=sys.stderr)
            print(out.logs, end="")
        except ApiError as exc:
            print(exc, file=sys.stderr)
            return 1
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        try:
            job = client.cancel_job(args.job)
        except ApiError as exc:
            print(exc, file=sys.stderr)
            return 1
    print(f"{job.id} {job.status.value}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``submit``, ``jobs``, ``logs`` and ``cancel`` on ``sub`` (the ``vigil`` parser's subparsers)."""
    s = sub.add_parser("submit", help="Submit a job file (YAML); prints the job id.")
    s.add_argument("file")
    s.add_argument("--working-dir", help="Your code: this folder is packed (minus .git/, __pycache__/, .venv/ and "
                   "what its .vigilignore lists), uploaded, and shipped to the driver and every rank.")
    s.add_argument("--exclude", action="append", metavar="PATTERN",
                   help="Leave matching files out of the package (gitignore syntax; repeatable).")
    s.add_argument("--follow", action="store_true", help="Show a progress bar until the job ends.")

    j = sub.add_parser("jobs", help="List jobs.")
    j.add_argument("--limit", type=int, default=50)
    j.add_argument("--json", action="store_true")

    lg = sub.add_parser("logs", help="Print the end of a job's driver log.")
    lg.add_argument("job")
    lg.add_argument("--tail-bytes", type=int, default=None,
                    help="at most this many bytes from the end (default 256 KiB, at most 16 MiB)")

    cn = sub.add_parser("cancel", help="Cancel a job.")
    cn.add_argument("job")
