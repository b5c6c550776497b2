"""The prepass dequantising kernel compiles for sm_90 for MXFP8 and MXFP4 pairs, with and without skipping groups
without rows: no register spills, and the group offsets read only where groups are skipped. Runs Triton's compiler
and bundled ptxas on the CPU, in a subprocess without the interpreter."""


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_dequant_sm90_compile.py")
    assert len(results) == 4
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert (r["offs_loads"] > 0) == name.endswith("-skip"), (name, r)
