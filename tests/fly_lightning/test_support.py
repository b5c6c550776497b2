"""The support matrix: one row per registered (op, backend), FlyDSL marked compile-only, the CLI, the README copy.

The expected rows come from the registry (``fly_lightning.OPS``), never from a list of op names kept here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fly_lightning
from fly_lightning import support
from fly_lightning.backends import BACKENDS
from fly_lightning.registry import OPS

ROOT = Path(fly_lightning.__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- support-matrix -->", "<!-- /support-matrix -->"
HEADER = ["op", "backend", "supports", "verified"]


def _cells(line: str) -> list[str]:
    assert line.startswith("| ") and line.endswith(" |"), line
    return [c.strip() for c in line[1:-1].split(" | ")]


def _table(md: str) -> list[list[str]]:
    """The data rows of the markdown table; checks the header and that every row has exactly four cells."""
    lines = md.strip().splitlines()
    assert _cells(lines[0]) == HEADER
    assert lines[1] == "|---|---|---|---|"
    rows = [_cells(line) for line in lines[2:]]
    for row in rows:
        assert len(row) == len(HEADER), row  # a '|' inside a cell would split it
    return rows


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fly_lightning.support", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "250"},
    )


@pytest.fixture(scope="module")
def cli_markdown() -> str:
    proc = _run_cli("--markdown")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_one_row_per_registered_op_and_backend():
    rows = _table(support.markdown())
    got = [(op.strip("`"), backend) for op, backend, _, _ in rows]
    expected = {(op.name, backend) for op in OPS.values() for backend in op.impls}
    assert len(got) == len(set(got)), "duplicate rows"
    assert set(got) == expected
    assert all(op.startswith("`") and op.endswith("`") for op, *_ in rows)
    # every op has its ATen fallback row; rows grouped by op (sorted), backends in preference order
    assert {op for op, _ in got} == set(OPS) and all((name, "aten") in got for name in OPS)
    order = list(BACKENDS)
    assert got == sorted(got, key=lambda r: (r[0], order.index(r[1])))
    # the cells are the registry's words
    for (name, backend), (_, _, supports, verified) in zip(got, rows, strict=True):
        impl = OPS[name].impls[backend]
        assert supports == impl.constraints and supports, (name, backend)
        assert verified == impl.verified


def test_flydsl_is_compile_only_and_everything_else_tested():
    rows = _table(support.markdown())
    flydsl = [r for r in rows if r[1] == "flydsl"]
    assert len(flydsl) == sum("flydsl" in op.impls for op in OPS.values()) > 0
    assert all(r[3] == "compile-only" for r in flydsl)
    assert all(r[3] == "tested" for r in rows if r[1] != "flydsl")
    # the README says what compile-only means: not run, numerics and speed not verified
    legend = README.read_text().split(END, 1)[1].split("\n\n", 2)[1]
    assert legend.startswith('"compile-only"') and "not verified" in legend


def test_rows_report_availability_here():
    # this machine (CI and developers): no GPU, Triton through its interpreter (conftest), FlyDSL without ROCm
    here = {(r["op"], r["backend"]): r["here"] for r in support.rows()}
    assert {h for (_, b), h in here.items() if b == "aten"} == {"available"}
    assert {h for (_, b), h in here.items() if b == "triton"} == {"available"}
    flydsl = {h for (_, b), h in here.items() if b == "flydsl"}
    assert len(flydsl) == 1 and next(iter(flydsl)).startswith("unavailable: ") and "ROCm" in next(iter(flydsl))


def test_cli_markdown_is_the_module_output(cli_markdown):
    assert cli_markdown.strip() == support.markdown()


def test_cli_table_runs_and_lists_every_op():
    proc = _run_cli()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fly-lightning support matrix" in proc.stdout and "on this machine" in proc.stdout
    for name in OPS:
        assert name in proc.stdout, name
    any_unavailable = any(b.unavailable_reason() is not None for b in BACKENDS.values())
    assert ("unavailable" in proc.stdout) == any_unavailable


def test_readme_matrix_is_current(cli_markdown):
    """README.md's block between the support-matrix markers is the CLI's output (regenerate it when this fails)."""
    text = README.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    block = text.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == cli_markdown.strip(), (
        "README support matrix is stale: replace the block with `python -m fly_lightning.support --markdown`"
    )
