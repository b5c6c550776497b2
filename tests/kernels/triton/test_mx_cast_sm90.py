"""The MX cast kernel compiles for the H200 (sm_90) in its GPU form for every format and input dtype: no register
spills, fp8 elements rounded by the conversion instructions, fp4 from bf16 by f16x2 conversions and integer rounding
(Hopper has no fp4 conversion), the column-wise word kernel's block maxima by 16-bit integer maxima.
Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the interpreter."""

from fly_lightning.quant import formats


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_cast_sm90_compile.py")
    # row-wise and column-wise: floor from bf16 and fp32, rceil from bf16; the fp4 pair and word kernels in both modes
    # (the word kernel also masked, and with 32-bit maxima as before sm90)
    assert len(results) == 6 * len(formats.FORMATS) + 8
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert (r["fp8_cvt"] > 0) == name.startswith("mxfp8"), (name, r)
    fp4 = [f"mxfp4_e2m1-bf16{c}-{k}" for c, k in (("", "pairs"), ("-cols", "pairs"), ("-cols", "words"))]
    for name in (f + m for f in fp4 for m in ("", "-rceil")):
        pairs = results[name]  # bf16 -> MXFP4: two elements per f16x2 conversion and clamp
        assert pairs["f16x2_cvt"] > 0 and pairs["f16x2_min"] > 0, (name, pairs)
    for name in ("mxfp4_e2m1-bf16-cols-words", "mxfp4_e2m1-bf16-cols-words-rceil", "mxfp4_e2m1-bf16-cols-words-masked"):
        assert results[name]["u16x2_max"] > 0, (name, results[name])
    assert results["mxfp4_e2m1-bf16-cols-words-max32"]["u16x2_max"] == 0
