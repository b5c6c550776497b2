"""Compile the routing kernel for AMD gfx950 on the CPU (no GPU) with the constexprs the launcher picks on ROCm, and
report each variant as JSON on stdout (run by ``test_moe_route_gfx950.py``, without the interpreter)."""

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fly_lightning.kernels.triton import moe_route

_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_route(n_experts, k, dtype, score, bias, groups):
    moe_route.ON_HIP = True  # as on a ROCm build of torch
    plan = moe_route._plan(4096, n_experts, k, dtype, n_experts, score, True, bias, *(groups or (None, None)), False,
                           torch.device("cpu"), None, False)  # fmt: skip
    const = dict(plan.constexprs)
    options = dict(num_warps=const.pop("num_warps"), num_stages=const.pop("num_stages"))
    runtime = dict(X=_PTR[dtype], stride_x="i32", BIAS="*fp32" if bias else _PTR[dtype], W_OUT="*fp32",
                   ID_OUT="*i32", POS_OUT="*i32", HIST="*i32", COUNTS="*i32", OFFSETS="*i32",
                   WS="*i64" if plan.packed_tail else "*i32", T="i32", n_tiles="i32", tiles_per_prog="i32",
                   route_scale="fp32")  # fmt: skip
    fn = moe_route._moe_route_fwd
    sig = {a: "constexpr" if a in const else runtime[a] for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("hip", "gfx950", 64), options=options)
    return dict(fast_sigmoid=const["FAST_SIGMOID"], hsaco=len(kernel.asm["hsaco"]))


VARIANTS = {
    "glm-4.5 biased sigmoid": (160, 8, torch.bfloat16, "sigmoid", True, None),
    "deepseek-v3 grouped sigmoid": (256, 8, torch.float32, "sigmoid", True, (8, 4)),
}

if __name__ == "__main__":
    results = {}
    for name, args in VARIANTS.items():
        try:
            results[name] = dict(ok=True, **compile_route(*args))
        except Exception as exc:  # reported, not raised: the test names the failing variant
            results[name] = dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[-300:]}")
    json.dump(results, sys.stdout)
