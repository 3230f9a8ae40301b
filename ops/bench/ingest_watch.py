"""The monitor's pass times during the ingest benchmark (:mod:`ops.bench.ingest`), read off ``/metrics``."""

from __future__ import annotations

import threading
from typing import Self

import httpx


class MonitorWatch:
    """Reads the monitor's pass time off ``/metrics`` every ``period`` seconds while the posts run.

    Each scrape costs the controller a few database reads, so it is not done more often than a
    second: the histogram's bucket counts (their growth between the first and the last scrape) give
    every pass's bucket, the latest-pass gauge a sample of exact durations. With several workers a
    scrape reaches any of them; only the leader's answers (the monitor runs there) count.
    """

    def __init__(self, base: str, token: str, period: float = 1.0) -> None:
        self.base, self.token, self.period = base, token, period
        self.samples: dict[int, float] = {}  # pass count -> the latest pass's duration then
        self.first: dict[float, float] | None = None  # bucket bound -> cumulative count, at the first scrape
        self.last: dict[float, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor-watch", daemon=True)

    def __enter__(self) -> Self:
        self._scrape()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._scrape()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._scrape()

    def _scrape(self) -> None:
        try:
            text = httpx.get(f"{self.base}/metrics", headers={"Authorization": f"Bearer {self.token}"},
                             timeout=10).text
        except httpx.HTTPError:
            return
        count = _metric(text, "vigil_monitor_pass_seconds_count")
        if not count:
            return  # a worker that does not lead (or no pass yet)
        buckets = {float(le): v for le, v in _buckets(text, "vigil_monitor_pass_seconds_bucket").items()}
        if self.first is None:
            self.first = buckets
        else:
            self.samples[int(count)] = float(_metric(text, "vigil_monitor_last_pass_seconds") or 0.0)
        self.last = buckets

    def summary(self) -> tuple[float | None, float | None, int]:
        """(longest pass, median pass, passes) during the watch: the longest and the median are the
        larger of the longest sampled pass and the lower bound of the highest bucket that grew."""
        if self.first is None or self.last is None:
            return None, None, 0
        grew = {le: self.last[le] - self.first.get(le, 0.0) for le in sorted(self.last)}
        passes = int(grew.get(float("inf"), 0.0))
        if passes == 0:
            return None, None, 0
        bounds = sorted(grew)
        lower = {b: (bounds[i - 1] if i else 0.0) for i, b in enumerate(bounds)}
        top = next(b for b in bounds if grew[b] >= passes)  # every pass is at or under this bound
        mid = next(b for b in bounds if grew[b] >= passes / 2)
        seen = sorted(self.samples.values())
        longest = max([lower[top], *seen])
        median = seen[len(seen) // 2] if seen else lower[mid]
        return round(longest, 4), round(median, 4), passes


def _buckets(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out["inf" if le == "+Inf" else le] = float(line.rsplit(" ", 1)[1])
    return out


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None
