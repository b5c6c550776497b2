"""Compare two dispatch manifests: ``python -m fly_lightning.callbacks.manifest_diff a.json b.json``.

Prints the shape signatures whose backend changed from run ``a`` to run ``b`` and those seen in one run only: a rich
table on a terminal, one line per signature when piped (``ManifestDiff.format()``). Exit status, as ``diff``: 0 when
nothing changed backend, 1 when something did, 2 when a file is missing or not a manifest.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fly_lightning.callbacks.manifest import diff_manifests


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fly_lightning.callbacks.manifest_diff", description="What changed backend between two runs."
    )
    parser.add_argument("a", help="the earlier run's dispatch_manifest.json")
    parser.add_argument("b", help="the later run's dispatch_manifest.json")
    args = parser.parse_args(argv)
    try:
        diff = diff_manifests(args.a, args.b)
    except (OSError, ValueError) as exc:
        print(f"manifest_diff: {exc}", file=sys.stderr)
        return 2
    diff.print()
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
