"""The grouped-GEMM benchmark cases: 24 in three families, and the tensors for one case.

- ``uniform``: equal groups over a range of expert counts and group sizes (64 to 4096 rows per expert);
- ``projection``: the gate/up (``[H] -> [2I]``) and down (``[I] -> [H]``) projections of real MoE models with a
  balanced router: Mixtral-8x7B, Qwen3-30B-A3B, OLMoE-1B-7B and a DeepSeek-V3-like expert-parallel rank;
- ``uneven``: the same model shapes under skewed loads: Zipf, one hot expert, half the experts empty, one expert
  taking every row.

Model projections use the transformers/nn.Linear weight layout (the transposed view of a contiguous [E, N, K]);
half the uniform cases use the N-contiguous [E, K, N] layout. Loads are deterministic (seeded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fly_lightning import grouped_mm, mx_cast
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm_reference
from fly_lightning.quant.formats import from_mx

# (name, hidden H, expert intermediate I, experts E, top-k, tokens T): M = T * k rows per projection
MODELS = {
    "mixtral-8x7b": (4096, 14336, 8, 2, 8192),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 8192),
    "olmoe-1b-7b": (2048, 1024, 64, 8, 8192),
    "deepseek-v3-ep8": (7168, 2048, 32, 8, 4096),  # 256 experts over 8 ranks: 32 local, 1024 rows each
}


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    e: int
    k: int
    n: int
    counts: tuple[int, ...]
    k_major: bool = True
    load: str = "uniform"

    @property
    def m(self) -> int:
        return sum(self.counts)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def shape_key(self) -> tuple:
        """What a compiled kernel is specialised on (the Inductor peer compiles once per key)."""
        return (self.m, self.k, self.n, self.e, self.k_major)


def uniform_counts(m: int, e: int) -> tuple[int, ...]:
    return tuple(m // e + (1 if i < m % e else 0) for i in range(e))


def _shuffle(counts: list[int], seed: int) -> tuple[int, ...]:
    order = torch.randperm(len(counts), generator=torch.Generator().manual_seed(seed)).tolist()
    return tuple(counts[i] for i in order)


def _from_weights(m: int, p: list[float], seed: int) -> tuple[int, ...]:
    total = sum(p)
    raw = [m * q / total for q in p]
    counts = [math.floor(r) for r in raw]
    for i in sorted(range(len(p)), key=lambda i: raw[i] - counts[i], reverse=True)[: m - sum(counts)]:
        counts[i] += 1
    return _shuffle(counts, seed)


def zipf_counts(m: int, e: int, s: float, empty_frac: float = 0.0, seed: int = 0) -> tuple[int, ...]:
    p = [r**-s for r in range(1, e + 1)]
    for i in range(e - int(e * empty_frac), e):
        p[i] = 0.0
    return _from_weights(m, p, seed)


def hot_counts(m: int, e: int, hot_frac: float, seed: int = 0) -> tuple[int, ...]:
    p = [hot_frac] + [(1 - hot_frac) / (e - 1)] * (e - 1)
    return _from_weights(m, p, seed)


def empty_counts(m: int, e: int, empty_frac: float, seed: int = 0) -> tuple[int, ...]:
    live = e - int(e * empty_frac)
    return _from_weights(m, [1.0] * live + [0.0] * (e - live), seed)


def _projections(model: str) -> tuple[tuple[int, int], tuple[int, int], int, int]:
    h, i, e, k, t = MODELS[model]
    return (h, 2 * i), (i, h), e, t * k


def cases() -> list[Case]:
    out = []
    for j, (e, per, k, n) in enumerate(
        [(8, 4096, 4096, 4096), (8, 2048, 7168, 2048), (16, 1024, 4096, 4096), (32, 512, 2048, 4096),
         (64, 256, 2048, 2048), (128, 128, 2048, 1536), (128, 64, 4096, 1024), (16, 1000, 2048, 2816)]
    ):  # fmt: skip
        out.append(Case(f"uniform-E{e}-m{per}-K{k}-N{n}", "uniform", e, k, n, uniform_counts(e * per, e), j % 2 == 0))
    for model in MODELS:
        (gk, gn), (dk, dn), e, m = _projections(model)
        out.append(Case(f"{model}-gate_up", "projection", e, gk, gn, uniform_counts(m, e)))
        out.append(Case(f"{model}-down", "projection", e, dk, dn, uniform_counts(m, e)))
    skews = {
        "mixtral-8x7b": (("zipf1.2", lambda m, e: zipf_counts(m, e, 1.2, seed=1)),
                         ("hot75%", lambda m, e: hot_counts(m, e, 0.75, seed=2))),
        "qwen3-30b-a3b": (("zipf1.0", lambda m, e: zipf_counts(m, e, 1.0, seed=3)),
                          ("half-empty", lambda m, e: empty_counts(m, e, 0.5, seed=4))),
        "olmoe-1b-7b": (("zipf1.5", lambda m, e: zipf_counts(m, e, 1.5, seed=5)),
                        ("one-takes-all", lambda m, e: hot_counts(m, e, 1.0, seed=6))),
        "deepseek-v3-ep8": (("zipf1.2+25%empty", lambda m, e: zipf_counts(m, e, 1.2, 0.25, seed=7)),
                            ("zipf2.0", lambda m, e: zipf_counts(m, e, 2.0, seed=8))),
    }  # fmt: skip
    for model, ((l1, f1), (l2, f2)) in skews.items():
        (gk, gn), (dk, dn), e, m = _projections(model)
        out.append(Case(f"{model}-gate_up-{l1}", "uneven", e, gk, gn, f1(m, e), load=l1))
        out.append(Case(f"{model}-down-{l2}", "uneven", e, dk, dn, f2(m, e), load=l2))
    return out


def make_inputs(case: Case, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """x [M, K], w [E, K, N] (K-major view or N-major), int32 offsets: scaled so outputs are O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(case.m, case.k, device=device, dtype=dtype, generator=gen)
    shape = (case.e, case.n, case.k) if case.k_major else (case.e, case.k, case.n)
    w = torch.randn(shape, device=device, dtype=dtype, generator=gen) * case.k**-0.5
    if case.k_major:
        w = w.transpose(1, 2)
    offs = torch.tensor(case.counts, device=device).cumsum(0).to(torch.int32)
    return x, w, offs


