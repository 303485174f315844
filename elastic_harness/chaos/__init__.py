"""Faults as data (``FaultSpec``: kind, target, at step/time) and the code that fires them."""
