"""OCP MX formats: elements with one shared E8M0 scale per block of 32 values along the last dim (plain torch).

This is the reference (and the ATen path) for the MX operators: it is bit-exact with torchao's ``to_mx`` /
``MXTensor.to_mx`` for the same element format and scale mode, which the tests check on random, zero, subnormal,
huge, infinite and NaN blocks.

Formats: ``mxfp8_e4m3``, ``mxfp8_e5m2`` (one byte per element, ``torch.float8_*``) and ``mxfp4_e2m1`` (two elements
per byte, element ``2j`` in the low nibble, as ``torch.float4_e2m1fn_x2`` packs them). Scales: ``float8_e8m0fnu``
(a biased power of two, 127 = 2^0, 255 = NaN), shape ``[..., K / 32]``.

Scale modes (torchao's ``ScaleCalculationMode`` names):

- ``floor``: ``2^(floor(log2(amax)) - emax)``, emax the element format's largest power of two (OCP MX v1.0 6.3):
  the block's largest value may exceed the element range and then saturates.
- ``rceil``: ``2^ceil(log2(amax / max))``, max the element format's largest value (cuBLAS / Transformer Engine):
  nothing saturates. As in torchao, ``log2`` is taken in fp32, so a quotient a hair above a large power of two can
  round down to it (the hardware's ``cvt.rp`` rounds up there).

Special values, as torchao has them: a block holding a NaN gets the NaN scale (255) and decodes to NaN whatever its
elements hold (they are unspecified). An infinite value saturates: with ``floor`` the block's scale becomes
``2^(128 - emax)`` and the infinity the element format's largest value; with ``rceil`` the scale is 254 (2^127) and
the infinity the largest value. Either way it decodes to infinity again (the product passes fp32's range) and the
block's finite values to nearly zero. Finite values past the element range saturate to its largest
value with their sign. A block of zeros or subnormals gets the smallest scale (0, i.e. 2^-127); its elements are
then the values divided by 2^-126 (``floor``) or unscaled (``rceil``), torchao's choices for that scale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


class ScaleMode(str, enum.Enum):
    """How a block's shared scale is derived from its largest magnitude (torchao's ``ScaleCalculationMode``)."""

    FLOOR = "floor"
    RCEIL = "rceil"


@dataclass(frozen=True)
class MXFormat:
    """One MX element format."""

    name: str
    max: float  # the largest finite element value
    emax: int  # floor(log2(max)): the largest power of two
    bits: int  # bits per element
    torch_dtype: torch.dtype  # the element dtype torch and torchao name it by (fp4: the packed pair)

    @property
    def per_byte(self) -> int:
        return 8 // self.bits


MXFP8_E4M3 = MXFormat("mxfp8_e4m3", 448.0, 8, 8, torch.float8_e4m3fn)
MXFP8_E5M2 = MXFormat("mxfp8_e5m2", 57344.0, 15, 8, torch.float8_e5m2)
MXFP4_E2M1 = MXFormat("mxfp4_e2m1", 6.0, 2, 4, torch.float4_e2m1fn_x2)
FORMATS = {f.name: f for f in (MXFP8_E4M3, MXFP8_E5M2, MXFP4_E2M1)}

# e2m1 magnitudes by code 0..7, and the midpoints between neighbours (rounding boundaries)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_E2M1_VALUES, _E2M1_VALUES[1:], strict=False))


def as_format(fmt: MXFormat | str) -> MXFormat:
    if isinstance(fmt, MXFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):  # TypeError: an unhashable value
        raise ValueError(f"unknown MX format {fmt!r}; known: {sorted(FORMATS)}") from None


def op_format(op: str, fmt: str, name: str = "fmt") -> MXFormat:
    """The format an operator's ``name`` argument names: a format name (the custom ops' schemas take strings, and
    the kernels key their constants by name), or ``ValueError`` naming ``op``."""
    if not isinstance(fmt, str):
        raise ValueError(f"{op}: {name} must be a format name, one of {sorted(FORMATS)}; got {fmt!r}")
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"{op}: unknown MX format {fmt!r} for {name}; known: {sorted(FORMATS)}") from None


def data_dtype(fmt: MXFormat | str) -> torch.dtype:
    """The dtype MX element data has in the MX operators: the fp8 dtype, or ``uint8`` for fp4 (packed pairs)."""
    f = as_format(fmt)
    return f.torch_dtype if f.bits == 8 else torch.uint8


def check_operand(op: str, name: str, data: Tensor, scale: Tensor, fmt: str, dims: int) -> int:
    """Validate one MX operand of ``op``: ``dims``-D data ``[..., rows, K / per_byte]`` in ``data_dtype(fmt)`` with
    ``[..., rows, K / 32]`` E8M0 scales on its device, K % 32 == 0. Raises ``ValueError`` naming ``op``; returns K."""
    f = op_format(op, fmt, f"{name}_fmt")
    want = data_dtype(f)
    if not isinstance(data, Tensor) or data.dim() != dims or data.dtype != want:
        got = f"{getattr(data, 'dtype', type(data).__name__)} of {getattr(data, 'dim', lambda: '?')()} dims"
        raise ValueError(f"{op}: {name} must be a {dims}-D {want} tensor for {f.name}, got {got}")
    if not isinstance(scale, Tensor) or scale.dtype != torch.float8_e8m0fnu or scale.dim() != dims:
        raise ValueError(f"{op}: {name}_scale must be a {dims}-D float8_e8m0fnu tensor")
    k = data.shape[-1] * f.per_byte
    want_scale = (*data.shape[:-1], k // BLOCK)
    if k % BLOCK or tuple(scale.shape) != want_scale:
        raise ValueError(
            f"{op}: {name} {list(data.shape)} ({f.name}) needs K % {BLOCK} == 0 and scales {list(want_scale)}, "
            f"got K={k} and scales {list(scale.shape)}"
        )
    if scale.device != data.device:
        raise ValueError(f"{op}: {name} and its scales are on {data.device} and {scale.device}")
    return k


def as_mode(mode: ScaleMode | str | enum.Enum) -> ScaleMode:
    """A scale mode from ours, a string, or torchao's ``ScaleCalculationMode`` (by value)."""
    value = mode.value if isinstance(mode, enum.Enum) else mode
    try:
        return ScaleMode(str(value).lower())
    except ValueError:
        raise ValueError(f"unsupported MX scale mode {mode!r}; supported: floor, rceil") from None


