"""The MX grouped GEMM on a real GPU: what the interpreter cannot show. The compiled kernel (hardware fp8 conversion,
bf16 dots, the persistent schedule) in every format pair and configuration against the fp32 product of the dequantised
operands, rows past the last offset unwritten, invalid device offsets clamped, NaN scales and element codes,
CUDA-graph replay with new offsets (the schedule is read on the device), and ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

import fly_lightning
from fly_lightning import DISPATCH_LOG
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm_reference

pytestmark = pytest.mark.gpu

COUNTS = [0, 130, 7, 0, 1000, 64, 1, 333]  # empty groups, a tiny one, one spanning many tiles, sizes off 16
PAIRS = [(None, "mxfp8_e4m3"), (None, "mxfp4_e2m1"), ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2"),
         ("mxfp4_e2m1", "mxfp4_e2m1"), ("mxfp8_e5m2", "mxfp8_e4m3"), ("mxfp8_e4m3", "mxfp4_e2m1")]  # fmt: skip


def _problem(counts, k, n, x_fmt, w_fmt, tail=0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts) + tail, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(len(counts), n, k, device="cuda", generator=gen) * k**-0.5
    wd, ws = fly_lightning.mx_cast(w.reshape(-1, k), w_fmt)
    xd, xs = (x, None) if x_fmt is None else fly_lightning.mx_cast(x, x_fmt)
    return (xd, xs, x_fmt, wd.reshape(len(counts), n, -1), ws.reshape(len(counts), n, -1), w_fmt, offs)


def _err(y, args) -> float:
    end = int(args[-1][-1])
    ref = mx_grouped_mm_reference(*args, torch.float32)[:end]
    return ((y[:end].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("x_fmt, w_fmt", PAIRS)
def test_dispatched_call_runs_triton_and_matches_the_dequantised_product(x_fmt, w_fmt):
    args = _problem(COUNTS, 512, 384, x_fmt, w_fmt, tail=9)
    y = fly_lightning.mx_grouped_mm(args[0], *args[3:7], x_scale=args[1], x_fmt=x_fmt)
    assert DISPATCH_LOG.records("mx_grouped_mm")[-1]["backend"] == "triton"
    assert y.dtype == torch.bfloat16 and _err(y, args) < 1e-2  # bf16 output rounding only


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_aten_path_rounds_other_outputs_once(out_dtype):
    # fp32 / fp16 out on ATen: fp32 sums rounded once to out_dtype (not through bf16), as the Triton kernel's
    args = _problem(COUNTS, 512, 384, "mxfp8_e4m3", "mxfp8_e4m3", tail=9)
    y = fly_lightning.get_op("mx_grouped_mm").impls["aten"].fn(*args, out_dtype)
    end = int(args[-1][-1])
    ref = mx_grouped_mm_reference(*args, torch.float32)[:end].double()  # the reference's fp32 sums
    assert y.dtype == out_dtype
    # fp32: summation order only; fp16: one rounding (2^-11 relative) of those sums; through bf16 sums (2^-9) fails
    rtol = 1e-5 if out_dtype == torch.float32 else 6e-4
    torch.testing.assert_close(y[:end].double(), ref, rtol=rtol, atol=1e-5 * ref.abs().max().item())


SWAP_PLANS = {  # per plan: uneven group sizes (empty groups included) whose mean rows per group select it
    "swapped": ([0, 40, 64, 3, 0, 17, 64, 1] * 4, 512, 384),  # 189 rows per 8 groups: under 64
    "swapped_mid": ([0, 140, 64, 300, 0, 17, 250, 1] * 2, 512, 384),  # 772 rows per 8 groups: 96.5
    "swapped_wide": ([0, 700, 300, 1000, 0, 620], 1024, 256),  # 2620 rows over 6 groups: 437
}


@pytest.mark.parametrize("plan", list(SWAP_PLANS))
@pytest.mark.parametrize("x_fmt, w_fmt", [p for p in PAIRS if p[0] is not None])
def test_swapped_plans_on_hopper(x_fmt, w_fmt, plan, monkeypatch):
    """Rows per group that select a swapped plan (x dequantised first, in the tiles' K order): the launcher picks it on
    Hopper; bf16 output against the dequantised product, rows past the end unwritten, the public call equal."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the swapped plans are Hopper's")
    picked = []
    choose = mk.choose_config
    monkeypatch.setattr(mk, "choose_config", lambda *a, **k: picked.append(choose(*a, **k)) or picked[-1])
    counts, k, n = SWAP_PLANS[plan]
    args = _problem(counts, k, n, x_fmt, w_fmt, tail=6)
    out = torch.full((args[0].shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    mk.launch(*args, out)  # the launcher's own plan
    assert picked == [{"swapped": mk.SWAPPED, "swapped_mid": mk.SWAPPED_MID, "swapped_wide": mk.SWAPPED_WIDE}[plan]]
    assert _err(out, args) < 1e-2 and out[int(args[-1][-1]) :].isnan().all()
    y = fly_lightning.mx_grouped_mm(args[0], *args[3:7], x_scale=args[1], x_fmt=x_fmt)
    assert torch.equal(y[: int(args[-1][-1])], out[: int(args[-1][-1])])


CONFIGS = {c.label(): c for c in (mk.SMALL_GROUPS, mk.MX_MX, mk.MXFP4_MXFP4, mk.WEIGHT_ONLY, mk.PREPASS,
                                   mk.MXGroupedMMConfig(64, 64, 128, 4, 2, 4, programs_per_sm=0),
                                   mk.MXGroupedMMConfig(64, 128, 128, 8, 3, 8, swap=True), mk.SWAPPED,
                                   mk.SWAPPED_MID, mk.SWAPPED_WIDE)}  # fmt: skip


@pytest.mark.parametrize(
    "name, x_fmt, w_fmt",  # the plans that dequantise x first take MX x only
    [(c, x, w) for c in CONFIGS for x, w in PAIRS[:3] if x is not None or not CONFIGS[c].x_prepass],
)
def test_configurations_leave_rows_past_the_end_unwritten(name, x_fmt, w_fmt):
    args = _problem(COUNTS, 768, 640, x_fmt, w_fmt, tail=5)
    out = torch.full((args[0].shape[0], 640), float("nan"), device="cuda")
    mk.launch(*args, out, config=CONFIGS[name])
    assert _err(out, args) < 1e-5  # fp32 output: the bf16 products are exact, only the summation order differs
    assert out[int(args[-1][-1]) :].isnan().all()


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("x_fmt, w_fmt", PAIRS)
def test_swapped_fragment_k_tiles(x_fmt, w_fmt, rows):
    """Swapped tiles summing K in the register fragment's order (MX x dequantised first): the compiled form against
    the dequantised product, rows past the end unwritten, and close to the natural K order's output."""
    from dataclasses import replace

    cfg = mk.MXGroupedMMConfig(rows, 128, 128, 8, 3, 8, swap=True)
    frag = replace(cfg, fragment_k=True, x_prepass=x_fmt is not None)
    args = _problem(COUNTS, 768, 640, x_fmt, w_fmt, tail=5)
    outs = []
    for c in (frag, cfg):
        out = torch.full((args[0].shape[0], 640), float("nan"), device="cuda")
        mk.launch(*args, out, config=c)
        assert _err(out, args) < 1e-5 and out[int(args[-1][-1]) :].isnan().all(), c
        outs.append(out)
    end = int(args[-1][-1])
    assert torch.allclose(outs[0][:end], outs[1][:end], rtol=1e-4, atol=1e-4 * outs[1][:end].abs().amax().item())


def test_nan_scales_and_element_codes_give_nan_rows():
    x_fmt = w_fmt = "mxfp8_e4m3"
    xd, xs, _, wd, ws, _, offs = _problem([64, 64], 256, 128, x_fmt, w_fmt)
    xs.view(torch.uint8)[3, 1] = 255  # a NaN scale: row 3 (group 0) is NaN in every column
    xd.view(torch.uint8)[70, 5] = 0x7F  # an e4m3 NaN element: row 70 (group 1)
    y = fly_lightning.mx_grouped_mm(xd, wd, ws, w_fmt, offs, x_scale=xs, x_fmt=x_fmt, out_dtype=torch.float32)
    nan_rows = y.isnan().any(1).nonzero().flatten().tolist()
    assert nan_rows == [3, 70] and y[[3, 70]].isnan().all()


def test_invalid_device_offsets_stay_inside_the_tensors():
    args = list(_problem([100, 50, 80], 256, 128, "mxfp8_e4m3", "mxfp8_e4m3"))
    args[-1] = torch.tensor([-5, 10**9, 20], device="cuda", dtype=torch.int32)  # clamped: [0, 230, 230]
    y = fly_lightning.mx_grouped_mm(args[0], *args[3:7], x_scale=args[1], x_fmt=args[2], out_dtype=torch.float32)
    torch.cuda.synchronize()
    clamped = list(args)
    clamped[-1] = torch.tensor([0, 230, 230], device="cuda", dtype=torch.int32)
    assert _err(y, clamped) < 1e-5


def test_cuda_graph_replay_follows_new_offsets():
    args = list(_problem([64, 64, 64, 64], 256, 256, None, "mxfp4_e2m1"))
    offs = args[-1]
    call = lambda: fly_lightning.mx_grouped_mm(args[0], *args[3:7], out_dtype=torch.float32)  # noqa: E731
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call()
    offs.copy_(torch.tensor([10, 200, 200, 256], device="cuda", dtype=torch.int32))
    graph.replay()
    assert _err(y, args) < 1e-5


def test_torch_compile_runs_the_custom_op():
    args = _problem([100, 0, 156], 256, 128, "mxfp8_e4m3", "mxfp8_e4m3")
    fn = torch.compile(lambda *a: fly_lightning.mx_grouped_mm(a[0], *a[3:7], x_scale=a[1], x_fmt=a[2]), fullgraph=True)
    assert _err(fn(*args), args) < 1e-2


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_moe_experts_mx_gemm_form_runs_triton_and_equals_the_emulated_form(fmt):
    """``FlyMXConfig(kernel_preference="mx_gemm")`` on a bf16 block: the projections cast and run the Triton
    ``mx_grouped_mm``; forward and gradients match the emulated form (the same MX values) to bf16 rounding."""
    from torchao.quantization import quantize_

    from fly_lightning import FlyMoE, FlyMXConfig, mx_filter

    def block() -> FlyMoE:
        torch.manual_seed(0)
        return FlyMoE(512, 256, 8, 2, device="cuda", dtype=torch.bfloat16)

    x0 = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    out = {}
    for preference in ("emulated", "mx_gemm"):
        moe = block()
        quantize_(moe, FlyMXConfig(fmt, fmt, kernel_preference=preference), filter_fn=mx_filter)
        fly_lightning.DISPATCH_LOG.reset()
        x = x0.clone().requires_grad_()
        y = moe(x)
        y.float().square().sum().backward()
        backends = {r["backend"] for r in fly_lightning.DISPATCH_LOG.records("mx_grouped_mm")}
        assert backends == ({"triton"} if preference == "mx_gemm" else set()), backends
        out[preference] = (y.float(), x.grad.float(), [p.grad.float() for p in moe.experts.parameters()])
    (y_e, gx_e, gw_e), (y_m, gx_m, gw_m) = out["emulated"], out["mx_gemm"]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y_m, y_e) < 1e-2 and rel(gx_m, gx_e) < 2e-2
    assert all(rel(a, b) < 2e-2 for a, b in zip(gw_m, gw_e, strict=True))


@pytest.mark.parametrize("config", [mk.SWAPPED, mk.SWAPPED_MID, mk.SWAPPED_WIDE, mk.PREPASS], ids=lambda c: c.label())
def test_mx_x_plans_nan_rows_invalid_offsets_and_graph_replay(config):
    """The plans for MX x that dequantise it first: NaN scales and element codes give NaN rows, invalid device offsets
    are clamped, a CUDA-graph replay follows new offsets (x's dequantisation and the GEMM both in the graph)."""
    x_fmt = w_fmt = "mxfp8_e4m3"
    args = list(_problem([64, 64, 200], 256, 128, x_fmt, w_fmt))
    xd, xs = args[0], args[1]
    xs.view(torch.uint8)[3, 1] = 255  # a NaN scale: row 3 NaN in every column
    xd.view(torch.uint8)[70, 5] = 0x7F  # an e4m3 NaN element: row 70
    y = mk.launch(*args, torch.zeros(328, 128, device="cuda", dtype=torch.bfloat16), config=config)
    assert y.isnan().any(1).nonzero().flatten().tolist() == [3, 70] and y[[3, 70]].isnan().all()
    args = list(_problem([100, 50, 80], 256, 128, x_fmt, w_fmt))
    offs = torch.tensor([-5, 10**9, 20], device="cuda", dtype=torch.int32)  # clamped: [0, 230, 230]
    out = torch.zeros(230, 128, device="cuda")
    call = lambda: mk.launch(*args[:6], offs, out, config=config)  # noqa: E731
    call()
    torch.cuda.synchronize()
    clamped = args[:6] + [torch.tensor([0, 230, 230], device="cuda", dtype=torch.int32)]
    assert _err(out, clamped) < 1e-5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    offs.copy_(torch.tensor([10, 200, 230], device="cuda", dtype=torch.int32))
    graph.replay()
    assert _err(out, args[:6] + [offs]) < 1e-5
