"""``FlyExperts``: a transformers v5 experts container on grouped GEMMs, for blocks whose routing stays stock.

Some models route in ways ``FlyMoE`` does not compute, or inline the MoE in the decoder layer (Gemma 4: the router
normalises and scales its input, scales each expert's weight, and sees other hidden states than the experts). Their
experts container has the transformers v5 interface, ``experts(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``, with ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``down_proj``
``[E, H, I]``: that call alone is swapped, the router runs as before.

Forward: the stable expert order of the ``T * k`` slots (``argsort``), per-expert end offsets, then the same path as
``FlyMoE``'s experts (``experts_forward``: gathered gate/up grouped GEMM, SwiGLU or GeGLU, down grouped GEMM,
``moe_combine`` in fp32 and slot order). Gradients reach the tokens, both projections and ``top_k_weights``. An index
equal to E (transformers' "no expert" slot, skipped by the stock loop) contributes nothing and gets no gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from fly_lightning.modules.moe import AUTO_PATH, experts_forward
from fly_lightning.ops.swiglu import ACTIVATIONS


class FlyExperts(nn.Module):
    """Routed experts ``sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` for given routing, on grouped GEMMs.

    Args:
        gate_up_proj: ``[E, 2I, H]`` parameter (gate rows, then up rows), shared with the wrapped container.
        down_proj: ``[E, H, I]`` parameter, shared.
        activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` (see ``fly_lightning.ops.swiglu``).
        path: ``"plain"``, ``"fused"`` or ``"auto"``, as ``FlyMoE``'s.
    """

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        *,
        activation: str = "silu",
        path: Literal["plain", "fused", "auto"] = "auto",
    ) -> None:
        super().__init__()
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise ValueError(
                f"FlyExperts: 3-D weights expected, got {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}"
            )
        e, two_i, h = gate_up_proj.shape
        if two_i % 2 or tuple(down_proj.shape) != (e, h, two_i // 2):
            raise ValueError(
                "FlyExperts: gate_up_proj [E, 2I, H] and down_proj [E, H, I] expected, got "
                f"{tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(f"FlyExperts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if path not in ("plain", "fused", "auto"):
            raise ValueError(f"FlyExperts: path must be 'plain', 'fused' or 'auto', got {path!r}")
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, two_i // 2
        self.activation, self.path = activation, path

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        x = hidden_states.reshape(-1, self.hidden_size)
        t, e = x.shape[0], self.num_experts
        ids = top_k_index.reshape(t, top_k_index.shape[-1])  # not -1: 0 tokens leave k undetermined
        k = ids.shape[1]
        if top_k_weights.shape[:1] != (t,) or top_k_weights.numel() != t * k:
            raise ValueError(
                f"FlyExperts: top_k_weights {tuple(top_k_weights.shape)} for top_k_index {tuple(ids.shape)}"
            )
        skipped = ids == e  # transformers' "no expert" slot: computed by expert 0, weighted 0 (no gradient)
        flat = ids.masked_fill(skipped, 0).long().reshape(-1)
        weights = top_k_weights.reshape(t, k).masked_fill(skipped, 0)
        perm = torch.argsort(flat, stable=True).to(torch.int32)  # slots t * k + j by expert, then by slot
        ones = torch.ones_like(flat, dtype=torch.int32)
        offs = (
            torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(0, flat, ones).cumsum(0, dtype=torch.int32)
        )
        fused = (AUTO_PATH if self.path == "auto" else self.path) == "fused"
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        y = experts_forward(x, weights, offs, perm, gate_up, None, down, fused=fused, activation=self.activation)
        return y.reshape(hidden_states.shape)

    @classmethod
    def from_module(cls, experts: nn.Module, **options: object) -> FlyExperts:
        """Wrap a transformers v5 experts container (sharing its parameters); ``ValueError`` with the reason for one
        whose math this does not compute (biases, transposed or gate-less weights, clamped SwiGLU, other activations).
        """
        from fly_lightning.modules.moe_convert import _act_name, _activation, _check_clamped_swiglu

        name = type(experts).__name__
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise ValueError(f"{name}: no gate_up_proj / down_proj weights")
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise ValueError(f"{name}: experts have biases")
        if getattr(experts, "is_transposed", False) or not getattr(experts, "has_gate", True):
            raise ValueError(f"{name}: transposed or gate-less expert weights are not supported")
        _check_clamped_swiglu(experts, experts)
        if not hasattr(experts, "act_fn"):
            raise ValueError(f"{name}: experts have no act_fn")
        if (activation := _activation(experts.act_fn)) is None:
            raise ValueError(f"{name}: expert activation {_act_name(experts.act_fn)} is not SiLU or GELU (erf or tanh)")
        return cls(gate_up, down, activation=activation, **options)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"activation={self.activation}, path={self.path}"
        )
