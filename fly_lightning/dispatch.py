"""Route each call of an operator to a backend: choose per (policy, op, shape signature), cache the decision, count
every call.

``Op`` is a registry entry (``fly_lightning.registry.OpDef``) that can be called. Its ``__call__`` is the steady-state
path: one signature computation, one dict lookup and one counter increment. Everything else (validation,
availability, support predicates, measurement) runs once per new signature and is recorded in the dispatch log.

Layering: this module imports ``backends``, ``registry``, ``policy`` and ``dispatch_log``; nothing below imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from fly_lightning import policy, registry, tuning
from fly_lightning.backends import BACKENDS
from fly_lightning.dispatch_log import DISPATCH_LOG, INDUCTOR, Decision
from fly_lightning.registry import BackendImpl, OpDef

__all__ = ["Decision", "Op", "record_fallback", "record_inductor", "register_op"]


class Op(OpDef):
    """A registered operator, callable: runs on the backend chosen for this (policy, shape signature)."""

    def __call__(self, *args: Any) -> Any:
        """Decide (and validate) on first sight of a signature; afterwards look up, count and run."""
        key = (policy._active.uid, self.signature(*args))
        try:
            decision = self.cache.get(key)
        except TypeError:  # an unhashable argument (a list for an int, say): let validation name it
            if self.validate is not None:
                self.validate(*args)
            raise
        if decision is None:
            return _first_call(self, _decide(self, policy._active, key, args), args)
        if self.check is not None:
            self.check(*args)
        if not decision.calls:  # no call of it has returned yet (the first raised): this one may fall back too
            return _first_call(self, decision, args)
        decision.calls += 1
        if profile_ranges:  # only while OperatorTime profiles a step; otherwise one global read
            return call_in_range(decision, args)
        return decision.fn(*args)


def register_op(
    name: str,
    *,
    reference: Callable[..., Any],
    signature: Callable[..., Hashable],
    validate: Callable[..., None] | None = None,
    check: Callable[..., None] | None = None,
    aten: Callable[..., Any] | None = None,
    traced: Callable[..., Any] | None = None,
    doc: str = "",
) -> Op:
    """Create an operator and put it in the registry.

    ``aten`` is the always-available fallback (defaults to the reference); it must accept every valid input.
    ``traced``: plain torch, free of host reads, that ``torch.compile`` may trace instead of the opaque op when the
    policy leaves the op to Inductor (``DispatchConfig.inductor_ops``); None: the op is always opaque under compile.
    """
    if name in registry.OPS:  # before creating anything
        raise ValueError(f"operator {name!r} is already registered")
    op = Op(name=name, reference=reference, signature=signature, validate=validate, check=check, doc=doc, traced=traced)
    op.implement("aten", constraints="every valid input (fallback and oracle)")(aten or reference)
    registry.add(op)
    return op


# --- profiler ranges, for fly_lightning.callbacks.OperatorTime -------------------------------------------------------
# While a step is being profiled, each dispatched call runs inside record_function("fly::<op>/<backend>") so the
# profile can attribute its time to the backend that actually ran. Off otherwise: the steady-state path in
# ``Op.__call__`` then pays one global read, and no range object is created.
profile_ranges: bool = False


def range_name(op: str, backend: str) -> str:
    """The profiler range around one dispatched call (parsed back by ``fly_lightning.callbacks.breakdown``)."""
    return f"fly::{op}/{backend}"


def call_in_range(dec: Decision, args: tuple) -> Any:
    with torch.profiler.record_function(range_name(dec.op, dec.backend)):
        return dec.fn(*args)


# ----------------------------------------------------------------------------------------------------------------------


def _first_call(op: OpDef, dec: Decision, args: tuple) -> Any:
    start = time.perf_counter()
    try:
        out = call_in_range(dec, args) if profile_ranges else dec.fn(*args)
    except Exception as exc:  # a specialised kernel failing on valid input falls back, recorded, never crashes
        if dec.backend == "aten":
            raise
        reason = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        failed, aten = dec.backend, op.impls["aten"]
        if profile_ranges:
            with torch.profiler.record_function(range_name(dec.op, "aten")):
                out = aten.fn(*args)
        else:  # ATen raising too is the input's fault, not the kernel's: nothing changes, the next call tries again
            out = aten.fn(*args)
        # committed once ATen ran; the failed kernel leaves the ranks' agreement (``_adopt``) too
        dec.rejected = (*dec.rejected, (failed, reason))
        dec.backend, dec.fn = "aten", aten.fn
        dec.alternatives.pop(failed, None)
    dec.first_call_s = time.perf_counter() - start
    dec.calls += 1
    return out


_CHECKED_UIDS: set[int] = set()  # policies whose op names were checked against the registry


def _support_verdict(impl: BackendImpl, args: tuple) -> str | None:
    """None when ``impl`` supports ``args``, else the reason (a predicate that raises counts as unsupported)."""
    try:
        verdict = impl.supports(*args)
    except Exception as exc:
        return f"support check raised {type(exc).__name__}: {str(exc)[:120]}"
    return None if verdict is True else str(verdict)


def _decide(op: OpDef, cfg: policy.DispatchConfig, key: tuple[int, Hashable], args: tuple) -> Decision:
    if cfg.uid not in _CHECKED_UIDS:  # e.g. FLY_LIGHTNING_DISABLE, read before any op was registered
        policy.check_op_names(cfg)
        _CHECKED_UIDS.add(cfg.uid)
    if op.validate is not None:
        op.validate(*args)
    if op.check is not None:
        op.check(*args)
    candidates = cfg.candidates(op.name)
    rejected: list[tuple[str, str]] = []
    if not cfg.enabled:
        rejected += [(b, "fly_lightning disabled by policy") for b in op.impls if b != "aten"]
    elif op.name in cfg.disabled_ops:
        rejected += [(b, "op disabled by policy") for b in op.impls if b != "aten"]
    supported: list[BackendImpl] = []
    for name in candidates:
        impl = op.impls.get(name)
        if impl is None:
            rejected.append((name, registry.no_impl_reason(name)))
            continue
        reason = BACKENDS[name].unavailable_reason()
        if reason is None:
            reason = _support_verdict(impl, args)
        if reason is not None:
            rejected.append((name, reason))
            continue
        supported.append(impl)
        if cfg.select == "first":
            break
    chosen, timings, tuning_s, tkey = supported[0], {}, None, None
    if cfg.select == "measure" and len(supported) > 1:
        chosen, timings, tuning_s, tkey = _measured_choice(op, supported, args, rejected)
    shape, dtype = _describe(args)
    dec = Decision(
        op.name,
        key[1],
        shape,
        dtype,
        chosen.backend,
        chosen.fn,
        tuple(rejected),
        cfg.uid,
        tuning_s=tuning_s,
        timings_ms=timings,
        tuning_key=tkey,
        alternatives={impl.backend: impl.fn for impl in supported} if tkey is not None else {},
    )
    op.cache[key] = dec
    DISPATCH_LOG.add(dec)
    return dec


def _measured_choice(
    op: OpDef, supported: list[BackendImpl], args: tuple, rejected: list[tuple[str, str]]
) -> tuple[BackendImpl, dict[str, float], float | None, str]:
    """The fastest supported candidate: the one the run's ranks agreed on, else the tuning database's winner for this
    shape and environment, else timed on the real inputs (and written there), within the process's tuning budget.
    Every choice is journaled for the next agreement across ranks. Returns (choice, timings, tuning s, shape key)."""
    key = tuning.tuning_key(args)
    env = tuning.environment_key(next((t.device for t in _tensors(args)), torch.device("cpu")))
    chosen, timings, tuning_s = _choose(op, supported, args, rejected, env, key)
    tuning.journal(op.name, key, {"backend": chosen.backend, "timings_ms": timings, "environment": env})
    return chosen, timings, tuning_s, key


def _choose(
    op: OpDef, supported: list[BackendImpl], args: tuple, rejected: list[tuple[str, str]], env: str, key: str
) -> tuple[BackendImpl, dict[str, float], float | None]:
    by_name = {impl.backend: impl for impl in supported}
    agreed = tuning.agreed(op.name, key)
    if agreed is not None and agreed.get("backend") in by_name:
        rejected += [(b, f"agreed across ranks: {agreed['backend']}") for b in by_name if b != agreed["backend"]]
        return by_name[agreed["backend"]], dict(agreed.get("timings_ms", {})), 0.0
    db = tuning.active_db()
    if db is not None:
        hit = db.get(env, op.name, key)
        if hit is not None and hit.get("backend") in by_name:
            how = "pinned" if hit.get("pinned") else "measured earlier"
            rejected += [(b, f"tuning database: {hit['backend']} {how}") for b in by_name if b != hit["backend"]]
            return by_name[hit["backend"]], dict(hit.get("timings_ms", {})), 0.0
    if _capturing():
        rejected.append(("measure", "skipped during CUDA graph capture; first supported candidate used"))
        return supported[0], {}, None
    if not tuning.budget_left():
        rejected.append(("measure", f"tuning budget ({tuning.budget_s():g} s) spent; first supported candidate used"))
        return supported[0], {}, None
    start = time.perf_counter()
    measured = {impl.backend: _time_ms(impl.fn, args) for impl in supported}
    tuning_s = time.perf_counter() - start
    tuning.spend(tuning_s)
    timings = {b: t for b, t in measured.items() if isinstance(t, float)}
    failed = [(b, f"raised when measured: {err}") for b, err in measured.items() if isinstance(err, str)]
    ran = [impl for impl in supported if impl.backend in timings] or [op.impls["aten"]]
    chosen = min(ran, key=lambda impl: timings.get(impl.backend, 0.0))
    rejected += failed
    rejected += [(b, f"slower when measured ({t:.4f} ms)") for b, t in timings.items() if b != chosen.backend]
    if db is not None and timings:
        try:
            kept = db.put(env, op.name, key, chosen.backend, timings)
        except OSError as exc:  # a read-only cache must not fail the call
            rejected.append(("tuning database", f"not written: {exc}"))
        else:  # another process stored this shape first: take its winner, so that processes on a host agree
            other = next((impl for impl in ran if impl.backend == kept["backend"] != chosen.backend), None)
            if other is not None:
                rejected[:] = [(b, r) for b, r in rejected if b != other.backend]
                rejected.append((chosen.backend, f"tuning database: {other.backend} stored by another process"))
                chosen = other
    return chosen, timings, tuning_s


@tuning.on_agreement("*")
def _adopt(op: str, key: str, entry: dict[str, Any]) -> int:
    """Switch this process's decisions of ``op`` for shape ``key`` to the agreed backend, where it is supported here."""
    changed = 0
    for dec in DISPATCH_LOG.decisions:
        backend = entry.get("backend")
        if dec.op == op and dec.tuning_key == key and dec.backend != backend and backend in dec.alternatives:
            dec.rejected = (*dec.rejected, (dec.backend, f"agreed across ranks: {backend}"))
            dec.rejected = tuple((b, r) for b, r in dec.rejected if b != backend)
            dec.backend, dec.fn = backend, dec.alternatives[backend]
            changed += 1
    return changed


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _time_ms(fn: Callable[..., Any], args: tuple, reps: int = 5) -> float | str:
    """Median time of ``fn(*args)`` after one warm-up call (which also absorbs JIT compilation); if the warm-up
    raises, the exception as a short string instead."""
    device = next((a.device for a in _tensors(args)), torch.device("cpu"))
    try:
        fn(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _tensors(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _describe(args: tuple) -> tuple[str, str]:
    """Human-readable shape signature ('16384x4096, 4096') and dtype of the first tensor."""
    tensors = _tensors(args)
    shape = ", ".join("x".join(map(str, t.shape)) or "scalar" for t in tensors)
    notes = [f"arg{i} non-contiguous" for i, t in enumerate(tensors) if not t.is_contiguous()]
    if notes:
        shape += " (" + ", ".join(notes) + ")"
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
    return shape, dtype


@torch.compiler.assume_constant_result
def record_inductor(op_name: str, shape: str, dtype: str) -> None:
    """Record that ``torch.compile`` traced ``op_name``'s plain-torch form (see ``DispatchConfig.inductor_ops``).

    Runs while Dynamo traces (a constant-result function: no graph break), so ``calls`` counts the compiled graphs
    holding the op, not their runs: a compiled graph cannot report its runs without a graph break.
    """
    op = registry.OPS[op_name]
    cfg = policy._active
    key = (cfg.uid, (INDUCTOR, shape, dtype))
    dec = op.cache.get(key)
    if dec is None:
        reason = "torch.compile: left to Inductor (policy inductor_ops), which fuses it with its neighbours"
        dec = Decision(op.name, key[1], shape, dtype, INDUCTOR, op.traced, (("*", reason),), cfg.uid)
        op.cache[key] = dec
        DISPATCH_LOG.add(dec)
    dec.calls += 1


def record_fallback(op: OpDef, signature: Hashable, args: tuple, reason: str) -> None:
    """Count a call that ran the reference outside the dispatcher (e.g. a DTensor it cannot run on local shards)."""
    cfg = policy._active
    key = (cfg.uid, ("fallback", signature))
    dec = op.cache.get(key)
    if dec is None:
        shape, dtype = _describe(args)
        dec = Decision(op.name, key[1], shape, dtype, "aten", op.reference, (("*", reason),), cfg.uid)
        op.cache[key] = dec
        DISPATCH_LOG.add(dec)
    dec.calls += 1
