"""Compile-only tests of the FlyDSL MX grouped GEMM for gfx950 (the MX GEMM kernel's grouped form; no AMD GPU needed,
nothing is launched).

The MoE expert projections of Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B and a DeepSeek-V3 expert-parallel shard in
MXFP8 and MXFP4, mixed formats, fp32 output, both tiles and the largest group count are compiled in ONE child
process; the gfx950 assembly of each must show what the dense kernel's does (only the scaled MFMA with VGPR scales,
16-byte fragments, planned LDS, no scratch or spills: ``check_scaled_mfma_isa``) plus the device tile search (dword
offset loads, swizzle shuffles) and a runtime K loop. Without FlyDSL or ld.lld the compile tests skip with the
reason.
"""

import pytest
import torch

import fly_lightning
from fly_lightning.kernels.flydsl import _mx_scaled_mm_kernel as mxk
from tests.kernels.flydsl._compile_util import (
    OnRocm,
    check_gfx950_facts,
    check_refuses_other_amd_arch,
    check_registered_as_compile_only,
    check_scaled_mfma_isa,
    compile_cases,
    gfx950_verdict,
    print_isa_summary,
    trace_launches,
)

F8, F8E5, F4 = "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"

# (name, E, N, K): expert projections, w [E, N, K]
SHAPES = [
    ("qwen3-30b-gate-up", 128, 1536, 2048),
    ("qwen3-30b-down", 128, 2048, 768),
    ("olmoe-gate-up", 64, 2048, 2048),
    ("mixtral-down", 8, 4096, 14336),
]
SPECS = [{"case": f"{name}-{tag}", "E": e, "N": n, "K": k, "a_fmt": f, "b_fmt": f} for name, e, n, k in SHAPES
         for tag, f in (("fp8", F8), ("fp4", F4))]  # fmt: skip
SPECS += [
    {"case": "deepseek-ep8-e5m2xe4m3-fp32out", "E": 32, "N": 4096, "K": 7168, "a_fmt": F8E5, "b_fmt": F8,
     "out_dtype": torch.float32, "tile": "64x128"},
    {"case": "fp8xfp4-1024-groups", "E": 1024, "N": 256, "K": 384, "a_fmt": F8, "b_fmt": F4},
]  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_cases(mxk.compile_mx_scaled_mm_many, SPECS, tmp_path_factory.mktemp("mx_grouped_mm"))


@pytest.mark.parametrize("i", range(len(SPECS)), ids=[s["case"] for s in SPECS])
def test_mx_grouped_mm_compiles_for_gfx950(compiled, i):
    spec, facts = SPECS[i], compiled[i]
    asm = check_gfx950_facts(facts, mxk.KERNEL_NAME)
    plan = facts["plan"]
    assert (plan["E"], plan["N"], plan["K"]) == (spec["E"], spec["N"], spec["K"])
    check_scaled_mfma_isa(facts, asm, spec["a_fmt"], spec["b_fmt"], spec.get("out_dtype"), grouped=True)
    assert "ds_swizzle_b32" in asm  # the wave scans of the tile search


def test_isa_facts_summary(compiled):
    print_isa_summary(SPECS, compiled, lambda f, asm: f"E={f['plan']['E']} mfma={asm.count(mxk.MFMA)}")


def test_support_and_tiles():
    assert mxk.supports(4096, 1536, 2048, F8, F8, torch.bfloat16, E=128) == (True, "ok")
    assert "E=1025" in mxk.supports(4096, 256, 256, F8, F8, torch.bfloat16, E=1025)[1]
    ok, reason = mxk.supports(1024, 4096, 7168, F8, F8, torch.bfloat16, E=128)  # w: 3.5 GiB of fp8
    assert not ok and reason.startswith("b is")
    assert mxk.pick_tile(8191, E=64) == "64x128" and mxk.pick_tile(8192, E=64) == "128x128"
    assert mxk.make_plan(1536, 2048, F4, F4, torch.bfloat16, E=128).E == 128


