"""Where the ranks run: intra-node and inter-node process groups for hierarchical collectives.

Every rank contributes the id of the node it runs on (Ray's node id inside a Ray worker, else the
hostname; or ``rank // ranks_per_node`` when a test or benchmark overrides the topology to pretend
one machine is several nodes). From the gathered ids:

* the **intra-node group** of a rank is every rank on its node;
* the **inter-node group** is the rank with the same *local rank* (position among its node's
  ranks, in global-rank order) on every node.

``torch.distributed.new_group`` is collective over the whole world: every rank creates every
group, in the same order (all intra groups by node, then all inter groups by local rank), and
keeps the two it belongs to. Nodes must hold equally many ranks, or the inter groups would not
be well defined; :func:`discover` raises ``ValueError`` otherwise.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace

import torch.distributed as dist

log = logging.getLogger(__name__)


def local_node_id() -> str:
    """This process's node: Ray's node id when running inside Ray, else the hostname."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception as exc:  # noqa: BLE001 - no Ray, or no runtime context: fall back, don't crash
        log.debug("no Ray node id (%s); using the hostname", exc)
    return socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """The placement of ranks on nodes, as seen by one rank, and that rank's two groups.

    ``node_ranks[n]`` lists the global ranks on node ``n`` in increasing order (nodes are ordered by
    their smallest rank); ``intra_ranks`` / ``inter_ranks`` are this rank's two groups in increasing
    global-rank order, which is also the order of their group ranks (``new_group`` sorts).
    """

    rank: int
    world_size: int
    node_ranks: tuple[tuple[int, ...], ...]
    node_index: int
    local_rank: int
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]
    intra_group: dist.ProcessGroup | None = None
    inter_group: dist.ProcessGroup | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def ranks_per_node(self) -> int:
        return len(self.node_ranks[0])

    def inter_ranks_of(self, rank: int) -> tuple[int, ...]:
        """The inter-node group (sorted global ranks) of any rank ``rank``."""
        for ranks in self.node_ranks:
            if rank in ranks:
                local = ranks.index(rank)
                return tuple(sorted(r[local] for r in self.node_ranks))
        raise ValueError(f"rank {rank} is not in the topology")


def layout(node_ids: list[str], rank: int) -> Topology:
    """The topology (without process groups) for ranks whose node ids are ``node_ids[rank]``."""
    world = len(node_ids)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    by_node: dict[str, list[int]] = {}
    for r, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(r)  # ranks ascending; nodes in order of first rank
    node_ranks = tuple(tuple(rs) for rs in by_node.values())
    sizes = {len(rs) for rs in node_ranks}
    if len(sizes) != 1:
        raise ValueError(f"nodes hold different numbers of ranks ({[len(rs) for rs in node_ranks]}); "
                         "hierarchical groups need the same count on every node")
    node_index = next(i for i, rs in enumerate(node_ranks) if rank in rs)
    local_rank = node_ranks[node_index].index(rank)
    return Topology(
        rank=rank,
        world_size=world,
        node_ranks=node_ranks,
        node_index=node_index,
        local_rank=local_rank,
        intra_ranks=node_ranks[node_index],
        inter_ranks=tuple(sorted(rs[local_rank] for rs in node_ranks)),
    )


def discover(ranks_per_node: int | None = None) -> Topology:
    """Find where every rank runs and create the intra- and inter-node process groups.

    Collective: every rank of the default process group must call it. ``ranks_per_node`` overrides
    the real placement (rank ``r`` is on pretend node ``r // ranks_per_node``); it must divide the
    world size. Without an initialised process group, the topology of a single rank is returned.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return layout(["local"], 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    if ranks_per_node is not None:
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide the world size {world}")
        node_ids = [f"node-{r // ranks_per_node}" for r in range(world)]
    else:
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, local_node_id())
        node_ids = [str(n) for n in gathered]
    topo = layout(node_ids, rank)
    intra = inter = None
    # Every rank creates every group, in one fixed order (new_group is collective over the world).
    for node in topo.node_ranks:
        g = dist.new_group(list(node))
        if rank in node:
            intra = g
    for local in range(topo.ranks_per_node):
        same_local = sorted(rs[local] for rs in topo.node_ranks)
        g = dist.new_group(same_local)
        if rank in same_local:
            inter = g
    log.info("topology: %d nodes x %d ranks; rank %d is node %d local %d",
             topo.num_nodes, topo.ranks_per_node, rank, topo.node_index, topo.local_rank)
    return replace(topo, intra_group=intra, inter_group=inter)


__all__ = ["Topology", "discover", "layout", "local_node_id"]
