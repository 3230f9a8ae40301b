"""A stand-in for the rank's telemetry sender (:class:`vigil.telemetry.RankTelemetry`), for the rank API
tests (tests/vigil: sdk, capture, Ray Train): :class:`Sink` keeps, in memory, every step sample with its
collective records and every checkpoint sample the rank sends, for the test to read back.

Needs nothing: no agent, no socket, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

from vigil.comm import CollectiveRecord
from vigil.contract.schemas import CheckpointSample, FaultSample, StepSample


class Sink:
    def __init__(self) -> None:
        self.steps: list[StepSample] = []
        self.records: list[list[CollectiveRecord]] = []
        self.checkpoints: list[CheckpointSample] = []

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        self.steps.append(sample)
        self.records.append(list(records))

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        self.checkpoints.append(sample)

    def close(self) -> None:
        pass


class FaultSink(Sink):
    """The test sink, plus the fault samples (an applied version is one, ``fault_kind="adapt"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.faults: list[FaultSample] = []

    def send_fault(self, sample: FaultSample) -> None:
        self.faults.append(sample)
