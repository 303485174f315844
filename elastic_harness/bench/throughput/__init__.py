"""``bench throughput``: training samples/s, the harness against a plain torchrun DDP script.

``main`` is the command (its rows, flags and JSON); ``sides`` starts one side of a case and
reads back its step stamps; ``harness`` and ``plain`` are the two sides' training scripts, sharing
``common`` (arguments, model, step clock) and ``data`` (the image set, cheap and costly);
``stream`` and ``stream_plain`` are the streaming rows (``--stream``); ``stats`` the arithmetic
over a run's records that both kinds of rows share.
"""
