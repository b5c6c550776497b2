"""Shared checks of the FlyDSL GEMM compile tests: the batch compile fixture body, the ISA facts every gfx950 kernel
must show, the runtime K loop, the stand-in for a ROCm tensor and the launch-tracing child."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fly_lightning.kernels.flydsl import _toolchain as compile_check

GFX950_TARGET = re.compile(r'^\s*\.amdgcn_target\s+"amdgcn-amd-amdhsa-[a-z]*-gfx950"', re.MULTILINE)


def require_toolchain() -> None:
    problem = compile_check.toolchain_problem()
    if problem:
        pytest.skip(f"FlyDSL compile checks cannot run: {problem}")


def compile_cases(compile_many: Callable[..., dict], cases: list[dict], out_dir: Path) -> list[dict]:
    """``compile_many`` (a kernel's ``compile_*_many``) on ``cases`` less their ``case`` name: one facts dict each."""
    require_toolchain()
    specs = [{k: v for k, v in s.items() if k != "case"} for s in cases]
    facts = compile_many(specs, out_dir=str(out_dir))
    assert "results" in facts, facts.get("reason", "") + facts.get("stderr_tail", "")
    assert len(facts["results"]) == len(cases)
    return facts["results"]


def ops(asm: str, prefix: str) -> list[str]:
    """Every instruction starting with ``prefix``, in order (repeats kept)."""
    return re.findall(rf"^\s+({prefix}\S*)", asm, re.MULTILINE)


def check_gfx950_facts(facts: dict[str, Any], kernel_name: str) -> str:
    """The facts every specialisation must show (gfx950, one wave64 block of 256, no scratch, no spills, within the
    256 VGPR + AGPR budget); returns the assembly."""
    assert facts["ok"], facts.get("reason", "")
    asm = Path(facts["asm_path"]).read_text()
    assert GFX950_TARGET.search(asm) and "gfx942" not in asm
    assert facts["kernel_name"].startswith(kernel_name)
    assert facts["wavefront_size"] == 64 and facts["max_flat_workgroup_size"] == 256
    assert facts["scratch_bytes"] == 0 and facts["vgpr_spill_count"] == 0 and facts["sgpr_spill_count"] == 0
    assert facts["vgpr_count"] + facts["agpr_count"] <= 256
    return asm


def print_isa_summary(cases: list[dict], compiled: list[dict], extra: Callable[[dict, str], str]) -> None:
    """One line per specialisation (shown with -s): register, LDS and scratch use, then ``extra(facts, asm)``."""
    for spec, f in zip(cases, compiled, strict=True):
        assert f["ok"]
        asm = Path(f["asm_path"]).read_text()
        print(
            f"{spec['case']:<34} vgpr={f['vgpr_count']} agpr={f['agpr_count']} sgpr={f['sgpr_count']} "
            f"lds={f['lds_bytes']} scratch={f['scratch_bytes']} {extra(f, asm)} compile_s={f['compile_s']}"
        )


def backward_branches(asm: str) -> list[re.Match]:
    """Conditional branches to an earlier label: a runtime loop (code size independent of its trip count)."""
    labels = {m.group(1): m.start() for m in re.finditer(r"^(\.LBB\d+_\d+):", asm, re.MULTILINE)}
    return [
        m for m in re.finditer(r"s_cbranch_\w+\s+(\.LBB\d+_\d+)", asm) if labels.get(m.group(1), 1 << 62) < m.start()
    ]


class OnRocm:
    """A CPU tensor standing in for one on a ROCm GPU (none here): what the registered predicate reads."""

    def __init__(self, t):
        self._t = t
        self.device = torch.device("cuda", 0)

    def __getattr__(self, name):
        return getattr(self._t, name)


def gfx950_verdict(monkeypatch, backend, args: tuple) -> bool | str:
    """``backend._supports(*args)`` as on a ROCm build with a gfx950 device (operands stand in with ``OnRocm``)."""
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(backend, "device_arch", lambda device: "gfx950")
    return backend._supports(*args)


def check_registered_as_compile_only(op) -> None:
    """The op's ``flydsl`` backend says gfx950 and compile-only, and so does its one row of the support matrix."""
    from fly_lightning.support import markdown

    impl = op.impls["flydsl"]
    assert impl.verified == "compile-only" and "gfx950" in impl.constraints
    rows = [line for line in markdown().splitlines() if line.startswith(f"| `{op.name}` | flydsl |")]
    assert len(rows) == 1 and rows[0].endswith("| compile-only |")


def check_refuses_other_amd_arch(monkeypatch, backend, args: tuple) -> None:
    """``backend._supports(*args)`` (operands it accepts on gfx950) refuses gfx942, and a CUDA build before that."""
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(backend, "device_arch", lambda device: "gfx942")
    assert "gfx942" in backend._supports(*args)
    monkeypatch.setattr(torch.version, "hip", None)  # a CUDA build: refused before the arch is looked at
    assert backend._supports(*args) == "tensor not on a ROCm device"


def trace_launches(tmp_path: Path, module_source: str) -> dict[str, Any]:
    """Run ``trace_launches()`` of ``module_source`` in a compile child with ``tmp_path`` as its output folder."""
    require_toolchain()
    (tmp_path / "launch_mod.py").write_text(module_source)
    facts = compile_check.run_compile_in_subprocess(
        str(tmp_path / "launch_mod.py"), "trace_launches", {}, out_dir=str(tmp_path)
    )
    assert facts["ok"], facts.get("reason", "") + facts.get("stderr_tail", "")
    return facts


def check_scaled_mfma_isa(
    facts: dict[str, Any], asm: str, a_fmt: str, b_fmt: str, out_dtype: torch.dtype | None, *, grouped: bool
) -> None:
    """What the FlyDSL MX GEMM's design depends on, dense or grouped (``_mx_scaled_mm_kernel``): only the scaled MFMA
    with each operand's format code and VGPR scales (no conversion instructions), its fragments read from LDS in
    16-byte reads with one scale byte each, 16-byte data writes and dword scale writes, 16-byte global loads, the
    planned LDS size, a runtime K loop (or LLVM's full unroll of a few dense stages)."""
    from fly_lightning.kernels.flydsl import _mx_scaled_mm_kernel as mxk

    plan = facts["plan"]
    # Only the scaled MFMA, A operand = b (cbsz), B operand = a (blgp), each with its format code; both scale
    # operands are VGPRs (an omitted scale would be a constant or the data register) with op_sel 0 (the low byte).
    mfmas = re.findall(r"^\s+(v_mfma\S*)\s+(.*)$", asm, re.MULTILINE)
    assert {op for op, _ in mfmas} == {mxk.MFMA}
    b_code, a_code = mxk.FORMATS[b_fmt][1], mxk.FORMATS[a_fmt][1]
    for _, operands in mfmas:
        assert re.search(r"cbsz:(\d)", operands) is None if b_code == 0 else f"cbsz:{b_code}" in operands, operands
        assert re.search(r"blgp:(\d)", operands) is None if a_code == 0 else f"blgp:{a_code}" in operands, operands
        regs = [r.strip() for r in operands.split(" op_sel")[0].split(",")]
        assert len(regs) == 6 and re.fullmatch(r"v\d+", regs[4]) and re.fullmatch(r"v\d+", regs[5]), operands
        a_regs = 8 if b_fmt != "mxfp4_e2m1" else 4  # the MFMA's A operand is b: 32 values of 8 or 4 bits per lane
        lo, hi = map(int, re.fullmatch(r"v\[(\d+):(\d+)\]", regs[1]).groups())
        assert hi - lo + 1 == a_regs, operands
    assert not re.search(r"v_cvt_\S*(fp8|bf8|fp4|scale)", asm)  # nothing dequantised in software
    assert plan["k_steps"] == (2 if a_fmt == b_fmt == "mxfp4_e2m1" and plan["K"] % 256 == 0 else 1)

    # Per copy of the MFMA step (LLVM peels/rotates the loop): MI*NI MFMAs, one 16-byte read per fp4 fragment and
    # two per fp8 fragment, one scale byte per fragment.
    mi = plan["bm"] // plan["waves_m"] // 16
    ni = plan["bn"] // plan["waves_n"] // 16
    steps, rem = divmod(len(mfmas), mi * ni)
    assert rem == 0 and steps >= plan["k_steps"]
    a_frag, b_frag = plan["a_row_bytes"] // plan["k_steps"] // 64, plan["b_row_bytes"] // plan["k_steps"] // 64
    reads = ops(asm, "ds_read")
    assert set(reads) == {"ds_read_b128", "ds_read_u8"}
    assert reads.count("ds_read_b128") == steps * (mi * a_frag + ni * b_frag)
    assert reads.count("ds_read_u8") == steps * (mi + ni)

    # LDS: the planned size; data in 16-byte writes, scales as one dword (two for 2-step fp4 stages) per thread.
    assert facts["lds_bytes"] == plan["lds_bytes"]
    writes = set(ops(asm, "ds_write"))
    scale_w = "b32" if plan["k_steps"] == 1 else "b64"
    assert "ds_write_b128" in writes
    assert writes - {"ds_write_b128"} and writes - {"ds_write_b128"} <= {
        f"ds_write_{scale_w}",
        f"ds_write2_{scale_w}",
        f"ds_write2st64_{scale_w}",
    }

    # Global memory: 16-byte data loads, scale dwords (grouped: and the offsets' dwords), one vector store per 4
    # outputs.
    loads = set(ops(asm, "buffer_load"))
    scale_load = "buffer_load_dword" if plan["k_steps"] == 1 else "buffer_load_dwordx2"
    if grouped:
        assert {"buffer_load_dwordx4", scale_load} <= loads <= {"buffer_load_dwordx4", "buffer_load_dword", scale_load}
        assert set(ops(asm, "ds_swizzle")) <= {"ds_swizzle_b32"}  # the tile search's shuffles
    else:
        assert loads == {"buffer_load_dwordx4", scale_load}
    out32 = out_dtype == torch.float32
    assert set(ops(asm, "buffer_store")) == {"buffer_store_dwordx4" if out32 else "buffer_store_dwordx2"}
    assert not ops(asm, "global_") and not ops(asm, "flat_") and not ops(asm, "scratch_")

    # A runtime K loop (a backward branch; code size independent of K), or, for a few K stages, LLVM's full unroll
    # (exactly one MFMA step per K step then), with the two barriers of one LDS stage.
    # (Grouped: the trip count is KT or, past the last tile, 0; a few stages unroll behind one guard.)
    if not backward_branches(asm):
        assert plan["k_tiles"] <= 8 and steps == plan["k_tiles"] * plan["k_steps"], "K loop missing or mangled"
    assert asm.count("s_barrier") >= 2
    assert facts["num_instructions"] < 2000
