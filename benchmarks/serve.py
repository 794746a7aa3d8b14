"""Serving benchmark; same as `nanoinfer bench serve` (see `python benchmarks/serve.py --help`)."""

import sys

from nanoinfer.benchmarks.serve import main

if __name__ == "__main__":
    sys.exit(main())
