"""The dispatch manifest: which backend served each shape signature of each operator in one run, as diffable JSON.

Layout (``json.dumps(sort_keys=True, indent=2)``)::

    {
      "format": "fly-lightning dispatch manifest", "version": 1,
      "ops": {                                  # compared part: no timestamps, no timings
        "<op>": {
          "backends": ["aten", "triton"],       # registered for the op
          "calls": 120, "by_backend": {"triton": 120}, "fallback_calls": 0, "specialised_share": 1.0,
          "signatures": {
            "<canonical signature>": {
              "backend": "triton",              # the backend that served most calls
              "by_backend": {"triton": 120},    # several when the policy changed mid-run or ranks disagreed
              "calls": 120, "shape": "4x8x32, 32", "dtype": "float32",
              "rejected": {"flydsl": "not a ROCm build of torch"}
            }}}},
      "cold_start": {"<op>": {"<signature>": {"first_call_s": .., "tuning_s": .., "first_seen_step": ..}}},
      "run": {"written_at": .., "world_size": .., "versions": {..}, "policy": ..}   # not compared
    }

Calls are summed over ranks; cold-start times take the slowest rank. ``diff_manifests`` compares the ``ops`` part.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fly_lightning._files import write_text_atomic
from fly_lightning.dispatch_log import NOT_SPECIALISED

if TYPE_CHECKING:
    from fly_lightning.dispatch_log import Decision

FORMAT = "fly-lightning dispatch manifest"
VERSION = 1
_MEASURED = re.compile(r"\s*\([0-9.eE+-]+ ms\)")  # timings inside "slower when measured (0.0123 ms)"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def canonical_signature(sig: Hashable) -> str:
    """A stable, readable string for a shape signature (the same across runs and ranks)."""
    if isinstance(sig, torch.Size):
        return "x".join(map(str, sig)) or "scalar"
    if isinstance(sig, torch.dtype):
        return str(sig).removeprefix("torch.")
    if isinstance(sig, torch.device):
        return sig.type
    if isinstance(sig, (tuple, list)):
        return "(" + ", ".join(canonical_signature(s) for s in sig) + ")"
    if isinstance(sig, (set, frozenset)):
        return "{" + ", ".join(sorted(canonical_signature(s) for s in sig)) + "}"
    if isinstance(sig, str):
        return sig
    return _ADDRESS.sub("", repr(sig))


@dataclass
class Usage:
    """One decision's share of a run: calls made during the run, and whether the run created it."""

    decision: Decision
    calls: int
    new: bool
    first_seen_step: int | None = None


def rank_sections(usages: Iterable[Usage], ops: Iterable[Any]) -> dict[str, Any]:
    """This rank's ``ops`` and ``cold_start`` sections. ``ops``: the registry's ``Op`` objects (all are listed)."""
    out_ops: dict[str, Any] = {op.name: {"backends": sorted(op.impls), "signatures": {}} for op in ops}
    cold: dict[str, Any] = {}
    for u in usages:
        d = u.decision
        key = canonical_signature(d.signature)
        op_entry = out_ops.setdefault(d.op, {"backends": ["aten"], "signatures": {}})
        sig = op_entry["signatures"].setdefault(
            key, {"by_backend": {}, "shape": d.shape, "dtype": d.dtype, "rejected": {}}
        )
        sig["by_backend"][d.backend] = sig["by_backend"].get(d.backend, 0) + u.calls
        for backend, reason in d.rejected:
            sig["rejected"].setdefault(backend, _MEASURED.sub("", reason))
        if u.new:
            cold.setdefault(d.op, {})[key] = {
                "backend": d.backend,
                "first_call_s": d.first_call_s,
                "tuning_s": d.tuning_s,
                "timings_ms": dict(sorted(d.timings_ms.items())),
                "first_seen_step": u.first_seen_step,
            }
    return {"ops": out_ops, "cold_start": cold}


