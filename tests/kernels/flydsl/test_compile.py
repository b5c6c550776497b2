"""Compile-only tests of the FlyDSL kernels for gfx950 (no AMD GPU needed, nothing is launched).

Each compile runs in a child process (compile_check). The tests read the
produced gfx950 assembly, so they fail if FlyDSL silently targets another
arch, emits no ISA, or the expected instructions are missing. Without FlyDSL
or ld.lld they fail: the README's test command installs both (the ``flydsl`` extra brings ziglang's LLD).
"""

import os
import re
from pathlib import Path

import pytest
import torch

from fly_lightning.kernels.flydsl import _moe_route_kernel as moe_route
from fly_lightning.kernels.flydsl import _rms_norm_kernel as rms_norm
from fly_lightning.kernels.flydsl import _toolchain as compile_check

GFX950_TARGET = re.compile(r'^\s*\.amdgcn_target\s+"amdgcn-amd-amdhsa-[a-z]*-gfx950"', re.MULTILINE)


@pytest.fixture(scope="module")
def toolchain():
    problem = compile_check.toolchain_problem()
    if problem:
        pytest.fail(f"FlyDSL compile checks cannot run: {problem}")


def check_gfx950_asm(facts: dict, kernel: str) -> str:
    """Common assertions on a successful compile; returns the assembly text."""
    assert facts["ok"], facts.get("reason", "") + facts.get("stderr_tail", "")
    assert facts["arch"] == "gfx950"
    asm_path = Path(facts["asm_path"])
    asm = asm_path.read_text()
    assert GFX950_TARGET.search(asm), "assembly is not for gfx950"
    assert "gfx942" not in asm
    symbol = facts["kernel_name"]
    assert symbol.startswith(kernel)
    assert re.search(rf"^{re.escape(symbol)}:", asm, re.MULTILINE), "kernel label missing"
    assert re.search(rf"^\s*\.amdhsa_kernel\s+{re.escape(symbol)}$", asm, re.MULTILINE)
    assert "s_endpgm" in asm
    assert facts["num_instructions"] > 30
    assert facts["wavefront_size"] == 64
    assert facts["vgpr_count"] and facts["sgpr_count"]
    assert facts["scratch_bytes"] == 0 and facts["vgpr_spill_count"] == 0
    assert facts["max_flat_workgroup_size"] == 256
    return asm


def check_export(facts: dict, name: str) -> None:
    assert "export_error" not in facts, facts.get("export_error")
    obj = Path(facts["object_path"]).read_bytes()
    assert obj[:4] == b"\x7fELF" and b"gfx950" in obj  # host object embedding the gfx950 code object
    assert f"int32_t {name}(void **args);" in Path(facts["header_path"]).read_text()


# ------------------------------------------------------------------ RMSNorm

RMS_CASES = [
    # H, dtype, has_weight, weight_dtype, expected instructions, forbidden instructions
    (4096, torch.bfloat16, True, None, ["buffer_load_dwordx4", "buffer_store_dwordx4", "v_cvt_pk_bf16_f32"], []),
    (4097, torch.bfloat16, True, None, ["buffer_load_ushort", "buffer_store_short"], ["buffer_load_dwordx4"]),
    (1, torch.bfloat16, True, None, ["buffer_load_ushort"], ["ds_swizzle", "s_barrier"]),
    (4096, torch.float16, False, None, ["buffer_load_dwordx4", "v_cvt_pk_f16_f32"], []),
    (4097, torch.float32, True, None, ["buffer_load_dword "], ["buffer_load_dwordx4"]),
    (4096, torch.float32, True, None, ["buffer_load_dwordx4"], []),
    (4096, torch.bfloat16, True, torch.float32, ["buffer_load_dwordx4", "v_cvt_pk_bf16_f32"], []),
    (1, torch.float32, False, None, ["buffer_load_dword"], []),
    (65536, torch.bfloat16, True, None, ["buffer_load_dwordx4", "s_cbranch"], []),
]


