"""Dispatch policy: which backends are candidates, per op and globally, and how a candidate is chosen.

Three ways to set it, innermost wins: ``with dispatch_config(...)`` (context manager), ``set_dispatch_config(...)``
(process-wide), and environment variables read at import:

- ``FLY_LIGHTNING=0``: every op runs on ATen.
- ``FLY_LIGHTNING_BACKENDS=triton,flydsl``: candidate backends in preference order.
- ``FLY_LIGHTNING_DISABLE=rms_norm,moe_route``: ops kept on ATen.
- ``FLY_LIGHTNING_SELECT=measure``: time the supported candidates per shape and keep the fastest.
- ``FLY_LIGHTNING_INDUCTOR=rms_norm,swiglu`` (or ``none``): ops left to Inductor under ``torch.compile``.

Enabling a backend adds a candidate; it never forces one: support predicates are always checked and ATen is always
the last candidate. Op names in a policy are checked against the registry when the policy is set and when it is first
used (a misspelt name would otherwise do nothing).

The policy is one per process, not per thread: ``dispatch_config`` blocks entered by two threads at once overlap
(autograd's backward threads must see the training loop's policy, so it is deliberately not thread-local).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from fly_lightning.backends import BACKENDS
from fly_lightning.registry import OPS

Select = Literal["first", "measure"]
INDUCTOR_OPS: frozenset[str] = frozenset({"rms_norm", "swiglu"})
"""Ops whose plain-torch form ``torch.compile`` traces instead of the opaque op, so that Inductor fuses them with
their neighbours. Chosen by measurement on the H200 (``benchmarks/results/train_step.md``: ``fly_compile`` against
``fly_compile_opaque``; ``moe_layer.md``'s profiles): RMSNorm and SwiGLU fused by Inductor with the residual adds and
their backward beat the opaque kernels; ``moe_combine`` stays opaque, as Inductor's gradient of its gather was an
atomic ``index_add`` (1.15 ms of a 6.6 ms Qwen3-MoE block) where ours is ``moe_dispatch``'s one pass."""
_UIDS: dict[tuple, int] = {}  # equal configs share a uid, so decisions cached under one are reused by the other
_UIDS_LOCK = threading.Lock()


class _FrozenMapping(Mapping):
    """A read-only, hashable mapping (``op_backends``): a config's uid must not go stale after it is made."""

    def __init__(self, items: Mapping) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> tuple[str, ...]:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._d.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other)

    def __repr__(self) -> str:
        return repr(self._d)


@dataclass(frozen=True)
class DispatchConfig:
    """Immutable dispatch policy.

    Args:
        enabled: ``False`` sends every op to ATen.
        backends: candidate backends in preference order (``aten`` is appended if absent).
        disabled_ops: op names always run on ATen.
        op_backends: per-op preference order, overriding ``backends`` for that op.
        select: ``"first"`` takes the first supported candidate; ``"measure"`` times each supported candidate once per
            shape signature and caches the fastest (reported as a tuning event, apart from steady state).
        inductor_ops: under ``torch.compile``, these ops (those with a traceable form) are left to Inductor, which
            fuses them with their neighbours where an opaque custom op cannot be; recorded in the dispatch log with
            backend ``inductor``. Eager calls are not affected.
    """

    enabled: bool = True
    backends: tuple[str, ...] = ("flydsl", "triton", "aten")
    disabled_ops: frozenset[str] = frozenset()
    op_backends: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    select: Select = "first"
    inductor_ops: frozenset[str] = INDUCTOR_OPS
    uid: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("backends", "disabled_ops", "inductor_ops"):  # tuple("triton") would be its letters
            if isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a collection of names, e.g. {name}=[{getattr(self, name)!r}]")
        for op, names in dict(self.op_backends).items():
            if isinstance(names, str):
                raise TypeError(f"op_backends[{op!r}] must be a collection of names, e.g. [{names!r}]")
        object.__setattr__(self, "backends", _order(self.backends))
        object.__setattr__(self, "disabled_ops", frozenset(self.disabled_ops))
        object.__setattr__(self, "inductor_ops", frozenset(self.inductor_ops))
        object.__setattr__(
            self, "op_backends", _FrozenMapping({k: _order(v) for k, v in dict(self.op_backends).items()})
        )
        if self.select not in ("first", "measure"):
            raise ValueError(f"select must be 'first' or 'measure', got {self.select!r}")
        key = (
            self.enabled,
            self.backends,
            tuple(sorted(self.disabled_ops)),
            tuple(sorted(self.op_backends.items())),
            self.select,
            tuple(sorted(self.inductor_ops)),
        )
        with _UIDS_LOCK:
            object.__setattr__(self, "uid", _UIDS.setdefault(key, len(_UIDS) + 1))

    def __reduce__(self) -> tuple:
        """Rebuilt through the constructor: the uid is this process's (a pickled one, from ``spawn`` or a checkpoint,
        would name another policy here)."""
        fields = (self.enabled, self.backends, self.disabled_ops, dict(self.op_backends), self.select)
        return (DispatchConfig, (*fields, self.inductor_ops))

    def candidates(self, op: str) -> tuple[str, ...]:
        """Backends to try for ``op``, in order; always ends with ``aten``."""
        if not self.enabled or op in self.disabled_ops:
            return ("aten",)
        return self.op_backends.get(op, self.backends)

    def replace(self, **changes: object) -> DispatchConfig:
        return replace(self, **changes)

    def unknown_ops(self, known: Iterable[str]) -> list[str]:
        """Op names this policy mentions that are not in ``known``."""
        known = set(known)
        return sorted(n for n in (*self.disabled_ops, *self.op_backends, *self.inductor_ops) if n not in known)


