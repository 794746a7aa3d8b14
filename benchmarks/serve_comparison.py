"""Several `nanoinfer bench serve --request-rates ...` result files on one latency-against-load figure.

python3 benchmarks/serve_comparison.py --out FIGURE.png LABEL=RESULT.json [LABEL=RESULT.json ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoinfer.benchmarks.serve import plot_comparison  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the figure to write (PNG)")
    parser.add_argument("sweeps", nargs="+", metavar="LABEL=RESULT.json")
    args = parser.parse_args()
    sweeps = {}
    for item in args.sweeps:
        label, sep, path = item.partition("=")
        if not sep or not label:
            parser.error(f"expected LABEL=RESULT.json, got {item!r}")
        with open(path) as f:
            sweeps[label] = json.load(f)["runs"]
    plot_comparison(sweeps, args.out)
    print(f"figure written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
