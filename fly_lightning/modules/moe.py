"""``FlyMoE``: a token-choice top-k MoE block (router, SwiGLU experts, weighted combine) on grouped GEMMs.

Forward: router logits -> top-k routing (weights, expert ids, group end offsets, stable permutation) -> gate/up
grouped GEMM on the token rows in expert order -> ``swiglu`` -> down grouped GEMM -> ``moe_combine``.

Two data paths, numerically identical:
- ``plain``: copy the token rows into expert order, then ``grouped_mm``;
- ``fused``: ``moe_grouped_mm`` reads the token rows through the permutation inside the gate/up GEMM (no copy).
Experts in the MX GEMM form (``FlyMoE.mx``, ``modules.moe_mx``) take the plain path: ``mx_grouped_mm`` reads MX rows.

Both leave the down GEMM's rows in expert order: ``moe_combine`` reads each token's k rows through the inverse
permutation and sums them weighted, in fp32 and slot order (deterministic, no atomics), rounding once to the input's
dtype as the stock blocks do. (Scattering rows to slot order from the GEMM, which ``moe_grouped_mm`` can do, made the
GEMM slower than the combine's gather costs.) The backward of the token gather sums each token's k slot gradients in
slot order.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fly_lightning.modules import moe_convert
from fly_lightning.modules.moe_layout import LAYOUTS, RouterWeight, init_experts, make_experts
from fly_lightning.modules.moe_mx import MXExperts
from fly_lightning.ops.grouped_mm import autocast_operands, grouped_mm
from fly_lightning.ops.moe_combine import moe_combine
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm
from fly_lightning.ops.moe_route import group_reason, moe_route, moe_route_reference
from fly_lightning.ops.permutation import inverse_permutation
from fly_lightning.ops.swiglu import ACTIVATIONS, split_gate_up, swiglu, swiglu_reference

Path = Literal["plain", "fused", "auto"]
AUTO_PATH: Literal["plain", "fused"] = "fused"
"""What ``path="auto"`` runs, from ``python -m benchmarks.bench_grouped_mm --moe`` on the H200 (``moe_layer*.md``):
fused vs plain 0.98-1.18x in the forward, 0.95-1.12x in forward+backward over the runs (side by side in rounds at
3d5d079: 1.07-1.10x and 0.95-1.00x), and no permuted token copy."""


def _route(moe: FlyMoE, logits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The single routing call site: the dispatched ``moe_route`` op."""
    own_renorm = moe.renorm_eps is not None and moe.norm_topk_prob  # another epsilon than the op's: renormalised here
    r = moe_route(
        logits,
        moe.top_k,
        score=moe.score_func,
        renormalize=moe.norm_topk_prob and not own_renorm,
        bias_E=moe.selection_bias(),
        route_scale=1.0 if own_renorm else moe.route_scale,
        n_groups=moe.n_groups,
        topk_groups=moe.topk_groups,
        return_permutation=True,
    )
    weights = _renormalize(moe, r.weights_TK) if own_renorm else r.weights_TK
    return weights, r.ids_TK, r.counts_E, r.offsets_E, r.sorted_slots_S


def _renormalize(moe: FlyMoE, weights_TK: Tensor) -> Tensor:
    """``w / (sum(w) + renorm_eps) * route_scale`` in fp32, the family's own formula (``renorm_eps``)."""
    return weights_TK / (weights_TK.sum(-1, keepdim=True) + moe.renorm_eps) * moe.route_scale


