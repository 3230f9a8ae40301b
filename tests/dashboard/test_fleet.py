"""The fleet view (``/nodes``) and the node page (``/nodes/<id>``).

Unit tests of the pure builders of :mod:`dashboard.pages.nodes.tables`,
:mod:`dashboard.pages.nodes.host_summary` and :mod:`dashboard.pages.node.figures` (host dicts as the
agents' collectors send them, with unavailable parts,
with and without GPUs; node-history figures), then the pages in a real
Chromium against the REAL controller (``dashboard_site``: ``create_app()`` on SQLite served live,
heartbeats posted through ``POST /api/v1/telemetry`` as agents send them).

Needs: dash, dash-ag-grid, plotly; for the browser tests ``apt-get install -y chromium
chromium-driver`` (skipped without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

import re
import time
from typing import Any

from dashboard import format as fmt
from dashboard.pages.node import figures as node_views
from dashboard.pages.nodes import host_summary
from dashboard.pages.nodes import tables as fleet
from tests.dashboard.conftest import Site
from tests.dashboard.harness import Browser
from tests.dashboard.samples import make_node
from vigil.contract.schemas import Heartbeat, NodeHistoryPublic, NodeState, RankProcess

KEY_VALUE = re.compile(r"\b[\w.]+=[\w.-]+")
"""What the old nodes table showed: raw ``key=value`` dumps of the host dict."""


def host(
    cpu: float = 37.5,
    rx: float | None = 1_250_000.0,
    tx: float | None = 250_000.0,
    gpus: list[dict[str, Any]] | None = None,
    ib: bool = False,
) -> dict[str, Any]:
    """A ``host`` dict in the agents' layout (agent/collectors.py, agent/gpu.py)."""
    out: dict[str, Any] = {
        "ts": time.time(),
        "system": {
            "available": True,
            "cpu": {"available": True, "percent": cpu, "count": 16},
            "memory": {"available": True, "percent": 61.0, "total_bytes": 64 << 30, "used_bytes": 39 << 30},
            "disk": {"/": {"available": True, "percent": 40.0}, "/data": {"available": True, "percent": 91.5}},
            "load": {"available": True, "1m": 3.25, "5m": 2.0, "15m": 1.0},
        },
        "nics": {"available": True, "interfaces": {
            "eth0": {"rx_bytes_per_s": rx, "tx_bytes_per_s": tx, "rx_errors_per_s": 0.0, "tx_errors_per_s": 0.5,
                     "rx_dropped_per_s": 2.0, "tx_dropped_per_s": 0.0, "operstate": "up", "speed_mbps": 10000},
            "eth1": {"rx_bytes_per_s": None, "tx_bytes_per_s": None, "rx_errors_per_s": None,
                     "tx_errors_per_s": None, "rx_dropped_per_s": None, "tx_dropped_per_s": None,
                     "operstate": "down", "speed_mbps": None},
        }},
        "infiniband": {"available": False, "reason": "no InfiniBand device (/sys/class/infiniband absent)"},
        "gpus": {"available": False, "reason": "no GPU on this node"},
        "agent": {"spool_bytes": 0},
    }
    if gpus is not None:
        out["gpus"] = {"available": True, "count": len(gpus), "devices": gpus}
    if ib:
        out["infiniband"] = {"available": True, "ports": {"mlx5_0/1": {
            "rx_bytes_per_s": 5e9, "tx_bytes_per_s": 4e9, "rx_errors_per_s": 0.0, "tx_dropped_per_s": 1.0,
            "operstate": "up", "speed_mbps": 200000}}}
    return out


GPU = {"available": True, "util_percent": 80, "memory_used_bytes": 30 << 30, "memory_total_bytes": 80 << 30,
       "temperature_c": 71}
GPU_2 = {**GPU, "util_percent": 40, "memory_used_bytes": 10 << 30, "temperature_c": 65}


def _node(node_id: str, host_dict: dict[str, Any], state: NodeState = NodeState.ALIVE):  # type: ignore[no-untyped-def]
    return make_node(node_id, state, ranks=[("job-a", 0), ("job-a", 1)]).model_copy(update={"host": host_dict})


