"""Every Triton kernel of ours compiles for AMD gfx950 (MI350) in the variants its launcher picks on ROCm, without
spills, with the memory and matrix instructions its design depends on. Triton's AMD backend builds on the CPU; nothing
is launched, so this says nothing about numerics or speed on AMD hardware (none is available here)."""

from types import SimpleNamespace

import torch

from fly_lightning.kernels.triton import _grouped_mm_config as gc
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk


def test_kernels_compile_for_gfx950_without_spills(compiled_variants):
    results = compiled_variants("gfx950_compile.py", needs_ptxas=False)
    kernels = {name.split("-")[0] for name in results}
    # with moe_route_gfx950_compile.py: every Triton kernel of ours
    assert kernels == {
        "rms_norm", "swiglu", "moe_combine", "moe_dispatch", "topk", "grouped_mm", "mx_cast", "mx_fake_quantize"
    }  # fmt: skip
    for name, r in results.items():
        assert r["vgpr_spills"] == r["sgpr_spills"] == r["scratch"] == 0, (name, r)
        if name.startswith("grouped_mm"):
            assert r["mfma"] > 0 and r["wide_lds"] > 0, (name, r)  # bf16 MFMA fed from LDS in 16-byte reads
        else:
            assert r["wide_global"] > 0, (name, r)  # 16-byte global loads or stores


def test_rocm_takes_the_pointer_path_configuration(monkeypatch):
    monkeypatch.setattr(gc, "ON_HIP", True)
    monkeypatch.setattr(gk, "ON_HIP", True)
    x = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # no GPU needed: ROCm never asks its capability
    w = torch.empty(8, 2048, 768)
    assert gc.table_config(x, w, 4096) == gc.PRE_HOPPER_CONFIG and not gc.PRE_HOPPER_CONFIG.tma
    assert gk.tma_available(x) is False
