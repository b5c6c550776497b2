"""The MX -> e4m3 re-expression kernel compiles for the H200 (sm_90) for every pair of element formats the fp8
prepass plan takes: no register spills, e4m3 by the hardware's conversion from fp16 pairs. Runs Triton's compiler and
bundled ptxas on the CPU, in a subprocess without the interpreter."""


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_requant_sm90_compile.py")
    assert len(results) == 3
    for name, r in results.items():
        assert r["spill_bytes"] == 0 and r["e4m3_cvt"] > 0 and r["f32_cvt"] == 0, (name, r)  # from fp16 pairs
