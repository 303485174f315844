"""Faults as data: the vocabulary (``vocabulary``: per kind who fires it, what it needs, how),
when they are due (``schedule``) and the host's side of carrying them out (``inject``)."""