def _history(n: int = 5, gpu: bool = False) -> NodeHistoryPublic:
    ts = [1.7e9 + 10 * i for i in range(n)]
    return NodeHistoryPublic(
        node_id="n1", ts=ts, cpu_percent=[10.0 * i for i in range(n)], memory_percent=[50.0] * n,
        disk_percent=[91.5] * n, load_1m=[1.0] * n, rx_bytes_per_s=[1e6 * i for i in range(n)],
        tx_bytes_per_s=[None] + [2e5] * (n - 1), nic_errors_per_s=[0.0] * n, nic_drops_per_s=[0.0] * n,
        gpu_util_percent=[60.0] * n if gpu else [None] * n, gpu_memory_percent=[25.0] * n if gpu else [None] * n,
    )


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list | tuple):
        return [s for v in obj for s in _strings(v)]
    return []


# --------------------------------------------------------------------------------------------------
# Host summary
# --------------------------------------------------------------------------------------------------


def test_summary_of_a_full_host_without_gpu_or_infiniband() -> None:
    s = host_summary.summarize_host(host())
    assert (s.cpu_percent, s.cpu_count, s.memory_percent, s.load_1m) == (37.5, 16, 61.0, 3.25)
    assert (s.disk_percent, s.disk_path) == (91.5, "/data")  # the fullest disk
    # eth1 has no rates yet (first reading): the sums are over what is known.
    assert (s.nic_count, s.nic_rx_bps, s.nic_tx_bps) == (2, 1_250_000.0, 250_000.0)
    assert (s.nic_errors_per_s, s.nic_drops_per_s, s.nics_down) == (0.5, 2.0, ("eth1",))
    assert s.gpu_count is None and s.reasons["gpu"] == "no GPU on this node"
    assert s.ib_ports is None and s.reasons["ib"].startswith("no InfiniBand device")
    assert set(s.reasons) == {"gpu", "ib"}


def test_summary_with_gpus_and_infiniband() -> None:
    s = host_summary.summarize_host(host(gpus=[GPU, GPU_2], ib=True))
    assert s.gpu_count == 2
    assert s.gpu_util_percent == 60.0  # mean
    assert s.gpu_memory_percent == 25.0  # (30 + 10) / (80 + 80)
    assert s.gpu_temp_c == 71  # the hottest
    assert (s.ib_ports, s.ib_rx_bps, s.ib_tx_bps, s.ib_errors_per_s) == (1, 5e9, 4e9, 1.0)
    assert "gpu" not in s.reasons and "ib" not in s.reasons


def test_unavailable_missing_and_odd_parts_are_na_with_a_reason() -> None:
    h = host()
    h["system"]["cpu"] = {"available": False, "reason": "psutil: permission denied"}
    h["system"]["disk"] = {"/": {"available": False, "reason": "EIO"}}
    h["system"]["load"] = {"available": True, "1m": float("nan")}
    h["nics"] = {"available": False, "reason": "cannot read /proc/net/dev"}
    h["gpus"] = {"available": True, "count": 1, "devices": [{"index": 0, "available": False, "reason": "GPU lost"}]}
    s = host_summary.summarize_host(h)
    assert s.cpu_percent is None and s.reasons["cpu"] == "psutil: permission denied"
    assert s.disk_percent is None and "disk" in s.reasons
    assert s.load_1m is None  # NaN is no value
    assert s.nic_rx_bps is None and s.reasons["nic"] == "cannot read /proc/net/dev"
    assert s.gpu_count == 1 and s.gpu_util_percent is None and s.reasons["gpu"] == "GPU lost"
    assert s.memory_percent == 61.0  # the rest still shows

    for odd in ({}, None, {"system": "garbage"}, {"system": {"cpu": {"percent": True}}}, {"cpu_percent": 12.5}):
        s = host_summary.summarize_host(odd)  # type: ignore[arg-type]
        assert s.cpu_percent is None and s.nic_rx_bps is None and s.gpu_count is None
        assert {"cpu", "memory", "disk", "load", "nic", "gpu", "ib"} <= set(s.reasons)


