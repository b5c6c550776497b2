"""Dispatch decisions and the process-wide log of them, queryable as Python data and printable as a rich table.

It is always on: the per-call cost is one counter increment on the cached decision (see ``dispatch.py``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fly_lightning.registry import clear_decisions

if TYPE_CHECKING:
    from rich.table import Table


INDUCTOR = "inductor"
"""Not a backend: the name decisions carry when ``torch.compile`` traced an op's plain-torch form (Inductor generated
its code) because the policy leaves that op to Inductor (``DispatchConfig.inductor_ops``)."""
NOT_SPECIALISED = ("aten", INDUCTOR)  # calls served by neither of our kernel backends


@dataclass(eq=False)
class Decision:
    """Which backend serves one shape signature of one op under one policy, and why the others did not."""

    op: str
    signature: Hashable
    shape: str
    dtype: str
    backend: str
    fn: Callable[..., Any]
    rejected: tuple[tuple[str, str], ...]  # (backend, reason) for each candidate passed over
    config_uid: int
    calls: int = 0
    created_at: float = field(default_factory=time.time)
    first_call_s: float | None = None  # host wall time of the first call (includes JIT compilation)
    tuning_s: float | None = None  # time spent measuring candidates (select="measure")
    timings_ms: dict[str, float] = field(default_factory=dict)  # measured candidates
    # measured selection only: the tuning database's shape key, and each supported candidate's function (so that an
    # agreement across ranks can switch this decision to another rank's choice)
    tuning_key: str | None = None
    alternatives: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)

    @property
    def fallback(self) -> bool:
        """True when a specialised candidate was passed over and ATen runs instead."""
        return self.backend == "aten" and bool(self.rejected)

    @property
    def reason(self) -> str:
        return "; ".join(f"{b}: {r}" for b, r in self.rejected)


class DispatchLog:
    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self._listeners: list[Callable[[Decision], None]] = []

    def add(self, decision: Decision) -> None:
        self.decisions.append(decision)
        for listener in self._listeners:
            listener(decision)

    def subscribe(self, listener: Callable[[Decision], None]) -> Callable[[], None]:
        """Call ``listener`` on each new decision (a new shape signature or policy); returns an unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def reset(self) -> None:
        """Forget all decisions and counts; the next call of each signature decides again."""
        clear_decisions()
        self.decisions.clear()

    def records(self, op: str | None = None) -> list[dict[str, Any]]:
        """One dict per decision: op, shape, dtype, backend, calls, fallback reason, cold-start times."""
        return [
            {
                "op": d.op,
                "shape": d.shape,
                "dtype": d.dtype,
                "backend": d.backend,
                "calls": d.calls,
                "fallback": d.fallback,
                "reason": d.reason,
                "first_call_s": d.first_call_s,
                "tuning_s": d.tuning_s,
                "timings_ms": dict(d.timings_ms),
            }
            for d in self.decisions
            if op is None or d.op == op
        ]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per op: total calls, calls per backend, and the share served by a specialised backend."""
        out: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"calls": 0, "by_backend": defaultdict(int), "signatures": 0, "fallback_reasons": {}}
        )
        for d in self.decisions:
            s = out[d.op]
            s["calls"] += d.calls
            s["by_backend"][d.backend] += d.calls
            s["signatures"] += 1
            if d.fallback:
                s["fallback_reasons"].setdefault(d.reason, []).append(d.shape)
        for s in out.values():
            s["by_backend"] = dict(s["by_backend"])
            ours = s["calls"] - sum(s["by_backend"].get(b, 0) for b in NOT_SPECIALISED)
            s["specialised_share"] = ours / s["calls"] if s["calls"] else 0.0
        return dict(out)

    def table(self, title: str = "fly-lightning dispatch") -> Table:
        from rich.table import Table

        # a backend passed over for the same reason on every row (not installed, no ROCm, ...) is said once, in the
        # caption, so that the rows show what depends on the shape
        everywhere = set.intersection(*(set(d.rejected) for d in self.decisions)) if self.decisions else set()
        caption = "; ".join(f"{b}: {r}" for b, r in sorted(everywhere))
        table = Table(title=title, caption=f"passed over on every row: {caption}" if caption else None)
        for col in ("op", "shape", "dtype", "backend", "calls", "first call", "why not a faster backend"):
            table.add_column(col, overflow="fold")
        for d in sorted(self.decisions, key=lambda d: (d.op, -d.calls)):
            style = "yellow" if d.fallback else ("green" if d.backend != "aten" else None)
            first = f"{d.first_call_s * 1e3:.1f} ms" if d.first_call_s is not None else "-"
            reason = "; ".join(f"{b}: {r}" for b, r in d.rejected if (b, r) not in everywhere)
            table.add_row(d.op, d.shape, d.dtype, d.backend, str(d.calls), first, reason, style=style)
        return table

    def print(self, title: str = "fly-lightning dispatch") -> None:
        from rich.console import Console

        Console().print(self.table(title))


DISPATCH_LOG = DispatchLog()
"""The process-wide dispatch log."""
