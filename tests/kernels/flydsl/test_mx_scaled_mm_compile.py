"""Compile-only tests of the FlyDSL MX GEMM for gfx950 (no AMD GPU needed, nothing is launched).

The specialisations of a few LLM projection shapes (Llama-3-8B attention / MLP, Qwen3-30B-A3B attention, a
Mixtral-sized down projection) in MXFP8 x MXFP8 and MXFP4 x MXFP4, plus mixed formats (e5m2, fp8 x fp4), fp16 /
fp32 output, the 64-row tile and an fp4 K that is not a multiple of 256 (one MFMA step per stage), are compiled in
ONE child process, then the gfx950 assembly of each is checked for what the design depends on: only the scaled MFMA
``v_mfma_scale_f32_16x16x128_f8f6f4`` with each operand's format code and VGPR scale operands (the scales are
applied by the instruction: no conversion instructions), 16-byte LDS reads for every MFMA fragment (two per fp8
lane, one per fp4 lane) and one ``ds_read_u8`` per fragment's scale, 16-byte LDS writes for the data, dword writes for
the scales, 16-byte global loads, the planned LDS size, a runtime K loop, no scratch and no spills. Without FlyDSL or
ld.lld the compile tests skip with the reason.
"""

import pytest
import torch

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

# (name, N, K): projections of [tokens, K] activations by an [N, K] weight
SHAPES = [
    ("llama8b-qkv", 6144, 4096),
    ("llama8b-o", 4096, 4096),
    ("llama8b-gate-up", 28672, 4096),
    ("llama8b-down", 4096, 14336),
    ("qwen3-30b-qkv", 5120, 2048),
    ("mixtral-down", 4096, 14336),
]
SPECS = [{"case": f"{name}-{tag}", "N": n, "K": k, "a_fmt": f, "b_fmt": f} for name, n, k in SHAPES[:5] for tag, f in
         (("fp8", F8), ("fp4", F4))]  # fmt: skip
SPECS += [
    {"case": "mixtral-down-e5m2xe4m3-fp32out", "N": 4096, "K": 14336, "a_fmt": F8E5, "b_fmt": F8,
     "out_dtype": torch.float32},
    {"case": "llama8b-o-fp8xfp4-64row", "N": 4096, "K": 4096, "a_fmt": F8, "b_fmt": F4, "tile": "64x128"},
    {"case": "fp4xfp8-fp16out", "N": 1024, "K": 512, "a_fmt": F4, "b_fmt": F8, "out_dtype": torch.float16},
    {"case": "fp4-k384-one-step-64row", "N": 260, "K": 384, "a_fmt": F4, "b_fmt": F4, "tile": "64x128"},
]  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_cases(mxk.compile_mx_scaled_mm_many, SPECS, tmp_path_factory.mktemp("mx_scaled_mm"))


@pytest.mark.parametrize("i", range(len(SPECS)), ids=[s["case"] for s in SPECS])
def test_mx_scaled_mm_compiles_for_gfx950(compiled, i):
    spec, facts = SPECS[i], compiled[i]
    asm = check_gfx950_facts(facts, mxk.KERNEL_NAME)  # also: nothing spilled, no scratch
    plan = facts["plan"]
    assert (plan["N"], plan["K"], plan["a_fmt"], plan["b_fmt"]) == (spec["N"], spec["K"], spec["a_fmt"], spec["b_fmt"])

    check_scaled_mfma_isa(facts, asm, spec["a_fmt"], spec["b_fmt"], spec.get("out_dtype"), grouped=False)


def test_isa_facts_summary(compiled):
    """One line per specialisation (shown with -s): the numbers the notes quote."""
    print_isa_summary(SPECS, compiled, lambda f, asm: f"mfma={asm.count(mxk.MFMA)} steps/stage={f['plan']['k_steps']}")


# ------------------------------------------------------------------ unsupported inputs and the support predicate


@pytest.mark.parametrize(
    "args,needle",
    [
        ((4096, 4096, None, F8), "weight-only"),
        ((4096, 4096, "mxfp6_e2m3", F8), "a format mxfp6_e2m3"),
        ((4096, 4000, F8, F8), "K=4000"),
        ((4096, 64, F4, F4), "K=64"),
        ((4098, 4096, F8, F8), "N=4098"),
        ((4096, 4096, F8, F8, torch.int32), "out_dtype"),
    ],
)
def test_unsupported_is_a_reason_not_a_compile(args, needle):
    facts = mxk.compile_mx_scaled_mm(*args)
    assert facts["ok"] is False and facts["supported"] is False and needle in facts["reason"]


