"""The simulated cluster: a job's nodes as agent processes on this machine (``cluster``), each
optionally in a network namespace of its own (``netns``) or on a host of its own (``simhost``, the
host's first process, and ``pidns``, its pids seen from here). Used by ``run`` and the benches."""
