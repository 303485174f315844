"""The run's records: its directory claimed and prepared (``rundir``), the one fold of its event log
(``goodput``, and ``runstate`` built on it) and the ``summary.json`` written from that fold."""
