"""The routing and top-k kernels compile for the H200 (sm_90) with the constexprs their launchers use (bf16/fp32
logits, softmax/sigmoid, bias, expert groups, the permutation variant, E not a power of two), without register
spills, within the registers the launcher's grid assumes, and with the counting tail's memory orders as intended.
Runs Triton's compiler and its ptxas on the CPU (no GPU), in a subprocess without the interpreter."""


def test_kernels_compile_for_sm90(compiled_variants):
    results = compiled_variants("moe_route_sm90_compile.py")
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["shared"] <= 232448, (name, r)
        if r.get("launcher_default"):
            # the launcher's programs per SM must fit at once (4 programs of 4 warps: 128 registers, 2: 256). Triton
            # 3.7-3.9 compiled Qwen3's shape to 229-255 with 3.6's store form (see _store_step)
            assert r["registers"] <= r["register_budget"], (name, r)
        if name.startswith("route"):
            atomics = r["global_atomics"]
            if r["tail"] == "packed":
                # one relaxed 64-bit add per expert and program, nothing else: no ticket, no fence
                assert set(atomics) == {"relaxed.add.64"}, (name, atomics)
                continue
            # the ticket tail: one acq_rel ticket (one thread), the 32-bit tallies and the last program's reads
            # relaxed (the default) or release / acq_rel, and no other global atomic
            tally, read = (
                ("relaxed.add.32", "relaxed.exch.32") if r["relaxed_tail"] else ("release.add.32", "acq_rel.exch.32")
            )
            assert atomics["acq_rel.add.32"] == 1 and atomics[tally] >= 1 and atomics[read] >= 2, (name, atomics)
            assert set(atomics) == {"acq_rel.add.32", tally, read}, (name, atomics)
