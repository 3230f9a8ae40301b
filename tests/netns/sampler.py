"""What a node's agent sees of its NIC, sampled inside the node's namespace: ``python -m tests.netns.sampler``.

Runs the agent's own collectors (``agent.collectors.NicCollector`` and ``agent.netfaults.LinkCollector``)
every ``interval`` seconds for ``duration`` seconds and writes one JSON line per sample to ``out``:
``{"ts": unix time, "host": {"nics": ..., "link": ...}}`` - the ``host`` part of an agent heartbeat.
Started with ``ip netns exec`` so that ``/proc/net`` and ``/sys/class/net`` are the namespace's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from agent.collectors import NicCollector
from agent.netfaults import LinkCollector


def main(argv: list[str]) -> int:
    out, interval, duration = Path(argv[0]), float(argv[1]), float(argv[2])
    nic, link = NicCollector(), LinkCollector("eth0")
    deadline = time.monotonic() + duration
    with out.open("w") as f:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            f.write(json.dumps({"ts": time.time(), "host": {"nics": nic.collect(), "link": link.collect()}}) + "\n")
            f.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
