"""``bench checkpoint``: what checkpointing costs, side by side, in one run.

``main`` is the command (it spawns the ranks and prints the JSON); ``ranks`` is what each
spawned process does, ``train`` the training job's saves and steps with saves, ``floor`` the
raw durable writes under the training overhead, ``common`` what ``ranks`` and ``train`` share.
"""