def mx_weights(w_EKN: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_inputs``' weights ``[E, K, N]`` cast to MX ``fmt`` along K, as the MX grouped GEMM takes them: data
    ``[E, N, K / per_byte]``, scales ``[E, N, K / 32]``."""
    e, k, n = w_EKN.shape
    data, scale = mx_cast(w_EKN.transpose(1, 2).reshape(e * n, k), fmt)
    return data.view(e, n, -1), scale.view(e, n, -1)


def mx_probe_operands(case: Case, fmt: str) -> tuple:
    """For the MX grouped probes: the case's operands cast to ``fmt`` (weights as ``[E * N, K]`` rows), the MX
    arguments of ``mx_grouped_mm`` / the kernel launcher (x data, x scales, x format, w data ``[E, N, K / per_byte]``,
    w scales, w format, offsets), our bf16 grouped GEMM on the dequantised operands as a function (the ratios' base),
    the fp32 reference and a bf16 output buffer: ``(xd, xs, wd, ws, args, bf16, ref, out)``."""
    x, w, offs = make_inputs(case)
    e, n, k = case.e, case.n, case.k
    xd, xs = mx_cast(x, fmt)
    wd, ws = mx_cast(w.transpose(1, 2).reshape(-1, k), fmt)
    xb, wb = from_mx(xd, xs, fmt, torch.bfloat16), from_mx(wd, ws, fmt, torch.bfloat16).view(e, n, k)
    args = (xd, xs, fmt, wd.view(e, n, -1), ws.view(e, n, -1), fmt, offs)
    out = torch.empty(case.m, n, device=x.device, dtype=torch.bfloat16)

    def bf16() -> torch.Tensor:
        return grouped_mm(xb, wb.transpose(1, 2), offs)

    return xd, xs, wd, ws, args, bf16, mx_grouped_mm_reference(*args, torch.float32), out
