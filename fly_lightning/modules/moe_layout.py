"""Expert weight containers whose parameter names and shapes are those of the common MoE implementations.

``FlyMoE`` keeps each model's own checkpoint layout, so swapping it in changes no state_dict key or shape. Keys are
relative to the MoE block; E experts, hidden size H, expert intermediate size I:

- ``hf`` (transformers v5 Mixtral, Qwen2/3-MoE, OLMoE, ...): ``gate.weight`` [E, H], ``experts.gate_up_proj``
  [E, 2I, H] (gate rows first), ``experts.down_proj`` [E, H, I]. Stored as named.
- ``mixtral`` (per-expert Linear lists): ``gate.weight``, ``experts.{i}.w1.weight`` [I, H] (gate),
  ``experts.{i}.w3.weight`` [I, H] (up), ``experts.{i}.w2.weight`` [H, I] (down). Stored stacked.
- ``qwen`` (per-expert Linear lists of transformers 4 Qwen2/3-MoE and OLMoE): ``gate.weight``,
  ``experts.{i}.gate_proj.weight`` [I, H], ``experts.{i}.up_proj.weight`` [I, H], ``experts.{i}.down_proj.weight``
  [H, I]. Stored stacked.
- ``torchtitan``: ``router.gate.weight`` [E, H], ``experts.w1`` [E, I, H] (gate), ``experts.w3`` [E, I, H] (up),
  ``experts.w2`` [E, H, I] (down), plus ``expert_bias`` [E] with load balancing. Stored as named.
- ``torchtitan_legacy``: as ``torchtitan`` with ``w1``/``w3`` [E, H, I] and ``w2`` [E, I, H]. Stored as named.
- ``hf_transposed`` (transformers Llama-4): ``experts.gate_up_proj`` [E, H, 2I] (gate columns first),
  ``experts.down_proj`` [E, I, H]. Stored as named.
- ``dbrx`` (transformers DBRX): ``experts.mlp.w1`` (gate), ``experts.mlp.v1`` (up), ``experts.mlp.w2`` (down), each
  [E * I, H]. Stored as named.

The router lives at ``gate`` (``router.gate`` for torchtitan) unless ``FlyMoE``'s ``router_path`` says otherwise.

"Stored as named": the parameters are the model's own tensors (shared, not copied, by ``FlyMoE.from_module``).
"Stored stacked": a grouped GEMM needs each projection contiguous over experts, so the per-expert matrices live in
one ``[E, 2I, H]`` and one ``[E, H, I]`` parameter; state_dict hooks present and accept the per-expert keys, as
views of the stacked storage (in-place loading, e.g. by distributed checkpointing, writes through; the keys also
resolve as attributes, as ``get_model_state_dict`` needs). Optimizer state and ``named_parameters`` use the stacked
names.

Every container exposes ``projections()``: the ``[E, K, N]`` weights of the grouped GEMMs (transposed views, no
copy): ``(gate_up or gate, up or None, down)``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

LAYOUTS = ("hf", "mixtral", "qwen", "torchtitan", "torchtitan_legacy", "hf_transposed", "dbrx")
LIST_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}
STOCK_ORDER = {("w1", "w3", "w2"): ("w1", "w2", "w3")}  # transformers 4's Mixtral expert defines w1, w2, w3


class _Initialised(nn.Module):
    """A container whose own parameters ``reset_parameters`` initialises (normal, ``FlyMoE.reset_parameters``' std):
    Lightning's FSDP2 / model-parallel setup calls it on every module holding parameters when it materialises a model
    built on the meta device; without it they would keep uninitialised memory."""

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            for p in self.parameters(recurse=False):
                nn.init.normal_(p, std=std)


class RouterWeight(_Initialised):
    """The router's ``[E, H]`` weight (``gate.weight``, or ``router.gate.weight`` in torchtitan)."""

    def __init__(self, num_experts: int, hidden_size: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))


