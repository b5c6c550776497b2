"""Lightning callbacks that show which implementation each operator used and how much of the step it takes.

- ``DispatchCoverage``: per operator, calls and the share served by each backend, fallbacks with reasons and shapes,
  new shape signatures and their cold start; logged, printed as a table and written as a diffable JSON manifest.
- ``OperatorTime``: every N steps, one step profiled and its time split by operator and backend, GEMM, attention,
  communication, optimizer and the rest, with the time-weighted coverage and its Amdahl bound; table, scalars, PNG.
- ``diff_manifests(a, b)`` (and ``python -m fly_lightning.callbacks.manifest_diff a.json b.json``): what changed
  backend between two runs.
"""

from fly_lightning.callbacks.breakdown import StepBreakdown, analyse
from fly_lightning.callbacks.dispatch_coverage import DispatchCoverage
from fly_lightning.callbacks.manifest import ManifestDiff, diff_manifests, load_manifest, validate_manifest
from fly_lightning.callbacks.op_time import OperatorTime


def default_callbacks(every_n_steps: int = 10, first_step: int = 5) -> list:
    """Both callbacks: coverage always, one profiled step every ``every_n_steps``; the PNG where matplotlib is
    installed (without it, the end-of-fit output says once that no PNG was written; the tables and ``op_time.json``
    are written either way)."""
    return [DispatchCoverage(), OperatorTime(every_n_steps=every_n_steps, first_step=first_step)]


__all__ = [
    "DispatchCoverage",
    "ManifestDiff",
    "OperatorTime",
    "StepBreakdown",
    "analyse",
    "default_callbacks",
    "diff_manifests",
    "load_manifest",
    "validate_manifest",
]
