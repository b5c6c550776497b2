"""The moe_combine and moe_dispatch kernels compile for the H200 (sm_90) without register spills and read rows in
16-byte vectors. Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the interpreter."""


def test_compiles_for_sm90_with_vector_loads(compiled_variants):
    for name, r in compiled_variants("moe_combine_sm90_compile.py").items():
        assert r["spill_bytes"] == 0 and r["vector_loads"] > 0, (name, r)
