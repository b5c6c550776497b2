"""The MX grouped GEMM kernel compiles for sm_90 (Hopper) on the CPU in every format pair and launch configuration:
bf16 wgmma (fp8 wgmma in the opt-in fp8-MMA configuration) fed by software-pipelined asynchronous copies, at most the
8 bytes of register spills that the swept configurations have (``_mx_grouped_mm_kernel``'s table). Says nothing about
speed."""


def test_every_variant_compiles_to_wgmma_within_the_known_spills(compiled_variants):
    results = compiled_variants("mx_grouped_mm_sm90_compile.py")
    assert len(results) == 14
    for name, r in results.items():
        assert r["spill_bytes"] <= 8, (name, r)  # the table's sweep timed these spills; more would be news
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
        assert r["wgmma"] > 0 and r["mma"] == 0, (name, r)  # Hopper's warpgroup MMA, not Ampere's mma.sync
        assert r["async_copies"] > 0, (name, r)  # MX bytes and scales staged through shared memory
        # fp8 MMAs on the raw bytes in the opt-in fp8-MMA configuration only (no spills there), bf16 ones elsewhere
        assert (r["fp8_wgmma"] > 0) == name.endswith("fp8mma"), (name, r)
        assert not name.endswith("fp8mma") or r["spill_bytes"] == 0, (name, r)