@pytest.mark.parametrize("H,dtype,has_w,w_dtype,expect,forbid", RMS_CASES)
def test_rms_norm_compiles_for_gfx950(toolchain, tmp_path, H, dtype, has_w, w_dtype, expect, forbid):
    export = H == 4096 and dtype == torch.bfloat16 and w_dtype is None
    facts = rms_norm.compile_rms_norm(H, dtype, has_w, str(tmp_path), weight_dtype=w_dtype, export=export)
    asm = check_gfx950_asm(facts, rms_norm.KERNEL_NAME)
    for ins in expect:
        assert ins in asm, f"{ins} missing"
    for ins in forbid:
        assert ins not in asm, f"{ins} unexpected"
    assert "buffer_store_dword" in asm  # rstd
    plan = facts["plan"]
    assert plan["H"] == H and plan["lanes_per_row"] * plan["rows_per_block"] == 256
    # Rows spanning 4 waves combine partial sums through LDS; shorter rows must not touch it.
    assert (facts["lds_bytes"] > 0) == (plan["lanes_per_row"] > 64)
    if export:
        check_export(facts, rms_norm.KERNEL_NAME)


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        ((4096, torch.float64, True), {}, "dtype"),
        ((4096, torch.int8, True), {}, "dtype"),
        ((0, torch.bfloat16, True), {}, "H=0"),
        ((rms_norm.MAX_H + 1, torch.bfloat16, True), {}, "H="),
        ((4096, torch.bfloat16, True), {"weight_dtype": torch.float16}, "weight dtype"),
    ],
)
def test_rms_norm_reports_unsupported(args, kwargs, needle):
    facts = rms_norm.compile_rms_norm(*args, **kwargs)
    assert facts["ok"] is False and facts["supported"] is False
    assert needle in facts["reason"]


def test_rms_norm_supports_and_constraints():
    assert rms_norm.supports(4097, torch.bfloat16)[0]
    assert not rms_norm.supports(4096, torch.bfloat16, x_stride=(1, 4096))[0]
    c = rms_norm.constraints()
    assert c["H_max"] == rms_norm.MAX_H and c["arch"] == "gfx950"


# ------------------------------------------------------------------ MoE routing

_DT = [torch.bfloat16, torch.float16, torch.float32]
MOE_CASES = [
    # E, k, dtype, score, renormalize, with_counts
    (E, k, _DT[i % 3], ("softmax", "sigmoid")[i % 2], i % 3 != 1, i % 4 == 0)
    for i, (E, k) in enumerate((E, k) for E in (8, 60, 128, 256) for k in (1, 2, 8))
]


@pytest.mark.parametrize("E,k,dtype,score,renorm,counts", MOE_CASES)
def test_moe_route_compiles_for_gfx950(toolchain, tmp_path, E, k, dtype, score, renorm, counts):
    export = E == 128 and k == 8
    facts = moe_route.compile_moe_route(E, k, dtype, score, renorm, counts, str(tmp_path), export=export)
    asm = check_gfx950_asm(facts, moe_route.KERNEL_NAME)
    assert "v_exp_f32" in asm
    assert asm.count("buffer_store_dword") >= 2  # weights and ids
    load = {torch.float32: "buffer_load_dword", torch.bfloat16: "buffer_load_ushort"}.get(dtype, "buffer_load_ushort")
    assert load in asm
    # Counts: LDS histogram + one global atomic per expert; absent otherwise.
    assert ("global_atomic_add" in asm) == counts
    assert ("ds_add_u32" in asm) == counts
    assert (facts["lds_bytes"] == 4 * E) if counts else facts["lds_bytes"] == 0
    plan = facts["plan"]
    assert plan["lanes_per_token"] * plan["slots"] >= E and plan["k"] == k
    if export:
        check_export(facts, moe_route.KERNEL_NAME)


