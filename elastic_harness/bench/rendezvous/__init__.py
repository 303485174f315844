"""``bench rendezvous`` and ``bench rendezvous-scale``: what a rendezvous round costs.

``main`` is ``bench rendezvous`` (a round on etcd's v3 API against its v2 API, one local etcd);
``scale`` is ``bench rendezvous-scale`` (messages and bytes per round at N light agents), with
every store call counted by ``store_calls``.
"""
