"""Compile a Triton kernel for AMD gfx950 (MI350) on the CPU: Triton's AMD backend builds the code object without a
GPU. Shared by ``gfx950_compile.py``; like the ``*sm90_compile.py`` scripts it runs without TRITON_INTERPRET."""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("hip", "gfx950", 64)


def _count(amdgcn: str, key: str) -> int:
    values = [int(v) for v in re.findall(rf"\.{key}:\s+(\d+)", amdgcn)]
    if not values:  # a metadata line that went missing must fail the check, not read as zero
        raise RuntimeError(f"no .{key} in the gfx950 code object's metadata")
    return max(values)


def compile_gfx950(fn, sig: dict, const: dict, aligned: tuple[str, ...], **options) -> dict:
    """Build ``fn`` for gfx950 and read what the design depends on from its assembly: spills (VGPR, SGPR, scratch),
    VGPRs, 16-byte global and LDS accesses, MFMA instructions."""
    sig = {a: "constexpr" if a in const else sig[a] for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a not in const}
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options)
    asm = kernel.asm["amdgcn"]
    if not kernel.asm["hsaco"]:
        raise RuntimeError("empty code object")
    return dict(
        vgpr_spills=_count(asm, "vgpr_spill_count"),
        sgpr_spills=_count(asm, "sgpr_spill_count"),
        scratch=_count(asm, "private_segment_fixed_size"),
        vgprs=_count(asm, "vgpr_count"),
        wide_global=len(re.findall(r"(?:global|buffer)_(?:load|store)(?:_lds)?_dwordx4", asm)),
        wide_lds=len(re.findall(r"ds_(?:read|write)_b128", asm)),
        mfma=len(re.findall(r"v_mfma_", asm)),
    )
