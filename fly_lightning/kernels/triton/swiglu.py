"""Triton SwiGLU / GeGLU forward, registered as the ``triton`` backend of ``swiglu``.

One pass over ``[BT rows, BI columns]`` blocks: gate and up are read once (straight from the fused gate/up
projection's halves, no split copies), ``act(gate) * up`` is computed in fp32 and rounded once. ATen runs it as two
kernels on strided views (the activation, then the product) and rounds twice. GELU (erf) uses ``tl.math.erf``; the
tanh approximation is written as ``x * sigmoid(2 z)``, which equals ``0.5 x (1 + tanh(z))`` exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._support import device_reason, on_device, rows_per_program
from fly_lightning.ops.swiglu import ACTIVATIONS, SWIGLU, split_gate_up

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACT = {name: code for code, name in enumerate(ACTIVATIONS)}  # the kernel's ACT constexpr (the op's order)


@triton.jit
def _swiglu_fwd(G, stride_g, U, stride_u, Y, S, N, BT: tl.constexpr, BI: tl.constexpr, ACT: tl.constexpr = 0):
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    ok = (r < S)[:, None] & (c < N)[None, :]
    r64 = r.to(tl.int64)[:, None]
    g = tl.load(G + r64 * stride_g + c[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if ACT == 1:  # exact GELU: 0.5 g (1 + erf(g / sqrt(2)))
        y = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:  # tanh GELU: 2 z = 2 sqrt(2 / pi) (g + 0.044715 g^3)
        y = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g))) * u
    else:
        y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + r64 * N + c[None, :], y.to(Y.dtype.element_ty), mask=ok)


def _supports(gate: torch.Tensor, up: torch.Tensor | None, activation: str = "silu") -> bool | str:
    if (reason := device_reason(gate, up)) is not None:
        return reason
    if gate.dtype not in _DTYPES:
        return f"dtype {gate.dtype}"
    g, u = split_gate_up(gate, up)
    if g.shape[1] > 1 and (g.stride(1) != 1 or u.stride(1) != 1):
        return "last dim not contiguous"
    return True


def _plan(i: int) -> tuple[int, int]:
    """(BT, BI): about 2048 outputs per program, 16-byte vectors along the row."""
    bi = min(next_pow2(i), 2048)
    return max(1, 2048 // bi), bi


_SWIGLU = FastLaunch(_swiglu_fwd)


@SWIGLU.implement(
    "triton",
    supports=_supports,
    constraints="gate/up fp32/bf16/fp16, two [S, I] tensors or one fused [S, 2I] (gate first), last dim "
    "contiguous, any row stride; SiLU, GELU (erf) or tanh GELU; fp32 math, one rounding",
)
def swiglu_triton(gate: torch.Tensor, up: torch.Tensor | None, activation: str = "silu") -> torch.Tensor:
    g, u = split_gate_up(gate, up)
    s, i = g.shape
    y = outputs.empty((s, i), dtype=g.dtype, device=g.device)  # the grid covers [S, I]
    if y.numel() == 0:
        return y
    bt, bi = _plan(i)
    bt = rows_per_program(s, bt, g)
    with on_device(g):
        _SWIGLU(
            (cdiv(s, bt), cdiv(i, bi)), (g, g.stride(0), u, u.stride(0), y, s, i), BT=bt, BI=bi, ACT=_ACT[activation],
            num_warps=4,
        )  # fmt: skip
    return y
