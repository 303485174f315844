"""The rendezvous: which nodes form each round of the job, on torch's dynamic rendezvous.

``rules`` are its decisions, pure, over a view of torch's state and our fields beside it;
``handler`` is torch's dynamic handler applying them at torch's hook points; ``rounds``,
``liveness``, ``verdict`` and ``exclusion`` are the pure deciders the rules and the agent use;
``probe`` a node's beacon. The state travels sealed under the job's key (``sealed``: c10d and etcd-v2, ``etcd_v3``
over ``etcd_gateway``), and writes that change it are pushed (``changes``) (docs/architecture.md).
"""
