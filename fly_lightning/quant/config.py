"""The torchao configuration: ``quantize_(model, FlyMXConfig(...), filter_fn=...)`` (or ``Fly*Strategy(quantization=
FlyMXConfig(...))``) swaps each selected ``nn.Linear`` for ``FlyMXLinear`` and gives each selected ``FlyMoE`` block
MX expert numerics (``FlyMoE.mx``). Both multiply MX values through the dispatched MX operators, in the form
``kernel_preference`` picks: ``mx_fake_quantize`` then the plain GEMMs (emulated), or ``mx_cast`` then
``mx_scaled_mm`` / ``mx_grouped_mm`` (MX GEMM); the dispatch log, support matrix and callbacks cover them.
``mx_filter`` selects both, leaving the output head and routers in high precision.

``FlyMXConfig(frozen=True)`` stores the selected weights in MX instead, with no high-precision master and no weight
gradient (``quant.frozen``): Linears become ``FlyMXFrozenLinear``, a block's expert container ``FlyMXFrozenExperts``.
To freeze only the experts: ``filter_fn=lambda m, fqn: isinstance(m, FlyMoE)``.

Left as they are, with a warning naming them: a Linear whose ``in_features`` is not a multiple of 32 (MX blocks);
a parametrized Linear (``torch.nn.utils.parametrize``: its weight is computed, its trainable tensors would be lost);
``nn.MultiheadAttention``'s ``out_proj`` (attention reads its weight directly, never calls it); a layer torchao
already quantized; an MX layer (frozen) whose stored format differs from a new config's. A training ``FlyMXLinear``
takes a new config's numerics (its master weight is there). A selected ``FlyMoE`` block's shared experts are
converted with it, with ``mx_filter``'s rules: ``quantize_`` does not visit a selected module's children.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from fly_lightning.modules.moe import FlyMoE, MXExperts
from fly_lightning.quant import formats
from fly_lightning.quant.frozen import FlyMXFrozenExperts, FlyMXFrozenLinear, install_saved_tensor_hooks
from fly_lightning.quant.linear import FlyMXLinear, MXSpec


@dataclass
class FlyMXConfig(AOBaseConfig):
    """MX forward GEMMs for ``nn.Linear``.

    The handler replaces modules (a Linear becomes a ``FlyMXLinear``): ``quantize_`` a model holding the Linears,
    not a bare Linear, whose replacement torchao cannot hand back.

    Args:
        weight: the weights' MX format: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"``.
        activation: the activations' format, or None for weight-only (bf16/fp32 activations times MX weights).
        mode: scale mode, ``"floor"`` or ``"rceil"`` (torchao's ``ScaleCalculationMode`` values). None (default):
            ``formats.default_mode`` of the formats (``"rceil"`` when every format is MXFP8, else ``"floor"``),
            resolved in ``spec``, so that ``dataclasses.replace`` with other formats takes their default.
        frozen: store the weights in MX (data and scales as buffers; parameters without gradients under the FSDP2
            strategies, which shard them), drop the high-precision weights, no weight gradient
            (``fly_lightning.quant.frozen``); False: training, cast from the master every forward.
        kernel_preference: how training layers multiply (``formats.KERNEL_PREFERENCES``): ``"auto"`` (default;
            the MX GEMM ops where a kernel multiplies the MX bytes themselves, else ``"emulated"``), ``"emulated"``
            (fake-quantised operands and the plain GEMM: the same products) or ``"mx_gemm"``; torchao's
            ``KernelPreference.AUTO`` / ``.EMULATED`` are taken too. Frozen weights ignore it: Linears run
            ``mx_scaled_mm``, experts the bf16 grouped GEMMs on their dequantised weights.
    """

    weight: str = "mxfp8_e4m3"
    activation: str | None = "mxfp8_e4m3"
    mode: str | None = None
    frozen: bool = False
    kernel_preference: str = "auto"

    def __post_init__(self) -> None:
        formats.as_format(self.weight)
        if self.activation is not None:
            formats.as_format(self.activation)
        if self.mode is not None:
            self.mode = formats.as_mode(self.mode).value
        self.kernel_preference = formats.as_kernel_preference(self.kernel_preference)

    @property
    def spec(self) -> MXSpec:
        """The layers' numerics: the formats, the scale mode (the formats' default when ``mode`` is None), the form."""
        return MXSpec(self.weight, self.activation, self.mode, self.kernel_preference)


def torchao_quantized(module: nn.Module) -> str | None:
    """What torchao converted ``module`` to (its module class, or its weight's tensor subclass, e.g. ``MXTensor`` from
    ``MXDynamicActivationMXWeightConfig``), or None: such a layer already has its own quantized GEMM, and casting its
    weight again would quantize twice."""
    if type(module).__module__.startswith("torchao."):
        return type(module).__name__
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and type(weight).__module__.startswith("torchao."):
        return type(weight).__name__
    return None


_HEADS = ("lm_head", "output", "embed_out", "score")
"""Output heads by name: transformers' ``lm_head``, torchtitan's ``output``, GPT-NeoX's ``embed_out``, sequence
classification's ``score``."""
_ROUTERS = ("gate", "router", "shared_expert_gate")
"""Routers by name, the Linear itself or a module holding it (DBRX / Granite-MoE ``router.layer``, Switch
``router.classifier``)."""