def test_formatting() -> None:
    assert [fmt.fmt_rate(v) for v in (None, 0, 512, 1_250_000, 12.5e9)] == [
        "n/a", "0 B/s", "512 B/s", "1.25 MB/s", "12.5 GB/s"]
    assert [fmt.fmt_per_s(v) for v in (None, 0, 0.5, 12)] == ["n/a", "0", "0.5/s", "12/s"]
    assert [fmt.fmt_age(v) for v in (None, 0.84, 42, 180, 9000)] == ["–", "0.8 s", "42 s", "3 min", "2.5 h"]


# --------------------------------------------------------------------------------------------------
# Grid rows and columns
# --------------------------------------------------------------------------------------------------


def test_rows_without_gpus_hide_the_gpu_and_infiniband_columns() -> None:
    nodes = [_node("n1", host()), _node("n2", {}, NodeState.DEAD)]
    rows = fleet.fleet_rows(nodes, {"n1": _history()}, "/dashboard/")
    n1, n2 = rows
    assert n1["id"] == "n1" and n1["href"] == "/dashboard/nodes/n1"
    assert (n1["state"], n1["heartbeat"], n1["ranks"], n1["rank_count"]) == ("ALIVE", "1.2 s", "job-a: 0, 1", 2)
    assert (n1["cpu_percent"], n1["memory_percent"], n1["disk_percent"]) == (37.5, 61.0, 91.5)
    assert (n1["nic_rx_text"], n1["nic_tx_text"], n1["nic_errors_text"], n1["nic_drops_text"]) == (
        "1.25 MB/s", "250 kB/s", "0.5/s", "2/s")
    assert n1["nic_rx_hist"] == [0.0, 1e6, 2e6, 3e6, 4e6] and n1["nic_tx_hist"][0] is None
    assert n1["nic_note"] == "down: eth1" and n1["disk_note"] == "fullest disk: /data"
    assert (n1["gpu_count_text"], n1["ib_rx_text"]) == ("n/a", "n/a")
    # A node that sent no host metrics: every value n/a, no sparkline, the row still there.
    assert n2["state"] == "DEAD" and n2["cpu_percent"] is None and n2["nic_rx_text"] == "n/a"
    assert n2["nic_rx_hist"] == [] and n2["cpu_note"] == "not reported"

    columns = {c["field"]: c for c in fleet.fleet_columns(rows)}
    for gpu_or_ib in ("gpu_count", "gpu_util_percent", "gpu_memory_percent", "gpu_temp_c", "ib_rx_bps",
                      "ib_tx_bps", "ib_errors_per_s"):
        assert columns[gpu_or_ib]["hide"] is True, gpu_or_ib
    assert columns["cpu_percent"]["cellRenderer"] == "VigilBar"
    assert columns["nic_rx_bps"]["cellRendererParams"] == {"textField": "nic_rx_text", "histField": "nic_rx_hist"}
    assert all(f in rows[0] for f in columns)  # every column has its field in the rows
    assert not [s for s in _strings(rows) if KEY_VALUE.search(s)]  # no raw key=value anywhere


def test_gpu_columns_show_when_one_node_has_gpus_and_na_on_the_others() -> None:
    rows = fleet.fleet_rows([_node("n1", host(gpus=[GPU, GPU_2], ib=True)), _node("n2", host())])
    columns = {c["field"]: c for c in fleet.fleet_columns(rows)}
    assert not columns["gpu_util_percent"].get("hide") and not columns["ib_rx_bps"].get("hide")
    gpu, plain = rows
    assert (gpu["gpu_count"], gpu["gpu_util_percent"], gpu["gpu_memory_percent"], gpu["gpu_temp_c"]) == (2, 60, 25, 71)
    assert (gpu["ib_rx_text"], gpu["ib_errors_text"]) == ("5 GB/s", "1/s")
    assert (plain["gpu_count"], plain["gpu_count_text"], plain["gpu_util_percent"]) == (None, "n/a", None)
    assert plain["gpu_note"] == "no GPU on this node"