class _GatherTokens(torch.autograd.Function):
    """``x[perm // k]`` whose backward sums each token's k slot gradients in slot order, in fp32 (no atomic
    index_add): ``moe_combine`` with unit weights."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inv: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(inv)
        ctx.top_k, ctx.tokens = top_k, x.shape[0]
        return x.index_select(0, perm.long() // top_k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inv,) = ctx.saved_tensors  # slot s = t * k + j takes expert-ordered row inv[s]
        ones = torch.ones(ctx.tokens, ctx.top_k, dtype=torch.float32, device=grad.device)
        return moe_combine(grad, ones, inv, out_dtype=grad.dtype), None, None, None  # the unweighted slot sum


def experts_forward(
    x_TH: Tensor,
    weights_Tk: Tensor,
    offs_E: Tensor,
    perm_M: Tensor,
    gate_up_EHN: Tensor,
    up_EHI: Tensor | None,
    down_EIH: Tensor,
    *,
    fused: bool,
    score_before_experts: bool = False,
    mx: MXExperts | None = None,
    activation: str = "silu",
) -> Tensor:
    """Routed SwiGLU (``activation="silu"``) or GeGLU (``"gelu"``, ``"gelu_tanh"``) experts and the deterministic
    combine: ``[T, H]``.

    ``gate_up_EHN`` is ``[E, H, 2I]`` (gate columns first) when ``up_EHI`` is None, else the ``[E, H, I]`` gate.
    ``mx``: the GEMM operands go through MX casts (``MXExperts``: fake-quantised, or cast for ``mx_grouped_mm``).
    """
    out_dtype = x_TH.dtype  # the input's (under autocast the MX casts below may take the autocast dtype)
    mx_gemm = mx is not None and mx.mx_gemm(x_TH, gate_up_EHN, down_EIH)
    emulated = mx is not None and not mx_gemm
    if emulated:  # cast to the autocast dtype first, as the MX GEMM form and Linears
        x_TH, gate_up_EHN = autocast_operands(x_TH, gate_up_EHN)
        down_EIH = autocast_operands(x_TH, down_EIH)[1]
        up_EHI = None if up_EHI is None else autocast_operands(x_TH, up_EHI)[1]
    k = weights_Tk.shape[1]
    inv = inverse_permutation(perm_M)  # slot -> expert-ordered row: the combine gathers through it
    if mx_gemm:  # the MX GEMM takes MX rows in expert order: the plain path's copy, then one cast for gate and up
        xs = _GatherTokens.apply(x_TH, perm_M, inv, k)
        gate_up, *up = mx.project(xs, offs_E, *([gate_up_EHN] if up_EHI is None else [gate_up_EHN, up_EHI]))
        up = up[0] if up else None
    else:
        if emulated:  # the tokens cast once (no graph), shared by gate and up; gradients from the high-precision ones
            with torch.no_grad():
                x_q = mx.act(x_TH)
        if fused and emulated:
            project = lambda w: mx.emulated(x_TH, x_q, w, offs_E, perm_M, k)  # noqa: E731
        elif fused:
            project = lambda w: moe_grouped_mm(x_TH, w, offs_E, perm_M, topk=k, gather=True)  # noqa: E731
        else:
            xs = _GatherTokens.apply(x_TH, perm_M, inv, k)
            if emulated:
                xs_q = x_q.index_select(0, perm_M.long() // k)  # the gather's rows, of the cast tokens
                project = lambda w: mx.emulated(xs, xs_q, w, offs_E)  # noqa: E731
            else:
                project = lambda w: grouped_mm(xs, w, offs_E)  # noqa: E731
        gate_up = project(gate_up_EHN)
        up = None if up_EHI is None else project(up_EHI)
    if score_before_experts:  # torchtitan: the score scales the expert input; experts are linear up to SwiGLU
        gate, up = split_gate_up(gate_up, up)
        s = weights_Tk.reshape(-1).index_select(0, perm_M.long()).unsqueeze(1).to(gate.dtype)
        gate_up, up = gate * s, up * s
        weights_Tk = torch.ones_like(weights_Tk)  # the combine is then a plain sum (still in fp32)
    h = swiglu(gate_up, up, activation)
    if mx_gemm:
        (rows,) = mx.project(h, offs_E, down_EIH)
    elif emulated:
        with torch.no_grad():
            h_q = mx.act(h)
        rows = mx.emulated(h, h_q, down_EIH, offs_E)  # expert order
    else:
        rows = grouped_mm(h, down_EIH, offs_E)  # expert order
    return moe_combine(rows, weights_Tk, inv, out_dtype=out_dtype)


def expert_projections(moe: FlyMoE, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """``moe.experts.projections()``; a container without floating weights of its own (frozen MX experts, which set
    ``follows_activations``) gives them in the activations' dtype ``x.dtype``, the dtype FSDP2's
    ``MixedPrecisionPolicy`` casts the block's inputs and other weights to."""
    if getattr(moe.experts, "follows_activations", False) and x.is_floating_point():
        return moe.experts.projections(x.dtype)
    return moe.experts.projections()