def op_mode(op: str, mode: ScaleMode | str | enum.Enum) -> ScaleMode:
    """``as_mode`` for an operator's ``mode`` argument: the ``ValueError`` names ``op``."""
    try:
        return as_mode(mode)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None


def default_mode(*fmts: MXFormat | str | None) -> ScaleMode:
    """The quality default for casts to ``fmts`` (None entries: no cast): RCEIL when every format is MXFP8 (published
    MXFP8 training recipes: a block's largest value is never clipped), else FLOOR (the OCP MX rule, torchao's MXFP4
    default)."""
    return ScaleMode.RCEIL if all(as_format(f).bits == 8 for f in fmts if f is not None) else ScaleMode.FLOOR


KERNEL_PREFERENCES = ("auto", "emulated", "mx_gemm")
"""How MX training layers multiply (``FlyMXConfig.kernel_preference``): ``"mx_gemm"`` casts the operands to MX bytes
and scales and runs the MX GEMM ops (``mx_scaled_mm``, ``mx_grouped_mm``); ``"emulated"`` fake-quantises them
(``mx_fake_quantize``) and runs the plain GEMM on the MX values (torchao's emulated form); ``"auto"`` takes
``"mx_gemm"`` where a kernel would multiply the MX bytes themselves, else ``"emulated"``
(``ops.mx_scaled_mm.emulated_form``)."""


def as_kernel_preference(preference: str | enum.Enum) -> str:
    """One of ``KERNEL_PREFERENCES``, from a string or torchao's ``KernelPreference`` (``AUTO``, ``EMULATED``)."""
    value = preference.value if isinstance(preference, enum.Enum) else preference
    if value not in KERNEL_PREFERENCES:
        raise ValueError(f"kernel_preference must be one of {KERNEL_PREFERENCES}, got {preference!r}")
    return value


def _check(x: Tensor, fmt: MXFormat) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"to_mx: x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"to_mx: x must be float32 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"to_mx: the last dim must be a multiple of {BLOCK}, got shape {list(x.shape)}")


