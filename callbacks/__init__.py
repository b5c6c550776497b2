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

__all__ = [
    "DispatchCoverage",
    "ManifestDiff",
    "OperatorTime",
    "StepBreakdown",
    "analyse",
    "diff_manifests",
    "load_manifest",
    "validate_manifest",
]
