"""Persistent tuning database: the winners of measured selection (``select="measure"``), kept across runs.

One JSON file, human-readable, shared by every process on a host::

    {"format": "fly-lightning tuning db", "version": 1,
     "environments": {"NVIDIA H200 (sm_90) | torch 2.11.0 | triton 3.6.0 | flydsl - | fly_lightning 0.1.0": {
         "grouped_mm": {"8192x2048 bf16 c, 128x2048x768 bf16 c, 128 int32 c | None": {
             "backend": "triton", "timings_ms": {"triton": 0.51, "aten": 0.55}, "pinned": false,
             "measured": "2026-12-03T16:00:00Z"}}}}}

- **Environment key**: device name and architecture, torch / Triton / FlyDSL versions and the package version. An
  upgrade is a new environment: its shapes are measured again, never answered by stale winners.
- **Shape key** (``tuning_key``): each tensor's shape, dtype and contiguity, the other arguments' values. The first
  dimension of each tensor is bucketed to the next power of two (a sequence or token count), so runs whose lengths
  vary reuse one measurement per bucket; the in-process decision still keys on the exact shape.
- **Pinned** entries (``fly-lightning tuning pin``) are never overwritten by a measurement.
- **One choice per host**: the first measurement of a shape is the one kept; a process that measured the same shape
  at the same time takes the stored winner, not its own, so the ranks of a run on one host agree.
- **One choice per run** (``agree_across_ranks``): ranks on other hosts have their own file, and may measure
  differently. Every choice a process makes (measured, read from its file, or taken untimed past the budget) is
  journaled; at agreement points the journals are gathered and, per shape, the lowest rank's choice is adopted by
  every rank (in memory and in its file). The fly-lightning strategies hold agreements before steps 2, 3, 5, 9, 17,
  ... (one after each power of two) and every 512 steps after, so a shape is agreed after its first step at the
  latest by the next agreement point. A pre-tuned file copied to every host agrees from the first step.
- **Writes** take an exclusive lock on ``<file>.lock``, re-read the file, merge, write a temporary file and rename it
  over the old one: several processes (the ranks of a DDP run on one host) lose none of each other's entries, and a
  reader never sees half a file. A file that cannot be parsed is moved aside (``<file>.corrupt-<time>``) with a
  warning and rebuilt; it never crashes a run.

Besides the backend choices of measured selection, kernels keep their own measured configurations here (the Triton
grouped GEMM's launch configuration per shape class: op ``grouped_mm.config``, the configuration in ``detail``).

``FLY_LIGHTNING_TUNING_DB`` is the file (default ``$XDG_CACHE_HOME/fly_lightning/tuning.json``); ``off`` disables it.
``FLY_LIGHTNING_TUNING_BUDGET_S`` (default 120) bounds the seconds a process spends measuring: past it, new shapes run
their first supported candidate, recorded as such, so a rare shape never stalls training.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fly_lightning._files import write_text_atomic

FORMAT = "fly-lightning tuning db"
VERSION = 1
DEFAULT_BUDGET_S = 120.0

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; writes are still atomic renames
    fcntl = None


def default_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fly_lightning" / "tuning.json"


def active_path() -> Path | None:
    """The database file in force (``FLY_LIGHTNING_TUNING_DB``), or None when it is off."""
    value = os.environ.get("FLY_LIGHTNING_TUNING_DB", "").strip()
    if value.lower() in ("off", "0", "none", "false"):
        return None
    return Path(value) if value else default_path()


def budget_s() -> float:
    """``FLY_LIGHTNING_TUNING_BUDGET_S`` (seconds of measuring per process; 0 measures nothing), else the default; a
    value that is not a number >= 0 is named in a warning and the default used."""
    raw = os.environ.get("FLY_LIGHTNING_TUNING_BUDGET_S", "").strip()
    if not raw:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # NaN too
        _warn_budget(raw)
        return DEFAULT_BUDGET_S
    return value


@functools.cache  # once per value: budget_s runs on every measured decision
def _warn_budget(raw: str) -> None:
    warnings.warn(
        f"FLY_LIGHTNING_TUNING_BUDGET_S={raw!r} is not a number of seconds >= 0; using {DEFAULT_BUDGET_S:g}",
        stacklevel=3,
    )


@functools.cache  # read once per process: the key is built on every measured decision
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment_key(device: torch.device) -> str:
    """Device name and architecture, and the versions that decide what a kernel compiles to."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
        name = f"{props.name} ({arch})"
    else:
        name = device.type
    versions = " | ".join(
        f"{d} {v}"
        for d, v in (
            ("torch", torch.__version__),
            ("triton", _version("triton")),
            ("flydsl", _version("flydsl")),
            ("fly_lightning", _version("fly-lightning")),
        )
    )
    return f"{name} | {versions}"


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 and 1 stay): the bucket of a leading (token / row) dimension."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def tuning_key(args: tuple) -> str:
    """``"8192x2048 bf16 c, 128x2048x768 bf16 t | 8, True"``: tensors (first dim bucketed, dtype, ``c`` contiguous or
    ``t`` not), then the other arguments."""
    tensors, others = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            dims = list(a.shape)
            if dims:
                dims[0] = bucket(dims[0])
            shape = "x".join(map(str, dims)) or "scalar"
            tensors.append(f"{shape} {str(a.dtype).removeprefix('torch.')} {'c' if a.is_contiguous() else 't'}")
        else:
            others.append(str(a).removeprefix("torch."))
    return ", ".join(tensors) + " | " + ", ".join(others)


