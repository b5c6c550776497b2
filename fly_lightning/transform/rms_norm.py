"""RMSNorm matchers: ``nn.RMSNorm`` and the RMSNorm classes of Hugging Face models, recognised by structure.

Three variants differ in where the weight meets the cast back to the input dtype: ``llama`` (``w * x̂.to(dtype)``),
``plain`` (``(w * x̂).to(dtype)``, Olmo2-style) and ``gemma`` (``(x̂ * (1 + w)).to(dtype)``). With real weights a probe
runs the original module on random inputs (in the weight's dtype, and in bf16 for fp32 weights) and picks the variant
our reference reproduces exactly; the class tables only break ties and say what to expect. With weights on the meta
device or sharded (DTensor) no probe can run, so only classes in the tables are swapped.
"""

from __future__ import annotations

import torch
from torch import nn

from fly_lightning.dtensor import is_dtensor
from fly_lightning.modules.rms_norm import FlyRMSNorm
from fly_lightning.ops.rms_norm import rms_norm_reference
from fly_lightning.transform.core import Matcher, Unsupported, register_matcher

_KNOWN = {
    **dict.fromkeys(
        (
            "LlamaRMSNorm",
            "MistralRMSNorm",
            "MixtralRMSNorm",
            "Qwen2RMSNorm",
            "Qwen2MoeRMSNorm",
            "Qwen3RMSNorm",
            "Qwen3MoeRMSNorm",
            "OlmoeRMSNorm",
            "OlmoRMSNorm",
            "DeepseekV3RMSNorm",
            "DeepseekV2RMSNorm",
        ),
        "llama",
    ),
    "Olmo2RMSNorm": "plain",
    **dict.fromkeys(("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"), "gemma"),
}
# Liger-Kernel's RMSNorm has its own fused backward; ours runs ATen's (by design). A swap must only add speed to a user
# who composes the two, and ours has not been measured faster than Liger's: it is left, said in the summary.
_LIGER_REASON = "Liger-Kernel's RMSNorm (fused forward and backward) kept: ours not measured faster"
_OPTIONS = {"torch": {}, "plain": {}, "gemma": {"offset": 1.0}, "llama": {"cast_before_scale": True}}
_PROBED = ("llama", "plain", "gemma")


def _weight_1d(module: nn.Module) -> torch.Tensor | None:
    w = module._parameters.get("weight")
    params = [p for p in module._parameters.values() if p is not None]
    if w is None or w.dim() != 1 or len(params) != 1 or module._modules:
        return None
    return w


def _match(module: nn.Module) -> str | None:
    if type(module) is nn.RMSNorm:
        return "torch"
    cls = type(module).__name__
    if type(module).__module__.startswith("liger_kernel.") and cls.endswith("RMSNorm"):
        return "liger"
    if isinstance(module, FlyRMSNorm) or not cls.endswith("RMSNorm") or _weight_1d(module) is None:
        return None
    if cls in _KNOWN:
        return _KNOWN[cls]
    if hasattr(module, "variance_epsilon") or hasattr(module, "eps"):
        return "probe"  # an RMSNorm by structure; the probe decides which variant, if any
    return None


def _build(module: nn.Module, variant: str, root: nn.Module) -> nn.Module:
    if variant == "liger":
        raise Unsupported(_LIGER_REASON)
    if variant == "torch":
        if len(module.normalized_shape) != 1:
            raise Unsupported(f"normalized_shape {tuple(module.normalized_shape)} spans more than the last dim")
        return FlyRMSNorm.from_module(module, eps=module.eps)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float):
        raise Unsupported(f"eps attribute is {type(eps).__name__}, expected float")
    w = module.weight
    if w.is_meta or is_dtensor(w):
        if variant == "probe":
            raise Unsupported("weight on meta / sharded: an unlisted RMSNorm class needs a probe on real weights")
    else:
        variant = _probe(module, eps, prefer=variant)
    new = FlyRMSNorm.from_module(module, eps=eps, **_OPTIONS[variant])
    new._fly_variant = variant
    return new


def _probe(old: nn.Module, eps: float, prefer: str) -> str:
    """The variant whose reference reproduces ``old`` on random inputs: exactly if one does (``prefer`` first), else
    the closest within tolerance. No dispatch, nothing logged."""
    w = old.weight
    dtypes = [w.dtype] + ([torch.bfloat16] if w.dtype == torch.float32 else [])
    inputs = [torch.randn(4, w.shape[0], device=w.device).to(d) for d in dtypes]
    with torch.no_grad():  # forward, not __call__: the module's hooks (the user's) must not see the probe
        expected = [old.forward(x) for x in inputs]
    order = sorted(_PROBED, key=lambda v: v != prefer)
    errors: dict[str, float] = {}
    for v in order:
        err = 0.0
        for x, want in zip(inputs, expected, strict=True):
            with torch.no_grad():
                got = rms_norm_reference(x, w, eps, **_OPTIONS[v])[0]
            if got.shape != want.shape or got.dtype != want.dtype:
                err = float("inf")
                break
            rel = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
            err = max(err, rel if rel == rel else float("inf"))
        if err == 0.0:
            return v
        errors[v] = err
    best = min(order, key=lambda v: errors[v])
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    if not errors[best] <= tol:
        detail = ", ".join(f"{v} {e:.1e}" for v, e in errors.items())
        raise Unsupported(f"probe: no variant reproduces the original (relative errors: {detail})")
    return best


register_matcher(Matcher("rms_norm", "rms_norm", _match, _build))
