"""Frozen MX weights: ``FlyMXConfig(frozen=True)`` stores the selected weights in MX, with no high-precision copy.

For fine-tuning around weights that stay fixed (a large MoE model's experts, say): each weight becomes MX data and
E8M0 scales held as buffers (nothing for an optimizer, no ``requires_grad``) and the high-precision weight is
dropped, so it costs 1 + 1/32 bytes per parameter in MXFP8 and 1/2 + 1/32 in MXFP4 instead of 2 (bf16). For FSDP2,
which shards parameters only, ``frozen_as_parameters`` makes them parameters that need no gradient.

- ``FlyMXFrozenLinear`` replaces an ``nn.Linear``: forward through ``mx_scaled_mm`` (weight-only, or with activations
  cast by ``mx_cast``), the activation gradient through the dequantised weight (``grad_x = grad_y @ dequant(W)``,
  dequantised again in backward: nothing of weight size is saved for it); no weight gradient. The bias stays the
  Linear's own parameter (trainable if it was).
- ``FlyMXFrozenExperts`` replaces a ``FlyMoE`` block's expert container: ``projections()`` gives the grouped GEMMs'
  ``[E, K, N]`` operands dequantised (in the autocast dtype under autocast, else the block's activations' dtype), so
  the block's forward, its reference and its probes are unchanged. While the block runs, saved-tensor hooks store
  those operands as a reference to the MX buffers and dequantise them again in backward, so the block does not keep
  a dequantised copy of its experts alive between forward and backward (off under ``torch.compile`` and when outer
  saved-tensor hooks, such as activation checkpointing's, are active: they must see every saved tensor).

Storage: buffers are ``uint8`` (fp8 element bytes; fp4 packed two per byte, element ``2j`` in the low nibble; scales
the biased E8M0 exponent, 127 = 2^0), not ``float8_*`` dtypes, because ``Module.to(dtype)`` would convert floating
buffers (fp8 included) to the new dtype. A weight ``[N, K]`` (a projection ``[E, K, N]`` as ``[E, N, K]``) is stored
row-wise with blocks of 32 along K: data ``[..., N, K / per_byte]``, scales ``[..., N, K / 32]``. The state dict
holds those buffers and ``_extra_state`` metadata (format, scale mode, block size, version, shape), checked on load.

Dtypes: MX weights have no floating dtype of their own, so both layers compute in the autocast dtype under autocast,
else in their activations' dtype (as bitsandbytes' 4-bit layers do). That is what FSDP2's ``MixedPrecisionPolicy``
needs: it casts inputs and floating weights to ``param_dtype``, never these bytes (an FSDP2 that did: ``_as_bytes``).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from fly_lightning.modules._state import carry_module_state
from fly_lightning.modules.moe import FlyMoE
from fly_lightning.ops.mx_cast import mx_cast
from fly_lightning.ops.mx_dequantize import mx_dequantize
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm
from fly_lightning.quant import formats
from fly_lightning.quant.linear import COMPUTE, MXSpec, check_features, linear_dtypes

VERSION = 1  # of the stored layout and metadata (state dicts and MX checkpoints)


def quantize_rows(w: Tensor, fmt: str, mode: str) -> tuple[Tensor, Tensor]:
    """``w`` ``[..., K]`` cast to MX along its last dim: ``(data, scale)`` as ``uint8`` (see the module docstring)."""
    x = w.detach()
    if x.dtype not in COMPUTE:
        x = x.float()  # fp16 is exact in fp32
    data, scale = mx_cast(x.reshape(-1, x.shape[-1]).contiguous(), fmt, mode)
    f = formats.as_format(fmt)
    return (
        data.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // f.per_byte),
        scale.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // formats.BLOCK),
    )


def typed(data: Tensor, scale: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``uint8`` buffers viewed as the MX operators' dtypes (fp8 elements, ``float8_e8m0fnu`` scales; fp4 stays
    packed ``uint8``)."""
    want = formats.data_dtype(fmt)
    return (data if data.dtype == want else data.view(want)), scale.view(torch.float8_e8m0fnu)