def moe_reference(moe: FlyMoE, hidden_states: Tensor) -> Tensor:
    """What ``moe`` computes, in plain torch with a loop over the experts hit (no dispatch, nothing logged, no state
    updated): the oracle that the transform's probe compares a wrapped block with. Expert rows run in the weights'
    dtype, the combine in fp32 (as ``moe_combine``)."""
    x = hidden_states.reshape(-1, moe.hidden_size)
    bias = moe.selection_bias()
    own_renorm = moe.renorm_eps is not None and moe.norm_topk_prob
    weights, ids, *_ = moe_route_reference(
        moe.router_logits(x), moe.top_k, moe.score_func, moe.norm_topk_prob and not own_renorm, bias,
        1.0 if own_renorm else moe.route_scale, moe.n_groups, moe.topk_groups,
    )  # fmt: skip
    weights = _renormalize(moe, weights) if own_renorm else weights
    gate_up, up, down = expert_projections(moe, x)
    acc = torch.promote_types(x.dtype, torch.float32)
    y = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok].to(down.dtype)
        w = weights[tok, slot].unsqueeze(1)
        gate, u = split_gate_up(xe @ gate_up[e], None if up is None else xe @ up[e])
        if moe.score_before_experts:
            gate, u = gate * w.to(gate.dtype), u * w.to(u.dtype)
            w = torch.ones_like(w)
        rows = swiglu_reference(gate, u, moe.activation) @ down[e]
        y.index_add_(0, tok, rows.to(acc) * w.to(acc))
    return moe.add_shared(x, y.to(x.dtype)).reshape(hidden_states.shape)


