"""Compile the RMSNorm kernels for sm_90 without a GPU (Triton's bundled ptxas) and report each variant as JSON.

Run in a process without TRITON_INTERPRET (``test_rms_norm_sm90.py`` does): under the interpreter ``@triton.jit``
gives interpreted functions that cannot be compiled.
"""

import re

import triton
from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton.rms_norm import _rms_norm_rows, _rms_norm_unaligned, launch_config


def _compile(fn, sig: dict, const: dict, aligned: tuple[str, ...], num_warps: int) -> dict:
    kernel, spill_bytes, _ = compile_sm90(fn, sig, const, aligned, num_warps=num_warps)
    ptx = kernel.asm["ptx"]
    return dict(
        spill_bytes=spill_bytes,
        vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]\.", ptx)),
        vector_stores=len(re.findall(r"st\.global(?:\.\w+)*\.v[248]\.", ptx)),
        scalar_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.(?:b16|u16)\s", ptx)),
    )


def rows(h: int, rows_per_program: int, num_warps: int, chunked_block: int | None = None) -> dict:
    block = chunked_block or triton.next_power_of_2(h)
    sig = dict(X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", n_rows="i32", stride_x="i32", stride_y="i32",
               eps="fp32", offset="fp32")  # fmt: skip
    const = dict(H=h, BLOCK=block, ROWS=rows_per_program, CHUNKED=block < h, HAS_W=True, CAST_FIRST=False)
    aligned = ("X", "W", "Y", "RSTD") + (("stride_x", "stride_y") if h % 16 == 0 else ())
    return _compile(_rms_norm_rows, sig, const, aligned, num_warps)


def unaligned(h: int, num_warps: int) -> dict:
    cfg = launch_config(h, 2, True)
    sig = dict(X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", eps="fp32", offset="fp32")
    const = dict(H=h, VEC=8, BLOCK=cfg.block, HAS_W=True, CAST_FIRST=False)
    return _compile(_rms_norm_unaligned, sig, const, ("X", "W", "Y", "RSTD"), num_warps)


VARIANTS = {
    "rows-4096-1row": lambda: rows(4096, 1, 4),
    "rows-4096-1row-8w": lambda: rows(4096, 1, 8),
    "rows-1024-2rows": lambda: rows(1024, 2, 4),
    "rows-2048-1row-2w": lambda: rows(2048, 1, 2),
    "rows-65536-chunked": lambda: rows(65536, 1, 16, chunked_block=32768),
    "unaligned-4097": lambda: unaligned(4097, 4),
    "unaligned-2049": lambda: unaligned(2049, 2),
}


if __name__ == "__main__":
    report(VARIANTS)
