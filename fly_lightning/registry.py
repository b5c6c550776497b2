"""The one registry of operators and their backends: the bottom of the dispatch core (it imports only ``backends``).

An operator (``OpDef``) has a name, a reference implementation (plain torch/ATen, also the test oracle), an argument
validator, a shape-signature function and a set of backend implementations. Validation and support predicates run
once per signature, so a signature must determine their outcome: it holds ``tensor_key`` of every tensor argument and
every scalar the validator or a predicate inspects. What a signature cannot hold (the values of CPU index tensors)
goes in ``check``, which runs on every call, after validation. Kernel modules register themselves with
``@OP.implement("triton", supports=...)``. ``OPS`` is the one table of operators: the package keeps no second list of
op names (the public functions are exported by name, and a test checks they match the registry both ways).

How a call is routed to one of the implementations is ``fly_lightning.dispatch``'s business: its ``Op`` is an
``OpDef`` that can be called, and ``register_op`` lives there.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fly_lightning import backends
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


def scalar_key(v: Any) -> Any:
    """An integer argument in a shape signature: ``2``, ``2.0`` and ``True`` hash and compare alike, but validation
    takes only the first, and a cached decision skips validation. Ints (and None) stay as they are (this runs on every
    call); anything else goes with its type, and is refused by validation before a decision is cached."""
    return v if type(v) is int or v is None else (type(v), v)


def always_supported(*args: Any, **kwargs: Any) -> bool:
    return True


@dataclass(eq=False)
class OpDef:
    """An operator: name, reference, validation, signature and backends (in registration order)."""

    name: str
    reference: Callable[..., Any]
    signature: Callable[..., Hashable]
    validate: Callable[..., None] | None = None
    check: Callable[..., None] | None = None  # per-call value checks (after ``validate`` on a signature's first call)
    doc: str = ""
    # plain torch that torch.compile may trace in place of the opaque op (policy ``inductor_ops``); None: never
    traced: Callable[..., Any] | None = None
    impls: dict[str, BackendImpl] = field(default_factory=dict)
    # decisions keyed by (config uid, signature); filled and read by fly_lightning.dispatch
    cache: dict[tuple[int, Hashable], Any] = field(default_factory=dict, repr=False)

    def implement(
        self,
        backend: str,
        supports: SupportPredicate = always_supported,
        constraints: str = "",
        verified: str = "tested",
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


OPS: dict[str, OpDef] = {}


def add(op: OpDef) -> OpDef:
    """Put ``op`` in the table (names are unique) with ``aten`` already registered by its creator."""
    if op.name in OPS:
        raise ValueError(f"operator {op.name!r} is already registered")
    OPS[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    """Look up a registered operator by name (``import fly_lightning`` has registered the ops and kernels)."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; registered: {sorted(OPS)}") from None


def no_impl_reason(backend: str) -> str:
    """Why ``backend`` has no implementation of an op: a module that registered kernels for other ops shows the
    library is there (FlyDSL's register even without it), so the op simply has none."""
    if BACKENDS[backend].library_installed() or any(backend in o.impls for o in OPS.values()):
        return "no kernel for this op"
    return "not installed"


def clear_decisions() -> None:
    """Forget every op's cached dispatch decisions (the next call of each signature decides again)."""
    for op in OPS.values():
        op.cache.clear()


def reset_availability() -> None:
    """Forget cached backend availability and every dispatch decision made under it (tests, or after changing
    TRITON_INTERPRET): a cached decision would keep a backend that is no longer there. The dispatch log keeps the
    calls already made (a signature decided again gets a second row); ``DISPATCH_LOG.reset()`` clears it too."""
    backends.clear_probes()
    clear_decisions()
