"""The routing benchmark cases (``bench_moe_route``, ``bench_moe_route_floor``, ``goal_bounds``): ten routers of real
MoE models, their inputs, the bytes a router moves, and the ATen routing sequence every case is measured against.

The ATen sequence is what a model does today: scores, top-k (with selection bias and expert groups where the model
has them), gate renormalisation and scale, per-expert counts with ``scatter_add_`` (graph-capturable, deterministic for
1-D input) and ``cumsum`` offsets; ``counts="bincount"`` counts with ``torch.bincount`` instead (it synchronises with
the host, so it can be timed only eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.harness import rotation_count

MIB = 2**20
BIG_LOGITS_BYTES = 16 * MIB  # the copy-bandwidth goal counts the cases with at least this much logits


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    experts: int
    k: int
    dtype: torch.dtype = torch.bfloat16
    score: str = "softmax"
    renormalize: bool = True
    bias: bool = False
    n_groups: int | None = None
    topk_groups: int | None = None
    route_scale: float = 1.0
    permutation: bool = False  # also time the variant that returns the token permutation

    @property
    def logits_bytes(self) -> int:
        return self.tokens * self.experts * torch.finfo(self.dtype).bits // 8


CASES = [
    Case("mixtral", 16384, 8, 2, permutation=True),
    Case("qwen2-moe", 4096, 60, 4, renormalize=False),
    Case("olmoe", 16384, 64, 8, renormalize=False),
    Case("qwen3-moe", 16384, 128, 8),
    Case("qwen3-moe-64k", 65536, 128, 8, permutation=True),
    Case("deepseek-v3-fp32", 16384, 256, 8, torch.float32, "sigmoid", True, True, 8, 4, 2.5, permutation=True),
    Case("deepseek-v3-64k", 65536, 256, 8, torch.bfloat16, "sigmoid", True, True, 8, 4, 2.5),
    Case("glm-4.5", 32768, 160, 8, torch.bfloat16, "sigmoid", True, True, route_scale=2.5),
    Case("llama4", 65536, 16, 1, score="sigmoid", renormalize=False),
    Case("deepseek-v2-lite-fp32", 65536, 64, 6, torch.float32, renormalize=False),
]


def route_args(case: Case, bias: torch.Tensor | None) -> tuple:
    """The arguments after the logits, in ``moe_route``'s order (``aten_route`` takes the same)."""
    return (case.k, case.score, case.renormalize, bias, case.route_scale, case.n_groups, case.topk_groups)


def route_inputs(case: Case, device) -> tuple[list[tuple], torch.Tensor | None]:
    """Input sets of logits (enough to rotate past the L2), and the selection bias where the case has one."""
    g = torch.Generator(device=device).manual_seed(0)
    sets = rotation_count(case.logits_bytes)
    xs = [(torch.randn(case.tokens, case.experts, device=device, generator=g) * 2).to(case.dtype) for _ in range(sets)]
    bias = (torch.randn(case.experts, device=device, generator=g) * 0.05) if case.bias else None
    return [(x,) for x in xs], bias


def route_bytes(case: Case, permutation: bool = False) -> int:
    """Bytes a router moves: logits read; fp32 weights and int32 ids, counts and offsets written (and the two int32
    permutation arrays with ``permutation``)."""
    out = case.tokens * case.k * 8 + case.experts * 8
    return case.logits_bytes + out + (case.tokens * case.k * 8 if permutation else 0)


def aten_route(logits, k, score, renorm, bias, route_scale, n_groups, topk_groups, counts="scatter"):
    """The ATen routing sequence: (weights fp32 [T, k], ids int32 [T, k], counts int32 [E], offsets int32 [E])."""
    s = torch.softmax(logits.float(), dim=-1) if score == "softmax" else torch.sigmoid(logits.float())
    if bias is None and n_groups is None:
        w, ids = torch.topk(s, k, dim=-1)
    else:
        sel = s if bias is None else s + bias
        if n_groups is not None:
            t, e = sel.shape
            group_scores = sel.view(t, n_groups, -1).topk(2, dim=-1).values.sum(-1)
            chosen = group_scores.topk(topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
            sel = sel.masked_fill(~keep.repeat_interleave(e // n_groups, dim=1), float("-inf"))
        ids = torch.topk(sel, k, dim=-1).indices
        w = s.gather(1, ids)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * route_scale
    flat = ids.flatten()
    if counts == "scatter":
        n = torch.zeros(logits.shape[1], dtype=torch.int32, device=logits.device)
        n = n.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    else:
        n = torch.bincount(flat, minlength=logits.shape[1]).to(torch.int32)
    return w, ids.to(torch.int32), n, torch.cumsum(n, 0, dtype=torch.int32)


def aten_route_permutation(logits, *args):
    """``aten_route`` plus the stable token permutation by expert and its inverse (int32)."""
    w, ids, n, offsets = aten_route(logits, *args)
    perm = torch.argsort(ids.flatten(), stable=True)
    pos = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return w, ids, n, offsets, perm.to(torch.int32), pos.to(torch.int32)