@pytest.mark.parametrize(
    "args,needle",
    [
        ((257, 2, torch.bfloat16), "E=257"),
        ((0, 1, torch.bfloat16), "E=0"),
        ((64, 9, torch.bfloat16), "k=9"),
        ((4, 5, torch.bfloat16), "k=5"),
        ((64, 0, torch.bfloat16), "k=0"),
        ((64, 2, torch.float64), "dtype"),
        ((64, 2, torch.bfloat16, "relu"), "score"),
    ],
)
def test_moe_route_reports_unsupported(args, needle):
    facts = moe_route.compile_moe_route(*args)
    assert facts["ok"] is False and facts["supported"] is False
    assert needle in facts["reason"]


# ------------------------------------------------------------------ compile_check itself


def test_missing_ld_lld_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setattr(compile_check, "find_ld_lld", lambda: None)
    facts = rms_norm.compile_rms_norm(4096, torch.bfloat16, True)
    assert facts["ok"] is False and facts["toolchain_missing"] and "ld.lld" in facts["reason"]


def test_missing_flydsl_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setattr(compile_check, "flydsl_installed", lambda: False)
    facts = moe_route.compile_moe_route(8, 2, torch.bfloat16)
    assert facts["ok"] is False and facts["toolchain_missing"] and "flydsl" in facts["reason"]


CHILD_MODULE = """
import os

def boom():
    os.abort()  # what a FlyDSL launch without libamdhip64 does

def env_probe():
    root = os.environ["ROCM_PATH"]
    return {"ok": True, "arch": os.environ.get("FLYDSL_GPU_ARCH"), "compile_only": os.environ.get("COMPILE_ONLY"),
            "ARCH": os.environ.get("ARCH"), "lld": os.path.exists(os.path.join(root, "llvm", "bin", "ld.lld"))}
"""


def test_child_abort_is_contained(toolchain, tmp_path):
    (tmp_path / "child_mod.py").write_text(CHILD_MODULE)
    facts = compile_check.run_compile_in_subprocess(str(tmp_path / "child_mod.py"), "boom", {}, out_dir=str(tmp_path))
    assert facts["ok"] is False and "SIGABRT" in facts["reason"]


def test_child_environment(toolchain, tmp_path, monkeypatch):
    (tmp_path / "child_mod.py").write_text(CHILD_MODULE)
    monkeypatch.setenv("ARCH", "gfx942")  # a generic ARCH would retarget FlyDSL
    facts = compile_check.run_compile_in_subprocess(str(tmp_path / "child_mod.py"), "env_probe", {})
    assert facts == {**facts, "ok": True, "arch": "gfx950", "compile_only": "1", "ARCH": None, "lld": True}


LAUNCH_MODULE = """
import os
import torch
import _moe_route_kernel as moe_route  # the child has the kernel folder on its path
import _rms_norm_kernel as rms_norm

def trace_launches():
    # COMPILE_ONLY=1 and CPU tensors: flyc.compile traces + compiles with the launchers' real
    # argument lists and returns None instead of launching.
    assert os.environ["COMPILE_ONLY"] == "1"
    torch.cuda.current_stream = lambda device=None: None  # CPU-only torch has no streams
    x = torch.randn(64, 4100, dtype=torch.bfloat16)[:5, :4096]  # strided rows
    rms_norm.launch_rms_norm(x, torch.ones(4096, dtype=torch.bfloat16), 1e-6, 1.0)
    rms_norm.launch_rms_norm(torch.randn(3, 4097), None)
    moe_route.launch_moe_route(torch.randn(7, 60, dtype=torch.float16), 2, with_counts=True)
    keys = [str(k[:4]) for k in rms_norm._LAUNCHERS] + [str(k[:6]) for k in moe_route._LAUNCHERS]
    return {"ok": True, "keys": keys}
"""


