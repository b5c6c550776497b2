"""The prepass dequantising kernel compiles for sm_90 for MXFP8 and MXFP4 pairs, with and without skipping groups
without rows, and with the first operand in the swapped tiles' K order: no register spills, the group offsets read only
where groups are skipped, and bf16 written in 16-byte stores in either order (scattered 2-byte stores of the
reordered operand ran about 10x slower on the H100). Runs Triton's compiler and bundled ptxas on the CPU, in a
subprocess without the interpreter."""


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_dequant_sm90_compile.py")
    assert len(results) == 6
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert (r["offs_loads"] > 0) == name.endswith("-skip"), (name, r)
        assert r["wide_stores"] > 0 and r["narrow_stores"] == 0, (name, r)