def block_scales(amax_f32: Tensor, fmt: MXFormat, mode: ScaleMode) -> tuple[Tensor, Tensor]:
    """``(biased E8M0 scale as uint8, fp32 multiplier that maps the block's values to elements)`` per block."""
    if mode is ScaleMode.FLOOR:
        # floor(log2(amax)) is the fp32 exponent field minus its bias (zero and subnormals: the field is 0)
        exponent = ((amax_f32.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
        unbiased = (exponent - fmt.emax).clamp(-E8M0_BIAS, E8M0_BIAS + 1)
        biased = torch.where(amax_f32.isnan(), E8M0_NAN, unbiased + E8M0_BIAS).to(torch.uint8)
        # 2^(biased - 127) from its bits (255 gives inf: NaN blocks decode to NaN); the smallest divisor is the
        # smallest normal fp32, 2^-126, not 2^-127 (torchao's choice: subnormal divisors misbehave in some backends)
        divisor = (biased.to(torch.int32) << 23).view(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)
        return biased, 1.0 / divisor
    descale = amax_f32 / fmt.max
    log2 = torch.ceil(torch.log2(descale)).clamp(-E8M0_BIAS, E8M0_BIAS)
    biased = torch.where(descale.isnan(), E8M0_NAN, torch.where(descale.isinf(), 254, log2 + E8M0_BIAS))
    biased = biased.to(torch.uint8)
    b = biased.to(torch.float32)
    multiplier = torch.where(
        biased == E8M0_NAN,
        descale,
        torch.where(biased == 254, 2.0**-127, torch.where(biased == 0, 1.0, torch.exp2(E8M0_BIAS - b))),
    )
    return biased, multiplier


def _encode_e2m1(v: Tensor) -> Tensor:
    """fp32 (already within +-6, or saturating) to e2m1 codes in uint8 (sign in bit 3), round to nearest even."""
    sign = (v.view(torch.int32) < 0).to(torch.uint8) << 3
    mag = v.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=v.device)
    down = torch.bucketize(mag, mids, right=False)  # a value on a midpoint goes to the lower code ...
    up = torch.bucketize(mag, mids, right=True)  # ... or the upper one: on a tie, take the even code
    code = torch.where((down != up) & (down % 2 == 1), up, down)
    code = torch.where(mag.isnan(), 7, code)  # NaN only in NaN-scale blocks, whose elements are unspecified
    return code.to(torch.uint8) | sign


def _decode_e2m1(codes: Tensor) -> Tensor:
    """From the bits (no table: a host-to-device copy per call would forbid CUDA-graph capture): exponent e and
    mantissa m give ``m / 2`` for e = 0, else ``2^(e - 1) * (1 + m / 2)`` (``_E2M1_VALUES``), exact in fp32."""
    e = ((codes >> 1) & 3).to(torch.float32)
    m = (codes & 1).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, torch.exp2(e - 1) * (1 + m * 0.5))
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_fp4(codes: Tensor) -> Tensor:
    """``[..., K]`` e2m1 codes to ``[..., K / 2]`` bytes, element ``2j`` in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """``[..., K / 2]`` bytes to ``[..., K]`` e2m1 codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def to_mx(x: Tensor, fmt: MXFormat | str, mode: ScaleMode | str = ScaleMode.FLOOR) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` ``[..., K]`` (fp32/bf16, K % 32 == 0) along its last dim: ``(data, scale)``.

    ``data``: ``[..., K]`` in ``fmt.torch_dtype`` (fp8), or ``[..., K / 2]`` uint8 (fp4, two per byte); ``scale``:
    ``[..., K / 32]`` ``float8_e8m0fnu``. torchao's ``to_mx`` returns the same two tensors, in the other order.
    """
    fmt, mode = as_format(fmt), as_mode(mode)
    _check(x, fmt)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).to(torch.float32)
    biased, multiplier = block_scales(amax, fmt, mode)
    scaled = (blocks.to(torch.float32) * multiplier).clamp(-fmt.max, fmt.max)  # clamp keeps NaN
    if fmt.bits == 8:
        data = scaled.to(fmt.torch_dtype).reshape(x.shape)
    else:
        data = pack_fp4(_encode_e2m1(scaled).reshape(x.shape))
    return data, biased.squeeze(-1).view(torch.float8_e8m0fnu)


def from_mx(data: Tensor, scale: Tensor, fmt: MXFormat | str, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantise: ``[..., K]`` in ``dtype``, each element times its block's scale (NaN scales give NaN blocks)."""
    fmt = as_format(fmt)
    if fmt.bits == 8:
        values = data.to(torch.float32)
    else:
        values = _decode_e2m1(unpack_fp4(data.view(torch.uint8)))
    k = values.shape[-1]
    if scale.shape[-1] * BLOCK != k:
        raise ValueError(f"from_mx: {scale.shape[-1]} scales for a last dim of {k} (one per {BLOCK})")
    biased = scale.view(torch.uint8).to(torch.int32)
    factor = torch.where(biased == E8M0_NAN, float("nan"), torch.exp2((biased - E8M0_BIAS).to(torch.float32)))
    blocks = values.reshape(*values.shape[:-1], k // BLOCK, BLOCK) * factor.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)
