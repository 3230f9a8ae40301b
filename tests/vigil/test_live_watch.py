"""The live driver's watch on its replicas' nodes (vigil/live_watch.py): probes of a raylet's port, the bounds
before a node counts as lost, the label selector that keeps a replacement off it."""

from __future__ import annotations

import socket

from vigil.live_watch import OK, REFUSED, SILENT, NodeWatch, avoiding, probe

RAYLETS = {"a": ("10.0.0.1", 1), "b": ("10.0.0.2", 2)}


class Probes:
    """Scripted probe results per host, in order; OK once a script runs out."""

    def __init__(self, **scripts: list[str]) -> None:
        self.scripts = {RAYLETS[node][0]: list(results) for node, results in scripts.items()}
        self.seen: list[str] = []

    def __call__(self, host: str, port: int) -> str:
        self.seen.append(host)
        script = self.scripts.get(host, [])
        return script.pop(0) if script else OK


def test_two_refusals_in_a_row_lose_a_node_once_and_it_is_not_probed_again() -> None:
    probes = Probes(a=[REFUSED, OK, REFUSED, REFUSED])
    watch = NodeWatch(probe=probes)
    looks = [watch.look(RAYLETS, ["a", "b"]) for _ in range(5)]
    assert looks == [set(), set(), set(), {"a"}, set()]  # the OK between resets the count
    assert watch.lost == {"a"}
    assert probes.seen.count("10.0.0.1") == 4  # not after it was lost
    assert probes.seen.count("10.0.0.2") == 5


def test_silence_takes_more_looks_than_refusal() -> None:
    watch = NodeWatch(probe=Probes(a=[SILENT] * 5, b=[SILENT, SILENT, OK, SILENT, SILENT]))
    looks = [watch.look(RAYLETS, ["a", "b"]) for _ in range(5)]
    assert looks == [set(), set(), set(), set(), {"a"}]  # a blip (b) never adds up


def test_only_nodes_ray_counts_alive_and_that_run_a_replica_are_probed() -> None:
    probes = Probes(a=[REFUSED] * 5)
    watch = NodeWatch(probe=probes)
    for _ in range(3):
        assert watch.look({"b": RAYLETS["b"]}, ["a", "b"]) == set()  # Ray declared a dead: Ray's to restart
        assert watch.look(RAYLETS, ["b"]) == set()  # a runs no replica
    assert "10.0.0.1" not in probes.seen and watch.lost == set()


def test_a_real_probe_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert probe("127.0.0.1", port) == OK
    assert probe("127.0.0.1", port) == REFUSED  # closed now: the kernel refuses at once


def test_a_replacement_is_kept_off_the_lost_nodes() -> None:
    assert avoiding([]) == {}
    assert avoiding(["n2", "n1"]) == {"ray.io/node-id": "!in(n1, n2)"}
    from ray._private.label_utils import validate_label_selector

    assert validate_label_selector(avoiding(["n2", "n1"])) is None  # Ray accepts it as a selector