def mx_filter(module: nn.Module, fqn: str) -> bool:
    """``quantize_``'s ``filter_fn`` for ``FlyMXConfig``: every ``nn.Linear`` and swapped MoE block, except output
    heads (``_HEADS``) and routers (``_ROUTERS``, or any Linear under one), which published MX recipes keep in high
    precision, and ``nn.MultiheadAttention``'s ``out_proj`` (never called: see the module docstring). The strategies
    also keep a model's ``get_output_embeddings()`` whatever its name."""
    if not isinstance(module, (nn.Linear, FlyMoE, FlyMXFrozenLinear)) or isinstance(module, _NEVER_CALLED):
        return False  # frozen MX Linears: selected so that a new config's different format is reported
    parts = fqn.split(".")
    return parts[-1] not in _HEADS and not any(p in _ROUTERS for p in parts)


_NEVER_CALLED = (nn.modules.linear.NonDynamicallyQuantizableLinear,)
"""Linears whose owner reads the weight without calling them (``nn.MultiheadAttention.out_proj``): an MX forward
would never run there, and a frozen one would take away the weight the owner reads."""


LEFT_ATTR = "_fly_quantize_left"
"""Set on a module the handler left unconverted, to why: the strategies report it (``transform_summary.left``)."""


def _left(module: nn.Module, why: str, left: str = "left as it is") -> nn.Module:
    setattr(module, LEFT_ATTR, why)
    warnings.warn(f"FlyMXConfig: Linear({module.in_features}, {module.out_features}) {left}: {why}", stacklevel=3)
    return module


def _experts_left(moe: FlyMoE, left: str, why: str) -> FlyMoE:
    setattr(moe, LEFT_ATTR, f"experts {left}: {why}")
    warnings.warn(f"FlyMXConfig: MoE experts {left}: {why}", stacklevel=3)
    return moe


@register_quantize_module_handler(FlyMXConfig)
def _swap_linear(module: nn.Module, config: FlyMXConfig) -> nn.Module:
    if isinstance(module, FlyMoE):
        return _mx_experts(module, config)
    if isinstance(module, FlyMXFrozenLinear):  # no master to convert again from
        if _stored(module.spec) != _stored(config.spec):
            return _left(module, f"frozen in MX as {_stored(module.spec)}; a new config cannot re-cast it")
        return module
    if not isinstance(module, nn.Linear):
        return module
    if (owner := torchao_quantized(module)) is not None:
        return _left(module, f"already quantized by torchao ({owner})")
    if isinstance(module, _NEVER_CALLED):
        return _left(module, "its owner (nn.MultiheadAttention) reads the weight without calling it")
    if parametrize.is_parametrized(module):
        return _left(module, "parametrized (its weight is computed from trainable tensors a swap would lose)")
    if isinstance(module, FlyMXLinear) and not config.frozen:
        module.spec = config.spec  # a training layer: the master weight is there, the new numerics apply
        return module
    if module.in_features % formats.BLOCK:
        return _left(module, f"in_features is not a multiple of {formats.BLOCK}", "left in high precision")
    if config.frozen:  # from a Linear or a training FlyMXLinear: its master is dropped
        return FlyMXFrozenLinear.from_linear(module, config.spec)
    return FlyMXLinear.from_linear(module, config.spec)


def _stored(spec: MXSpec) -> tuple[str, str | None, str]:
    """What a frozen layer's stored bytes and forward are fixed to (a new frozen config must match them)."""
    return (spec.weight, spec.activation, spec.mode)


def _swap_children(parent: nn.Module, prefix: str, config: FlyMXConfig) -> None:
    """``_swap_linear`` on the Linears below ``parent`` that ``mx_filter`` selects (their names from ``prefix``)."""
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}"
        if mx_filter(child, fqn):
            setattr(parent, name, _swap_linear(child, config))
        else:
            _swap_children(child, fqn, config)


_SHARED = ("shared_experts", "shared_expert")  # FlyMoE's dense experts (torchtitan's; Qwen2-MoE's / Llama-4's)


def _mx_experts(moe: FlyMoE, config: FlyMXConfig) -> FlyMoE:
    """The block's experts take MX forward numerics (``FlyMoE.mx``), its shared experts' Linears the Linear rules
    (``quantize_`` does not visit the children of a module it selected); the router stays as it is."""
    for attr in _SHARED:
        shared = getattr(moe, attr, None)
        if isinstance(shared, nn.Module) and mx_filter(shared, attr):  # the shared expert a single Linear
            setattr(moe, attr, _swap_linear(shared, config))
        elif isinstance(shared, nn.Module):
            _swap_children(shared, attr, config)
    bad = [f"{n} {d}" for n, d in (("hidden", moe.hidden_size), ("intermediate", moe.intermediate_size)) if d % 32]
    if bad:
        why = f"{' and '.join(bad)} not a multiple of {formats.BLOCK} (MX blocks)"
        return _experts_left(moe, "left in high precision", why)
    spec = config.spec
    owners = {type(p).__name__ for p in moe.experts.parameters() if type(p).__module__.startswith("torchao.")}
    if owners:  # torchao's MoE training config wraps the expert weights: their GEMMs are quantized already
        return _experts_left(moe, "left as they are", f"already quantized by torchao ({', '.join(sorted(owners))})")
    if isinstance(moe.experts, FlyMXFrozenExperts):
        if not config.frozen or _stored(moe.experts.spec) != _stored(spec):
            why = f"frozen in MX as {_stored(moe.experts.spec)} (no master to cast again from)"
            return _experts_left(moe, "left as they are", why)
        return moe
    if config.frozen:
        moe.experts = FlyMXFrozenExperts.from_moe(moe, spec)  # the old container (the masters) goes
        install_saved_tensor_hooks(moe)
    moe.mx = MXExperts(spec.weight, spec.activation, spec.mode, config.frozen, spec.kernel_preference)
    return moe
