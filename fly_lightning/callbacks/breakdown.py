"""Attribute one profiled training step to operators and backends: the analysis behind ``OperatorTime``.

Input: the events of a ``torch.profiler.profile`` run that holds one ``record_function(STEP_RANGE)`` around the step,
with ``fly_lightning.dispatch.profile_ranges`` on (each dispatched call then runs inside ``fly::<op>/<backend>``).

Categories (labels), highest priority first; an event takes the first that matches it or any enclosing CPU range:

- ``<op>/<backend>``: the innermost ``fly::<op>/<backend>`` dispatch range, or a ``fly::<name>`` custom-op event (and
  its autograd wrapper, or the eager path's ``fly_<name>_eager`` autograd.Function) holding such a range, so the
  wrapper's own cost and kernels launched from it count for the op.
- ``<op>.backward/aten``: the autograd node of a ``fly::`` custom op or of its eager autograd.Function (its backward
  runs existing ATen ops by design; a dispatched op called inside it still claims its own time through its range).
- ``optimizer``: inside ``Optimizer.zero_grad#...``, or inside ``Optimizer.step#...`` after the update marker
  (``UPDATE_MARK``, emitted from ``on_before_optimizer_step``). Lightning runs forward and backward as the optimizer's
  closure, inside ``Optimizer.step``; the marker separates the closure from the update.
- ``comm``: collectives (``nccl``/``gloo``/``c10d`` ops, ``record_param_comms``).
- ``attention/<sdpa backend>``: SDPA and its backward; the backend (flash, efficient, cudnn, math, flex,
  overrideable) is read from the names of the ATen ops that ran under it (``_scaled_dot_product_flash_attention``, ...).
- ``gemm``: ``mm``/``addmm``/``bmm``/``baddbmm``/``matmul``/``linear``/``_scaled_mm``/``_grouped_mm`` ... .
- ``other``: any other operator; on GPU also kernels no CPU operator launched.
- ``overhead``: the rest of the step. CPU runs: time inside the step but outside every operator (Python, Lightning,
  the optimizer's Python). GPU runs: time in which no kernel ran (the device waited for the host).

Method.
- GPU (device events present): each kernel, memcpy and memset is attributed through the profiler's correlation ids to
  the CPU operator that launched it (``FunctionEvent.kernels``, the same link torch uses for "Self CUDA"), and that
  operator is classified through its CPU parents (``cpu_parent``). ``overhead`` = step window minus the union of all
  device intervals. Kernels overlapping on concurrent streams (communication under compute) are each counted in full,
  so the parts then exceed the step by the overlap; it is reported as ``kernel_overlap_ms`` and shows as a negative
  residual.
- CPU: the self time of every event under the step range (its duration minus its children's) goes to the event's
  category; self time of ranges that are not operators (the step range, ``Optimizer.step`` before the marker, user
  ranges) is ``overhead``. ``Optimizer.step``'s own time is split at the marker.
- ``coverage`` = time in parts that ran a specialised (non-ATen) backend / step time; ``amdahl_bound`` =
  ``1 / (1 - coverage)``, the step speedup if those parts took no time at all.

Limits.
- One profiled step; profiler overhead inflates CPU-side time (a few µs per op), so host-bound steps look slower
  under the profiler than they are; GPU kernel durations are unaffected.
- A dispatched call made while a new signature is decided includes its decision and JIT compile (cold start).
- Kernels replayed from a CUDA graph, or launched outside any operator, land in ``other``.
- The math SDPA backward runs as ordinary bmm/softmax autograd nodes: it is counted as ``gemm``/``other``.
- The DTensor reference path of an op (``record_fallback``) runs outside the dispatcher and has no range.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.autograd import DeviceType

if TYPE_CHECKING:
    from rich.table import Table
    from torch.autograd.profiler_util import FunctionEvent

STEP_RANGE = "OperatorTime::step"
UPDATE_MARK = "OperatorTime::optimizer_update"

GEMM, ATTENTION, COMM, OPTIMIZER, OTHER, OVERHEAD = "gemm", "attention", "comm", "optimizer", "other", "overhead"

_DISPATCH = re.compile(r"^fly::([^/\s]+)/([\w.-]+)$")
_CUSTOM_OP = re.compile(r"^fly::(\w+)$")
# an op's autograd wrapper: the custom op's, or the eager path's autograd.Function (fly_lightning/ops/_eager.py)
_AUTOGRAD_FWD = re.compile(r"^(?:GeneratedBackwardFor_fly_(\w+?)_default|fly_(\w+?)_eager)$")
_AUTOGRAD_BWD = re.compile(r"(?:GeneratedBackwardFor_fly_(\w+?)_default|fly_(\w+?)_eager)Backward")
_COMM = re.compile(r"^(nccl|gloo|c10d|_c10d_functional|c10d_functional|record_param_comms|ProcessGroup|mpi:|ucc)", re.I)
_ATTENTION = re.compile(r"scaled_dot_product|ScaledDotProduct|_(flash|efficient|cudnn)_attention|flex_attention", re.I)
# first match wins: cuDNN's SDPA kernels carry "flash" in their names, so cudnn is tested first
_SDPA_BACKENDS = (
    ("cudnn", re.compile(r"cudnn", re.I)),
    ("flash", re.compile(r"flash", re.I)),
    ("efficient", re.compile(r"efficient|mem_eff|fmha_cutlass", re.I)),
    ("math", re.compile(r"attention_math", re.I)),
    ("flex", re.compile(r"flex", re.I)),
    ("overrideable", re.compile(r"overrideable", re.I)),
)
_GEMM = frozenset(
    f"aten::{n}"
    for n in "mm addmm _addmm_activation bmm baddbmm addbmm matmul linear mv addmv dot _scaled_mm _scaled_grouped_mm "
    "_grouped_mm _int_mm".split()
)
_USER_SCOPE = 7  # torch._C._profiler.RecordScope.USER_SCOPE


@dataclass
class StepBreakdown:
    """Where one training step's time went. All times in milliseconds.

    ``parts_ms`` adds up to ``step_ms`` up to ``residual_ms`` (``step_ms - sum(parts_ms)``): on CPU the skew between
    the step's wall clock and the profiler's range (µs); on GPU minus the kernel overlap between concurrent streams.
    """

    step: int
    device: str  # "cuda" (device kernel time) or "cpu" (CPU self time)
    step_ms: float
    parts_ms: dict[str, float]
    specialised: list[str]  # labels of parts that ran a specialised (non-ATen) backend
    kernel_overlap_ms: float = 0.0
    ranks: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def attributed_ms(self) -> float:
        return sum(self.parts_ms.values())

    @property
    def residual_ms(self) -> float:
        return self.step_ms - self.attributed_ms

    @property
    def residual_pct(self) -> float:
        return 100.0 * self.residual_ms / self.step_ms if self.step_ms else 0.0

    @property
    def specialised_ms(self) -> float:
        return sum(self.parts_ms.get(label, 0.0) for label in self.specialised)

    @property
    def coverage(self) -> float:
        """Share of the step spent in operators that ran a specialised backend."""
        return self.specialised_ms / self.step_ms if self.step_ms else 0.0

    @property
    def amdahl_bound(self) -> float:
        """Step speedup if every specialised part took no time: ``1 / (1 - coverage)``."""
        return 1.0 / (1.0 - self.coverage) if self.coverage < 1.0 else math.inf

    def pct(self, label: str) -> float:
        return 100.0 * self.parts_ms.get(label, 0.0) / self.step_ms if self.step_ms else 0.0

    def labels(self) -> list[str]:
        return sorted(self.parts_ms, key=part_order)

    def metrics(self, prefix: str = "OperatorTime") -> dict[str, float]:
        """Scalars for a Lightning logger: ``<prefix>/<part>/ms`` and ``/pct``, step time, coverage, bound, residual."""
        out = {
            f"{prefix}/step_ms": self.step_ms,
            f"{prefix}/coverage": self.coverage,
            f"{prefix}/residual_ms": self.residual_ms,
            f"{prefix}/residual_pct": self.residual_pct,
        }
        if math.isfinite(self.amdahl_bound):
            out[f"{prefix}/amdahl_bound"] = self.amdahl_bound
        for label in self.labels():
            out[f"{prefix}/{label}/ms"] = self.parts_ms[label]
            out[f"{prefix}/{label}/pct"] = self.pct(label)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "device": self.device,
            "ranks": self.ranks,
            "step_ms": self.step_ms,
            "parts_ms": {k: self.parts_ms[k] for k in self.labels()},
            "specialised": sorted(self.specialised),
            "kernel_overlap_ms": self.kernel_overlap_ms,
            "residual_ms": self.residual_ms,
            "coverage": self.coverage,
            "amdahl_bound": self.amdahl_bound if math.isfinite(self.amdahl_bound) else None,
            "notes": list(self.notes),
        }

    def table(self, title: str = "step time by operator", fold_below_pct: float = 0.5) -> Table:
        """Parts by time share; parts that are not specialised and under ``fold_below_pct`` % of the step are folded
        into one row (the JSON and the logged scalars keep every part). The Amdahl bound is shown for GPU runs only:
        CPU (and Triton interpreter) times say nothing about what a GPU kernel would save."""
        from rich.table import Table

        unit = "device" if self.device == "cuda" else "CPU"
        title = f"{title} ({unit} time, {self.ranks} rank{'s' if self.ranks != 1 else ''})"
        table = Table(title=title, min_width=min(len(title), 80))  # the title on one line where it fits
        for col, justify in (("part", "left"), ("ms / step", "right"), ("% of step", "right")):
            table.add_column(col, justify=justify, no_wrap=True)
        small = [label for label in self.labels() if label not in self.specialised and self.pct(label) < fold_below_pct]
        for label in self.labels():
            if label in small and len(small) > 1:
                continue
            special = label in self.specialised
            style = "green" if special else ("yellow" if label.endswith("/aten") and "/" in label else None)
            table.add_row(label, f"{self.parts_ms[label]:.3f}", f"{self.pct(label):.1f}", style=style)
        if len(small) > 1:
            small_ms = sum(self.parts_ms[label] for label in small)
            pct = 100.0 * small_ms / self.step_ms if self.step_ms else 0.0
            label = f"{len(small)} parts < {fold_below_pct:g}% each"
            table.add_row(label, f"{small_ms:.3f}", f"{pct:.1f}", style="dim")
        table.add_section()
        table.add_row("measured step", f"{self.step_ms:.3f}", "100.0")
        why = "kernel overlap on concurrent streams" if self.kernel_overlap_ms > 0 else "clock skew"
        caption = (
            f"green: specialised backends, {100 * self.coverage:.1f}% of the step; "
            f"parts sum to {self.attributed_ms:.3f} ms (residual {self.residual_ms:+.3f} ms, {why})"
        )
        if self.device == "cuda":
            bound = f"{self.amdahl_bound:.2f}x" if math.isfinite(self.amdahl_bound) else "unbounded"
            caption += f"; Amdahl bound 1/(1-coverage) = {bound}"
        table.caption = caption
        return table


def part_order(label: str) -> tuple:
    """Display order: our operators (forward, then backward), dense GEMM, attention, communication, optimizer, other,
    overhead."""
    fixed = {GEMM: 2, COMM: 4, OPTIMIZER: 5, OTHER: 6, OVERHEAD: 7}
    if label in fixed:
        return (fixed[label], label)
    if label.startswith(ATTENTION + "/"):
        return (3, label)
    op = label.rsplit("/", 1)[0]
    return (1, op.removesuffix(".backward"), op.endswith(".backward"), label)


def is_specialised(label: str) -> bool:
    """An operator part served by a backend other than ATen."""
    if part_order(label)[0] != 1 or "/" not in label:
        return False
    op, backend = label.rsplit("/", 1)
    return backend != "aten" and not op.endswith(".backward")


def mean(breakdowns: Sequence[StepBreakdown]) -> StepBreakdown:
    """Average of several breakdowns (ranks, or profiled steps); parts stay additive."""
    if not breakdowns:
        raise ValueError("mean of no breakdowns")
    n = len(breakdowns)
    parts: dict[str, float] = defaultdict(float)
    for b in breakdowns:
        for k, v in b.parts_ms.items():
            parts[k] += v / n
    return StepBreakdown(
        step=breakdowns[-1].step,
        device=breakdowns[0].device,
        step_ms=sum(b.step_ms for b in breakdowns) / n,
        parts_ms=dict(parts),
        specialised=sorted({s for b in breakdowns for s in b.specialised}),
        kernel_overlap_ms=sum(b.kernel_overlap_ms for b in breakdowns) / n,
        ranks=max(b.ranks for b in breakdowns),
        notes=sorted({note for b in breakdowns for note in b.notes}),
    )


@dataclass
class _Ctx:
    """What the enclosing CPU ranges say about an event."""

    fly: str | None = None
    opt_step: Any = None  # enclosing Optimizer.step range
    opt: bool = False
    comm: bool = False
    attn: str | None = None
    gemm: bool = False


class _Classifier:
    def __init__(self, events: Sequence[FunctionEvent]) -> None:
        self._ctx: dict[int, _Ctx] = {}
        self._below: dict[int, str | None] = {}
        self._markers = sorted(e.time_range.start for e in events if e.name == UPDATE_MARK)
        self._op_names: dict[str, str] = {}  # custom-op name -> registry op name, learnt from the forward

    def label(self, e: FunctionEvent, t: float) -> str | None:
        """Category of event ``e`` at time ``t`` (µs), or None if no category claims it."""
        c = self.ctx(e)
        if c.fly is not None:
            return c.fly
        if c.opt or (c.opt_step is not None and t >= self._update_start(c.opt_step)):
            return OPTIMIZER
        if c.comm:
            return COMM
        if c.attn is not None:
            return f"{ATTENTION}/{c.attn}"
        if c.gemm:
            return GEMM
        return None

    def ctx(self, e: FunctionEvent) -> _Ctx:
        chain = []
        node = e
        while node is not None and id(node) not in self._ctx:
            chain.append(node)
            node = node.cpu_parent
        ctx = self._ctx[id(node)] if node is not None else _Ctx()
        for ev in reversed(chain):
            ctx = self._derive(ctx, ev)
            self._ctx[id(ev)] = ctx
        return ctx

    def _derive(self, p: _Ctx, e: FunctionEvent) -> _Ctx:
        name = e.name
        c = _Ctx(p.fly, p.opt_step, p.opt, p.comm, p.attn, p.gemm)
        if m := _DISPATCH.match(name):
            c.fly = f"{m[1]}/{m[2]}"
        elif m := _CUSTOM_OP.match(name) or _AUTOGRAD_FWD.match(name):
            below = self._dispatch_below(e)
            if below is not None:
                c.fly = below
                self._op_names.setdefault(m[m.lastindex], below.rsplit("/", 1)[0])
        elif m := _AUTOGRAD_BWD.search(name):
            op = m[m.lastindex]
            c.fly = f"{self._op_names.get(op, op)}.backward/aten"
        if name.startswith("Optimizer.zero_grad#"):
            c.opt = True
        elif name.startswith("Optimizer.step#"):
            c.opt_step = e
        if _COMM.match(name):
            c.comm = True
        if c.attn is None and _ATTENTION.search(name):
            c.attn = self._sdpa_backend(e)
        if name in _GEMM:
            c.gemm = True
        return c

    def _dispatch_below(self, e: FunctionEvent) -> str | None:
        """Label of the first dispatch range under a custom-op event (breadth first)."""
        key = id(e)
        if key not in self._below:
            found, queue = None, list(e.cpu_children)
            while queue and found is None:
                nxt = []
                for ch in queue:
                    if m := _DISPATCH.match(ch.name):
                        found = f"{m[1]}/{m[2]}"
                        break
                    nxt.extend(ch.cpu_children)
                queue = nxt
            self._below[key] = found
        return self._below[key]

    def _update_start(self, step_range: FunctionEvent) -> float:
        """When the optimizer's update began: the last marker inside its step range, else the range's start."""
        start, end = step_range.time_range.start, step_range.time_range.end
        inside = [t for t in self._markers if start <= t <= end]
        return inside[-1] if inside else start

    @staticmethod
    def _sdpa_backend(e: FunctionEvent) -> str:
        queue = [e]
        while queue:  # breadth first: the nearest named implementation decides
            nxt = []
            for ev in queue:
                for backend, pattern in _SDPA_BACKENDS:
                    if pattern.search(ev.name):
                        return backend
                nxt.extend(ev.cpu_children)
                nxt.extend(_KernelLeaf(k.name) for k in getattr(ev, "kernels", ()))
            queue = nxt
        return "unknown"


@dataclass
class _KernelLeaf:
    """A kernel seen as a leaf while looking for the SDPA backend."""

    name: str
    cpu_children: tuple = ()


def _is_cpu(e: FunctionEvent) -> bool:
    return e.device_type == DeviceType.CPU and not e.is_async


def _is_user_range(e: FunctionEvent) -> bool:
    return bool(getattr(e, "is_user_annotation", False)) or getattr(e, "scope", None) == _USER_SCOPE


def analyse(events: Iterable[FunctionEvent], *, step: int = 0, step_ms: float | None = None) -> StepBreakdown:
    """Break one profiled step down by category (see the module docstring).

    Args:
        events: ``prof.events()`` of a profile holding exactly one ``STEP_RANGE`` range.
        step: recorded as the breakdown's step.
        step_ms: the step's wall time measured outside the profiler; defaults to the step range's duration.
    """
    events = list(events)
    roots = [e for e in events if e.name == STEP_RANGE and _is_cpu(e)]
    if len(roots) != 1:
        raise ValueError(f"expected one {STEP_RANGE!r} range in the profile, found {len(roots)}")
    root = roots[0]
    w0, w1 = root.time_range.start, root.time_range.end
    window_us = w1 - w0
    classify = _Classifier(events)
    user_names = {e.name for e in events if _is_cpu(e) and _is_user_range(e)}
    device_events = [
        e
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False) and e.name not in user_names
    ]
    parts_us: dict[str, float] = defaultdict(float)
    notes: list[str] = []
    overlap_us = 0.0
    if device_events:
        device = "cuda"
        attributed = 0.0
        for e in events:
            if not _is_cpu(e) or not e.kernels:
                continue
            label = classify.label(e, e.time_range.start) or OTHER
            for k in e.kernels:
                if k.name == e.name:  # the GPU-side mirror of a user range, not a kernel
                    continue
                parts_us[label] += k.duration
                attributed += k.duration
        total = sum(_clip(e, w0, w1) for e in device_events)
        if total - attributed > 0.0:
            parts_us[OTHER] += total - attributed  # kernels no CPU operator launched (graph replay, ...)
        elif attributed - total > 0.01 * max(total, 1.0):
            notes.append(f"kernels attributed ({attributed:.1f} us) exceed device time in the window ({total:.1f} us)")
        busy = _union_us(device_events, w0, w1)
        parts_us[OVERHEAD] += max(window_us - busy, 0.0)
        overlap_us = max(total - busy, 0.0)
    else:
        device = "cpu"
        stack = [root]
        while stack:
            e = stack.pop()
            children = sorted((c for c in e.cpu_children if _is_cpu(c)), key=lambda c: c.time_range.start)
            stack.extend(children)
            fallback = OVERHEAD if _is_user_range(e) else OTHER
            cursor = e.time_range.start
            for c in [*children, None]:
                gap_end = e.time_range.end if c is None else c.time_range.start
                if gap_end > cursor:
                    parts_us[classify.label(e, cursor) or fallback] += gap_end - cursor
                if c is not None:
                    cursor = max(cursor, c.time_range.end)
    parts = {k: v / 1e3 for k, v in parts_us.items() if v > 0.0}
    return StepBreakdown(
        step=step,
        device=device,
        step_ms=step_ms if step_ms is not None else window_us / 1e3,
        parts_ms=parts,
        specialised=sorted(label for label in parts if is_specialised(label)),
        kernel_overlap_ms=overlap_us / 1e3,
        notes=notes,
    )


def _clip(e: FunctionEvent, w0: float, w1: float) -> float:
    return max(0.0, min(e.time_range.end, w1) - max(e.time_range.start, w0))


def _union_us(events: Iterable[FunctionEvent], w0: float, w1: float) -> float:
    spans = sorted(
        (max(e.time_range.start, w0), min(e.time_range.end, w1))
        for e in events
        if e.time_range.end > w0 and e.time_range.start < w1
    )
    total, cur_s, cur_e = 0.0, None, None
    for s, t in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
