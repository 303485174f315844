"""Worker side: one process per rank, started by the elastic agent (see ``worker``)."""