def _operands(m=300, e=4, n=256, k=512, x_fmt=F8, w_fmt=F8, rocm=True):
    def mx(shape, fmt):
        data = (
            torch.zeros(*shape[:-1], shape[-1] // 2, dtype=torch.uint8)
            if fmt == F4
            else torch.zeros(shape).to(formats.FORMATS[fmt].torch_dtype)
        )
        scale = torch.full((*shape[:-1], shape[-1] // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return data, scale

    from fly_lightning.quant import formats

    x, xs = mx((m, k), x_fmt) if x_fmt else (torch.zeros(m, k, dtype=torch.bfloat16), None)
    w, ws = mx((e, n, k), w_fmt)
    offs = torch.tensor([m // 4, m // 4, m // 2, m], dtype=torch.int32)[:e]
    if rocm:
        x, w, offs = OnRocm(x), OnRocm(w), OnRocm(offs)
    return x, xs, x_fmt, w, ws, w_fmt, offs, torch.bfloat16


@pytest.mark.parametrize(
    "make,expect",
    [
        (lambda: _operands(), True),
        (lambda: _operands(x_fmt=F4, w_fmt=F4), True),
        (lambda: _operands(rocm=False), "tensor not on a ROCm device"),
        (lambda: _operands(x_fmt=None), "weight-only"),
        (lambda: _operands(k=480), "K=480"),
        (lambda: _operands(n=250), "N=250"),
    ],
)
def test_registered_support_predicate(monkeypatch, make, expect):
    from fly_lightning.kernels.flydsl import mx_grouped_mm as backend

    verdict = gfx950_verdict(monkeypatch, backend, make())
    assert verdict is True if expect is True else expect in verdict


def test_registered_support_predicate_names_a_layout_copy(monkeypatch):
    from fly_lightning.kernels.flydsl import mx_grouped_mm as backend

    ops = list(_operands())
    ops[4] = torch.full((4, 256, 32), 127, dtype=torch.uint8)[:, :, ::2].view(torch.float8_e8m0fnu)
    nbytes = ops[4].numel()  # E8M0: one byte each
    assert gfx950_verdict(monkeypatch, backend, tuple(ops)) == (
        f"w_scale not contiguous (a layout copy of {nbytes} bytes would fit it)"
    )


def test_registered_support_predicate_refuses_other_amd_arch(monkeypatch):
    from fly_lightning.kernels.flydsl import mx_grouped_mm as backend

    check_refuses_other_amd_arch(monkeypatch, backend, _operands())


def test_registered_as_compile_only():
    from fly_lightning.ops.mx_grouped_mm import MX_GROUPED_MM

    check_registered_as_compile_only(MX_GROUPED_MM)


def test_cpu_call_runs_on_aten_with_the_reason():
    """On this host the op never reaches the kernel: the dispatcher serves ATen and records why not FlyDSL."""
    from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm, mx_grouped_mm_reference
    from fly_lightning.quant import formats

    g = torch.Generator().manual_seed(0)
    xd, xs = formats.to_mx(torch.randn(40, 128, generator=g), F8)
    wd, ws = formats.to_mx(torch.randn(3, 16, 128, generator=g), F8)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    with fly_lightning.dispatch_config(fly_lightning.DispatchConfig(backends=("flydsl",))):
        y = mx_grouped_mm(xd, wd, ws, F8, offs, x_scale=xs, x_fmt=F8, out_dtype=torch.float32)
    want = mx_grouped_mm_reference(xd, xs, F8, wd, ws, F8, offs, torch.float32)
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_grouped_mm")
    assert rec["backend"] == "aten" and rec["fallback"] and "flydsl" in rec["reason"] and "ROCm" in rec["reason"]


LAUNCH_MODULE = """
import os
import torch
import _mx_scaled_mm_kernel as mxk  # the child has the kernel folder on its path

def trace_launches():
    # COMPILE_ONLY=1 and CPU tensors: flyc.compile traces + compiles with launch_mx_grouped_mm's real argument list
    # (flat dword views of data, scales and offsets) and returns None instead of launching.
    assert os.environ["COMPILE_ONLY"] == "1"
    torch.cuda.current_stream = lambda device=None: None  # CPU-only torch has no streams
    scale = lambda *shape: torch.full(shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    offs = torch.tensor([100, 100, 300, 333], dtype=torch.int32)
    x = torch.randn(333, 512).to(torch.float8_e4m3fn)
    w = torch.randn(4, 256, 512).to(torch.float8_e4m3fn)
    out = mxk.launch_mx_grouped_mm(x, scale(333, 16), "mxfp8_e4m3", w, scale(4, 256, 16), "mxfp8_e4m3", offs)
    keys = [str(k[:7]) for k in mxk._LAUNCHERS]
    return {"ok": True, "keys": keys, "shape": list(out.shape), "dtype": str(out.dtype)}
"""


def test_launch_function_traces_and_compiles(tmp_path):
    facts = trace_launches(tmp_path, LAUNCH_MODULE)
    assert facts["keys"] == ["(256, 512, 'mxfp8_e4m3', 'mxfp8_e4m3', torch.bfloat16, '64x128', 4)"]
    assert facts["shape"] == [333, 256] and facts["dtype"] == "torch.bfloat16"
    assert [p.parent.name for p in (tmp_path / "dump").glob("*/*final_isa.s")] == ["fly_mx_scaled_mm_fwd_0"]


def test_a_misaligned_call_under_a_cached_decision_runs_aten(monkeypatch):
    """As the dense op: alignment is checked per call, since the dispatch key holds no addresses."""
    import fly_lightning
    from fly_lightning.kernels.flydsl import mx_grouped_mm as backend
    from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm_reference

    monkeypatch.setattr(backend.kernel, "launch_mx_grouped_mm", lambda *args: "kernel")
    x, xs, _, w, ws, _, offs, out = _operands(m=16, e=2, n=8, k=128, rocm=False)
    assert backend.mx_grouped_mm_flydsl(x, xs, F8, w, ws, F8, offs, out) == "kernel"
    odd = torch.zeros(x.numel() + 1, dtype=torch.uint8)[1:].view(x.dtype).view(x.shape)
    odd.copy_(x)
    y = backend.mx_grouped_mm_flydsl(odd, xs, F8, w, ws, F8, offs, out)
    rows = int(offs[-1])  # rows past the last offset are left unwritten
    torch.testing.assert_close(y[:rows], mx_grouped_mm_reference(x, xs, F8, w, ws, F8, offs, out)[:rows])
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_grouped_mm")
    assert rec["fallback"] and "x not 16-byte aligned on this call" in rec["reason"]
