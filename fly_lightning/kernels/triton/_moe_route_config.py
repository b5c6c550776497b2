"""Launch configurations of the Triton MoE routing kernel (``_moe_route_kernel``): the ``[G, LG, ROWS, C, VEC]``
tile, rows and elements per thread, programs per SM, counting tail, and the heuristic that picks them per
signature from the H200 sweeps."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton

from fly_lightning.kernels.triton._math import cdiv, next_pow2

# Triton after 3.6 (the H200 image's, where every timing here was taken) lowers this kernel differently. Compiled for
# sm_90 with 3.7.1 (torch 2.13's), 3.8.0 and 3.9.0, the broadcast winner-key store takes Qwen3's shape to 229-255
# registers (with spills on 3.7/3.8), so those use the direct store; the prefetch then still takes it to 166, past the
# 128 that 4 programs of 4 warps per SM allow (tests/kernels/triton/test_moe_route_sm90.py), so it stays off there.
# Both choices are untimed on those versions.
NEWER_TRITON = tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", triton.__version__).groups()) >= (3, 7)


@dataclass(frozen=True)
class LaunchConfig:
    """How a routing launch is shaped. The ``_exact_values``, ``_store_step`` and ``_*_tail`` the fields refer to are
    in ``_moe_route_kernel.py``; ``ON_HIP`` is in ``moe_route.py``."""

    elems_per_thread: int = 32  # row elements per thread; sets the lanes per row (fewer lanes: fewer shuffles)
    rows_per_thread: int = 1
    num_warps: int = 4
    programs_per_sm: int = 4  # persistent grid: SMs * programs_per_sm programs (fewer when there are fewer tiles)
    num_stages: int = 1  # software pipelining of the tile loop
    prefetch: bool = False  # load the next tile into registers before ranking this one
    fast_sigmoid: bool = True  # see _exact_values (CUDA only: off on ROCm, see ON_HIP)
    direct_store: bool | None = None  # see _store_step; None: by the Triton version
    relaxed_tail: bool = False  # see _ticket_tail
    # "packed": _packed_tail where its fields fit (else the ticket); "ticket": _ticket_tail; None: by row width, as
    # launch_config picks (default_tail: wider rows than 128 experts measured slower with the packed tail)
    tail: str | None = None
    programs: int | None = None  # exact number of programs (tests); overrides programs_per_sm


@dataclass(frozen=True)
class TileShape:
    """The ``[G, LG, ROWS, C, VEC]`` tile (see ``_select.py``) and the packed-key column base ``CB``."""

    G: int
    LG: int
    ROWS: int
    C: int
    VEC: int
    SG: int  # columns per group (all columns when ungrouped)
    NG: int
    CB: int


def tile_shape(n_experts: int, n_groups: int | None, row_stride: int, itemsize: int, cfg: LaunchConfig) -> TileShape:
    groups = n_groups or 1
    sg = n_experts // groups
    vec = 16 // itemsize  # one 16-byte load per chunk, as long as rows and groups stay aligned to it
    while vec > 1 and (sg % vec or row_stride % vec):
        vec //= 2
    g = next_pow2(groups)
    sgp = max(next_pow2(sg), vec)
    lg = max(1, min(sgp // max(cfg.elems_per_thread, vec), 32 // g))
    rows = (32 // (g * lg)) * cfg.num_warps * cfg.rows_per_thread
    return TileShape(
        G=g, LG=lg, ROWS=rows, C=sgp // (lg * vec), VEC=vec, SG=sg, NG=groups, CB=next_pow2((g - 1) * sg + sgp)
    )


def default_tail(n_experts: int) -> str:
    """The counting tail by row width: packed up to 128 experts, ticket above (see ``launch_config``)."""
    return "packed" if next_pow2(n_experts) <= 128 else "ticket"


def launch_config(n_experts: int, k: int, itemsize: int, grouped: bool, biased: bool = False) -> LaunchConfig:
    """Heuristic, from the H200 sweeps (``benchmarks/bench_moe_route.py --sweep [--pipeline]``,
    ``moe_route_sweep_dcd9d8f.md``, then ``moe_route_sweep_pipeline.md``): 32 row elements per thread and tiles of
    about 4096 elements, except where one change measured faster. A full sweep around the result (bfbab72,
    ``moe_route_sweep.md``) finds every case within 3% of its best configuration but Llama-4's 16 experts (4.3 vs
    4.0 us with 64 elements per thread):

    - 16-bit rows of 128+ experts, ungrouped: 64 elements per thread (fewer lanes per row, fewer shuffle stages;
      GLM-4.5's 160 experts 32.0 -> 26.1 us, Qwen3's 128 9.7 -> 8.5 us).
    - fp32 rows of up to 64 experts: 16 elements per thread (DeepSeek-V2-Lite 19.9 -> 15.6 us).
    - expert groups: two rows per thread (DeepSeek-V3 65k tokens 67.7 -> 57.3 us, fp32 16k 25.6 -> 23.2 us).
    - up to 8 experts: one row per thread, so a 16k-token batch spreads over 128 programs (Mixtral 4.6 -> 4.2 us).
    - the next tile prefetched, except for 16-bit rows of up to 64 experts (one tile per program at the suite's
      sizes; prefetching cost Mixtral 3.9 -> 4.1 us, OLMoE 7.1 -> 7.3): DeepSeek-V2-Lite 14.7 -> 13.6 us,
      Qwen3 65k 16.5 -> 16.0 (``moe_route_sweep_pipeline_explore.md``; Triton 3.6, off with later versions, see
      ``NEWER_TRITON``). Off for grouped scores since the compressed keys' check (f26d70a): with it the grouped
      kernels spilled (DeepSeek-V3 fp32 120 bytes, sm_90, Triton 3.6). Both changes together, side by side
      (``moe_route_spread_2c62ad9_repeat.md`` / ``moe_route_spread_108eedf.md``): DeepSeek-V3 fp32 20.1 -> 20.1 us,
      65k 53.7 -> 56.9 on the suite's inputs.
    - biased or grouped scores: 2 programs per SM. Those kernels take 255 registers, so only two programs of 4 warps
      fit on an SM and a 4-per-SM grid runs in two waves (GLM-4.5 26.3 -> 20.6 us, DeepSeek-V3 65k 58.4 -> 54.7, fp32
      16k 25.6 -> 21.7, with the prefetch; ``moe_route_sweep_pipeline_explore.md``).
    - the sigmoid of ranked scores (biased or grouped sigmoid routers) as ``ex2.approx.ftz`` and ``div.approx.ftz``
      (``fast_sigmoid``, see ``_exact_values``), side by side at 23207fe (``moe_route_variants_23207fe.md``):
      DeepSeek-V3 65k 57.0 -> 52.0 us, GLM-4.5 19.8 -> 19.1, DeepSeek-V3 fp32 20.4 -> 20.2 (its scores are fp32
      logits' sigmoids: the same instructions, a smaller share of the time).
    - the relaxed counting tail (``_ticket_tail``): 1.04-1.35x on every case, most on the small ones
      (Mixtral 4.10 -> 3.03 us, Qwen3 65k 15.8 -> 14.8; ``moe_route_sweep_pipeline.md``).
    - rows of up to 128 experts: the packed tail (``_packed_tail``). Ticket -> packed, side by side in one run at
      f0b67ee (``moe_route_floor_f0b67ee.md``): Mixtral 3.15 -> 2.20 us, Qwen2-MoE 4.06 -> 3.36, OLMoE 6.00 -> 4.94,
      Qwen3 7.66 -> 6.45, Llama-4 4.25 -> 3.34, DeepSeek-V2-Lite 12.75 -> 11.57, Qwen3 65k 14.67 -> 14.73; the pipeline
      sweep of the same run agrees. Wider rows lost (GLM-4.5's 160: 18.98 -> 21.59, DeepSeek-V3 fp32's 256: 19.97 ->
      21.25); why is not established (every program adds a word for every expert, where the ticket tail skips zero
      tallies, but GLM-4.5's 128-token programs have few of those). (The floors agree, though their stand-in tally
      leaves half the experts at zero, which favours the ticket tail. DeepSeek-V3 65k tied, 53.3 vs 52.5.) In the
      255-register biased kernels over 128 experts it also spilled 16 bytes (outside the main loop; sm_90, Triton 3.6).

    Tried and dropped: tiles drawn from a counter (one relaxed atomic per tile, the next one drawn while the current
    is ranked) instead of a fixed range per program, against the load imbalance that makes spread inputs slower (the
    programs that draw an exact-pass tile finish last, ``route_ncu_5b20dfb.md``): 0.80-0.94x on the suite's inputs
    of six cases, 0.88-1.01x on spread ones (``moe_route_variants_dynamic_0bc91f4.md``).
    The selection steps after the first, the exact pass's steps, or both, as loops instead of
    unrolled (a third to a half of the code, against the instruction-fetch stalls the profile shows on the long
    biased/grouped loops): 0.93-1.01x on DeepSeek-V3 fp32 and 65k and DeepSeek-V2-Lite fp32, suite and spread inputs
    (``moe_route_variants_roll_9547a40.md``; GLM-4.5 spilled with either, Qwen3 65k needed 168 registers).
    Finishing each tile one loop step later, its winning keys loaded before the next tile is
    ranked (the profile, ``route_ncu_5b20dfb.md``, has the reload after the barrier as the loop's most sampled stall
    on Qwen3 65k): slower on all seven cases it compiled for without spilling, 0.83-0.97x, with or without the
    prefetch (``moe_route_variants_23207fe.md``).

    Tried and dropped before the packed tail (``moe_route_sweep_pipeline_{98ecaa1,8285c4e,d578312}.md``, ticket vs the
    alternative in each run): an atomic tail (every program adds its tally into zeroed ``counts_E`` and its prefix into
    ``offsets_E``; no ticket). With one memset over both outputs it won on rows of up to 64 experts (OLMoE 6.10 -> 5.64
    us, Llama-4 4.10 -> 3.77) and lost from 128 (Qwen3 7.6 -> 8.2, GLM-4.5 19.2 -> 22.1), but a custom op's outputs may
    not alias, so the op would need two zeroings: by one foreach launch it was mixed (OLMoE 6.12 -> 6.92, Llama-4 5.05
    -> 4.00), by two memsets slower on four of five (Mixtral 3.18 -> 4.01, OLMoE 6.06 -> 7.61). And the accumulator in
    copies (program p adds into copy p % 4, spreading the atomics over more cache lines): Qwen3 16k 7.6 -> 7.2 in two
    runs, no gain or a loss elsewhere (DeepSeek-V3 fp32 19.8 -> 20.8), and 32 bytes of spills in the 255-register
    kernels.
    """
    width = next_pow2(n_experts)
    per_row = min(32, width)
    ept = 32
    if itemsize == 2 and n_experts >= 128 and not grouped:
        ept = 64
    elif itemsize == 4 and width <= 64:
        ept = 16
    if grouped:
        rows = 2
    elif width <= 8:
        rows = 1
    else:
        rows = max(1, 32 // per_row)
    return LaunchConfig(
        relaxed_tail=True,
        tail=default_tail(n_experts),
        elems_per_thread=ept,
        rows_per_thread=rows,
        num_warps=4,
        programs_per_sm=2 if grouped or biased else 4,
        prefetch=not (itemsize == 2 and width <= 64) and not grouped and not NEWER_TRITON,
    )


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(device: torch.device, cfg: LaunchConfig, n_tiles: int) -> tuple[int, int]:
    """(programs, tiles per program); every program gets at least one tile."""
    if cfg.programs is not None:
        progs = cfg.programs
    elif device.type == "cuda":
        progs = _sm_count(device.index) * cfg.programs_per_sm
    else:  # the interpreter runs programs one after another: a few are enough to exercise the multi-program logic
        progs = 4
    per = cdiv(n_tiles, max(1, min(progs, n_tiles)))
    return cdiv(n_tiles, per), per
