"""The Triton routing kernel compiles for AMD gfx950 with the launcher's ROCm choices (the fast sigmoid, CUDA-only,
off), for the biased and grouped sigmoid routers that reach Triton there (FlyDSL takes neither bias nor groups).
Triton's AMD backend compiles on the CPU; nothing is launched."""


def test_biased_and_grouped_routing_compile_for_gfx950(compiled_variants):
    results = compiled_variants("moe_route_gfx950_compile.py", needs_ptxas=False)
    assert set(results) == {"glm-4.5 biased sigmoid", "deepseek-v3 grouped sigmoid"}
    for name, r in results.items():
        assert r["fast_sigmoid"] is False and r["hsaco"] > 0, (name, r)
