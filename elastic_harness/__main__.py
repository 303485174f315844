import sys

from elastic_harness.cli import main

sys.exit(main())
