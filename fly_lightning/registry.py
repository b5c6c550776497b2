"""The one registry of operators and their backends.

An operator (``Op``) has a name, a reference implementation (plain torch/ATen, also the test oracle), an argument
validator, a shape-signature function and a set of backend implementations. Validation and support predicates run
once per signature, so a signature must determine their outcome: it holds ``tensor_key`` of every tensor argument and
every scalar the validator or a predicate inspects. What a signature cannot hold (the values of CPU index tensors)
goes in ``check``, which runs on every call, after validation. Kernel modules register themselves with
``@OP.implement("triton", supports=...)``. ``OPS`` is the one table of operators: the package keeps no second list of
op names (the public functions are exported by name, and a test checks they match the registry both ways).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fly_lightning import dispatch, policy
from fly_lightning.backends import BACKENDS

SupportPredicate = Callable[..., "bool | str"]
"""Returns ``True`` when a backend can run these arguments, otherwise a short reason (``"dtype float64"``)."""


@dataclass(frozen=True)
class BackendImpl:
    """One backend's implementation of one operator."""

    op: str
    backend: str
    fn: Callable[..., Any]
    supports: SupportPredicate
    constraints: str = ""  # the support boundary in words, for the support matrix
    verified: str = "tested"  # "tested" (runs in CI) or "compile-only" (FlyDSL: compiled for gfx950, never run here)


def tensor_key(t: Tensor | None) -> tuple | None:
    """What validation and support predicates may look at in a tensor: shape, strides, dtype, device (with index).

    Anything else is keyed by its type, so that validation (not a failing signature) reports it.
    """
    if t is None:
        return None
    if not isinstance(t, Tensor):
        return (type(t),)
    return (t.shape, t.stride(), t.dtype, t.device)


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


@dataclass(eq=False)
class Op:
    """An operator: name, reference, validation, signature and backends (in registration order)."""

    name: str
    reference: Callable[..., Any]
    signature: Callable[..., Hashable]
    validate: Callable[..., None] | None = None
    check: Callable[..., None] | None = None  # per-call value checks (after ``validate`` on a signature's first call)
    doc: str = ""
    impls: dict[str, BackendImpl] = field(default_factory=dict)
    # decisions keyed by (config uid, signature); owned by fly_lightning.dispatch
    cache: dict[tuple[int, Hashable], Any] = field(default_factory=dict, repr=False)

    def implement(
        self, backend: str, supports: SupportPredicate = _always, constraints: str = "", verified: str = "tested"
    ) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` as this op's implementation on ``backend``."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}")

        def deco(fn: Callable) -> Callable:
            if backend in self.impls:
                raise ValueError(f"{self.name}: backend {backend!r} registered twice")
            self.impls[backend] = BackendImpl(self.name, backend, fn, supports, constraints, verified)
            self.cache.clear()
            return fn

        return deco

    def __call__(self, *args: Any) -> Any:
        """Run on the backend chosen for this (policy, shape signature); decide (and validate) on first sight."""
        key = (policy._active.uid, self.signature(*args))
        try:
            decision = self.cache.get(key)
        except TypeError:  # an unhashable argument (a list for an int, say): let validation name it
            if self.validate is not None:
                self.validate(*args)
            raise
        if decision is None:
            return dispatch.decide_and_call(self, key, args)
        if self.check is not None:
            self.check(*args)
        decision.calls += 1
        if dispatch.profile_ranges:  # only while OperatorTime profiles a step; otherwise one attribute read
            return dispatch.call_in_range(decision, args)
        return decision.fn(*args)


OPS: dict[str, Op] = {}


def register_op(
    name: str,
    *,
    reference: Callable[..., Any],
    signature: Callable[..., Hashable],
    validate: Callable[..., None] | None = None,
    check: Callable[..., None] | None = None,
    aten: Callable[..., Any] | None = None,
    doc: str = "",
) -> Op:
    """Create and register an operator.

    ``aten`` is the always-available fallback (defaults to the reference); it must accept every valid input.
    """
    if name in OPS:
        raise ValueError(f"operator {name!r} is already registered")
    op = Op(name=name, reference=reference, signature=signature, validate=validate, check=check, doc=doc)
    op.implement("aten", constraints="every valid input (fallback and oracle)")(aten or reference)
    OPS[name] = op
    return op


def get_op(name: str) -> Op:
    """Look up a registered operator by name (loads the kernel modules first)."""
    from fly_lightning.backends import load_kernels

    load_kernels()
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; registered: {sorted(OPS)}") from None
