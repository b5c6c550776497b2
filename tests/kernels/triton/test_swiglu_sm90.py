"""The swiglu kernel compiles for the H200 (sm_90) without register spills, with 16-byte vector loads and stores.
Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the interpreter."""


def test_compiles_for_sm90_with_vector_memory_access(compiled_variants):
    for name, r in compiled_variants("swiglu_sm90_compile.py").items():
        assert r["spill_bytes"] == 0 and r["vector_loads"] > 0 and r["vector_stores"] > 0, (name, r)