def check_op_names(config: DispatchConfig) -> None:
    """Raise if ``config`` names an operator the registry does not have."""
    if unknown := config.unknown_ops(OPS):
        raise ValueError(f"dispatch config names unknown operator(s) {unknown}; registered: {sorted(OPS)}")
    if opaque := sorted(n for n in config.inductor_ops if OPS[n].traced is None):
        traceable = sorted(n for n, op in OPS.items() if op.traced is not None)
        raise ValueError(f"inductor_ops names op(s) {opaque} with no traced form; those with one: {traceable}")


def _order(backends: Iterable[str]) -> tuple[str, ...]:
    names = tuple(backends)
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; known: {list(BACKENDS)}")
    names = tuple(dict.fromkeys(names))  # drop repeats, keep order
    return names if names and names[-1] == "aten" else tuple(b for b in names if b != "aten") + ("aten",)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def config_from_env(env: Mapping[str, str] = os.environ) -> DispatchConfig:
    """The default config, shaped by ``FLY_LIGHTNING*`` environment variables."""
    kwargs: dict[str, object] = {}
    if env.get("FLY_LIGHTNING", "1").strip().lower() in ("0", "false", "off", "no"):
        kwargs["enabled"] = False
    if backends := _split(env.get("FLY_LIGHTNING_BACKENDS")):
        kwargs["backends"] = tuple(backends)
    if disabled := _split(env.get("FLY_LIGHTNING_DISABLE")):
        kwargs["disabled_ops"] = frozenset(disabled)
    if select := env.get("FLY_LIGHTNING_SELECT", "").strip():
        kwargs["select"] = select.lower()
    if (inductor := env.get("FLY_LIGHTNING_INDUCTOR", "").strip()) != "":  # blank: unset, as the others
        kwargs["inductor_ops"] = frozenset() if inductor.strip().lower() == "none" else frozenset(_split(inductor))
    return DispatchConfig(**kwargs)


_active: DispatchConfig = config_from_env()


def get_dispatch_config() -> DispatchConfig:
    """The policy in force now."""
    return _active


def set_dispatch_config(config: DispatchConfig | None = None, **changes: object) -> DispatchConfig:
    """Set the process-wide policy (a config, and/or field changes on top of it); returns the previous one."""
    global _active
    previous = _active
    base = config or _active
    new = base.replace(**changes) if changes else base
    check_op_names(new)
    _active = new
    return previous


@contextlib.contextmanager
def dispatch_config(config: DispatchConfig | None = None, **changes: object) -> Iterator[DispatchConfig]:
    """Temporarily set the policy: ``with dispatch_config(disabled_ops={"rms_norm"}): ...``. Process-wide while
    inside (see the module docstring), restored on exit."""
    global _active
    previous = set_dispatch_config(config, **changes)
    try:
        yield _active
    finally:
        _active = previous  # checked when it was set
