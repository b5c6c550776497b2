"""The Triton grouped GEMM kernel directly: every launch variant on uneven groups, memory safety of invalid offsets,
configuration choice and support reasons (interpreter: tiny shapes)."""

import dataclasses
from dataclasses import replace

import pytest
import torch

from fly_lightning.kernels.triton import _grouped_mm_config as gc
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton.grouped_mm import grouped_mm_triton, layout_reason
from fly_lightning.kernels.triton.moe_grouped_mm import moe_grouped_mm_triton
from fly_lightning.ops.grouped_mm import grouped_mm_reference
from fly_lightning.registry import reset_availability

BASE = gc.INTERPRETER_CONFIG
VARIANTS = {
    "pointer": BASE,
    "tma": replace(BASE, tma=True),
    "tma_store": replace(BASE, tma=True, tma_store=True),
    "not_persistent": replace(BASE, programs_per_sm=0),
    "block_m16_group1": replace(BASE, block_m=16, group_m=1),
    "block_n64_k16": replace(BASE, block_n=64, block_k=16, group_m=4),
    "table": replace(BASE, schedule="table"),
    "table_tma_ws": replace(BASE, schedule="table", tma=True, tma_store=True, warp_specialize="tiles"),
    "flatten": replace(BASE, flatten=True, programs_per_sm=2),
    "specialize": replace(BASE, specialize=True),
    "specialize_tma": replace(BASE, specialize=True, tma=True),
}