def test_summary_line() -> None:
    nodes = [_node("a", {}), _node("b", {}, NodeState.DEAD), _node("c", {})]
    assert fleet.fleet_summary(nodes) == "3 nodes: 2 ALIVE, 1 DEAD"
    assert fleet.fleet_summary([]) == "no nodes have reported yet"


# --------------------------------------------------------------------------------------------------
# Node page figures
# --------------------------------------------------------------------------------------------------


def test_node_figures_from_history() -> None:
    h = _history()
    util = node_views.node_utilisation_figure(h)
    assert [t.name for t in util.data] == ["CPU", "memory", "disk"]
    assert list(util.data[0].y) == [0.0, 10.0, 20.0, 30.0, 40.0] and len(util.data[0].x) == 5
    assert list(util.layout.yaxis.range) == [0, 100]
    assert [t.name for t in node_views.node_network_figure(h).data] == ["rx", "tx"]
    assert [t.name for t in node_views.node_nic_errors_figure(h).data] == ["errors", "drops"]
    assert [t.name for t in node_views.node_load_figure(h).data] == ["load 1m"]
    # No GPU ever reported: an empty figure that says so, and the page hides it.
    gpu = node_views.node_gpu_figure(h)
    assert gpu.data == () and [a.text for a in gpu.layout.annotations] == ["no GPU on this node"]
    assert not node_views.history_has_gpu(h)
    assert node_views.history_has_gpu(_history(gpu=True))
    assert [t.name for t in node_views.node_gpu_figure(_history(gpu=True)).data] == ["GPU util", "GPU memory"]
    # No history yet.
    for build in (node_views.node_utilisation_figure, node_views.node_network_figure):
        empty = build(None)
        assert empty.data == () and [a.text for a in empty.layout.annotations] == ["waiting for data"]
        assert build(_history(0)).data == ()


# --------------------------------------------------------------------------------------------------
# In a real browser, against the real controller
# --------------------------------------------------------------------------------------------------


def feed_history(site: Site, node_id: str, job_id: str, points: int = 4, gpus: bool = False) -> None:
    """Heartbeats of ``node_id``, 10 s apart and ending now, with rising NIC rates (the controller
    keeps one history sample per 5 s of heartbeat time), as its agent would send them."""
    now = time.time()
    ranks = [RankProcess(job_id=job_id, rank=0, pid=1000), RankProcess(job_id=job_id, rank=1, pid=1001)]
    for i in range(points):
        h = host(cpu=37.5, rx=1_250_000.0 * (i + 1) / points, gpus=[GPU, GPU_2] if gpus else None)
        hb = Heartbeat(ts=now - 10 * (points - 1 - i), hostname=f"host-{node_id}", address="198.18.0.2",
                       ranks=ranks, host=h)
        site.controller.post_batch(node_id, [], heartbeat=hb)
    site.controller.settle()


def _cell(page: Browser, node_id: str, col: str) -> str:
    cells = page.css(f'.ag-center-cols-container div[row-id="{node_id}"] div[col-id="{col}"], '
                     f'.ag-pinned-left-cols-container div[row-id="{node_id}"] div[col-id="{col}"]')
    return cells[0].text if cells else ""


