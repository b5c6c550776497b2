"""Compile the routing and top-k kernels for sm_90 without a GPU (Triton's bundled ptxas), with the constexprs their
launchers would use, and report each variant as JSON.

Run in a process without TRITON_INTERPRET (``test_moe_route_sm90.py`` does). The interpreter cannot reproduce every
GPU behaviour (it keeps NaN payloads that a GPU float op may canonicalise), so the H200 suites remain the numerical
check; this one keeps the kernels compiling, spill-free, in CI.
"""

import re
from collections import Counter
from dataclasses import replace

import torch
from _sm90 import compile_sm90, report, sass_loop

from fly_lightning.kernels.triton import moe_route, topk
from fly_lightning.kernels.triton._moe_route_config import launch_config

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def _compile(fn, sig: dict, const: dict, aligned: tuple[str, ...]) -> dict:
    options = dict(num_warps=const.pop("num_warps"), num_stages=const.pop("num_stages", 3))
    kernel, spill_bytes, registers = compile_sm90(fn, sig, const, aligned, **options)
    # global atomics by memory order, kind and width, e.g. "acq_rel.add.32": the counting tail's ordering, as compiled
    # (Triton 3.6 emits the ticket tail's tallies as atom, later versions as red: the same without the returned value)
    ops = re.findall(r"\b(?:atom|red)\.global\.gpu\.(\w+)\.(\w+)\.[a-z]+(\d+)", kernel.asm["ptx"])
    atomics = Counter(f"{sem}.{kind}.{bits}" for sem, kind, bits in ops)
    return dict(spill_bytes=spill_bytes, registers=registers, shared=kernel.metadata.shared, global_atomics=atomics,
                **sass_loop(kernel))  # fmt: skip


def route(t, e, k, dtype, score="softmax", renorm=True, bias=False, groups=None, perm=False, **config) -> dict:
    """``config``: LaunchConfig fields changed from the launcher's own choice (then ``launcher_default`` is False)."""
    cfg = launch_config(e, k, torch.finfo(dtype).bits // 8, groups is not None, bias)
    cfg = replace(cfg, **config)
    plan = moe_route._plan(t, e, k, dtype, e, score, renorm, bias, *(groups or (None, None)), perm,
                           torch.device("cpu"), cfg, False)  # fmt: skip
    sig = dict(X=TYPES[dtype], stride_x="i32", BIAS="*fp32" if bias else TYPES[dtype], W_OUT="*fp32",
               ID_OUT="*i32", POS_OUT="*i32", HIST="*i32", COUNTS="*i32", OFFSETS="*i32",
               WS="*i64" if plan.packed_tail else "*i32", T="i32",
               n_tiles="i32", tiles_per_prog="i32", route_scale="fp32")  # fmt: skip
    aligned = ("X", "W_OUT", "ID_OUT", "POS_OUT", "HIST", "COUNTS", "OFFSETS", "WS")
    out = _compile(moe_route._moe_route_fwd, sig, dict(plan.constexprs), aligned)
    # registers per thread that let the launcher's programs per SM be resident at once (65536 per SM)
    out["register_budget"] = 65536 // (cfg.programs_per_sm * cfg.num_warps * 32)
    tail = "packed" if plan.packed_tail else "ticket"
    return dict(out, launcher_default=not config, relaxed_tail=cfg.relaxed_tail, tail=tail)


def top(n, k, dtype) -> dict:
    _, const = topk._plan(n, k, dtype, n, 4096, None)
    sig = dict(X=TYPES[dtype], stride_x="i32", V_OUT=TYPES[dtype], I_OUT="*i64", R="i32")
    return _compile(topk._topk_fwd, sig, dict(const), ("X", "V_OUT", "I_OUT"))


VARIANTS = {
    "route-qwen3-bf16": lambda: route(65536, 128, 8, torch.bfloat16),
    "route-mixtral-perm": lambda: route(16384, 8, 2, torch.bfloat16, perm=True),
    "route-qwen2-60": lambda: route(4096, 60, 4, torch.bfloat16),
    "route-deepseek-v3-fp32-groups": lambda: route(16384, 256, 8, torch.float32, "sigmoid", True, True, (8, 4)),
    "route-glm-bias": lambda: route(32768, 160, 8, torch.bfloat16, "sigmoid", True, True),
    "route-v2-lite-fp32": lambda: route(65536, 64, 6, torch.float32, renorm=False),
    "route-fp16-sigmoid": lambda: route(16384, 64, 4, torch.float16, "sigmoid", False),
    # biased and grouped rows of up to 128 experts: the packed tail in the 255-register kernels
    "route-bias-64": lambda: route(16384, 64, 8, torch.bfloat16, "sigmoid", True, True),
    "route-groups-128-fp32": lambda: route(16384, 128, 8, torch.float32, "sigmoid", True, True, (8, 4)),
    # forms the launcher picks only with another Triton version: they must still compile without spills
    "route-qwen3-prefetch": lambda: route(65536, 128, 8, torch.bfloat16, prefetch=True),
    "route-qwen3-broadcast-store": lambda: route(65536, 128, 8, torch.bfloat16, direct_store=False),
    "route-mixtral-release-tail": lambda: route(16384, 8, 2, torch.bfloat16, tail="ticket", relaxed_tail=False),
    # the ticket tail on rows of up to 128 experts: the launcher's form where the packed tail's fields overflow
    "route-qwen3-ticket-tail": lambda: route(65536, 128, 8, torch.bfloat16, tail="ticket"),
    "route-mixtral-perm-ticket-tail": lambda: route(16384, 8, 2, torch.bfloat16, perm=True, tail="ticket"),
    "topk-128-8-bf16": lambda: top(128, 8, torch.bfloat16),
    "topk-1000-5-fp32": lambda: top(1000, 5, torch.float32),
}


if __name__ == "__main__":
    report(VARIANTS)