class FlyMoE(nn.Module):
    """Token-choice top-k MoE block with SwiGLU experts on grouped GEMMs, in a model's own parameter layout.

    Args:
        hidden_size: H. intermediate_size: I (per expert). num_experts: E. top_k: experts per token.
        layout: parameter/state_dict layout (``fly_lightning.modules.moe_layout``): ``"hf"`` (transformers v5),
            ``"mixtral"``/``"qwen"`` (per-expert Linear lists), ``"torchtitan"``, ``"torchtitan_legacy"``.
        score_func: ``"softmax"`` or ``"sigmoid"`` router scores (fp32).
        norm_topk_prob: renormalise the selected k scores to sum to 1 (Mixtral, Qwen3-30B-A3B: yes; OLMoE: no).
        route_scale: multiplies the routing weights.
        score_before_experts: apply the routing weight to the expert input (torchtitan's default) instead of its
            output; the combine is then a plain sum.
        load_balance_bias: keep torchtitan's ``expert_bias`` buffer (selection only) and ``tokens_per_expert``.
        shared_experts: a dense module added to the routed output (torchtitan ``shared_experts``), kept as is.
        n_groups / topk_groups: node-limited routing (DeepSeek-V3): pick experts only from the best ``topk_groups``
            of ``n_groups`` equal groups.
        router_fp32: compute the router logits in fp32 whatever the weight's dtype, as transformers' DeepSeek-style
            routers do (``from_module`` sets it when the wrapped router does); otherwise in the weight's dtype.
        path: ``"plain"``, ``"fused"`` (token rows gathered inside the gate/up GEMM) or ``"auto"`` (``AUTO_PATH``).
        router_path: dotted path of the module holding the router's ``weight`` (default: ``gate``, torchtitan
            ``router.gate``); e.g. ``"router"`` (Jamba, Granite-MoE, Llama-4), ``"router.gate"`` (AFMoE),
            ``"router.layer"`` (DBRX). ``from_module`` puts the wrapped block's own router modules there.
        router_call_path: dotted path of the router module run (with the tokens) when someone observes it, default
            ``router_path``; ``router_logits_index``: which output of it holds the logits when it returns a tuple
            (Llama-4: 1); ``router_bias_arg``: it takes the selection bias as second argument (MiniMax-M2).
        return_router_logits: ``forward`` returns ``(output, router_logits)``, as Llama-4's block does.
        activation: the experts' gated activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, erf) or ``"gelu_tanh"``
            (GeGLU, tanh approximation).
        renorm_eps: renormalise as ``w / (sum(w) + renorm_eps)`` (then scale), the family's own epsilon (LFM2-MoE
            1e-6, MiniMax-M2 and Laguna 0); None: ``moe_route``'s (1e-20, DeepSeek-V3's), fused in the routing op.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        layout: str = "hf",
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        norm_topk_prob: bool = True,
        route_scale: float = 1.0,
        score_before_experts: bool = False,
        load_balance_bias: bool = False,
        shared_experts: nn.Module | None = None,
        n_groups: int | None = None,
        topk_groups: int | None = None,
        router_fp32: bool = False,
        path: Path = "auto",
        router_path: str | None = None,
        router_call_path: str | None = None,
        router_logits_index: int = 0,
        router_bias_arg: bool = False,
        return_router_logits: bool = False,
        activation: str = "silu",
        renorm_eps: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if (n_groups is None) != (topk_groups is None):
            raise ValueError("n_groups and topk_groups must be given together")
        if n_groups is not None and (reason := group_reason(num_experts, top_k, n_groups, topk_groups)) is not None:
            raise ValueError(reason)
        if path not in ("plain", "fused", "auto"):
            raise ValueError(f"path must be 'plain', 'fused' or 'auto', got {path!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if renorm_eps is not None and not renorm_eps >= 0.0:
            raise ValueError(f"renorm_eps must be >= 0 or None, got {renorm_eps!r}")
        self.activation = activation
        self.renorm_eps = None if renorm_eps is None else float(renorm_eps)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.layout = num_experts, top_k, layout
        self.score_func, self.norm_topk_prob, self.route_scale = score_func, norm_topk_prob, float(route_scale)
        self.score_before_experts, self.path = score_before_experts, path
        self.n_groups, self.topk_groups, self.router_fp32 = n_groups, topk_groups, router_fp32
        router = RouterWeight(num_experts, hidden_size, device=device, dtype=dtype)
        default_path = "router.gate" if layout.startswith("torchtitan") else "gate"
        # None: the layout's default place (the attribute lookups of the original code, no path walk)
        self._router_path = None if router_path in (None, default_path) else tuple(router_path.split("."))
        self._router_call_path = None if router_call_path is None else tuple(router_call_path.split("."))
        self.router_logits_index, self.router_bias_arg = router_logits_index, router_bias_arg
        self.return_router_logits = return_router_logits
        if self._router_path is not None:
            owner = self
            for name in self._router_path[:-1]:
                if not hasattr(owner, name):
                    setattr(owner, name, nn.Module())
                owner = getattr(owner, name)
            setattr(owner, self._router_path[-1], router)
        elif layout.startswith("torchtitan"):
            self.router = nn.Module()
            self.router.gate = router
        else:
            self.gate = router
        self.experts = make_experts(layout, num_experts, hidden_size, intermediate_size, device, dtype)
        if load_balance_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer(
                "tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32, device=device), persistent=False
            )
        self.shared_experts = shared_experts
        self.reset_parameters()

    def selection_bias(self) -> Tensor | None:
        """The selection-only bias: torchtitan's (or AFMoE's) ``expert_bias``, DeepSeek-V3's
        ``gate.e_score_correction_bias``, one the block holds itself (MiniMax-M2's ``e_score_correction_bias``), or
        Ernie 4.5's ``gate.moe_statics.e_score_correction_bias``."""
        bias = getattr(self, "expert_bias", None)
        if bias is None and "e_score_correction_bias" in self._buffers:
            return self._buffers["e_score_correction_bias"]
        if bias is None and (statics := getattr(self.router_module, "moe_statics", None)) is not None:
            return statics.e_score_correction_bias.view(-1)  # Ernie 4.5: a [1, E] parameter (a view: writes through)
        return bias if bias is not None else getattr(self.router_module, "e_score_correction_bias", None)

    def _walk(self, path: tuple[str, ...]) -> nn.Module:
        module = self
        for name in path:
            module = getattr(module, name)
        return module

    @property
    def router_module(self) -> nn.Module:
        if self._router_path is not None:
            return self._walk(self._router_path)
        return self.router.gate if self.layout.startswith("torchtitan") else self.gate

    @property
    def router_call_module(self) -> nn.Module:
        """The router module run when observed (``router_call_path``), by default ``router_module``."""
        return self.router_module if self._router_call_path is None else self._walk(self._router_call_path)

    @property
    def router_weight(self) -> Tensor:
        return self.router_module.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.router_weight, std=std)
        init_experts(self.experts, std)

    @classmethod
    def from_module(cls, module: nn.Module, **options: object) -> FlyMoE:
        """Wrap an existing MoE block (transformers v5/v4, torchtitan), keeping its parameter names and shapes.

        Fused-layout parameters are shared with ``module``; per-expert Linear lists are copied into stacked storage.
        Raises ``ValueError`` (with the reason) for blocks whose routing or experts ``FlyMoE`` does not compute.
        """
        return moe_convert.from_module(cls, module, **options)

    def router_logits(self, x_TH: Tensor) -> Tensor:
        """``[T, E]`` router logits. A wrapped router module that someone observes (forward hooks: transformers
        records ``router_logits`` for its auxiliary loss that way) is run itself, so its observers see its outputs;
        otherwise one ``F.linear`` (the wrapped routers' own scores and top-k would be recomputed by ``moe_route``)."""
        router = self.router_module
        called = router if self._router_call_path is None else self.router_call_module
        if not isinstance(called, RouterWeight) and (called._forward_hooks or called._forward_pre_hooks):
            out = called(x_TH, self.selection_bias()) if self.router_bias_arg else called(x_TH)
            logits = out[self.router_logits_index] if isinstance(out, tuple) else out
            if isinstance(logits, Tensor) and logits.shape == (x_TH.shape[0], self.num_experts):
                return logits
        router_w = router.weight
        if self.router_fp32:
            return F.linear(x_TH.float(), router_w.float())
        return F.linear(x_TH.to(router_w.dtype), router_w)  # some routers keep fp32 weights

    def resolved_path(self) -> Literal["plain", "fused"]:
        return AUTO_PATH if self.path == "auto" else self.path

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"FlyMoE: expected last dim {self.hidden_size}, got {shape[-1]}")
        x = hidden_states.reshape(-1, self.hidden_size)
        logits = self.router_logits(x)
        weights, _, counts, offs, perm = _route(self, logits)
        if hasattr(self, "tokens_per_expert"):
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        gate_up, up, down = expert_projections(self, x)
        y = experts_forward(
            x,
            weights,
            offs,
            perm,
            gate_up,
            up,
            down,
            fused=self.resolved_path() == "fused",
            score_before_experts=self.score_before_experts,
            mx=self.mx,
            activation=self.activation,
        )
        out = self.add_shared(x, y).reshape(shape)
        return (out, logits) if self.return_router_logits else out

    mx: MXExperts | None = None  # MX forward numerics for the experts (``FlyMXConfig``); None: the weights' dtype

    def add_shared(self, x_TH: Tensor, y_TH: Tensor) -> Tensor:
        """``y_TH`` plus the shared experts' output, if the block has any (also used by ``moe_reference``)."""
        if self.shared_experts is not None:
            y_TH = y_TH + self.shared_experts(x_TH)
        if getattr(self, "shared_expert", None) is not None:  # Qwen2-MoE: a gated shared expert; Llama-4: ungated
            gate = getattr(self, "shared_expert_gate", None)
            if gate is None:
                y_TH = y_TH + self.shared_expert(x_TH)
            else:
                y_TH = y_TH + torch.sigmoid(gate(x_TH)) * self.shared_expert(x_TH)
        return y_TH

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"top_k={self.top_k}, layout={self.layout}, score={self.score_func}, norm={self.norm_topk_prob}, "
            f"path={self.path}"
            + (f", activation={self.activation}" if self.activation != "silu" else "")
            + (f", renorm_eps={self.renorm_eps}" if self.renorm_eps is not None else "")
            + (f", mx={self.mx}" if self.mx is not None else "")
        )
