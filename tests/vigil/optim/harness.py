"""The multi-process test harness: ``run_ranks(world_size, fn, *args, timeout)`` -> per-rank results.

Needs torch with gloo and a free TCP port on 127.0.0.1 (found by binding port 0). Each rank is a
process with one intra-op thread inside an initialised gloo process group; ``fn(rank, world_size,
*args)`` must be a module-level function (imported by reference in the child) and its result
picklable. A rank that raises, crashes or overruns ``timeout`` fails the run with every rank's
traceback (:class:`RankFailure`); processes still alive are terminated. The implementation lives in
:mod:`vigil.bench.ranks`, shared with ``python -m vigil.bench comm``.
"""

from vigil.bench.ranks import RankFailure, free_port, run_ranks

__all__ = ["RankFailure", "free_port", "run_ranks"]
