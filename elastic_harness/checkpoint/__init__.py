"""Checkpoints: pure layout, storage, DCP save/load, integrity."""
