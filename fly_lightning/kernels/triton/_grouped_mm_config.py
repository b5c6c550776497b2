"""Launch configurations of the Triton grouped GEMM: the per-shape-class table, and what tuning/sweeps try."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fly_lightning.kernels.triton._support import ON_HIP, interpreting


@dataclass(frozen=True)
class GroupedMMConfig:
    """One launch configuration of the grouped GEMM kernel.

    ``programs_per_sm = 0`` launches one program per tile of the host-side upper bound (not persistent).
    ``tma`` enables TMA loads where the strides allow (the activations only when they are not gathered);
    ``tma_store`` the per-group TMA store (never with a scatter). ``schedule``: ``"scan"`` (each program counts
    the tiles from the offsets and walks the groups: one launch) or ``"table"`` (a one-program kernel writes the
    tile prefix sums first; each tile then finds its group by binary search). ``warp_specialize``: ``""`` (software
    pipelining only), ``"tiles"`` (Triton's Hopper warp specialisation on the persistent tile loop: needs the
    ``table`` schedule and 4 warps) or ``"k"`` (on the K loop); ``flatten`` flattens the tile loop with the K loop
    (pipelining across tiles); ``specialize`` (label flag ``K``, for the known shape; not the K dim) compiles N, K
    and the strides of x, w and out in as constants (one compilation per weight shape and layout, row strides of x and
    out, dtype and form; the row count stays a runtime value).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    tma: bool = True
    tma_store: bool = False
    programs_per_sm: int = 1
    schedule: str = "scan"
    warp_specialize: str = ""
    flatten: bool = False
    specialize: bool = False

    def label(self) -> str:
        flags = "".join(
            f for f, on in (("T", self.tma), ("S", self.tma_store), ("F", self.flatten), ("K", self.specialize)) if on
        )
        flags += "t" if self.schedule == "table" else ""
        flags += f"W{self.warp_specialize}" if self.warp_specialize else ""
        persist = f"p{self.programs_per_sm}" if self.programs_per_sm else "np"
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}_g{self.group_m}_s{self.num_stages}_w{self.num_warps}"
            f"_{persist}{'_' + flags if flags else ''}"
        )


def shape_class(m: int, n: int, k: int, e: int) -> tuple[str, str, str]:
    """(rows per group, N, K) classes: the key of the configuration table."""
    avg = m / max(1, e)
    m_class = "small" if avg < 96 else "mid" if avg < 384 else "large"
    n_class = "narrow" if n <= 1536 else "wide"
    k_class = "short" if k <= 1024 else "long"
    return m_class, n_class, k_class


# Hopper (H100/H200) per shape class. The classes with a case in `python -m benchmarks.bench_grouped_mm --sweep` take
# its fastest configuration that is correct on every case (grouped_mm_sweep_3090b87.md; warp-specialised ones were
# wrong there, see _grouped_mm_kernel._effective_config), checked by a second sweep (grouped_mm_sweep.md) and the
# suite; the other classes keep the starting points they had.
# Every Hopper configuration below (table, tuning and sweep candidates) compiles N, K and the strides in
# (``specialize``): side by side on the H200 over the suite's 24 cases, 1.012x geomean on plain rows (15 of 24 faster,
# none more than 1.1% slower), 1.091x on the MoE layer's gathered gate/up rows (4 of 4) and 1.024x on its scattered
# down output (grouped_mm_specialize.md). The cost is one compilation per weight shape and layout, as Inductor's
# template compiles its static shapes.
C = functools.partial(GroupedMMConfig, specialize=True)
CONFIG_TABLE: dict[tuple[str, str, str], GroupedMMConfig] = {
    ("small", "narrow", "short"): C(64, 128, 64, 8, 4, 4),
    ("small", "narrow", "long"): C(64, 128, 128, 8, 3, 4),  # swept: 1.06x over the previous 64x128x64 s4
    ("small", "wide", "short"): C(64, 256, 64, 8, 3, 8),
    ("small", "wide", "long"): C(64, 256, 64, 8, 3, 8),
    ("mid", "narrow", "short"): C(128, 128, 64, 8, 4, 8),
    ("mid", "narrow", "long"): C(128, 256, 64, 8, 4, 8, flatten=True),  # swept: 1.08x over 128x128x64 s4
    ("mid", "wide", "short"): C(128, 256, 64, 8, 3, 8),
    ("mid", "wide", "long"): C(128, 256, 64, 8, 4, 8, flatten=True),  # swept: 1.10x over 128x256x64 s3
    ("large", "narrow", "short"): C(128, 128, 64, 8, 4, 8),
    ("large", "narrow", "long"): C(128, 256, 64, 8, 4, 8),  # swept: 1.23x over 128x128x64 s4 (Qwen3 gate/up)
    ("large", "wide", "short"): C(128, 256, 64, 8, 3, 8, flatten=True),  # swept: 1.05x over 128x256x64 s3
    # two sweeps disagreed here (4 stages 1.04x faster in one, 0.97x in the other) and the suite measured no gain
    ("large", "wide", "long"): C(128, 256, 64, 8, 3, 8),
}
# Ampere and older: no TMA, less shared memory.
PRE_HOPPER_CONFIG = GroupedMMConfig(128, 128, 32, 8, 3, 8, tma=False)
# The interpreter runs programs one after another: small tiles, few programs (still several tiles each).
INTERPRETER_CONFIG = GroupedMMConfig(32, 32, 32, 2, 1, 4, tma=False, programs_per_sm=1)
INTERPRETER_PROGRAMS = 3