def test_size_limit_tile_choice_and_stages():
    ok, reason = mxk.supports(2**17, 4096, 16384, F8, F8, torch.bfloat16)  # fp8 a: 2 GiB
    assert not ok and reason.startswith("a is")
    assert mxk.supports(2**17, 4096, 16384, F4, F4, torch.bfloat16) == (True, "ok")  # fp4 a: 1 GiB
    assert not mxk.supports(2**17, 8192, 1024, F4, F4, torch.float32)[0]  # out: 4 GiB
    assert mxk.pick_tile(64) == "64x128" and mxk.pick_tile(65) == "128x128"
    assert mxk.make_plan(4096, 4096, F4, F4, torch.bfloat16).k_steps == 2
    assert mxk.make_plan(4096, 4224, F4, F4, torch.bfloat16).k_steps == 1  # K % 256 != 0
    assert mxk.make_plan(4096, 4096, F8, F4, torch.bfloat16).k_steps == 1
    assert mxk.constraints()["arch"] == "gfx950"


def _mx(rows, k, fmt):
    data = (
        torch.zeros(rows, k // 2, dtype=torch.uint8)
        if fmt == F4
        else torch.zeros(rows, k).to(torch.float8_e4m3fn if fmt == F8 else torch.float8_e5m2)
    )
    return data, torch.full((rows, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # fmt: skip


def _operands(m=64, n=256, k=512, a_fmt=F8, b_fmt=F8, out_dtype=torch.bfloat16, rocm=True):
    a, a_s = _mx(m, k, a_fmt) if a_fmt else (torch.zeros(m, k, dtype=torch.bfloat16), None)
    b, b_s = _mx(n, k, b_fmt)
    if rocm:
        a, b = OnRocm(a), OnRocm(b)
    return a, a_s, a_fmt, b, b_s, b_fmt, out_dtype


def _replace(ops, i, t):
    ops = list(ops)
    ops[i] = t
    return tuple(ops)


@pytest.mark.parametrize(
    "make,expect",
    [
        (lambda: _operands(), True),
        (lambda: _operands(a_fmt=F4, b_fmt=F4, out_dtype=torch.float32), True),
        (lambda: _operands(a_fmt=F8E5, b_fmt=F4, k=384), True),
        (lambda: _operands(rocm=False), "tensor not on a ROCm device"),
        (lambda: _operands(a_fmt=None), "weight-only"),
        (lambda: _operands(k=480), "K=480"),
        (lambda: _operands(n=250), "N=250"),
        (lambda: _replace(_operands(), 0, OnRocm(_mx(64, 1024, F8)[0][:, ::2])), "a not contiguous"),
        (lambda: _replace(_operands(), 4, _mx(512, 512, F8)[1][::2]), "b_scale not contiguous"),
        (
            lambda: _replace(
                _operands(),
                3,
                OnRocm(torch.zeros(256 * 512 + 1, dtype=torch.uint8)[1:].view(torch.float8_e4m3fn).view(256, 512)),
            ),
            "b not 16-byte aligned",
        ),
    ],
)
def test_registered_support_predicate(monkeypatch, make, expect):
    from fly_lightning.kernels.flydsl import mx_scaled_mm as backend

    verdict = gfx950_verdict(monkeypatch, backend, make())
    assert verdict is True if expect is True else expect in verdict


def test_registered_support_predicate_refuses_other_amd_arch(monkeypatch):
    from fly_lightning.kernels.flydsl import mx_scaled_mm as backend

    check_refuses_other_amd_arch(monkeypatch, backend, _operands())


def test_registered_as_compile_only():
    from fly_lightning.ops.mx_scaled_mm import MX_SCALED_MM

    check_registered_as_compile_only(MX_SCALED_MM)


def test_cpu_call_runs_on_aten_with_the_reason():
    """On this host the op never reaches the kernel: the dispatcher serves ATen and records why not FlyDSL."""
    import fly_lightning
    from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm, mx_scaled_mm_reference

    a, a_s, _, b, b_s, _, _ = _operands(m=8, n=16, k=128, rocm=False)
    a = torch.randn(8, 128).to(torch.float8_e4m3fn)
    b = torch.randn(16, 128).to(torch.float8_e4m3fn)
    with fly_lightning.dispatch_config(fly_lightning.DispatchConfig(backends=("flydsl",))):
        y = mx_scaled_mm(a, b, b_s, F8, a_scale=a_s, a_fmt=F8, out_dtype=torch.float32)
    torch.testing.assert_close(y, mx_scaled_mm_reference(a, a_s, F8, b, b_s, F8, torch.float32))
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_scaled_mm")
    assert rec["backend"] == "aten" and rec["fallback"] and "flydsl" in rec["reason"] and "ROCm" in rec["reason"]


LAUNCH_MODULE = """
import os
import torch
import _mx_scaled_mm_kernel as mxk  # the child has the kernel folder on its path

def trace_launches():
    # COMPILE_ONLY=1 and CPU tensors: flyc.compile traces + compiles with launch_mx_scaled_mm's real argument list
    # (flat dword views of the data and scales) and returns None instead of launching.
    assert os.environ["COMPILE_ONLY"] == "1"
    torch.cuda.current_stream = lambda device=None: None  # CPU-only torch has no streams
    scale = lambda rows, k: torch.full((rows, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a8 = torch.randn(100, 512).to(torch.float8_e4m3fn)
    b8 = torch.randn(256, 512).to(torch.float8_e4m3fn)
    out = mxk.launch_mx_scaled_mm(a8, scale(100, 512), "mxfp8_e4m3", b8, scale(256, 512), "mxfp8_e4m3")
    a4 = torch.randint(0, 256, (30, 256), dtype=torch.uint8)
    b4 = torch.randint(0, 256, (132, 256), dtype=torch.uint8)
    out32 = mxk.launch_mx_scaled_mm(a4, scale(30, 512), "mxfp4_e2m1", b4, scale(132, 512), "mxfp4_e2m1", torch.float32)
    keys = [str(k[:6]) for k in mxk._LAUNCHERS]
    return {"ok": True, "keys": keys, "shapes": [list(out.shape), list(out32.shape)],
            "dtypes": [str(out.dtype), str(out32.dtype)]}
"""


def test_launch_function_traces_and_compiles(tmp_path):
    facts = trace_launches(tmp_path, LAUNCH_MODULE)
    assert facts["keys"] == [
        "(256, 512, 'mxfp8_e4m3', 'mxfp8_e4m3', torch.bfloat16, '128x128')",
        "(132, 512, 'mxfp4_e2m1', 'mxfp4_e2m1', torch.float32, '64x128')",
    ]
    assert facts["shapes"] == [[100, 256], [30, 132]] and facts["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert [p.parent.name for p in (tmp_path / "dump").glob("*/*final_isa.s")] == ["fly_mx_scaled_mm_fwd_0"]


def test_a_misaligned_call_under_a_cached_decision_runs_aten(monkeypatch):
    """Alignment is not part of the dispatch key: a later call whose operands sit at an unaligned address (a view at
    an odd offset, same shape and strides) must not reach the kernel. It runs ATen, counted and logged."""
    import fly_lightning
    from fly_lightning.kernels.flydsl import mx_scaled_mm as backend
    from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference

    launched = []
    monkeypatch.setattr(backend.kernel, "launch_mx_scaled_mm", lambda *args: launched.append(args) or "kernel")
    a, a_s, _, b, b_s, _, _ = _operands(m=8, n=16, k=128, rocm=False)
    a = torch.randn(8, 128).to(torch.float8_e4m3fn)
    aligned = torch.randn(16, 128).to(torch.float8_e4m3fn)
    odd = torch.zeros(16 * 128 + 1, dtype=torch.uint8)[1:].view(torch.float8_e4m3fn).view(16, 128)
    odd.copy_(aligned)
    assert aligned.data_ptr() % 16 == 0 and odd.data_ptr() % 16 == 1
    assert backend.mx_scaled_mm_flydsl(a, a_s, F8, aligned, b_s, F8, torch.float32) == "kernel"
    y = backend.mx_scaled_mm_flydsl(a, a_s, F8, odd, b_s, F8, torch.float32)
    assert len(launched) == 1
    torch.testing.assert_close(y, mx_scaled_mm_reference(a, a_s, F8, aligned, b_s, F8, torch.float32))
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_scaled_mm")
    assert rec["fallback"] and "b not 16-byte aligned on this call" in rec["reason"] and rec["calls"] == 1