def test_nodes_grid_shows_bars_rates_and_sparklines(page: Browser, dashboard_site: Site) -> None:
    feed_history(dashboard_site, "node-1", dashboard_site.demo.abc)
    page.get(f"{dashboard_site.dashboard}nodes")
    page.wait_for(lambda: _cell(page, "node-1", "id") == "node-1", what="node-1 row")
    page.wait_for(lambda: _cell(page, "node-2", "state") == "DEAD", what="node-2 DEAD")
    assert _cell(page, "node-1", "state") == "ALIVE"
    page.wait_equal(lambda: _cell(page, "node-1", "cpu_percent"), "37.5%", what="CPU bar label")
    (fill,) = page.css('div[row-id="node-1"] div[col-id="cpu_percent"] .vigil-bar-fill')
    assert fill.get_attribute("style").replace(" ", "").startswith("width:37.5%")
    assert _cell(page, "node-1", "memory_percent") == "61.0%"
    assert _cell(page, "node-1", "disk_percent") == "91.5%"
    assert _cell(page, "node-1", "nic_rx_bps") == "1.25 MB/s"
    assert _cell(page, "node-1", "nic_drops_per_s") == "2/s"
    assert _cell(page, "node-1", "ranks") == f"{dashboard_site.demo.abc}: 0, 1"
    # The sparkline: the node's history, drawn in the cell.
    page.wait_css('div[row-id="node-1"] div[col-id="nic_rx_bps"] svg.vigil-spark polyline')
    # node-2 reported no metrics in the agents' layout: n/a, not an error; the GPU columns are hidden.
    assert _cell(page, "node-2", "cpu_percent") == "n/a"
    assert not page.css('div[col-id="gpu_util_percent"]')
    assert "2 nodes: 1 ALIVE, 1 DEAD" in page.text("nodes-summary")
    body = page.js("return document.body.innerText;")
    assert not KEY_VALUE.search(body), KEY_VALUE.search(body)

    (link,) = page.css('div[row-id="node-1"] a.vigil-node-link')
    assert link.get_attribute("href") == f"{dashboard_site.dashboard}nodes/node-1"
    assert page.console_errors() == []


def test_gpu_columns_appear_for_a_node_with_gpus(page: Browser, dashboard_site: Site) -> None:
    feed_history(dashboard_site, "node-1", dashboard_site.demo.abc, points=1, gpus=True)
    page.get(f"{dashboard_site.dashboard}nodes")
    page.wait_equal(lambda: _cell(page, "node-1", "gpu_util_percent"), "60.0%", what="GPU util bar")
    assert _cell(page, "node-1", "gpu_count") == "2"
    assert _cell(page, "node-2", "gpu_util_percent") == "n/a"
    assert _cell(page, "node-1", "gpu_temp_c") == "71 °C"


def test_node_page_draws_its_series_ranks_and_incidents(page: Browser, dashboard_site: Site) -> None:
    feed_history(dashboard_site, "node-1", dashboard_site.demo.abc)
    page.get(f"{dashboard_site.dashboard}nodes/node-1")

    def traces(graph_id: str) -> list[tuple[str, int]] | None:
        g = page.graph(graph_id)
        return [(t["name"], t["n"]) for t in g["traces"]] if g and g["traces"] else None

    page.wait_for(lambda: traces("node-detail-util"), what="utilisation series")
    util = traces("node-detail-util")
    assert [name for name, _ in util] == ["CPU", "memory", "disk"]
    assert all(n >= 4 for _, n in util), util
    assert [name for name, _ in page.wait_for(lambda: traces("node-detail-net"), what="network")] == ["rx", "tx"]
    assert [name for name, _ in page.wait_for(lambda: traces("node-detail-load"), what="load")] == ["load 1m"]
    assert page.wait_for(lambda: traces("node-detail-nic-errors"), what="NIC errors")
    assert not page.css("#node-detail-gpu-row")[0].is_displayed()  # no GPU on this node
    assert "ALIVE" in page.text("node-detail-header")
    # One read of every row's rank in the page (the table may be drawn again between two element reads).
    ranks = page.wait_for(lambda: page.js("return Array.from(document.querySelectorAll('tr.vigil-rank-row'))"
                                          ".map(r => r.getAttribute('data-rank'))"), what="ranks")
    assert ranks == ["0", "1"]
    assert "no incidents on this node" in page.text("node-detail-incidents")
    assert page.css("#actions-node-evict") and page.css("#actions-node-readmit")

    page.get(f"{dashboard_site.dashboard}nodes/no-such-node")
    page.wait_for(lambda: page.css("#node-detail-not-found"), what="node not found")
    assert page.console_errors() == []