def _problem(counts, k, n, dtype=torch.float16, k_major=False, tail=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    m = int(offs[-1]) + tail
    x = torch.randn(m, k, generator=gen).to(dtype)
    if k_major:
        w = torch.randn(len(counts), n, k, generator=gen).to(dtype).transpose(1, 2)
    else:
        w = torch.randn(len(counts), k, n, generator=gen).to(dtype)
    return x, w, offs


def _check(out, x, w, offs, tol=2e-3):
    end = int(offs[-1])
    ref = grouped_mm_reference(x.double(), w.double(), offs)[:end]
    err = ((out[:end].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, err


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("k_major", [False, True])
def test_launch_variants_on_uneven_groups(variant, k_major):
    # empty groups, a group smaller than a tile, one spanning several, sizes off multiples of 16, rows past the end
    x, w, offs = _problem([0, 3, 70, 0, 17, 1], k=40, n=48, k_major=k_major, tail=5)
    out = torch.full((x.shape[0], 48), float("nan"), dtype=x.dtype)
    gk.launch(x, w, offs, out, config=VARIANTS[variant])
    _check(out, x, w, offs)
    assert out[int(offs[-1]) :].isnan().all()  # rows past the last offset are never written


@pytest.mark.parametrize("variant", ["specialize", "specialize_tma", "specialize_tma_store"])
@pytest.mark.parametrize("k_major", [False, True])
def test_compiled_in_strides_come_from_the_tensors(variant, k_major):
    # x and out are views of wider buffers (row strides 64 and 80, not K and N), w is padded: the constants must be
    # those strides, and nothing outside out is written
    cfg = {**VARIANTS, "specialize_tma_store": replace(BASE, specialize=True, tma=True, tma_store=True)}[variant]
    x0, w0, offs = _problem([5, 0, 40, 19], k=40, n=48, k_major=k_major, tail=3)
    x = torch.zeros(x0.shape[0], 64, dtype=x0.dtype)[:, :40].copy_(x0)
    w_pad = torch.zeros(4, 56, 64, dtype=x0.dtype)  # [E, N or K padded, ...]
    if k_major:  # w [E, K, N] as the transposed view of [E, N, K]
        w = w_pad[:, :48, :40].copy_(w0.transpose(1, 2)).transpose(1, 2)
    else:
        w = w_pad[:, :40, :48].copy_(w0)
    buf = torch.full((x.shape[0], 80), float("nan"), dtype=x.dtype)
    out = buf[:, 16:64]
    gk.launch(x, w, offs, out, config=cfg)
    _check(out, x, w, offs)
    assert buf[:, :16].isnan().all() and buf[:, 64:].isnan().all()


@pytest.mark.parametrize("k_major", [False, True])
def test_bf16_is_upcast_in_the_interpreter(k_major):
    x, w, offs = _problem([9, 30, 0, 21], k=32, n=32, dtype=torch.bfloat16, k_major=k_major)
    out = torch.empty(x.shape[0], 32, dtype=torch.bfloat16)
    gk.launch(x, w, offs, out, config=replace(BASE, tma=True))
    _check(out, x, w, offs, tol=1e-2)  # the interpreter truncates fp32 -> bf16 instead of rounding


def test_unaligned_strides_take_the_pointer_path_even_when_tma_is_asked():
    x, w, offs = _problem([5, 12, 8], k=13, n=7)  # K, N not multiples of 16 bytes: no descriptor possible
    out = torch.empty(x.shape[0], 7, dtype=x.dtype)
    gk.launch(x, w, offs, out, config=replace(BASE, tma=True, tma_store=True))
    _check(out, x, w, offs)


def test_float32_output():
    x, w, offs = _problem([10, 0, 22], k=32, n=16)
    out = torch.empty(x.shape[0], 16, dtype=torch.float32)
    gk.launch(x, w, offs, out)
    ref = grouped_mm_reference(x.double(), w.double(), offs)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_zero_k_gives_zeros_and_empty_problems_return():
    x, w, offs = _problem([3, 4], k=0, n=8)
    out = torch.full((7, 8), 5.0, dtype=x.dtype)
    assert (gk.launch(x, w, offs, out) == 0).all()
    x, w, offs = _problem([0, 0], k=8, n=8)
    assert gk.launch(x, w, offs, torch.empty(0, 8, dtype=x.dtype)).shape == (0, 8)


@pytest.mark.parametrize("schedule", ["scan", "table"])
@pytest.mark.parametrize("offsets", [[4, 2, 9], [3, 50, 60], [-5, 4, 9], [9, 9, 100]])
def test_invalid_offsets_never_touch_memory_outside_the_tensors(offsets, schedule):
    m, k, n = 9, 16, 16
    x, w, _ = _problem([3, 3, 3], k=k, n=n)
    offs = torch.tensor(offsets, dtype=torch.int32)
    guard = torch.full((m + 4, n), 7.0, dtype=x.dtype)
    out = guard[2 : 2 + m]  # rows of the buffer outside `out` must stay untouched
    gk.launch(x, w, offs, out, config=replace(BASE, schedule=schedule))
    assert (guard[:2] == 7).all() and (guard[2 + m :] == 7).all()


@pytest.mark.parametrize("gather,scatter", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("variant", ["pointer", "tma", "table", "specialize"])
def test_gather_and_scatter_modes(gather, scatter, variant):
    t, topk, e, k, n = 23, 2, 5, 32, 40
    gen = torch.Generator().manual_seed(2)
    ids = torch.rand(t, e, generator=gen).topk(topk, dim=-1).indices.reshape(-1)
    offs = torch.cumsum(torch.bincount(ids, minlength=e), 0).to(torch.int32)
    perm = torch.argsort(ids, stable=True).to(torch.int32)
    x_tok = torch.randn(t, k, generator=gen).half()
    x = x_tok if gather else x_tok[perm.long() // topk]
    w = torch.randn(e, n, k, generator=gen).half().transpose(1, 2)
    out = torch.empty(t * topk, n, dtype=x.dtype)
    gk.launch(x, w, offs, out, idx=perm, topk=topk, gather=gather, scatter=scatter, config=VARIANTS[variant])
    ref = grouped_mm_reference(x_tok.double()[perm.long() // topk], w.double(), offs)
    if scatter:
        ref = ref[torch.argsort(perm.long())]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_configuration_choice():
    assert gc.shape_class(8 * 4096, 14336, 4096, 8) == ("large", "wide", "long")
    assert gc.shape_class(128 * 64, 768, 2048, 128) == ("small", "narrow", "long")
    assert gc.shape_class(256 * 64, 2048, 768, 64) == ("mid", "wide", "short")
    assert len(gc.CONFIG_TABLE) == 12
    x, w, _ = _problem([4, 4], k=16, n=16)
    assert gc.choose_config(x, w, 8) == gc.INTERPRETER_CONFIG  # CPU tensors under the interpreter
    assert len(set(gc.candidate_configs())) == len(gc.candidate_configs())
    labels = {c.label() for c in gc.candidate_configs()}
    assert len(labels) == len(gc.candidate_configs())


def test_warp_specialisation_needs_tma_loads_and_the_tma_store():
    ws = gc.GroupedMMConfig(128, 256, 64, 8, 3, 4, schedule="table", warp_specialize="tiles")
    assert gk._effective_config(ws, True, True, True, interp=False) == ws
    for loads_and_store in ((True, True, False), (False, True, True), (True, False, True)):
        cfg = gk._effective_config(ws, *loads_and_store, interp=False)
        assert cfg.warp_specialize == "" and (cfg.block_m, cfg.block_n, cfg.schedule) == (128, 256, "table")
    assert gk._effective_config(ws, False, False, False, interp=True) == ws  # the interpreter ignores it
    plain = gc.GroupedMMConfig()
    assert gk._effective_config(plain, False, False, False, interp=False) == plain
    # what tuning and the sweep try is warp-specialised only with the TMA store
    for cfg in gc.candidate_configs() + gc.tune_candidates("small") + gc.tune_candidates("large"):
        if cfg.warp_specialize:  # 4 warps per partition; "tiles" needs the table schedule
            assert cfg.tma and cfg.tma_store and cfg.num_warps == 4 and cfg.schedule == "table", cfg.label()


@pytest.fixture
def clean_tuning():
    gc.MEASURED.clear()
    gc.REJECTED.clear()
    yield
    gc.MEASURED.clear()
    gc.REJECTED.clear()


def test_tune_never_chooses_a_configuration_whose_result_is_wrong(monkeypatch, clean_tuning):
    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40, tail=3)
    good, wrong, broken = BASE, replace(BASE, block_n=64, block_k=16), replace(BASE, block_m=16, group_m=1)
    real_launch = gk.launch

    def launch(*args, config=None, **kwargs):  # "wrong" corrupts one element, as a bad tile would; "broken" raises
        if config == broken:
            raise RuntimeError("out of resource")
        out = real_launch(*args, config=config, **kwargs)
        if config == wrong:
            out[7, 3] += 1.0
        return out

    monkeypatch.setattr(gk, "launch", launch)
    with pytest.warns(UserWarning, match="skipped"):
        best = gk.tune(x, w, offs, candidates=[wrong, broken, good], reps=1)
    key = gc.measure_key(x, w, x.shape[0], False, False)
    assert best == good and gc.MEASURED[key] == good
    assert set(gc.REJECTED[key]) == {wrong.label(), broken.label()}
    assert "1 elements differ" in gc.REJECTED[key][wrong.label()] and "row 7" in gc.REJECTED[key][wrong.label()]
    assert "out of resource" in gc.REJECTED[key][broken.label()]
    # no correct candidate: the table configuration is kept (the caller runs on), with a warning
    gc.MEASURED.clear()
    with pytest.warns(UserWarning) as caught:
        assert gk.tune(x, w, offs, candidates=[wrong], reps=1) == gc.table_config(x, w, x.shape[0])
    assert [str(c.message).split(":")[0] for c in caught] == [
        f"grouped_mm tuning skipped {wrong.label()}",
        "grouped_mm tuning",
    ] and "no candidate ran correctly" in str(caught[1].message)
    assert gc.MEASURED[key] == gc.table_config(x, w, x.shape[0])


def test_tune_replaces_the_table_only_when_clearly_faster(monkeypatch, clean_tuning):
    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40)
    table = gc.table_config(x, w, x.shape[0])
    near, fast = replace(BASE, block_n=64, block_k=16), replace(BASE, block_m=16, group_m=1)
    speed = {table: [1.0, 1.3, 1.0], near: [0.99, 0.99, 2.0], fast: [0.9, 0.8, 5.0]}  # ms per round, one outlier each
    launched, calls = [], []
    real_launch = gk.launch

    def launch(*args, config=None, **kwargs):
        launched.append(config)
        return real_launch(*args, config=config, **kwargs)

    def elapsed_ms(run, reps, cuda):  # which configuration: the one the timed function launches
        run()
        calls.append(launched[-1])
        return speed[launched[-1]][(sum(c == launched[-1] for c in calls) - 1) % 3]

    monkeypatch.setattr(gk, "launch", launch)
    monkeypatch.setattr(gk, "_elapsed_ms", elapsed_ms)
    assert gk.tune(x, w, offs, candidates=[near], reps=1) == table  # 1% faster: within the margin, noise
    calls.clear()
    assert gk.tune(x, w, offs, candidates=[near, fast], reps=1) == fast  # medians 0.9 vs 1.0
    assert calls == [table, near, fast] * 3  # rounds interleave the candidates
    assert gk.tune(x, w, offs, candidates=[fast], reps=1, margin=0.2) == table


def test_tuned_configuration_persists_in_the_tuning_database(monkeypatch, clean_tuning):
    """A later process (MEASURED empty) takes the configuration an earlier one measured, without timing anything."""
    from fly_lightning import tuning

    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40)
    fast = replace(BASE, block_m=16, group_m=1)
    table = gc.table_config(x, w, x.shape[0])
    speeds = iter([1.0, 0.5] * 3)  # table, fast: per round
    monkeypatch.setattr(gk, "_elapsed_ms", lambda run, reps, cuda: (run(), next(speeds))[1])
    monkeypatch.setattr(gk, "tune_candidates", lambda m_class: [fast])
    assert gk.tune(x, w, offs) == fast
    ((env, op, key, entry),) = list(tuning.active_db().entries())
    assert op == gk.DB_OP and entry["backend"] == fast.label() and entry["detail"]["block_m"] == 16
    assert set(entry["timings_ms"]) == {table.label(), fast.label()}
    gc.MEASURED.clear()
    monkeypatch.setattr(gk, "_elapsed_ms", lambda *a: pytest.fail("timed again"))
    assert gk.tune(x, w, offs) == fast and gc.MEASURED[gc.measure_key(x, w, x.shape[0], False, False)] == fast


def test_a_stored_configuration_this_version_cannot_build_is_measured_again(monkeypatch, clean_tuning):
    """An entry written by another version of ``GroupedMMConfig`` (a field it no longer has) is not an error: the
    shape is measured again and the entry replaced."""
    from fly_lightning import tuning

    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40)
    fast = replace(BASE, block_m=16, group_m=1)
    key = gc.measure_key(x, w, x.shape[0], False, False)
    env = tuning.environment_key(x.device)
    tuning.active_db().put(env, gk.DB_OP, str(key), "old", {"old": 1.0}, detail={"block_m": 16, "old_field": 1})
    speeds = iter([1.0, 0.5] * 3)
    monkeypatch.setattr(gk, "_elapsed_ms", lambda run, reps, cuda: (run(), next(speeds))[1])
    monkeypatch.setattr(gk, "tune_candidates", lambda m_class: [fast])
    assert gk.tune(x, w, offs) == fast
    assert tuning.active_db().get(env, gk.DB_OP, str(key))["detail"] == dataclasses.asdict(fast)


def test_tune_mismatch_is_elementwise():
    e = torch.randn(3000, 64).to(torch.bfloat16)
    assert gk._mismatch(e.clone(), e) is None
    rounded = (e.float() * (1 + 2**-9)).to(torch.bfloat16)  # about one bf16 rounding step apart
    assert gk._mismatch(rounded, e) is None
    one = e.clone()
    one[2500, 5] += 0.25 * one.float().abs().max().item()  # one element in 192000, past the first row chunk
    assert "1 elements differ" in gk._mismatch(one, e, rows=1024) and "row 2500" in gk._mismatch(one, e, rows=1024)
    special = e.clone()
    special[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert gk._mismatch(special.clone(), special) is None  # equal non-finite values match
    finite = special.clone()
    finite[0, 0] = 1.0
    assert gk._mismatch(finite, special) is not None  # a finite value where the table gives inf does not


def test_tune_drops_warp_specialised_candidates_for_gathered_or_scattered_rows(monkeypatch, clean_tuning):
    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40)
    idx = torch.randperm(34).to(torch.int32)
    tried = []
    real_launch = gk.launch

    def launch(*args, config=None, **kwargs):
        tried.append(config)
        return real_launch(*args, config=config, **kwargs)

    monkeypatch.setattr(gk, "launch", launch)
    ws = replace(BASE, schedule="table", tma=True, tma_store=True, warp_specialize="tiles")
    assert gk.tune(x, w, offs, idx=idx, scatter=True, candidates=[ws, BASE], reps=1) == BASE
    assert ws not in tried


def test_measured_choice_overrides_the_table_and_table_config_ignores_it(monkeypatch, clean_tuning):
    monkeypatch.setattr(gc, "interpreting", lambda: False)  # as on a GPU (CPU tensors take the table's path too)
    x, w, _ = _problem([4, 4], k=16, n=16)
    table = gc.CONFIG_TABLE[gc.shape_class(8, 16, 16, 2)]
    assert gc.choose_config(x, w, 8) == gc.table_config(x, w, 8) == table
    gc.MEASURED[gc.measure_key(x, w, 8, False, False)] = BASE
    assert gc.choose_config(x, w, 8) == BASE and gc.table_config(x, w, 8) == table
    assert gc.choose_config(x, w, 8, gather=True) == table  # another key


@pytest.fixture
def fresh_plans():
    gk.reset_plans()
    yield
    gk.reset_plans()


def test_launch_plans_are_planned_once_per_signature(monkeypatch, fresh_plans):
    """The first call of a signature plans its launch; later calls look the plan up. Another row count,
    configuration or data alignment (TMA descriptors need 16 bytes) is another signature."""
    planned = []
    real_plan = gk._plan
    monkeypatch.setattr(gk, "_plan", lambda *args: planned.append(args[0]) or real_plan(*args))
    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40, tail=3)
    for _ in range(3):
        out = torch.full((x.shape[0], 40), float("nan"), dtype=x.dtype)
        gk.launch(x, w, offs, out, config=VARIANTS["table"])
        _check(out, x, w, offs)
        assert out[int(offs[-1]) :].isnan().all()
    assert len(planned) == 1 and gk._PLANS[planned[0]].table
    gk.launch(x[:30], w, offs, torch.empty(30, 40, dtype=x.dtype), config=VARIANTS["table"])
    gk.launch(x, w, offs, out, config=VARIANTS["pointer"])
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view_as(x).copy_(x)  # 2-byte aligned data
    gk.launch(shifted, w, offs, out, config=VARIANTS["table"])
    _check(out, x, w, offs)
    assert len(planned) == 4 and len(set(planned)) == 4


def test_a_measured_choice_reaches_signatures_already_planned(monkeypatch, clean_tuning, fresh_plans):
    """``MEASURED`` changes (``tune`` recording a choice, a clear) drop the cached plans: the next call plans again
    and launches the measured choice, as ``choose_config`` picks it on every call."""
    monkeypatch.setattr(gc, "interpreting", lambda: False)  # choose_config consults MEASURED, as on a GPU
    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40, tail=3)
    key = gc.measure_key(x, w, x.shape[0], False, False)
    gc.MEASURED[key] = VARIANTS["pointer"]
    out = torch.empty(x.shape[0], 40, dtype=x.dtype)
    gk.launch(x, w, offs, out)
    assert [p.config for p in gk._PLANS.values()] == [VARIANTS["pointer"]]
    gc.MEASURED[key] = VARIANTS["table"]
    assert not gk._PLANS
    gk.launch(x, w, offs, out)
    _check(out, x, w, offs)
    assert [p.config for p in gk._PLANS.values()] == [VARIANTS["table"]]
    gc.MEASURED.clear()
    assert not gk._PLANS


def test_the_tuning_variable_is_read_when_a_signature_is_planned(monkeypatch, fresh_plans):
    """``FLY_LIGHTNING_GROUPED_MM_TUNE`` is read once per plan of the operators' calls without a configuration (not
    per call, and never with an explicit one); ``reset_plans`` makes the next call read it again. (Tuning itself
    needs CUDA tensors: never here.)"""
    reads = []
    monkeypatch.setattr(gk, "auto_tune_enabled", lambda: reads.append(1) or True)
    monkeypatch.setattr(gk, "tune", lambda *args, **kwargs: pytest.fail("tuned CPU tensors"))
    x, w, offs = _problem([5, 0, 20, 9], k=24, n=40)
    perm = torch.randperm(x.shape[0]).to(torch.int32)
    for _ in range(3):
        _check(grouped_mm_triton(x, w, offs, None), x, w, offs)
        moe_grouped_mm_triton(x, w, offs, perm, 1, True, False, None)
    assert len(reads) == 2  # one plan each
    grouped_mm_triton(x, w, offs, None, config=BASE)
    assert len(reads) == 2
    gk.reset_plans()
    grouped_mm_triton(x, w, offs, None)
    assert len(reads) == 3


def test_support_reasons(monkeypatch):
    x, w, offs = _problem([4, 4], k=16, n=16)
    assert layout_reason(x, w, offs) is None
    assert "dtype torch.float32" in layout_reason(x.float(), w.float(), offs)
    assert "x rows not contiguous" in layout_reason(torch.randn(16, 8).half().t(), w, offs)
    assert "neither N nor K contiguous" in layout_reason(x, torch.randn(2, 32, 32).half()[:, ::2, ::2], offs)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reset_availability()
    try:
        assert "tensor on CPU" in layout_reason(x, w, offs)
    finally:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        reset_availability()
