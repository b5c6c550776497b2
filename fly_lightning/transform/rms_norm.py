"""RMSNorm matchers: ``nn.RMSNorm`` and the RMSNorm classes of Hugging Face models, recognised by structure.

Structure decides the candidate variant; a probe on a small random input confirms that ``FlyRMSNorm`` computes the same
function before swapping (skipped when the weight is on the meta device or a DTensor).
"""

from __future__ import annotations

import torch
from torch import nn

from fly_lightning.dtensor import is_dtensor
from fly_lightning.modules.rms_norm import FlyRMSNorm
from fly_lightning.ops.rms_norm import rms_norm_reference
from fly_lightning.transform.core import Matcher, Unsupported, register_matcher

# Known classes: the probe still runs, the table only says which variant to expect
_LLAMA_STYLE = {
    "LlamaRMSNorm",
    "MistralRMSNorm",
    "MixtralRMSNorm",
    "Qwen2RMSNorm",
    "Qwen2MoeRMSNorm",
    "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm",
    "OlmoeRMSNorm",
    "OlmoRMSNorm",
    "Olmo2RMSNorm",
    "DeepseekV3RMSNorm",
    "DeepseekV2RMSNorm",
}
_GEMMA_STYLE = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"}


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
    if not cls.endswith("RMSNorm") or _weight_1d(module) is None:
        return None
    if cls in _GEMMA_STYLE or (hasattr(module, "eps") and not hasattr(module, "variance_epsilon")):
        return "gemma"
    if cls in _LLAMA_STYLE or hasattr(module, "variance_epsilon"):
        return "llama"
    return None


_OPTIONS = {"torch": {}, "gemma": {"offset": 1.0}, "llama": {"cast_before_scale": True}}


def _build(module: nn.Module, variant: str, root: nn.Module) -> nn.Module:
    if variant == "torch":
        if len(module.normalized_shape) != 1:
            raise Unsupported(f"normalized_shape {tuple(module.normalized_shape)} spans more than the last dim")
        return FlyRMSNorm.from_module(module, eps=module.eps)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float):
        raise Unsupported(f"eps attribute is {type(eps).__name__}, expected float")
    _probe(module, eps, **_OPTIONS[variant])
    return FlyRMSNorm.from_module(module, eps=eps, **_OPTIONS[variant])


def _probe(old: nn.Module, eps: float, offset: float = 0.0, cast_before_scale: bool = False) -> None:
    """Compare the original module with our reference semantics on a random input (no dispatch, nothing logged)."""
    w = old.weight
    if w.is_meta or is_dtensor(w):
        return
    x = torch.randn(4, w.shape[0], dtype=w.dtype, device=w.device)
    with torch.no_grad():
        expected = old(x)
        got = rms_norm_reference(x, w, eps, offset, cast_before_scale)[0]
    tol = 1e-5 if expected.dtype == torch.float32 else 2e-2
    if expected.shape != got.shape or expected.dtype != got.dtype:
        raise Unsupported(f"probe: output {got.dtype}{tuple(got.shape)} != {expected.dtype}{tuple(expected.shape)}")
    err = ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()
    if not err <= tol:
        raise Unsupported(f"probe: output differs from the original (relative error {err:.2e})")


register_matcher(Matcher("rms_norm", "rms_norm", _match, _build))
