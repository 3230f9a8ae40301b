"""Operator tools: the composition roots that start Vigil's packages and wire them together.

The ``vigil`` CLI (:mod:`ops.cli`), ``vigil up``'s local cluster (:mod:`ops.localcluster`), process
groups (:mod:`ops.processes`), the agent keeper (:mod:`ops.agentkeeper`), network namespaces
(:mod:`ops.netns`), the benches (:mod:`ops.bench`), and the dashboard's mount in the controller's app
(:mod:`ops.dashboard_mount`). They may import any package (the server in
``controller/``, the agent, the dashboard, the rank runtime); no package imports them
(``tests/test_boundaries.py``).
"""
