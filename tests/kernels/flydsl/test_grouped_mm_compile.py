"""Compile-only tests of the FlyDSL grouped GEMM for gfx950 (no AMD GPU needed, nothing is launched).

All specialisations the 24-case grouped suite needs (``benchmarks/grouped_mm_cases.py``: 15 distinct
(K, N, E, weight layout, tile) keys) plus the variants the suite does not reach (fp16, fp32 output, a K tail, the
64-row tile on N-contiguous weights, E = 1024) are compiled in ONE child process (one torch + FlyDSL import, about
1 s of compile each), then the gfx950 assembly of each is checked for what the design depends on: the 16x16x32
16-bit MFMA, 16-byte LDS reads for every MFMA operand, 16-byte global loads, LDS writes of the intended width, the
planned LDS size, a runtime K loop (not unrolled), no scratch and no spills. Without FlyDSL or ld.lld the compile
tests skip with the reason.
"""

import re

import pytest
import torch

from benchmarks.grouped_mm_cases import cases
from fly_lightning.kernels.flydsl import _grouped_mm_kernel as gmm
from tests.kernels.flydsl._compile_util import (
    OnRocm,
    backward_branches,
    check_gfx950_facts,
    check_refuses_other_amd_arch,
    check_registered_as_compile_only,
    compile_cases,
    gfx950_verdict,
    print_isa_summary,
    trace_launches,
)
from tests.kernels.flydsl._compile_util import ops as _all_ops


def _suite_specs() -> list[dict]:
    seen = {}
    for c in cases():
        spec = {
            "K": c.k,
            "N": c.n,
            "E": c.e,
            "dtype": torch.bfloat16,
            "k_major": c.k_major,
            "tile": gmm.pick_tile(c.m, c.e),
        }
        seen.setdefault(tuple(spec.values()), (spec, c.name))
    return [dict(spec, case=name) for spec, name in seen.values()]


SUITE = _suite_specs()
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EXTRA = [
    {"K": 4096, "N": 2048, "E": 16, "dtype": FP16, "k_major": False, "out_dtype": FP32, "case": "fp16-fp32out-nmajor"},
    {"K": 2048, "N": 1536, "E": 128, "dtype": BF16, "out_dtype": FP32, "tile": "64x128", "case": "fp32out-64row"},
    {"K": 1000, "N": 1032, "E": 8, "dtype": BF16, "k_major": False, "tile": "64x128", "case": "k-tail-nmajor-64row"},
    {"K": 1000, "N": 264, "E": 3, "dtype": FP16, "k_major": True, "case": "k-tail-kmajor"},
    {"K": 512, "N": 512, "E": 1024, "dtype": BF16, "k_major": True, "case": "E1024"},
]
ALL = SUITE + [{"k_major": True, "tile": "128x128", **s} for s in EXTRA]


def test_suite_specialisations_are_the_distinct_kernel_keys():
    assert len(cases()) == 24
    assert len(SUITE) == 15  # the 24 cases need 15 specialisations (K, N, E, layout, tile)
    assert {s["k_major"] for s in SUITE} == {True, False} and {s["tile"] for s in SUITE} == {"128x128", "64x128"}
    for c in cases():
        assert gmm.supports(c.k, c.n, c.e, torch.bfloat16, None, c.k_major, c.m) == (True, "ok"), c.name


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_cases(gmm.compile_grouped_mm_many, ALL, tmp_path_factory.mktemp("grouped_mm"))


def _ops(asm: str, prefix: str) -> set[str]:
    return set(_all_ops(asm, prefix))


