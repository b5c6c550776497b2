"""The MX fake-quantisation kernels compile for the H200 (sm_90) in their GPU form, row-wise and column-wise, for
every format, input dtype and scale mode: no register spills, fp8 rounded by the conversion instructions, bf16 output
rounded by conversion. Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the
interpreter."""

from fly_lightning.quant import formats


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_fake_quantize_sm90_compile.py")
    assert len(results) == 6 * len(formats.FORMATS)
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert (r["fp8_cvt"] > 0) == name.startswith("mxfp8"), (name, r)
        assert (r["bf16_cvt"] > 0) == ("-bf16-" in name), (name, r)