def _empty() -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "environments": {}}


def _entry_ok(entry: Any) -> bool:
    """An entry as ``get``'s callers read it: a backend name, timings (if any) backend -> number, a detail (if any)
    a mapping."""
    if not (isinstance(entry, dict) and isinstance(entry.get("backend"), str)):
        return False
    timings = entry.get("timings_ms", {})
    numbers = isinstance(timings, dict) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) for t in timings.values()
    )
    return numbers and isinstance(entry.get("detail", {}), dict)


def _well_formed(environments: dict) -> bool:
    """Every level a mapping down to the entries, each well formed (``_entry_ok``: ``get`` and the CLI read them so)."""
    return all(
        isinstance(ops, dict)
        and all(isinstance(keys, dict) and all(_entry_ok(e) for e in keys.values()) for keys in ops.values())
        for ops in environments.values()
    )


class TuningDB:
    """The database at ``path``: ``get`` reads (cached, reloaded when the file changes), ``put``/``pin``/``prune``
    write under the lock with a merge."""

    def __init__(self, path: str | os.PathLike, *, read_only: bool = False) -> None:
        """``read_only``: a file that cannot be read or parsed raises ``ValueError`` (for commands that show it)
        instead of being moved aside and rebuilt (what a training run does: it must never stop for a cache)."""
        self.path = Path(path)
        self.read_only = read_only
        self._data: dict[str, Any] | None = None
        self._stamp: tuple[int, int] | None = None

    # --- reading ------------------------------------------------------------------------------------------------
    def _read(self, move_aside: bool = False) -> dict[str, Any]:
        """The file's contents; a missing file is empty; an unreadable one is read as empty with a warning, and moved
        aside with ``move_aside`` (writers only, under the lock: a reader that moved it could take away a good file
        that a writer had just put in its place). A path that cannot be read at all, a directory say, stays."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return _empty()
        except (OSError, UnicodeDecodeError) as exc:
            if self.read_only:
                raise ValueError(f"{self.path}: cannot be read ({type(exc).__name__}: {exc})") from None
            warnings.warn(f"tuning database {self.path} cannot be read ({exc}); nothing tuned is used", stacklevel=3)
            return _empty()
        try:
            data = json.loads(text)
            if not (isinstance(data, dict) and data.get("format") == FORMAT):
                raise ValueError("not a fly-lightning tuning database")
            if data.get("version") != VERSION or not isinstance(data.get("environments"), dict):
                raise ValueError(f"version {data.get('version')!r}, expected {VERSION}")
            if not _well_formed(data["environments"]):
                raise ValueError("malformed entries (environment -> op -> shape key -> entry with a backend)")
            return data
        except ValueError as exc:
            if self.read_only:
                raise ValueError(f"{self.path}: {exc}") from None
            if not move_aside:
                warnings.warn(f"tuning database {self.path} unreadable ({exc}); nothing tuned is used", stacklevel=3)
                return _empty()
            # pid and nanoseconds: two writers moving bad files within a second never overwrite each other's copy
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.time_ns()}-{os.getpid()}")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            warnings.warn(
                f"tuning database {self.path} unreadable ({exc}); moved to {aside.name}, rebuilding", stacklevel=3
            )
            return _empty()

    def data(self) -> dict[str, Any]:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:  # missing, or a path that cannot be looked at (_read says which): read as empty
            stamp = None
        if self._data is None or stamp != self._stamp:
            self._data, self._stamp = self._read(), stamp
        return self._data

    def get(self, env: str, op: str, key: str) -> dict[str, Any] | None:
        return self.data()["environments"].get(env, {}).get(op, {}).get(key)

    def entries(self) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
        """``(environment, op, shape key, entry)`` for every entry."""
        for env, ops in self.data()["environments"].items():
            for op, keys in ops.items():
                for key, entry in keys.items():
                    yield env, op, key, entry

    # --- writing ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Exclusive lock, fresh contents to change in place, then an atomic replace of the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = self._read(move_aside=True)
                yield data
                write_text_atomic(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
                self._data, self._stamp = None, None
            finally:
                if fcntl is not None:
                    fcntl.flock(lock, fcntl.LOCK_UN)

    def put(
        self,
        env: str,
        op: str,
        key: str,
        backend: str,
        timings_ms: dict[str, float],
        replace: bool = False,
        detail: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record a measured winner and return the entry in force. The first measurement of a shape wins: where the
        shape already has an entry (another rank measured it meanwhile, or it is pinned) that entry stays and is
        returned, so that every process on the host takes the same choice. ``replace`` overwrites an unpinned one."""
        with self._locked() as data:
            slot = data["environments"].setdefault(env, {}).setdefault(op, {})
            if key in slot and (slot[key].get("pinned") or not replace):
                return dict(slot[key])
            slot[key] = {
                "backend": backend,
                "timings_ms": {b: round(t, 5) for b, t in timings_ms.items()},
                "pinned": False,
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **({"detail": detail} if detail else {}),
            }
            return dict(slot[key])

    def pin(self, env: str, op: str, key: str, backend: str | None) -> None:
        """Pin ``backend`` for this shape (never overwritten by a measurement); None unpins."""
        with self._locked() as data:
            slot = data["environments"].setdefault(env, {}).setdefault(op, {})
            if backend is None:
                if key in slot:
                    slot[key]["pinned"] = False
                return
            slot[key] = {**slot.get(key, {}), "backend": backend, "pinned": True}

    def prune(self, keep_env: str | None = None, op: str | None = None) -> int:
        """Drop entries (of ``op``, or all ops) of every environment but ``keep_env`` (None: every environment);
        pinned entries stay. Returns how many were dropped."""
        dropped = 0
        with self._locked() as data:
            for env, ops in list(data["environments"].items()):
                if env == keep_env:
                    continue
                for name, keys in list(ops.items()):
                    if op is not None and name != op:
                        continue
                    for key in [k for k, e in keys.items() if not e.get("pinned")]:
                        del keys[key]
                        dropped += 1
                    if not keys:
                        del ops[name]
                if not ops:
                    del data["environments"][env]
        return dropped


