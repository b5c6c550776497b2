"""The MX cast kernel compiles for the H200 (sm_90) in its GPU form for every format and input dtype: no register
spills, and fp8 elements rounded by the conversion instructions (fp4 by integer arithmetic: Hopper has none for it).
Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the interpreter."""

from fly_lightning.quant import formats


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_cast_sm90_compile.py")
    assert len(results) == 2 * len(formats.FORMATS)
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert (r["fp8_cvt"] > 0) == name.startswith("mxfp8"), (name, r)
