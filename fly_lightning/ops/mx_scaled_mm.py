"""MX scaled GEMM: ``y[M, N] = dequant(a)[M, K] @ dequant(b)[N, K]^T`` with E8M0 scales per 32 values along K.

``a`` is either MX (``a_fmt`` names its format, ``a_scale`` its scales) or high precision (``a_fmt=None``: bf16 or
fp32 activations times MX weights, "weight-only"); ``b`` is always MX, laid out as a ``Linear`` weight ``[N, K]``
(its blocks along K, so ``mx_cast(weight)`` row-wise gives it). Formats: ``mxfp8_e4m3``, ``mxfp8_e5m2``,
``mxfp4_e2m1`` (two elements per byte along K). Forward only, as the other forward operators; no autograd here.

The reference dequantises to fp32 and multiplies in fp32 (the oracle); the ATen path is torchao's emulated one:
dequantise to bf16, then a bf16 GEMM. Kernels for Hopper and gfx950 register as further backends.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.backends import BACKENDS
from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import TracedOrDirect
from fly_lightning.policy import get_dispatch_config
from fly_lightning.quant import formats
from fly_lightning.registry import tensor_key

_OUT = (torch.bfloat16, torch.float16, torch.float32)
NATIVE_BACKENDS = ("flydsl",)
"""Backends whose kernels multiply MX operands on MX tensor cores (FlyDSL's ``v_mfma_scale_f32_*`` on gfx950). Every
other backend converts first (Hopper has no MX tensor cores): to bf16 for a bf16 GEMM, or, Triton's dense plan from
128 rows, to e4m3 with 1x128 scales for cuBLAS's blockwise fp8 GEMM."""
NATIVE_K_MULTIPLE, NATIVE_N_MULTIPLE, NATIVE_MAX_GROUPS, NATIVE_MAX_BYTES = 128, 4, 1024, 2**31
"""The native kernels' boundaries (the FlyDSL MX GEMMs' constraints: K % 128, N % 4, grouped E <= 1024, each tensor
under 2 GiB; MX x MX only)."""
DEQUANT_BACKEND, DEQUANT_K_MULTIPLE = "triton", 128
"""The dequantising MX GEMM backend (Triton: CUDA sm90+, K % 128, MX or bf16 activations) and its K granularity:
fp32 models take the MX GEMM form there (see ``emulated_form``)."""


def _validate(
    a: Tensor, a_scale: Tensor | None, a_fmt: str | None, b: Tensor, b_scale: Tensor, b_fmt: str, out_dtype: torch.dtype
) -> None:
    kb = formats.check_operand("mx_scaled_mm", "b", b, b_scale, b_fmt, 2)
    if a_fmt is None:
        if not isinstance(a, Tensor) or a.dim() != 2 or a.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("mx_scaled_mm: a high-precision a must be a 2-D bf16/fp32 tensor")
        if a_scale is not None:
            raise ValueError("mx_scaled_mm: a_scale given without a_fmt")
        ka = a.shape[1]
    else:
        if a_scale is None:
            raise ValueError("mx_scaled_mm: an MX a needs a_scale")
        ka = formats.check_operand("mx_scaled_mm", "a", a, a_scale, a_fmt, 2)
    if ka != kb:
        raise ValueError(f"mx_scaled_mm: a has K={ka}, b has K={kb}")
    if a.device != b.device:
        raise ValueError(f"mx_scaled_mm: a on {a.device}, b on {b.device}")
    if out_dtype not in _OUT:
        raise ValueError(f"mx_scaled_mm: out_dtype must be one of {_OUT}, got {out_dtype}")


def _operands(a, a_scale, a_fmt, b, b_scale, b_fmt, dtype) -> tuple[Tensor, Tensor]:
    da = a.to(dtype) if a_fmt is None else formats.from_mx(a, a_scale, a_fmt, dtype)
    return da, formats.from_mx(b, b_scale, b_fmt, dtype)


def mx_scaled_mm_reference(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> Tensor:
    """The oracle: both operands dequantised to fp32, an fp32 GEMM, one rounding to ``out_dtype``."""
    da, db = _operands(a, a_scale, a_fmt, b, b_scale, b_fmt, torch.float32)
    return (da @ db.t()).to(out_dtype)


def _mx_scaled_mm_aten(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> Tensor:
    """torchao's emulated path: dequantise to bf16, a bf16 GEMM (fp32 GEMM on CPU, where bf16 matmul is slow)."""
    dtype = torch.bfloat16 if a.is_cuda else torch.float32
    da, db = _operands(a, a_scale, a_fmt, b, b_scale, b_fmt, dtype)
    if dtype == torch.bfloat16 and out_dtype != torch.bfloat16:  # fp32 sums rounded once, not through bf16
        return torch.mm(da, db.t(), out_dtype=torch.float32).to(out_dtype)
    return torch.mm(da, db.t()).to(out_dtype)


def _signature(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> tuple:
    keys = tuple(tensor_key(t) for t in (a, a_scale, b, b_scale))
    return (*keys, a_fmt, b_fmt, out_dtype)


MX_SCALED_MM = register_op(
    "mx_scaled_mm",
    reference=mx_scaled_mm_reference,
    aten=_mx_scaled_mm_aten,
    signature=_signature,
    validate=_validate,
    doc="MX GEMM a @ b^T: (a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> y [M, N]",
)


@torch.library.custom_op("fly::mx_scaled_mm", mutates_args=())
def mx_scaled_mm_op(
    a: Tensor,
    a_scale: Tensor | None,
    a_fmt: str | None,
    b: Tensor,
    b_scale: Tensor,
    b_fmt: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """Dispatched MX GEMM."""
    return MX_SCALED_MM(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)


@mx_scaled_mm_op.register_fake
def _(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> Tensor:
    _validate(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# the custom op where something traces or a tensor subclass is given; eager calls skip its wrapper's host cost
_mx_scaled_mm_call = TracedOrDirect(mx_scaled_mm_op, MX_SCALED_MM, forward_only="mx_scaled_mm")


def mx_scaled_mm(
    a: Tensor,
    b: Tensor,
    b_scale: Tensor,
    b_fmt: str,
    *,
    a_scale: Tensor | None = None,
    a_fmt: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``a @ dequant(b).T`` for MX ``b`` ``[N, K]`` (``mx_cast(weight)``); ``a`` is MX when ``a_fmt`` is given
    (``a_scale`` its scales), else bf16/fp32 ``[M, K]``. Returns ``[M, N]`` in ``out_dtype``."""
    return _mx_scaled_mm_call(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)


@torch.compiler.assume_constant_result  # read once when traced, no guard: a policy change on ROCm needs a recompile
def native_backend(op: str, device: torch.device) -> str | None:
    """The first of ``op``'s candidate backends (the active dispatch policy's; ``op`` an MX GEMM: ``mx_scaled_mm``,
    ``mx_grouped_mm``) that multiplies MX operands natively (``NATIVE_BACKENDS``) and is available on ``device``'s
    platform, or None: then every backend dequantises to bf16 first."""
    if device.type != "cuda" or torch.version.hip is None:  # CPU and NVIDIA: none today
        return None
    for name in get_dispatch_config().candidates(op):
        if name in NATIVE_BACKENDS and BACKENDS[name].is_available():
            return name
    return None


@torch.compiler.assume_constant_result  # as native_backend
def dequant_backend(op: str, device: torch.device) -> bool:
    """Whether ``DEQUANT_BACKEND`` (Triton, which converts MX to bf16 for bf16 MMAs) is one of ``op``'s candidates,
    available and on its hardware for ``device`` (NVIDIA sm90+)."""
    if device.type != "cuda" or torch.version.hip is not None or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return DEQUANT_BACKEND in get_dispatch_config().candidates(op) and BACKENDS[DEQUANT_BACKEND].is_available()


def emulated_form(
    preference: str,
    op: str,
    device: torch.device,
    weight_only: bool,
    k: int | None = None,
    n: int | None = None,
    *,
    bf16: bool = True,
    groups: int | None = None,
    weight_bytes: int | None = None,
    dtensor: bool = False,
) -> bool:
    """Whether an MX training layer fake-quantises and runs the plain GEMM (True) rather than casting to MX and
    running the MX GEMM ``op`` (False), for ``formats.KERNEL_PREFERENCES`` value ``preference``: ``k``-wide
    activations (``bf16`` or not) to ``n`` outputs, ``groups`` experts whose MX weights take ``weight_bytes`` (None:
    unknown); ``dtensor``: an operand is a DTensor (the MX ops have no sharding rule: emulated).

    ``"auto"``: a native backend within its boundaries (``NATIVE_*``: MX x MX) takes the MX GEMM. Without one the MX
    GEMMs convert first (Triton's prepass from 128 rows, ATen's fallback) or in their main loop, and the ``mx_linear``
    suite (event-timed ``FlyMXLinear``) measured the emulated form faster for bf16: on the H100 with Triton's fp8
    prepass (cadc36d), forward 1.22x MXFP8 / 1.24x MXFP4 from 128 rows (geomeans; 0.77-0.89x on the two largest
    shapes), 1.37x / 1.23x below, forward+backward 1.14x / 1.17x and 1.09x / 1.09x (again at 37d9692: 1.23x / 1.17x,
    1.10x / 1.20x; 1.14x / 1.17x, 1.01x / 1.13x); on the H200 with the bf16 prepass (2984bba), 1.22x / 1.27x forward
    from 128 rows. fp32 models take the MX GEMM form where Triton takes it (the emulated form's fp32 passes cost 0.83x
    there, H100)."""
    if preference != "auto":
        return preference == "emulated"
    if dtensor:
        return True
    if native_backend(op, device) is not None:
        off_bounds = (
            (k is not None and k % NATIVE_K_MULTIPLE != 0)
            or (n is not None and n % NATIVE_N_MULTIPLE != 0)
            or (groups is not None and groups > NATIVE_MAX_GROUPS)
            or (weight_bytes is not None and weight_bytes >= NATIVE_MAX_BYTES)
        )
        return weight_only or off_bounds
    if bf16:
        return True
    takes = not weight_only and k is not None and k % DEQUANT_K_MULTIPLE == 0
    return not (takes and dequant_backend(op, device))