def dequantize_rows(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """The values ``quantize_rows`` stored, ``[..., K]`` in ``dtype`` (exact in fp32, and in bf16 but for values
    under bf16's smallest subnormal), through the dispatched ``mx_dequantize``."""
    return mx_dequantize(data, scale, fmt, dtype)


def _operand_dtype(device: torch.device, want: torch.dtype) -> torch.dtype:
    """The dtype of dequantised expert weights: the autocast dtype under autocast (as ``F.linear``), else ``want``
    (the block's activations' dtype, fp16 too: its grouped GEMMs take one dtype for rows and weights)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else want


_HOLDS_BYTES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _as_bytes(t: Tensor) -> Tensor:
    """A stored MX tensor as its ``uint8`` bytes. An FSDP2 lacking the clamp that 2.12+ has in ``init_dtype_attrs``
    casts every parameter it gathers to ``MixedPrecisionPolicy(param_dtype=...)``, integer ones included (2.11 has no
    clamp, but its ``fully_shard`` refuses integer parameters anyway: ``fsdp2_shards_integer_parameters``). Bytes
    0-255 are exact in any float dtype with 8 significant bits (bf16, fp16, fp32), so they convert back exactly, at
    the cost of that pass and of gathering 2 bytes per byte. A dtype that rounds them is refused."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype not in _HOLDS_BYTES:
        raise TypeError(
            f"frozen MX weights reached the forward as {t.dtype}, which cannot hold their bytes exactly (a "
            "mixed-precision policy cast them?); keep them uint8: shard them with no param_dtype"
        )
    warnings.warn(
        f"frozen MX weights reached the forward as {t.dtype} (a MixedPrecisionPolicy cast integer parameters); "
        "converted back to their bytes exactly, at the cost of one pass and twice the gathered bytes",
        stacklevel=3,
    )
    return t.to(torch.uint8)


def _metadata(fmt: str, mode: str, shape: list[int], **extra: object) -> dict:
    return {"format": fmt, "mode": mode, "block_size": formats.BLOCK, "version": VERSION, "shape": shape, **extra}


def _check_metadata(owner: str, mine: dict, state: object) -> None:
    """Loading a state dict: its metadata must describe the same stored layout (else a ValueError naming both)."""
    if not isinstance(state, dict):
        raise ValueError(f"{owner}: expected MX metadata (a dict) in the state dict, got {type(state).__name__}")
    if state.get("version") != VERSION:
        raise ValueError(f"{owner}: MX state of version {state.get('version')!r}; this code reads version {VERSION}")
    for key in ("format", "mode", "block_size", "shape"):
        if state.get(key) != mine[key]:
            raise ValueError(
                f"{owner}: the state dict holds {key}={state.get(key)!r}, this module {key}={mine[key]!r}; "
                "convert the model with the config the state was saved from"
            )


class _FrozenMXFunction(torch.autograd.Function):
    @staticmethod
    def forward(x_MK: Tensor, data_NK: Tensor, scale_NK: Tensor, spec: MXSpec) -> Tensor:
        b, b_scale = typed(data_NK, scale_NK, spec.weight)
        if spec.activation is None:
            return mx_scaled_mm(x_MK, b, b_scale, spec.weight, out_dtype=x_MK.dtype)
        a, a_scale = mx_cast(x_MK, spec.activation, spec.mode)
        return mx_scaled_mm(a, b, b_scale, spec.weight, a_scale=a_scale, a_fmt=spec.activation, out_dtype=x_MK.dtype)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # apart from forward: torch.func.grad needs it
        ctx.save_for_backward(inputs[1], inputs[2])  # the MX bytes, not a dequantised weight
        ctx.spec = inputs[3]

    @staticmethod
    def backward(ctx, grad_MN: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        data, scale = ctx.saved_tensors
        w_NK = dequantize_rows(data, scale, ctx.spec.weight, grad_MN.dtype)  # straight through the activation cast
        return grad_MN @ w_NK, None, None, None


class FlyMXFrozenLinear(nn.Module):
    """A frozen ``nn.Linear`` stored in MX (see the module docstring); ``in_features % 32 == 0``.

    Buffers ``weight_data`` / ``weight_scale`` (``uint8``), the ``bias`` parameter (or None); ``dtype`` is the
    original weight's (``dequantized_weight``'s default; ``module.to(dtype)`` changes it). It computes in its
    input's dtype (the autocast dtype under autocast).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        spec: MXSpec | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        spec = spec or MXSpec()
        if in_features % formats.BLOCK:
            raise ValueError(f"FlyMXFrozenLinear: in_features must be a multiple of 32 (MX blocks), got {in_features}")
        f = formats.as_format(spec.weight)
        if spec.activation is not None:
            formats.as_format(spec.activation)
        spec = MXSpec(spec.weight, spec.activation, formats.as_mode(spec.mode).value)
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("weight_data", torch.zeros(out_features, in_features // f.per_byte, **u8))
        self.register_buffer("weight_scale", torch.full((out_features, in_features // formats.BLOCK), 127, **u8))
        # an empty floating buffer: Module.to(dtype) converts it, so it tracks the model's dtype (not saved)
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=device), persistent=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: MXSpec) -> FlyMXFrozenLinear:
        """Quantise ``linear.weight`` (the new module keeps no reference to it) and share ``linear.bias``."""
        new = cls(linear.in_features, linear.out_features, False, spec=spec, device=linear.weight.device,
                  dtype=linear.weight.dtype)  # fmt: skip
        data, scale = quantize_rows(linear.weight, spec.weight, new.spec.mode)
        new.weight_data, new.weight_scale = data, scale
        new.bias = linear.bias
        return carry_module_state(new, linear)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype.dtype

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight the module multiplies by, ``[out, in]`` (a new tensor)."""
        data, scale = _as_bytes(self.weight_data), _as_bytes(self.weight_scale)
        return dequantize_rows(data, scale, self.spec.weight, dtype or self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        check_features(self, x)
        # the input's dtype outside autocast (MX weights have none of their own; FSDP2's MixedPrecisionPolicy casts
        # inputs and floating weights, never these bytes)
        dtype, out = linear_dtypes(x, x.dtype if x.is_floating_point() else self.dtype)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, self.in_features).to(dtype)
            y = _FrozenMXFunction.apply(x2, _as_bytes(self.weight_data), _as_bytes(self.weight_scale), self.spec)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out).reshape(*x.shape[:-1], self.out_features)

    def get_extra_state(self) -> dict:
        return _metadata(self.spec.weight, self.spec.mode, [self.out_features, self.in_features],
                         activation=self.spec.activation)  # fmt: skip

    def set_extra_state(self, state: object) -> None:
        _check_metadata(type(self).__name__, self.get_extra_state(), state)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.spec.weight} (frozen), activation={self.spec.activation}, mode={self.spec.mode}"
        )