class FusedExperts(_Initialised):
    """transformers v5 experts: ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None, dtype=None) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device=device, dtype=dtype))

    def projections(self) -> tuple[Tensor, Tensor | None, Tensor]:
        return self.gate_up_proj.transpose(1, 2), None, self.down_proj.transpose(1, 2)


class ExpertList(FusedExperts):
    """Per-expert Linear weights in the state dict (``{i}.w1.weight`` ...) over stacked storage."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        names: tuple[str, str, str],
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, device, dtype)
        self.names = tuple(names)  # (gate, up, down)
        # the per-expert parameter order of the original module (how its optimizer listed them); conversion sets it
        self.stock_order = STOCK_ORDER.get(self.names, self.names)
        self.register_state_dict_post_hook(_list_state_dict_hook)
        self.register_load_state_dict_pre_hook(_list_load_hook)

    def extra_repr(self) -> str:
        return f"state_dict names={self.names}"

    def __getattr__(self, name: str):
        """``experts.{i}.{w1}.weight`` as attributes too: tools that resolve state_dict keys by attribute lookup
        (``torch.distributed.checkpoint``'s ``get_model_state_dict``, what Lightning's FSDP2 / model-parallel
        checkpointing calls) find the per-expert views the state_dict presents."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.isdigit() and int(name) < self.gate_up_proj.shape[0]:
                return _ExpertView(self, int(name))
            raise


class _ExpertView:
    """Expert ``i`` of an ``ExpertList``: ``.{gate, up, down name}.weight``, views of the stacked storage."""

    def __init__(self, experts: ExpertList, i: int) -> None:
        self._experts, self._i = experts, i

    def __getattr__(self, name: str):
        if name not in self._experts.names:
            raise AttributeError(name)
        inter = self._experts.gate_up_proj.shape[1] // 2
        gate, up, down = self._experts.names
        gu, dp = self._experts.gate_up_proj[self._i], self._experts.down_proj[self._i]
        return SimpleNamespace(weight={gate: gu[:inter], up: gu[inter:], down: dp}[name])


def _list_keys(module: ExpertList, prefix: str, i: int) -> tuple[str, str, str]:
    return tuple(f"{prefix}{i}.{name}.weight" for name in module.names)


def _list_state_dict_hook(module: ExpertList, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    gate_up = state_dict.pop(prefix + "gate_up_proj")
    down = state_dict.pop(prefix + "down_proj")
    inter = gate_up.shape[1] // 2
    for i in range(gate_up.shape[0]):
        kg, ku, kd = _list_keys(module, prefix, i)
        views = {module.names[0]: (kg, gate_up[i, :inter]), module.names[1]: (ku, gate_up[i, inter:]),
                 module.names[2]: (kd, down[i])}  # fmt: skip
        for name in module.stock_order:  # the original module's key order (Mixtral: w1, w2, w3)
            key, view = views[name]
            state_dict[key] = view


def _list_load_hook(
    module: ExpertList,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    keys = [_list_keys(module, prefix, i) for i in range(module.gate_up_proj.shape[0])]
    if not all(k in state_dict for ks in keys for k in ks):
        return  # stacked keys, or an incomplete list: the ordinary missing/unexpected key report applies
    gates = [state_dict.pop(kg) for kg, _, _ in keys]
    ups = [state_dict.pop(ku) for _, ku, _ in keys]
    downs = [state_dict.pop(kd) for _, _, kd in keys]
    state_dict[prefix + "gate_up_proj"] = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
    state_dict[prefix + "down_proj"] = torch.stack(downs)


def stack_expert_lists(model: nn.Module, state_dict: dict, read: bool = True) -> dict:
    """``state_dict`` (``model``'s keys, or the original per-expert keys of its ``ExpertList`` blocks, as
    ``model.state_dict()`` writes them) with every complete per-expert list stacked into the block's parameters, in
    place: what ``load_state_dict``'s hook does, for loaders that match keys to parameters without it (a full FSDP2
    checkpoint through ``torch.distributed.checkpoint``'s ``set_model_state_dict``). ``read=False``: the stacked
    tensors are left uninitialised (no page of a memory-mapped file read), for ranks that receive rank 0's values."""
    for name, m in model.named_modules():
        if not isinstance(m, ExpertList):
            continue
        prefix = f"{name}." if name else ""
        if read:
            _list_load_hook(m, state_dict, prefix, {}, True, [], [], [])
            continue
        keys = [k for i in range(m.gate_up_proj.shape[0]) for k in _list_keys(m, prefix, i)]
        if all(k in state_dict for k in keys):
            dtype = state_dict[keys[0]].dtype
            for k in keys:
                del state_dict[k]
            state_dict[prefix + "gate_up_proj"] = torch.empty(m.gate_up_proj.shape, dtype=dtype)
            state_dict[prefix + "down_proj"] = torch.empty(m.down_proj.shape, dtype=dtype)
    return state_dict


