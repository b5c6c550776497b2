"""MoE block matchers: transformers v5 fused experts, per-expert Linear lists, torchtitan ``MoE``.

Recognition is structural (an ``experts`` container plus a ``gate`` or ``router.gate``); ``FlyMoE.from_module``
decides whether it computes the same function and says why not (DeepSeek-V3's group-limited router, non-SiLU experts,
biases, router jitter). Structure cannot show everything a block computes (a sigmoid router without a bias, a clamp
before the activation, an extra norm), so two checks follow:

- state: the replacement's state_dict has exactly the original's keys and shapes (state it would drop or add means
  it does not model the block, and checkpoints would change);
- probe: a block class not in ``_KNOWN`` (whose conversion the tests check) must, with real weights, reproduce its
  output with ``moe_reference`` of the replacement on 64 random tokens (half of them at 30x scale, so clamps show;
  tokens whose k-th and next expert tie are skipped: tie order is not the block's math; so are tokens whose selected
  sigmoid scores sum to exactly 0, where a router without epsilon gives 0 / 0; the block renormalises with the
  family's own epsilon, ``FlyMoE.renorm_eps``, so smaller sums are compared). With weights on the meta
  device or sharded, or a block that outputs zeros, the probe cannot tell and such a class is left. Known classes
  skip it (it runs the block and a per-expert loop: for a Mixtral-sized block on a CPU, an estimated ~90 GFLOP, not
  measured).
- experts probe (transformers v5 blocks of classes not in ``_KNOWN``): the wrapped ``experts`` module alone, on
  tokens scaled so that the expert pre-activations reach ~1e3 whatever the weights' scale, must match the
  replacement's SwiGLU experts: a clamp (HY-V4's at 10) that a freshly initialised model's activations never reach in
  the block probe would otherwise be swapped and give other numbers once training grows the weights.

Experts alone: a transformers v5 experts container (``...Experts`` with 3-D ``gate_up_proj`` / ``down_proj``) that
no recognised block encloses becomes ``FlyExperts`` (the router stays stock), after the same state check and a probe
of the container on random tokens (half at pre-activations ~1e3) routed to every expert. Decoder layers (with a
``self_attn``) are never blocks: Gemma 4 and DiffusionGemma inline their MoE there, with routers ``FlyMoE`` does not
compute (a normalised, scaled router input and per-expert weight scales), so their experts are swapped alone.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import nn

from fly_lightning.dtensor import is_dtensor
from fly_lightning.modules.moe import FlyMoE, moe_reference
from fly_lightning.modules.moe_experts import FlyExperts
from fly_lightning.modules.moe_layout import FusedExperts
from fly_lightning.ops.moe_route import moe_route_reference, ranked_values
from fly_lightning.ops.swiglu import split_gate_up, swiglu_reference
from fly_lightning.transform.core import Matcher, Unsupported, register_matcher

# (module prefix, class): blocks whose math the conversion is known to reproduce (tests/fly_lightning/transform)
_KNOWN = {
    ("transformers.models.mixtral.", "MixtralSparseMoeBlock"),
    ("transformers.models.qwen2_moe.", "Qwen2MoeSparseMoeBlock"),
    ("transformers.models.qwen3_moe.", "Qwen3MoeSparseMoeBlock"),
    ("transformers.models.olmoe.", "OlmoeSparseMoeBlock"),
    ("transformers.models.deepseek_v3.", "DeepseekV3MoE"),
    ("torchtitan.", "MoE"),
}
_PROBE_TOKENS = 64


def _is_v5_experts(module: nn.Module) -> bool:
    """A transformers v5 experts container: ``...Experts`` with 3-D ``gate_up_proj`` and ``down_proj``."""
    return type(module).__name__.endswith("Experts") and all(
        isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() == 3
        for n in ("gate_up_proj", "down_proj")
    )


def _match(module: nn.Module) -> str | None:
    if isinstance(module, (FlyMoE, FlyExperts)):
        return None
    if isinstance(getattr(module, "self_attn", None), nn.Module):
        return None  # a decoder layer with its MoE inlined (Gemma 4): not a block; its experts are matched alone
    if _is_v5_experts(module) and not isinstance(module, FusedExperts):
        return "hf_experts"  # reached only when no enclosing block was recognised
    experts = getattr(module, "experts", None)
    router = getattr(module, "router", None)
    if experts is None:
        # JetMoE's block (and its attention counterpart): recognised, to be left with the reason
        return "hf_v5" if router is not None and hasattr(module, "input_linear") else None
    if router is not None and hasattr(router, "gate") and hasattr(experts, "w1"):
        return "torchtitan"
    if not hasattr(module, "gate"):
        # transformers v5 blocks routed by a ``router`` module (Jamba, Granite-MoE, Llama-4, AFMoE, DBRX, gpt-oss)
        weights = ("gate_up_proj", "up_proj")
        if router is not None and (any(isinstance(getattr(experts, n, None), torch.Tensor) for n in weights)
                                   or hasattr(getattr(experts, "mlp", None), "w1")):  # fmt: skip
            return "hf_v5"
        return None
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return "hf_v5"
    if isinstance(getattr(experts, "up_proj", None), torch.Tensor):  # gate-less experts (Nemotron-H): left
        return "hf_v5"
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        return "expert_list"
    return None


def _records_router_logits(root: nn.Module) -> bool:
    """Whether a model config under ``root`` asks for router logits: ``root`` may hold the Hugging Face model as an
    attribute (a LightningModule's ``self.model``), so every submodule's ``config`` counts, not only the root's."""
    return any(getattr(getattr(m, "config", None), "output_router_logits", False) for m in root.modules())


def _check_state(module: nn.Module, new: FlyMoE) -> None:
    old = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    got = {k: tuple(v.shape) for k, v in new.state_dict(keep_vars=True).items()}
    if dropped := sorted(old.keys() - got.keys()):
        raise Unsupported(f"state the swapped block does not model: {', '.join(dropped[:4])}")
    if added := sorted(got.keys() - old.keys()):
        raise Unsupported(f"the swapped block would add state: {', '.join(added[:4])}")
    if changed := sorted(k for k in old if old[k] != got[k]):
        raise Unsupported(f"state of another shape in the swapped block: {', '.join(changed[:4])}")


@contextlib.contextmanager
def _unobserved(module: nn.Module) -> Iterator[None]:
    """Run ``module`` (or the replacement, which may share its router) for the probe only: forward hooks
    (transformers' output recorders, user hooks) are off, buffers (torchtitan's ``tokens_per_expert``) are restored
    afterwards, and the global RNG is left as it was."""
    hooks = [(m, m._forward_hooks, m._forward_pre_hooks) for m in module.modules()]
    buffers = [(b, b.clone()) for b in module.buffers()]
    devices = sorted({b.device.index or 0 for b in module.parameters() if b.is_cuda})
    try:
        for m, _, _ in hooks:
            m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, forward, pre in hooks:
            m._forward_hooks, m._forward_pre_hooks = forward, pre
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _boundary_ties(moe: FlyMoE, x_TH: torch.Tensor) -> torch.Tensor:
    """Tokens whose k-th and (k+1)-th ranked values are equal up to the logits' rounding: which expert such a token
    takes depends on tie order, not on the block's math."""
    sel = ranked_values(moe.router_logits(x_TH).float(), moe.score_func, moe.selection_bias(), moe.n_groups is not None)
    if moe.top_k >= sel.shape[1]:
        return torch.zeros(sel.shape[0], dtype=torch.bool, device=sel.device)
    top = sel.topk(moe.top_k + 1, dim=-1).values
    gap = top[:, -2] - top[:, -1]
    return gap <= torch.finfo(moe.router_weight.dtype).eps * 4 * top[:, -2].abs().clamp_min(1e-3)


def _renorm_degenerate(moe: FlyMoE, x_TH: torch.Tensor) -> torch.Tensor:
    """Tokens whose selected sigmoid scores sum to exactly 0 (every chosen fp32 sigmoid underflowed: logits below
    about -104, as the 30x probe tokens can reach): a router without epsilon (MiniMax-M2, Laguna) gives 0 / 0 = NaN
    there, and so does the block with its ``renorm_eps`` 0; the probe compares finite outputs. Smaller but nonzero
    sums are compared: the block renormalises with the family's epsilon (read off the router: ``renorm_eps``)."""
    if not moe.norm_topk_prob or moe.score_func != "sigmoid":
        return torch.zeros(x_TH.shape[0], dtype=torch.bool, device=x_TH.device)
    logits = moe.router_logits(x_TH).float()
    raw, *_ = moe_route_reference(logits, moe.top_k, moe.score_func, False, moe.selection_bias(), 1.0, moe.n_groups,
                                  moe.topk_groups)  # fmt: skip
    return raw.sum(-1) == 0


def _probe(module: nn.Module, new: FlyMoE) -> bool:
    """Raise ``Unsupported`` unless ``new`` reproduces ``module`` on random tokens (see the module docstring); False
    when the probe cannot tell (the block outputs zeros: zero-initialised experts, say)."""
    dtype = new.experts.projections()[0].dtype
    device = new.router_weight.device
    g = torch.Generator().manual_seed(0)
    # half the tokens at unit scale, half at 30x: clamps and saturations that unit inputs never reach show there
    scale = torch.ones(_PROBE_TOKENS, 1).index_fill_(0, torch.arange(1, _PROBE_TOKENS, 2), 30.0)
    x = (torch.randn(_PROBE_TOKENS, new.hidden_size, generator=g) * scale).to(device=device, dtype=dtype)
    want, failure = None, None
    for shape in ((2, _PROBE_TOKENS // 2, new.hidden_size), x.shape):  # [B, S, H] (transformers), else [T, H]
        try:
            with torch.no_grad(), _unobserved(module):
                want = module(x.reshape(shape).clone())
            x = x.reshape(shape)
            break
        except Exception as exc:  # noqa: BLE001 - a block that needs more than hidden states cannot be probed
            failure = failure or exc
    if want is None:
        raise Unsupported(f"probe: the original block failed on random tokens ({type(failure).__name__})")
    want = want[0] if isinstance(want, tuple) else want
    with torch.no_grad(), _unobserved(new):  # a transformers v5 router is shared: its hooks stay silent too
        got = moe_reference(new, x)
        keep = ~_boundary_ties(new, x.reshape(-1, new.hidden_size))
        keep &= ~_renorm_degenerate(new, x.reshape(-1, new.hidden_size))
    if isinstance(want, torch.Tensor) and want.shape != got.shape and want.shape == (got.numel() // new.hidden_size,
                                                                                    new.hidden_size):  # fmt: skip
        want = want.reshape(got.shape)  # Llama-4's block returns flattened tokens, [B * S, H]
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise Unsupported("probe: the original block's output is not a tensor of its input's shape")
    want, got = want.reshape(-1, new.hidden_size)[keep].float(), got.reshape(-1, new.hidden_size)[keep].float()
    if not torch.isfinite(want).all():
        raise Unsupported("probe: the original block gives non-finite outputs (uninitialised weights?)")
    if not want.any():
        return False
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    # fp32: TF32 products (torch.set_float32_matmul_precision("high"), common with Lightning) summed in another order
    # differ by ~1e-3; a different function differs by far more (softmax vs sigmoid, a clamp, a norm: 1e-1 and up)
    tol = 5e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    if not err <= tol:
        raise Unsupported(f"probe: the swapped block computes something else (relative error {err:.1e} > {tol:.0e})")
    return True


def _experts_reference(new: FlyMoE, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """What the replacement's experts compute for given routing: ``sum_j w[t, j] * expert_{ids[t, j]}(x_t)``."""
    gate_up, up, down = new.experts.projections()
    y = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    for e in ids_TK.unique().tolist():
        tok, slot = torch.where(ids_TK == e)
        xe = x_TH[tok].to(down.dtype)
        gate, u = split_gate_up(xe @ gate_up[e], None if up is None else xe @ up[e])
        rows = swiglu_reference(gate, u, new.activation) @ down[e]
        y.index_add_(0, tok, rows.float() * w_TK[tok, slot].unsqueeze(1).float())
    return y


def _probe_with_random_bias(module: nn.Module, new: FlyMoE) -> bool:
    """``_probe`` with the selection bias (shared by both blocks) set to random values meanwhile, then restored: a
    freshly initialised bias is zero, and with a zero bias the probe cannot see how a block uses it (ranking
    ``sigmoid + bias`` or ``logits + bias``, adding it to the weights too), which the bias decides once it moves."""
    bias = new.selection_bias()
    if bias is None:
        return _probe(module, new)
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(2)
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.5)
        return _probe(module, new)
    finally:
        with torch.no_grad():
            bias.copy_(saved)


def _probe_experts(module: nn.Module, new: FlyMoE) -> None:
    """Raise ``Unsupported`` unless the wrapped experts module (transformers v5: ``experts(x, top_k_index,
    top_k_weights)``) reproduces the replacement's SwiGLU experts with expert pre-activations up to ~1e3, whatever the
    weights' scale. The block probe's random tokens reach the clamps of a trained checkpoint but not those of a freshly
    initialised model (HY-V4 clamps the SwiGLU at 10: with 0.02-std weights no pre-activation gets there), and a swap
    must not depend on how large the weights happen to be."""
    gate_up, up, _ = new.experts.projections()
    cols = gate_up.detach().float().norm(dim=1)  # [E, N]: pre-activation std per column for unit-normal tokens
    if up is not None:
        cols = torch.cat([cols, up.detach().float().norm(dim=1)], dim=1)
    big = 1e3 / cols.max().clamp_min(1e-30).item()
    t, e, k = 32, new.num_experts, min(new.top_k, new.num_experts)
    g = torch.Generator().manual_seed(1)
    scale = torch.ones(t, 1).index_fill_(0, torch.arange(1, t, 2), big)
    x = (torch.randn(t, new.hidden_size, generator=g) * scale).to(device=new.router_weight.device, dtype=gate_up.dtype)
    ids = torch.stack([(torch.arange(k) + i) % e for i in range(t)]).to(x.device)  # every expert, k distinct per token
    w = torch.rand(t, k, generator=g).to(device=x.device, dtype=torch.float32)
    try:
        with torch.no_grad(), _unobserved(module):
            if new.score_before_experts:  # Llama-4's experts: tokens already in expert order, n rows per expert
                ids = torch.arange(e, device=x.device).repeat_interleave(t).unsqueeze(1)
                x, w = x.repeat(e, 1), torch.ones(e * t, 1, device=x.device)
                want = module.experts(x.clone())
            else:
                want = module.experts(x.clone(), ids, w.to(x.dtype))
    except Exception as exc:  # noqa: BLE001 - experts that cannot be called alone cannot be checked
        raise Unsupported(f"probe: the experts could not be run alone ({type(exc).__name__})") from None
    with torch.no_grad():
        got = _experts_reference(new, x, ids, w)
    if isinstance(want, torch.Tensor) and want.shape[-1] == got.shape[-1] and want.numel() == got.numel():
        want = want.reshape(got.shape)  # DBRX's experts return [T, 1, H]
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise Unsupported("probe: the experts' output is not a tensor of their input's shape")
    want = want.float()
    if not torch.isfinite(want).all():
        raise Unsupported("probe: the experts give non-finite outputs")
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    tol = 5e-3 if gate_up.dtype in (torch.float32, torch.float64) else 5e-2
    if not err <= tol:
        raise Unsupported(f"probe: the experts compute something else at large activations (a clamp?): relative "
                          f"error {err:.1e} > {tol:.0e}")  # fmt: skip


def _probeable(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return not any(t.is_meta or is_dtensor(t) for t in tensors)


def _probe_experts_alone(module: nn.Module, new: FlyExperts) -> None:
    """Raise ``Unsupported`` unless ``new`` reproduces the experts container on random tokens (half of them scaled so
    that the pre-activations reach ~1e3: clamps show), routed to every expert with random weights."""
    cols = new.gate_up_proj.detach().float().norm(dim=2)  # [E, 2I]: pre-activation std per row for unit tokens
    big = 1e3 / cols.max().clamp_min(1e-30).item()
    t, e = 32, new.num_experts
    k = min(2, e)
    g = torch.Generator().manual_seed(1)
    scale = torch.ones(t, 1).index_fill_(0, torch.arange(1, t, 2), big)
    device, dtype = new.gate_up_proj.device, new.gate_up_proj.dtype
    x = (torch.randn(t, new.hidden_size, generator=g) * scale).to(device=device, dtype=dtype)
    ids = torch.stack([(torch.arange(k) + i) % e for i in range(t)]).to(device)
    w = torch.rand(t, k, generator=g).to(device=device, dtype=dtype)
    try:
        with torch.no_grad(), _unobserved(module):
            want = module(x.clone(), ids, w)
    except Exception as exc:  # noqa: BLE001 - experts that cannot be called so cannot be checked
        raise Unsupported(f"probe: the experts could not be run alone ({type(exc).__name__})") from None
    with torch.no_grad():
        got = new(x, ids, w).float()
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise Unsupported("probe: the experts' output is not a tensor of their input's shape")
    want = want.float()
    if not torch.isfinite(want).all() or not want.any():
        raise Unsupported("probe: the experts give non-finite or zero outputs on random tokens, so it cannot tell")
    err = ((got - want).norm() / want.norm()).item()
    tol = 5e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    if not err <= tol:
        raise Unsupported(f"probe: the experts compute something else (relative error {err:.1e} > {tol:.0e})")


def _build_experts(module: nn.Module) -> nn.Module:
    """A transformers v5 experts container whose block is not swapped (the router stays stock): ``FlyExperts``."""
    if module._forward_hooks or module._forward_pre_hooks:
        raise Unsupported("experts have forward hooks, which the swapped container would not fire")
    try:
        new = FlyExperts.from_module(module)
    except ValueError as exc:
        raise Unsupported(str(exc).removeprefix(f"{type(module).__name__}: ")) from None
    if not _probeable(module):
        raise Unsupported("weights on meta / sharded: experts swapped alone need a probe on real weights")
    _check_state(module, new)
    _probe_experts_alone(module, new)
    new.train(module.training)
    return new


def _build(module: nn.Module, variant: str, root: nn.Module) -> nn.Module:
    if variant == "hf_experts":
        return _build_experts(module)
    if variant != "hf_v5":  # only transformers v5 blocks keep their router module, so only their router's hooks fire
        router = module.router.gate if variant == "torchtitan" else module.gate
        if router._forward_hooks or router._forward_pre_hooks:
            raise Unsupported("router has forward hooks, which the swapped block (router not kept) would not fire")
        if _records_router_logits(root):
            raise Unsupported("model records router logits (output_router_logits=True); this router is not kept")
    try:
        new = FlyMoE.from_module(module)
    except ValueError as exc:
        # the summary names the class already: the reason alone
        raise Unsupported(
            str(exc).removeprefix("FlyMoE.from_module: ").removeprefix(f"{type(module).__name__}: ")
        ) from None
    if variant == "hf_v5":
        # a kept router is observed as in the original block; one the swapped block does not call (AFMoE's router,
        # which takes the block's bias) is checked as the other variants' routers are
        called = getattr(module, "gate", None) or getattr(module, "router", None)
        if called is not None and new.router_call_module is not called:
            if called._forward_hooks or called._forward_pre_hooks:
                raise Unsupported("router has forward hooks, which the swapped block (router not run) would not fire")
            if _records_router_logits(root):
                raise Unsupported("model records router logits (output_router_logits=True); this router is not run")
    _check_state(module, new)
    cls = type(module)
    if not any(cls.__module__.startswith(prefix) and cls.__name__ == name for prefix, name in _KNOWN):
        if not _probeable(module):
            raise Unsupported("weights on meta / sharded: a block class not known to convert needs a probe on real "
                              "weights")  # fmt: skip
        if not _probe_with_random_bias(module, new):
            raise Unsupported("probe: the block outputs zeros on random tokens, so it cannot tell; a class not known "
                              "to convert needs a probe on nonzero weights")  # fmt: skip
        if variant == "hf_v5":
            _probe_experts(module, new)
    new.train(module.training)
    return new


register_matcher(Matcher("moe", "moe", _match, _build))
