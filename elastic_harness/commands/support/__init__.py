"""What only the commands use: a script job's own files (``scriptfiles``), where a run will resume
(``resumepoint``), the terminal's progress line (``progress``) and the hot spares of a local run
(``spares``)."""