@pytest.mark.parametrize("i", range(len(ALL)), ids=[s["case"] for s in ALL])
def test_grouped_mm_compiles_for_gfx950(compiled, i):
    spec, facts = ALL[i], compiled[i]
    # Also registers: nothing spilled, no scratch; accumulators + prefetch fit the 512-register budget of a lane.
    asm = check_gfx950_facts(facts, gmm.KERNEL_NAME)
    plan = facts["plan"]
    assert (plan["K"], plan["N"], plan["E"], plan["k_major"]) == (spec["K"], spec["N"], spec["E"], spec["k_major"])

    # The MFMA: only the gfx950 16x16x32 16-bit one, at least one K tile's worth (2 K steps x MI x NI per wave).
    mfma = "v_mfma_f32_16x16x32_bf16" if spec["dtype"] == torch.bfloat16 else "v_mfma_f32_16x16x32_f16"
    assert _ops(asm, "v_mfma") == {mfma}
    per_wave = (plan["bm"] // plan["waves_m"] // 16) * (plan["bn"] // plan["waves_n"] // 16)
    assert asm.count(mfma) >= 2 * per_wave

    # LDS: the planned size (two K-contiguous [rows][64 + 8] tiles); every read is a 16-byte MFMA fragment.
    assert facts["lds_bytes"] == plan["lds_bytes"] == (plan["bm"] + plan["bn"]) * 72 * 2
    assert _ops(asm, "ds_read") == {"ds_read_b128"}
    writes = _ops(asm, "ds_write")
    if spec["k_major"]:
        assert writes == {"ds_write_b128"}  # both operands go to LDS as loaded
    else:
        assert "ds_write_b128" in writes and writes <= {"ds_write_b128", "ds_write_b64", "ds_write2_b64"}
    assert not _ops(asm, "ds_swizzle") - {"ds_swizzle_b32"}  # the tile search's shuffles only

    # Global memory: 16-byte operand loads, dword offset loads, one vector store per 4 outputs.
    assert _ops(asm, "buffer_load") == {"buffer_load_dwordx4", "buffer_load_dword"}
    out32 = spec.get("out_dtype") == torch.float32
    assert _ops(asm, "buffer_store") == {"buffer_store_dwordx4" if out32 else "buffer_store_dwordx2"}
    assert not _ops(asm, "global_") and not _ops(asm, "flat_") and not _ops(asm, "scratch_")
    if not out32:
        cvt = "v_cvt_pk_bf16_f32" if spec["dtype"] == torch.bfloat16 else "v_cvt_pk_f16_f32"
        assert cvt in asm

    # A runtime K loop (a backward branch; code size independent of K) with the two barriers of one LDS stage.
    assert backward_branches(asm), "no backward branch: the K loop was unrolled or is missing"
    assert asm.count("s_barrier") >= 2
    assert facts["num_instructions"] < 2500
    # The K tail is zeroed with selects only when K % 64 != 0.
    assert plan["k_tail"] == (spec["K"] % 64 != 0)


def test_isa_facts_summary(compiled):
    """One line per specialisation (shown with -s): the numbers the report quotes."""
    print_isa_summary(ALL, compiled, lambda f, asm: f"mfma={len(re.findall(r'v_mfma_f32_16x16x32', asm))}")


# ------------------------------------------------------------------ unsupported inputs and the support predicate


@pytest.mark.parametrize(
    "args,needle",
    [
        ((2048, 1536, 128, torch.float32), "dtype"),
        ((2048, 1536, 128, torch.bfloat16, torch.float16), "out_dtype"),
        ((2044, 1536, 128, torch.bfloat16), "K=2044"),
        ((2048, 1530, 128, torch.bfloat16), "N=1530"),
        ((2048, 1536, 1025, torch.bfloat16), "E=1025"),
        ((2048, 1536, 0, torch.bfloat16), "E=0"),
    ],
)
def test_unsupported_is_a_reason_not_a_compile(args, needle):
    facts = gmm.compile_grouped_mm(*args)
    assert facts["ok"] is False and facts["supported"] is False and needle in facts["reason"]


def test_size_limit_and_tile_choice():
    ok, reason = gmm.supports(8192, 8192, 128, torch.bfloat16, None, True, M=4096)
    assert not ok and reason.startswith("w is")
    assert not gmm.supports(4096, 8192, 8, torch.bfloat16, torch.float32, True, M=2**16)[0]  # out > 2 GiB
    assert gmm.pick_tile(128 * 64 - 1, 64) == "64x128" and gmm.pick_tile(128 * 64, 64) == "128x128"
    assert gmm.constraints()["arch"] == "gfx950"


def _operands(m=64, k=256, n=128, e=4, dtype=torch.bfloat16, k_major=True):
    x = torch.empty(m, k, dtype=dtype)
    w = torch.empty(e, n, k, dtype=dtype).transpose(1, 2) if k_major else torch.empty(e, k, n, dtype=dtype)
    return x, w, torch.zeros(e, dtype=torch.int32)


def _rocm(x, w, offs):
    return OnRocm(x), OnRocm(w), OnRocm(offs)


@pytest.mark.parametrize(
    "make,out_dtype,expect",
    [
        (lambda: _rocm(*_operands()), None, True),
        (lambda: _rocm(*_operands(k_major=False)), torch.float32, True),
        (lambda: _operands(), None, "tensor not on a ROCm device"),
        (lambda: _rocm(*_operands(dtype=torch.float32)), None, "dtype torch.float32"),
        (lambda: _rocm(*_operands()), torch.float16, "out_dtype"),
        (lambda: _rocm(*_operands(k=252)), None, "K=252"),
        (lambda: _rocm(*_operands(n=124)), None, "N=124"),
        (lambda: _rocm(*_operands(e=1025)), None, "E=1025"),
        (lambda: _rocm(torch.empty(256, 64).t().to(torch.bfloat16), *_operands()[1:]), None, "x not contiguous"),
        (lambda: _rocm(_operands()[0], torch.empty(4, 256, 256, dtype=torch.bfloat16)[:, :, :128], _operands()[2]),
         None, "neither N- nor K-contiguous"),
        (lambda: _rocm(*_operands()[:2], torch.zeros(8, dtype=torch.int32)[::2]), None, "offs not contiguous"),
    ],
)  # fmt: skip
def test_registered_support_predicate(monkeypatch, make, out_dtype, expect):
    from fly_lightning.kernels.flydsl import grouped_mm as backend

    verdict = gfx950_verdict(monkeypatch, backend, (*make(), out_dtype))
    assert verdict is True if expect is True else expect in verdict


def test_registered_support_predicate_refuses_other_amd_arch(monkeypatch):
    from fly_lightning.kernels.flydsl import grouped_mm as backend

    check_refuses_other_amd_arch(monkeypatch, backend, (*_rocm(*_operands()), None))


def test_registered_as_compile_only():
    from fly_lightning.ops.grouped_mm import GROUPED_MM

    check_registered_as_compile_only(GROUPED_MM)


def test_weight_layout():
    x, w, _ = _operands(k_major=True)
    assert gmm.weight_layout(w) is True
    assert gmm.weight_layout(_operands(k_major=False)[1]) is False
    assert gmm.weight_layout(torch.empty(4, 256, 256)[:, :, :128]) is None
    assert gmm.weight_layout(torch.empty(4, 128, 256).transpose(1, 2)[:, :, :64]) is None  # experts not dense
    assert gmm.weight_layout(torch.empty(1, 256, 128)) is False and gmm.weight_layout(torch.empty(3, 256, 1)) is True


LAUNCH_MODULE = """
import os
import torch
import _grouped_mm_kernel as gmm  # the child has the kernel folder on its path

def trace_launches():
    # COMPILE_ONLY=1 and CPU tensors: flyc.compile traces + compiles with launch_grouped_mm's real argument list
    # (flat views of x, w, out) and returns None instead of launching.
    assert os.environ["COMPILE_ONLY"] == "1"
    torch.cuda.current_stream = lambda device=None: None  # CPU-only torch has no streams
    offs = torch.tensor([100, 100, 300, 333], dtype=torch.int32)
    x = torch.randn(333, 256).to(torch.bfloat16)
    w_k = torch.randn(4, 128, 256).to(torch.bfloat16).transpose(1, 2)  # K-contiguous [E, K, N]
    out = gmm.launch_grouped_mm(x, w_k, offs)
    w_n = torch.randn(4, 256, 128).to(torch.float16)
    out32 = gmm.launch_grouped_mm(x.to(torch.float16), w_n, offs, torch.float32)
    keys = [str(k[:7]) for k in gmm._LAUNCHERS]
    shapes = [list(out.shape), list(out32.shape)]
    return {"ok": True, "keys": keys, "shapes": shapes, "dtypes": [str(out.dtype), str(out32.dtype)]}
"""


def test_launch_function_traces_and_compiles(tmp_path):
    facts = trace_launches(tmp_path, LAUNCH_MODULE)
    assert facts["keys"] == [
        "(256, 128, 4, torch.bfloat16, torch.bfloat16, True, '64x128')",
        "(256, 128, 4, torch.float16, torch.float32, False, '64x128')",
    ]
    assert facts["shapes"] == [[333, 128], [333, 128]] and facts["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert [p.parent.name for p in (tmp_path / "dump").glob("*/*final_isa.s")] == ["fly_grouped_mm_fwd_0"]
