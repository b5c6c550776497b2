"""The MX cast kernel compiles for the H200 (sm_90) in its GPU form for every format and input dtype: no register
spills, fp8 elements rounded by the conversion instructions (fp4 by integer arithmetic: Hopper has none for it), and
from bf16 no shared-memory round trip for the packed fp4 words.
Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the interpreter."""

from fly_lightning.quant import formats


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_cast_sm90_compile.py")
    assert len(results) == 2 * len(formats.FORMATS)
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert (r["fp8_cvt"] > 0) == name.startswith("mxfp8"), (name, r)
        if name.endswith("bf16"):  # shared memory only for the scales' store (fp4 words leave as the sum made them)
            assert r["shared"] <= 128, (name, r)
