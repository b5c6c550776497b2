"""The MX GEMM kernel compiles for the H200 (sm_90) for every format pair in the plans the launcher picks: no register
spills, wgmma (bf16 MMAs), the MX bytes prefetched by the software pipeline (async copies) on the large plans, and
within Hopper's shared memory; with ``fragment_k``, the swapped weight-only loop without its shared-memory round
trip. Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the interpreter."""


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_scaled_mm_sm90_compile.py")
    assert len(results) == 29
    for name, r in results.items():
        # the bit-placement fp8 path is no plan's default on the GPU (kept for the instruction count below); at
        # 128x256 it spills 12 bytes
        assert r["spill_bytes"] == 0 or name.endswith("-bits-loop"), (name, r)
        assert r["wgmma"] > 0, (name, r)
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
        if "mid" in name or "large" in name:
            assert r["async_copies"] > 0, (name, r)
        # fp4 pairs scaled in one word each (dequant_fp4's PTX form), fp8 by its own conversion
        assert (r["bf16x2_fma"] > 0) == name.startswith(("fp4", "w-fp4")), (name, r)
    for pair in ("e4m3", "e5m2"):  # the conversion instructions take a third of the bit path's loop or less
        bits, hw = results[f"{pair}-large-bits-loop"], results[f"{pair}-large-hwcvt-loop"]
        assert 0 < hw["loop_instructions"] < bits["loop_instructions"] / 2, (bits, hw)
        assert hw["loop_opcodes"].get("HMUL2", 0) > 0 and bits["loop_opcodes"].get("HMUL2", 0) > 0
    for name in ("w-fp4-small", "fp4-mid"):  # byte tables: one scale multiply per word instead of two
        pairs, lut = results[f"{name}-pairs-loop"], results[f"{name}-lut-loop"]
        assert 0 < lut["loop_opcodes"]["HMUL2"] * 2 == pairs["loop_opcodes"]["HMUL2"], (pairs, lut)
        assert lut["loop_opcodes"]["PRMT"] > pairs["loop_opcodes"].get("PRMT", 0), (pairs, lut)  # top 12 only
    # fragment_k: the decoded weights are the wgmma register operand as they are. No matrix loads of them back from
    # shared memory, fewer stores there and a shorter loop than the same plan in natural K order
    for tag in ("w-fp4-small-pairs", "w-fp4-small-lut", "w-e4m3-small"):
        natural, frag = results[f"{tag}-loop"], results[f"{tag}-fragk-loop"]
        assert frag["loop_ldsm"] == 0 and frag["loop_shared_stores"] <= natural["loop_shared_stores"], (natural, frag)
        assert 0 < frag["loop_instructions"] < natural["loop_instructions"], (natural, frag)
    lut, frag = results["w-fp4-small-lut-loop"], results["w-fp4-small-lut-fragk-loop"]
    assert lut["loop_ldsm"] > 0 and frag["loop_barriers"] < lut["loop_barriers"], (lut, frag)
    wide = results["w-fp4-small-n128-w8-lut-fragk-loop"]  # 128 weight rows over two warpgroups: the same per thread
    assert wide["loop_ldsm"] == 0 and wide["loop_instructions"] < lut["loop_instructions"], (lut, wide)