def test_launch_functions_trace_and_compile(toolchain, tmp_path):
    (tmp_path / "launch_mod.py").write_text(LAUNCH_MODULE)
    facts = compile_check.run_compile_in_subprocess(
        str(tmp_path / "launch_mod.py"), "trace_launches", {}, out_dir=str(tmp_path)
    )
    assert facts["ok"], facts.get("reason", "") + facts.get("stderr_tail", "")
    assert len(facts["keys"]) == 3
    asm = sorted(p.parent.name for p in (tmp_path / "dump").glob("*/*final_isa.s"))
    assert asm == ["fly_moe_route_fwd_0", "fly_rms_norm_fwd_0"]
    # Both RMSNorm specializations dump to the same folder; the last one is the generic fp32 path.
    last_rms = next((tmp_path / "dump" / "fly_rms_norm_fwd_0").glob("*final_isa.s")).read_text()
    assert "buffer_load_dword" in last_rms and "buffer_load_dwordx4" not in last_rms


def test_compile_and_collect_refuses_outside_child(monkeypatch):
    monkeypatch.delenv("COMPILE_ONLY", raising=False)
    with pytest.raises(RuntimeError, match="child environment"):
        compile_check.compile_and_collect(None, (), export_name=None)


def test_device_placeholders_are_refused():
    t = torch.empty(2, device="meta")
    with pytest.raises(RuntimeError, match="would launch"):
        compile_check.placeholders_are_safe((t,))


def test_find_ld_lld_honours_override(tmp_path, monkeypatch):
    fake = tmp_path / "ld.lld"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLYDSL_LD_LLD", str(fake))
    assert compile_check.find_ld_lld() == str(fake.resolve())
    monkeypatch.setenv("FLYDSL_LD_LLD", str(tmp_path / "missing"))
    found = compile_check.find_ld_lld()
    assert found is None or (os.path.isfile(found) and found != str(tmp_path / "missing"))


def test_parse_asm_facts():
    asm = """\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-gfx950"
\t.amdhsa_kernel k_0
    .group_segment_fixed_size: 16
    .sgpr_count:     26
    .vgpr_count:     36
"""
    f = compile_check.parse_asm_facts(asm)
    assert f["amdgcn_target"].endswith("gfx950") and f["kernel_symbols"] == ["k_0"]
    assert (f["lds_bytes"], f["sgpr_count"], f["vgpr_count"], f["scratch_bytes"]) == (16, 26, 36, None)


def test_ziglang_lld_is_a_working_fallback_linker():
    import subprocess

    path = compile_check._zig_ld_lld()
    assert path is not None, "ziglang is part of the flydsl extra"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "LLD" in out.stdout


class _RocmLogits:
    """Stands in for logits on a ROCm GPU (none here): what the registered support predicate reads."""

    def __init__(self, shape, stride, dtype=torch.bfloat16):
        self.shape, self._stride, self.dtype = torch.Size(shape), stride, dtype
        self.device = torch.device("cuda", 0)

    def stride(self, dim=None):
        return self._stride if dim is None else self._stride[dim]

    def numel(self):
        return self.shape.numel()

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()


@pytest.mark.parametrize(
    "logits,kwargs,expect",
    [
        (_RocmLogits((16, 64), (64, 1)), {}, True),
        (_RocmLogits((16, 64), (1, 16)), {}, "logits last dim not contiguous (a layout copy of 2048 bytes"),
        (_RocmLogits((16, 64), (64, 1)), {"return_permutation": True}, "permutation not implemented"),
        (_RocmLogits((16, 64), (64, 1)), {"n_groups": 8, "topk_groups": 4}, "selection bias / expert groups"),
        (_RocmLogits((16, 512), (512, 1)), {}, "E=512"),
    ],
)
def test_registered_moe_route_support_predicate(monkeypatch, logits, kwargs, expect):
    from fly_lightning.kernels.flydsl import moe_route as backend

    monkeypatch.setattr(torch.version, "hip", "7.0")
    args = dict(k=2, score="softmax", renormalize=True, bias_E=None, route_scale=1.0, n_groups=None,
                topk_groups=None, return_permutation=False) | kwargs  # fmt: skip
    verdict = backend._supports(logits, **args)
    assert verdict is True if expect is True else expect in verdict