class _Watched(dict):
    """A dict that calls its ``listeners`` after every change (the launcher drops its cached launch plans, which hold
    configurations chosen from it)."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[Callable[[], object]] = []

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._changed()

    def __ior__(self, other):
        super().__ior__(other)
        self._changed()
        return self

    def clear(self) -> None:
        super().clear()
        self._changed()

    def pop(self, *args):
        value = super().pop(*args)
        self._changed()
        return value

    def popitem(self):
        item = super().popitem()
        self._changed()
        return item

    def setdefault(self, key, default=None):
        value = super().setdefault(key, default)
        self._changed()
        return value

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._changed()


MEASURED: dict[tuple, GroupedMMConfig] = _Watched()
"""Configurations chosen by ``tune`` (or ``FLY_LIGHTNING_GROUPED_MM_TUNE=1``), keyed like ``measure_key``. Any change
drops the launcher's cached launch plans (``_grouped_mm_kernel.reset_plans``), so the next call sees it."""
REJECTED: dict[tuple, dict[str, str]] = {}
"""Candidates ``tune`` refused, keyed like ``measure_key``: configuration label -> why (wrong result, no launch)."""


def measure_key(x: torch.Tensor, w: torch.Tensor, m: int, gather: bool, scatter: bool) -> tuple:
    n, k, e = w.shape[2], w.shape[1], w.shape[0]
    return (*shape_class(m, n, k, e), w.stride(-1) != 1, x.dtype, gather, scatter)


def table_config(x: torch.Tensor, w: torch.Tensor, m: int) -> GroupedMMConfig:
    """The configuration table's choice (no measurement)."""
    if x.device.type == "cpu" and interpreting():
        return INTERPRETER_CONFIG
    # ROCm (gfx950): the pointer-path configuration, the one compile-checked for gfx950 without spills (the Hopper
    # table's 128x256 tiles spill SGPRs there; tests/kernels/triton/gfx950_compile.py); never run on AMD hardware here
    if x.is_cuda and (ON_HIP or torch.cuda.get_device_capability(x.device) < (9, 0)):
        return PRE_HOPPER_CONFIG
    return CONFIG_TABLE[shape_class(m, w.shape[2], w.shape[1], w.shape[0])]


def choose_config(
    x: torch.Tensor, w: torch.Tensor, m: int, gather: bool = False, scatter: bool = False
) -> GroupedMMConfig:
    """The measured choice for this shape class if any, else the table."""
    if x.device.type == "cpu" and interpreting():
        return INTERPRETER_CONFIG
    return MEASURED.get(measure_key(x, w, m, gather, scatter)) or table_config(x, w, m)


def candidate_configs() -> list[GroupedMMConfig]:
    """What the benchmark sweep tries: tile shapes x stages x warps; persistent (1 or 2 programs per SM) or one
    program per tile; TMA loads or pointers; TMA store; band width; scan or table schedule; warp specialisation. All
    with the shape compiled in, as the table runs, plus the first tile shape without it as a control."""
    base = [
        C(128, 256, 64, 8, 3, 8),
        C(128, 256, 64, 8, 4, 8),
        C(128, 128, 64, 8, 4, 8),
        C(128, 128, 64, 8, 4, 4),
        C(128, 128, 128, 8, 3, 8),
        C(64, 256, 64, 8, 4, 4),
        C(64, 128, 64, 8, 4, 4),
        C(64, 128, 128, 8, 3, 4),
        C(256, 128, 64, 8, 3, 8),
    ]
    # warp specialisation: 4 warps per partition; only with the TMA store (_grouped_mm_kernel._effective_config),
    # whose buffer leaves no room for a fourth 128x256 stage
    specialised = [
        C(128, 256, 64, 8, 3, 4, schedule="table", warp_specialize="tiles", tma_store=True),
        C(128, 128, 64, 8, 4, 4, schedule="table", warp_specialize="tiles", tma_store=True),
        C(128, 128, 128, 8, 3, 4, schedule="table", warp_specialize="tiles", tma_store=True),
        C(128, 256, 64, 8, 3, 4, schedule="table", warp_specialize="k", tma_store=True),
    ]
    variants = []
    for c in base[:3]:
        variants += [
            replace(c, tma=False),
            replace(c, programs_per_sm=0),
            replace(c, programs_per_sm=2),
            replace(c, tma_store=True, num_stages=min(c.num_stages, 3)),
            replace(c, group_m=4),
            replace(c, flatten=True),
            replace(c, schedule="table"),
        ]
    control = replace(base[0], specialize=False)
    return list(dict.fromkeys(base + specialised + variants + [control]))  # in order, without repeats


def tune_candidates(m_class: str) -> list[GroupedMMConfig]:
    """A short list for a measured choice (``tune``): the likely winners of a rows-per-group class (the sweep's)."""
    ws = dict(schedule="table", warp_specialize="tiles", tma_store=True)
    if m_class == "small":
        return [
            C(64, 128, 64, 8, 4, 4),
            C(64, 128, 128, 8, 3, 4),
            C(64, 256, 64, 8, 3, 8),
            C(128, 128, 64, 8, 4, 4, **ws),
        ]
    return [
        C(128, 256, 64, 8, 3, 8),
        C(128, 256, 64, 8, 4, 8),
        C(128, 128, 64, 8, 4, 8),
        C(128, 256, 64, 8, 3, 4, **ws),
        C(128, 256, 64, 8, 3, 8, flatten=True),
        C(128, 256, 64, 8, 4, 8, flatten=True),
    ]
