"""World-size-free data positions: map-style cursors (``sampler``) and sharded streams
(``stream``: the protocol, ``order``: the pure order, ``read``: reading lanes, ``adapters``:
what a user may pass, turned into a ``Stream``)."""

from elastic_harness.data.adapters import hf_stream, jsonl_stream, parquet_stream, tar_stream
from elastic_harness.data.stream import Packing, Stream

__all__ = ["Packing", "Stream", "hf_stream", "jsonl_stream", "parquet_stream", "tar_stream"]
