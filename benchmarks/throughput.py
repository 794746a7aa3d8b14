"""Offline throughput benchmark; same as `nanoinfer bench throughput` (see `--help`)."""

import sys

from nanoinfer.benchmarks.throughput import main

if __name__ == "__main__":
    sys.exit(main())
