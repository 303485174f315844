from elastic_harness.cli import entry

entry()