class SplitExperts(_Initialised):
    """torchtitan ``GroupedExperts``: ``w1`` (gate), ``w3`` (up), ``w2`` (down) as 3-D parameters.

    Current torchtitan stores them like stacked ``nn.Linear`` weights (``w1``/``w3`` [E, I, H], ``w2`` [E, H, I]);
    ``legacy=True`` is the earlier transposed layout (``w1``/``w3`` [E, H, I], ``w2`` [E, I, H]).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, legacy: bool = False, device=None, dtype=None
    ) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.legacy = legacy
        up_shape, down_shape = ((e, h, i), (e, i, h)) if legacy else ((e, i, h), (e, h, i))
        self.w1 = nn.Parameter(torch.empty(up_shape, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(down_shape, device=device, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(up_shape, device=device, dtype=dtype))

    def projections(self) -> tuple[Tensor, Tensor | None, Tensor]:
        if self.legacy:
            return self.w1, self.w3, self.w2
        return self.w1.transpose(1, 2), self.w3.transpose(1, 2), self.w2.transpose(1, 2)

    def extra_repr(self) -> str:
        return "legacy=True" if self.legacy else ""


class TransposedFusedExperts(_Initialised):
    """transformers Llama-4 experts: ``gate_up_proj`` [E, H, 2I] (gate columns, then up) and ``down_proj`` [E, I, H],
    already the grouped GEMMs' ``[E, K, N]`` operands."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None, dtype=None) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, device=device, dtype=dtype))

    def projections(self) -> tuple[Tensor, Tensor | None, Tensor]:
        return self.gate_up_proj, None, self.down_proj


class DbrxExperts(_Initialised):
    """transformers DBRX experts: ``mlp.w1`` (gate), ``mlp.v1`` (up), ``mlp.w2`` (down), each ``[E * I, H]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None, dtype=None) -> None:
        super().__init__()
        shape = (num_experts * intermediate_size, hidden_size)
        self.num_experts = num_experts
        self.mlp = nn.Module()
        for name in ("w1", "v1", "w2"):
            setattr(self.mlp, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))

    def projections(self) -> tuple[Tensor, Tensor | None, Tensor]:
        e, (ei, h) = self.num_experts, self.mlp.w1.shape
        split = lambda w: w.view(e, ei // e, h)  # noqa: E731
        return split(self.mlp.w1).transpose(1, 2), split(self.mlp.v1).transpose(1, 2), split(self.mlp.w2)


def make_experts(
    layout: str, num_experts: int, hidden_size: int, intermediate_size: int, device=None, dtype=None
) -> nn.Module:
    args = (num_experts, hidden_size, intermediate_size)
    if layout == "hf":
        return FusedExperts(*args, device=device, dtype=dtype)
    if layout in LIST_NAMES:
        return ExpertList(*args, LIST_NAMES[layout], device=device, dtype=dtype)
    if layout in ("torchtitan", "torchtitan_legacy"):
        return SplitExperts(*args, legacy=layout == "torchtitan_legacy", device=device, dtype=dtype)
    if layout == "hf_transposed":
        return TransposedFusedExperts(*args, device=device, dtype=dtype)
    if layout == "dbrx":
        return DbrxExperts(*args, device=device, dtype=dtype)
    raise ValueError(f"unknown expert layout {layout!r}; known: {LAYOUTS}")


def init_experts(experts: nn.Module, std: float = 0.02) -> None:
    for p in experts.parameters():
        nn.init.normal_(p, std=std)