_DBS: dict[Path, TuningDB] = {}
_spent_s = 0.0  # seconds this process has measured
# (op, shape key, entry) of each choice this process made since the last agreement (see ``agree_across_ranks``)
_JOURNAL: list[tuple[str, str, dict[str, Any]]] = []
_AGREED: dict[tuple[str, str], dict[str, Any]] = {}  # choices adopted from the run's lowest rank
# op -> callback applying an agreed entry to this process's in-memory choices; returns how many it changed
_ADOPTERS: dict[str, Callable[[str, str, dict[str, Any]], int]] = {}


def active_db() -> TuningDB | None:
    path = active_path()
    if path is None:
        return None
    if path not in _DBS:
        _DBS[path] = TuningDB(path)
    return _DBS[path]


def spend(seconds: float) -> None:
    global _spent_s
    _spent_s += seconds


def spent_s() -> float:
    """Seconds this process has spent measuring (measured selection and kernel configurations)."""
    return _spent_s


def budget_left() -> bool:
    return _spent_s < budget_s()


def reset_budget() -> None:
    global _spent_s
    _spent_s = 0.0


# --- agreement across the ranks of a distributed run ----------------------------------------------------------------
def journal(op: str, key: str, entry: dict[str, Any]) -> None:
    """Note a choice made in this process (``entry`` holds at least ``backend``), for the next agreement."""
    _JOURNAL.append((op, key, dict(entry)))


def agreed(op: str, key: str) -> dict[str, Any] | None:
    """The entry the run's ranks agreed on for this shape, if an agreement covered it."""
    return _AGREED.get((op, key))


def on_agreement(op: str) -> Callable[[Callable[[str, str, dict[str, Any]], int]], Callable]:
    """Register how ``op`` (``"*"``: every op without its own) applies an agreed entry to in-memory choices."""

    def register(fn: Callable[[str, str, dict[str, Any]], int]) -> Callable:
        _ADOPTERS[op] = fn
        return fn

    return register


def agree_across_ranks(group: Any = None) -> int:
    """Collective over ``group`` (every rank must call it): gather each rank's journal; per (op, shape) the lowest
    rank's choice is adopted by all, applied to in-memory choices and written to each rank's file where it differs
    (pinned entries there stay). Returns how many in-memory choices changed on this rank. Without an initialised
    process group of more than one rank it only clears the journal."""
    import torch.distributed as dist

    mine = list(_JOURNAL)
    _JOURNAL.clear()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return 0
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    chosen: dict[tuple[str, str], dict[str, Any]] = {}
    for entries in gathered:  # rank order: the lowest rank's choice wins
        for op, key, entry in entries:
            chosen.setdefault((op, key), entry)
    changed = 0
    for (op, key), entry in chosen.items():
        _AGREED[(op, key)] = entry
        adopt = _ADOPTERS.get(op) or _ADOPTERS.get("*")
        if adopt is not None:
            changed += adopt(op, key, entry)
        db, env = active_db(), entry.get("environment")
        if db is not None and env and entry.get("timings_ms"):
            local = db.get(env, op, key)
            if local is None or (local.get("backend") != entry["backend"] and not local.get("pinned")):
                with contextlib.suppress(OSError):
                    db.put(env, op, key, entry["backend"], entry["timings_ms"], replace=True,
                           detail=entry.get("detail"))  # fmt: skip
    return changed


def agreement_due(step: int) -> bool:
    """Whether the strategies hold an agreement before training step ``step`` (1-based): one after each power of
    two (2, 3, 5, 9, 17, ...) and every 512 steps after 513."""
    n = step - 1
    return n >= 1 and ((n & (n - 1)) == 0 or n % 512 == 0)
