"""The support matrix from the registry: ``python -m fly_lightning.support`` (add ``--markdown`` for the README)."""

from __future__ import annotations

import argparse

from fly_lightning.backends import BACKENDS
from fly_lightning.kernels import load_kernels
from fly_lightning.registry import OPS


def rows() -> list[dict[str, str]]:
    """One row per (op, backend): constraints, how it is verified, and whether it is usable on this machine."""
    load_kernels()
    out = []
    for op in sorted(OPS.values(), key=lambda o: o.name):
        for name in BACKENDS:
            impl = op.impls.get(name)
            if impl is None:
                continue
            reason = BACKENDS[name].unavailable_reason()
            out.append(
                {
                    "op": op.name,
                    "backend": name,
                    "constraints": impl.constraints,
                    "verified": impl.verified,
                    "here": "available" if reason is None else f"unavailable: {reason}",
                }
            )
    return out


def markdown() -> str:
    lines = ["| op | backend | supports | verified |", "|---|---|---|---|"]
    lines += [f"| `{r['op']}` | {r['backend']} | {r['constraints']} | {r['verified']} |" for r in rows()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--markdown", action="store_true")
    if ap.parse_args().markdown:
        print(markdown())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fly-lightning support matrix")
    for col in ("op", "backend", "supports", "verified", "on this machine"):
        table.add_column(col, overflow="fold")
    for r in rows():
        table.add_row(r["op"], r["backend"], r["constraints"], r["verified"], r["here"])
    Console().print(table)


if __name__ == "__main__":
    main()