def merge_sections(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine ranks' sections: calls summed, signatures united, cold starts from the slowest rank."""
    ops: dict[str, Any] = {}
    cold: dict[str, Any] = {}
    for section in per_rank:
        for name, entry in section["ops"].items():
            op = ops.setdefault(name, {"backends": entry["backends"], "signatures": {}})
            op["backends"] = sorted(set(op["backends"]) | set(entry["backends"]))
            for key, sig in entry["signatures"].items():
                merged = op["signatures"].setdefault(
                    key, {"by_backend": {}, "shape": sig["shape"], "dtype": sig["dtype"], "rejected": {}}
                )
                for backend, calls in sig["by_backend"].items():
                    merged["by_backend"][backend] = merged["by_backend"].get(backend, 0) + calls
                for backend, reason in sig["rejected"].items():
                    merged["rejected"].setdefault(backend, reason)
        for name, sigs in section["cold_start"].items():
            for key, rec in sigs.items():
                prev = cold.setdefault(name, {}).get(key)
                if prev is None or (rec["first_call_s"] or 0.0) > (prev["first_call_s"] or 0.0):
                    cold[name][key] = rec
    for op in ops.values():
        by_backend: dict[str, int] = {}
        for sig in op["signatures"].values():
            sig["calls"] = sum(sig["by_backend"].values())
            # most calls wins; ties broken by name so the choice is stable
            sig["backend"] = min(sig["by_backend"], key=lambda b: (-sig["by_backend"][b], b), default="none")
            for backend, calls in sig["by_backend"].items():
                by_backend[backend] = by_backend.get(backend, 0) + calls
        op["by_backend"] = by_backend
        op["calls"] = sum(by_backend.values())
        # ATen calls of signatures where a specialised backend was passed over, on whichever rank (ranks may decide
        # differently under select="measure"): counted per call, not by the signature's majority backend
        op["fallback_calls"] = sum(
            s["by_backend"].get("aten", 0) for s in op["signatures"].values() if _has_specialised(s)
        )
        special = op["calls"] - sum(by_backend.get(b, 0) for b in NOT_SPECIALISED)
        op["specialised_share"] = round(special / op["calls"], 6) if op["calls"] else 0.0
    return {"ops": ops, "cold_start": cold}


def _has_specialised(sig: Mapping[str, Any]) -> bool:
    return any(b != "aten" for b in sig["rejected"])


def make_manifest(sections: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "ops": sections["ops"],
        "cold_start": sections["cold_start"],
        "run": dict(run),
    }


def dumps(manifest: Mapping[str, Any]) -> str:
    return json.dumps(manifest, sort_keys=True, indent=2, default=str) + "\n"


def write_manifest(manifest: Mapping[str, Any], path: str | Path) -> Path:
    """Validate and write atomically (``fly-lightning diff`` reads the previous run's file: never half a file)."""
    validate_manifest(manifest)
    return write_text_atomic(path, dumps(manifest))


def load_manifest(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A manifest from a path or a dict, validated."""
    manifest = dict(source) if isinstance(source, Mapping) else json.loads(Path(source).read_text())
    validate_manifest(manifest)
    return manifest


_OP_FIELDS = {
    "backends": list,
    "calls": int,
    "by_backend": dict,
    "fallback_calls": int,
    "specialised_share": (int, float),
    "signatures": dict,
}
_SIG_FIELDS = {"backend": str, "by_backend": dict, "calls": int, "shape": str, "dtype": str, "rejected": dict}


def validate_manifest(manifest: Mapping[str, Any]) -> None:
    """Check the manifest's structure and internal consistency; raises ``ValueError`` naming the bad field."""

    def need(cond: bool, where: str, what: str) -> None:
        if not cond:
            raise ValueError(f"dispatch manifest: {where}: {what}")

    need(isinstance(manifest, Mapping), "<root>", "not an object")
    need(manifest.get("format") == FORMAT, "format", f"expected {FORMAT!r}, got {manifest.get('format')!r}")
    need(manifest.get("version") == VERSION, "version", f"expected {VERSION}, got {manifest.get('version')!r}")
    for key in ("ops", "cold_start", "run"):
        need(isinstance(manifest.get(key), Mapping), key, "missing or not an object")
    for name, op in manifest["ops"].items():
        where = f"ops.{name}"
        need(isinstance(op, Mapping), where, "not an object")
        for fld, typ in _OP_FIELDS.items():
            need(
                isinstance(op.get(fld), typ) and not isinstance(op.get(fld), bool),
                f"{where}.{fld}",
                f"missing or not {getattr(typ, '__name__', typ)}",
            )
        need(all(isinstance(b, str) for b in op["backends"]), f"{where}.backends", "not a list of names")
        need(_counts(op["by_backend"]), f"{where}.by_backend", "not a map of backend -> non-negative int")
        need(sum(op["by_backend"].values()) == op["calls"], f"{where}.calls", "differs from the sum of by_backend")
        need(
            0.0 <= op["specialised_share"] <= 1.0 and math.isfinite(op["specialised_share"]),
            f"{where}.specialised_share",
            "not in [0, 1]",
        )
        total = 0
        for key, sig in op["signatures"].items():
            swhere = f"{where}.signatures[{key!r}]"
            need(isinstance(sig, Mapping), swhere, "not an object")
            for fld, typ in _SIG_FIELDS.items():
                need(
                    isinstance(sig.get(fld), typ) and not isinstance(sig.get(fld), bool),
                    f"{swhere}.{fld}",
                    f"missing or not {typ.__name__}",
                )
            need(_counts(sig["by_backend"]), f"{swhere}.by_backend", "not a map of backend -> non-negative int")
            need(sum(sig["by_backend"].values()) == sig["calls"], f"{swhere}.calls", "differs from by_backend")
            need(sig["backend"] in sig["by_backend"], f"{swhere}.backend", "not among by_backend")
            need(all(isinstance(v, str) for v in sig["rejected"].values()), f"{swhere}.rejected", "reasons not str")
            total += sig["calls"]
        need(total == op["calls"], f"{where}.calls", "differs from the sum over signatures")


def _counts(mapping: Any) -> bool:
    return isinstance(mapping, Mapping) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in mapping.items()
    )


@dataclass
class ManifestDiff:
    """What changed backend between two runs' manifests (``a`` before, ``b`` after)."""

    changed: list[tuple[str, str, str, str]] = field(default_factory=list)  # (op, signature, backends a, backends b)
    added: list[tuple[str, str, str]] = field(default_factory=list)  # (op, signature, backends) only in b
    removed: list[tuple[str, str, str]] = field(default_factory=list)  # only in a

    def __bool__(self) -> bool:
        return bool(self.changed or self.added or self.removed)

    def format(self) -> str:
        if not self:
            return "no backend changes"
        lines = []
        if self.changed:
            lines.append(f"changed backend ({len(self.changed)}):")
            lines += [f"  {op}  {sig}  {a} -> {b}" for op, sig, a, b in self.changed]
        if self.added:
            lines.append(f"only in b ({len(self.added)}):")
            lines += [f"  {op}  {sig}  {b}" for op, sig, b in self.added]
        if self.removed:
            lines.append(f"only in a ({len(self.removed)}):")
            lines += [f"  {op}  {sig}  {b}" for op, sig, b in self.removed]
        return "\n".join(lines)

    __str__ = format

    def print(self, console: Any = None) -> None:
        """The diff as a rich table on a terminal (one row per signature); piped or redirected, ``format()``'s lines,
        one per signature, so they stay greppable (a table folds long signatures at 80 columns there)."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = console or Console()
        if not self or not console.is_terminal:
            console.print(Text(self.format()), soft_wrap=True)  # Text: manifest strings are never markup
            return
        table = Table(title="dispatch manifest diff (a -> b)")
        for col in ("change", "op", "signature", "a", "b"):
            table.add_column(col, overflow="fold")
        rows = [("changed backend", op, sig, a, b) for op, sig, a, b in self.changed]
        rows += [("only in b", op, sig, "", b) for op, sig, b in self.added]
        rows += [("only in a", op, sig, a, "") for op, sig, a in self.removed]
        for row in rows:
            table.add_row(*(Text(cell) for cell in row), style="yellow" if row[0] == "changed backend" else None)
        console.print(table)


def _served(sig: Mapping[str, Any]) -> str:
    """The backends that served a signature, e.g. ``triton`` or ``aten+triton``."""
    return "+".join(sorted(b for b, n in sig["by_backend"].items() if n > 0)) or sig["backend"]


def diff_manifests(a: str | Path | Mapping[str, Any], b: str | Path | Mapping[str, Any]) -> ManifestDiff:
    """Signatures whose serving backend(s) differ between manifests ``a`` and ``b``, and those seen in one only."""
    ma, mb = load_manifest(a), load_manifest(b)
    diff = ManifestDiff()
    for op in sorted(set(ma["ops"]) | set(mb["ops"])):
        sa = ma["ops"].get(op, {}).get("signatures", {})
        sb = mb["ops"].get(op, {}).get("signatures", {})
        for key in sorted(set(sa) | set(sb)):
            if key not in sb:
                diff.removed.append((op, key, _served(sa[key])))
            elif key not in sa:
                diff.added.append((op, key, _served(sb[key])))
            elif _served(sa[key]) != _served(sb[key]):
                diff.changed.append((op, key, _served(sa[key]), _served(sb[key])))
    return diff