class FlyMXFrozenExperts(nn.Module):
    """A ``FlyMoE`` block's experts stored in MX (see the module docstring), in place of its expert container.

    Projections: ``gate_up`` (``[E, H, 2I]``, gate columns first) or ``gate`` and ``up`` (``[E, H, I]`` each), and
    ``down`` (``[E, I, H]``); each stored as ``{name}_data`` / ``{name}_scale`` over its ``[E, N, K]`` transpose.
    """

    def __init__(self, projections: dict[str, Tensor], spec: MXSpec) -> None:
        super().__init__()
        mode = formats.as_mode(spec.mode).value
        self.spec = MXSpec(spec.weight, spec.activation, mode)
        self.names = tuple(projections)
        self.shapes = {}  # name -> [E, N, K]: the stored rows' logical shape
        dtype = None
        for name, w_EKN in projections.items():
            rows = w_EKN.detach().transpose(1, 2)  # blocks run along K, the contraction dim
            data, scale = quantize_rows(rows, spec.weight, mode)
            self.register_buffer(f"{name}_data", data)
            self.register_buffer(f"{name}_scale", scale)
            self.shapes[name] = list(rows.shape)
            dtype, device = w_EKN.dtype, w_EKN.device
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=device), persistent=False)
        self._live: dict[tuple, tuple[str, Tensor]] = {}  # dequantised operands of the running forward
        self._hooks: list = []  # entered saved-tensor hook contexts (a block may run more than once per step)

    @classmethod
    def from_moe(cls, moe: FlyMoE, spec: MXSpec) -> FlyMXFrozenExperts:
        gate_up, up, down = moe.experts.projections()
        names = ("gate_up", "down") if up is None else ("gate", "up", "down")
        ws = (gate_up, down) if up is None else (gate_up, up, down)
        return cls(dict(zip(names, ws, strict=True)), spec)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype.dtype

    def operand(self, name: str, dtype: torch.dtype) -> Tensor:
        """Projection ``name`` dequantised: ``[E, K, N]`` in ``dtype`` (the transpose of a contiguous ``[E, N, K]``)."""
        data, scale = _as_bytes(getattr(self, f"{name}_data")), _as_bytes(getattr(self, f"{name}_scale"))
        return dequantize_rows(data, scale, self.spec.weight, dtype).transpose(1, 2)

    follows_activations = True  # no floating weights: the block asks for its operands in its activations' dtype

    def projections(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """The grouped GEMMs' operands, as every expert container gives them: ``(gate_up or gate, up or None,
        down)``, dequantised (no gradient), in the autocast dtype under autocast, else ``dtype`` (``FlyMoE`` passes
        its activations'), else the original weights'."""
        device = getattr(self, f"{self.names[0]}_data").device  # a saved buffer: _dtype stays put on a meta load
        want = _operand_dtype(device, dtype or self.dtype)
        ws = {name: self.operand(name, want) for name in self.names}
        if self._hooks and torch.is_grad_enabled():
            for name, w in ws.items():  # the pack hook recognises them by storage, shape and strides
                self._live[_key(w)] = (name, w)
        gate_up = ws.get("gate_up", ws.get("gate"))
        return gate_up, ws.get("up"), ws["down"]

    # saved-tensor hooks, entered and left by forward hooks on the block (``install_saved_tensor_hooks``)
    def _pack(self, t: Tensor) -> object:
        # plain tensors only: the operands are; subclasses (DTensor activations, say) may have no data pointer
        hit = self._live.get(_key(t)) if self._live and type(t) is Tensor and not t.requires_grad else None
        return ("fly_mx_frozen", hit[0], t.dtype) if hit is not None and hit[1].dtype == t.dtype else t

    def _unpack(self, packed: object) -> Tensor:
        if isinstance(packed, tuple) and packed and packed[0] == "fly_mx_frozen":
            return self.operand(packed[1], packed[2])
        return packed

    def _enter(self) -> None:
        if torch.compiler.is_compiling() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self._hooks.append(None)  # not ours to intercept: everything is saved as usual
            return
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._hooks.append(ctx)

    def _exit(self) -> None:
        if not self._hooks:
            return
        ctx = self._hooks.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if not self._hooks:
            self._live.clear()

    def get_extra_state(self) -> dict:
        return _metadata(self.spec.weight, self.spec.mode, {n: self.shapes[n] for n in self.names},
                         activation=self.spec.activation, projections=list(self.names))  # fmt: skip

    def set_extra_state(self, state: object) -> None:
        _check_metadata(type(self).__name__, self.get_extra_state(), state)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={self.shapes[n]}" for n in self.names)
        return f"{shapes}, weight={self.spec.weight} (frozen), mode={self.spec.mode}"


def _mx_names(m: nn.Module) -> tuple[str, ...]:
    """A frozen layer's MX tensors (data and scales), by attribute name; () for any other module."""
    if isinstance(m, FlyMXFrozenLinear):
        return ("weight_data", "weight_scale")
    if isinstance(m, FlyMXFrozenExperts):
        return tuple(f"{n}_{part}" for n in m.names for part in ("data", "scale"))
    return ()


def frozen_buffer_names(model: nn.Module) -> list[str]:
    """The qualified names of the frozen layers' MX buffers in ``model`` (constants: no per-step synchronisation)."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, m in model.named_modules()
        for name in _mx_names(m)
        if name in m._buffers
    ]


def fsdp2_shards_integer_parameters() -> bool:
    """Whether this torch's ``fully_shard`` takes parameters of integer dtypes: from 2.12 (its sharded parameters keep
    ``requires_grad=False``, and mixed precision leaves integer ones uncast; the gloo tests ran on 2.12 and 2.13).
    2.11 refuses them: it makes each sharded parameter require grad before setting the flag ("only Tensors of
    floating point dtype can require gradients", seen on the GPU image's 2.11)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)


def frozen_as_parameters(model: nn.Module) -> list[str]:
    """Turn the frozen MX weights of ``model`` from buffers into parameters that need no gradient, in place, and
    return their qualified names: FSDP2's ``fully_shard`` shards parameters and leaves buffers whole on every rank.
    ``flydsl_fsdp2`` and ``flydsl_model_parallel`` do this to the modules they quantize; call it before your own
    ``fully_shard`` (modules already sharded keep their buffers, and are not named). The tensors stay ``uint8``, so
    setting ``requires_grad`` on them raises (as ``LightningModule.unfreeze`` or ``BaseFinetuning`` would): PyTorch
    gives gradients to floating dtypes only. Where ``fully_shard`` cannot take integer parameters
    (``fsdp2_shards_integer_parameters``), nothing changes, with a warning: the buffers stay whole on every rank."""
    from torch.distributed.fsdp import FSDPModule

    if not fsdp2_shards_integer_parameters():
        if any(_mx_names(m) for m in model.modules()):
            warnings.warn(
                f"torch {torch.__version__}: FSDP2 cannot shard integer parameters (torch 2.12 can), so frozen MX "
                "weights stay buffers, whole on every rank",
                stacklevel=2,
            )
        return []
    names, sharded = [], []  # modules fully_shard already holds: their parameter set is fixed, buffers stay
    for prefix, m in model.named_modules():
        if isinstance(m, FSDPModule):
            sharded.append(prefix)
        for name in _mx_names(m):
            if name in m._buffers and not any(prefix == s or prefix.startswith(f"{s}.") or not s for s in sharded):
                m.register_parameter(name, nn.Parameter(m._buffers.pop(name), requires_grad=False))
            if name in m._parameters:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _key(t: Tensor) -> tuple:
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _enter_block(moe: nn.Module, args: object) -> None:
    experts = getattr(moe, "experts", None)
    if isinstance(experts, FlyMXFrozenExperts):
        experts._enter()


def _exit_block(moe: nn.Module, args: object, output: object) -> None:
    experts = getattr(moe, "experts", None)
    if isinstance(experts, FlyMXFrozenExperts):
        experts._exit()


def install_saved_tensor_hooks(moe: FlyMoE) -> None:
    """Forward hooks on the block that enter and leave its frozen experts' saved-tensor hooks (once per block; the
    exit hook runs even when the forward raises)."""
    if getattr(moe, "_fly_mx_saved_hooks", False):
        return
    moe.register_forward_pre_hook(_enter_block)
    moe.register_forward_hook(_exit_block, always_call=True)
    moe._fly_mx_saved_hooks = True
