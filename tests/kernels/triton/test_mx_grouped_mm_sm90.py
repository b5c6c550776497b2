"""The MX grouped GEMM kernel compiles for sm_90 (Hopper) on the CPU in every format pair and launch configuration:
bf16 wgmma fed by software-pipelined asynchronous copies, at most the 8 bytes of register spills that the swept
configurations have (``_mx_grouped_mm_kernel``'s table); swapped weight-only tiles with ``fragment_k`` keep the decoded
weights out of shared memory, as do the plans for MX activations on Hopper (the same tiles of 64, 128 or 256 rows, x
dequantised first), whose x, stored in the fragment's K order, takes under half the copies that gathering it would.
Says nothing about speed."""


def test_every_variant_compiles_to_wgmma_within_the_known_spills(compiled_variants):
    results = compiled_variants("mx_grouped_mm_sm90_compile.py")
    assert len(results) == 28
    for name, r in results.items():
        # fp4 weights decode pairwise (dequant_fp4's PTX form) except beside fp4 activations (spills there); the
        # swapped plans read MX x dequantised to bf16 first, so there fp4 weights always decode pairwise
        pairwise = name.startswith(("w-fp4", "e4m3-fp4")) or name in ("fp4-small", "fp4-mid", "fp4-wide")
        assert (r["bf16x2_fma"] > 0) == pairwise, (name, r)
        assert r["spill_bytes"] <= 8, (name, r)  # the table's sweep timed these spills; more would be news
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
        assert r["wgmma"] > 0 and r["mma"] == 0, (name, r)  # Hopper's warpgroup MMA, not Ampere's mma.sync
        assert r["async_copies"] > 0, (name, r)  # MX bytes and scales staged through shared memory
    # swapped weight-only tiles: with fragment_k the decoded weights feed the MMA as they are, nothing of them stored
    # to shared memory in the K loop, and a shorter loop than the same tiles in natural K order
    for pair in ("w-e4m3", "w-fp4"):
        natural, frag = results[f"{pair}-swap"], results[f"{pair}-swap-fragk"]
        assert frag["loop_shared_stores"] == frag["loop_ldsm"] == 0, (natural, frag)
        assert 0 < frag["loop_instructions"] < natural["loop_instructions"], (natural, frag)
    # the plans for MX x at few and many rows per group on Hopper are swapped fragment_k tiles, x dequantised first
    for pair in ("e4m3", "e5m2", "fp4", "e4m3-fp4"):
        for plan in ("small", "mid", "wide"):
            r = results[f"{pair}-{plan}"]
            assert r["loop_shared_stores"] == r["loop_ldsm"] == 0 and r["spill_bytes"] == 0, (pair, plan, r)
    # x stored in the fragment's K order is copied in 16-byte pieces, not gathered in 4-byte ones (Triton 3.9: 20
    # against 68 copies per iteration)
    stored, gathered = results["e4m3-wide"], results["e4m3-wide-gathered-x"]
    assert 0 < 2 * stored["loop_async_copies"] < gathered["loop_async_copies"], (stored, gathered)
