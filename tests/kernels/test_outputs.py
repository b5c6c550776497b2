"""``fly_lightning.kernels.outputs``, the kernels' output allocator: poisoned under test (the session's autouse
``poisoned_outputs``), without deterministic mode's fill in production for outputs written in full, and the only way
a kernel module allocates its outputs (an AST scan of the Triton and FlyDSL modules)."""

import ast
import contextlib
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import profile

import fly_lightning.kernels
from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton import grouped_mm, moe_combine, moe_grouped_mm, moe_route, rms_norm, swiglu, topk


@contextlib.contextmanager
def _deterministic(fill: bool = True):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True


def _ops(fn) -> list[str]:
    with profile() as prof:
        fn()
    return [e.name for e in prof.events()]


@pytest.fixture
def production(monkeypatch):
    """The allocation as outside tests: no poison."""
    monkeypatch.setattr(outputs, "POISON", False)


# --- the helper --------------------------------------------------------------------------------------------------


def test_the_test_session_poisons_by_dtype_with_or_without_deterministic_algorithms():
    assert outputs.POISON  # tests/conftest.py, for the whole session
    for det in (False, True):
        with _deterministic() if det else contextlib.nullcontext():
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                assert outputs.empty(2, 3, dtype=dtype, device="cpu").isnan().all()
            assert (outputs.empty((4,), dtype=torch.int32, device="cpu") == 2**31 - 1).all()
            assert (outputs.empty_like(torch.zeros(3, dtype=torch.int64)) == 2**63 - 1).all()
            assert outputs.empty(3, dtype=torch.bool, device="cpu").all()
            assert outputs.empty_like(torch.zeros(2, 5), dtype=torch.float16).isnan().all()
            assert outputs.empty(0, 4, dtype=torch.float32, device="cpu").shape == (0, 4)
            assert outputs.empty(3, dtype=torch.float32, device="cpu", written_in_full=False).isnan().all()


def test_production_skips_the_fill_only_for_outputs_written_in_full(production):
    x = torch.zeros(8)
    with _deterministic():
        assert "aten::fill_" in _ops(lambda: torch.empty(8))
        for alloc in (lambda: outputs.empty(8, dtype=torch.float32, device="cpu"), lambda: outputs.empty_like(x)):
            assert "aten::fill_" not in _ops(alloc)
            assert torch.utils.deterministic.fill_uninitialized_memory  # restored
        kept = outputs.empty(8, dtype=torch.float32, device="cpu", written_in_full=False)
        assert kept.isnan().all()  # PyTorch's fill, as for torch.empty
        assert outputs.empty_like(torch.zeros(3, dtype=torch.int32), written_in_full=False).eq(2**31 - 1).all()
        with pytest.raises(RuntimeError):
            outputs.empty(-1, dtype=torch.float32, device="cpu")
        assert torch.utils.deterministic.fill_uninitialized_memory  # restored after a failed allocation too
    assert "aten::fill_" not in _ops(lambda: outputs.empty(8, dtype=torch.float32, device="cpu"))


def test_production_leaves_the_setting_alone_when_there_is_no_fill(production):
    with _deterministic(fill=False):
        outputs.empty(8, dtype=torch.float32, device="cpu")
        assert not torch.utils.deterministic.fill_uninitialized_memory
    outputs.empty(8, dtype=torch.float32, device="cpu")  # deterministic algorithms off
    assert torch.utils.deterministic.fill_uninitialized_memory


# --- the backends' outputs ---------------------------------------------------------------------------------------


def _calls():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    x = torch.randn(6, 32, generator=g)
    gate_up = torch.randn(5, 24, generator=g)
    rows = torch.randn(12, 16, generator=g)
    weights = torch.rand(6, 2, generator=g)
    xh = torch.randn(12, 16, generator=g).half()
    wh = torch.randn(3, 16, 8, generator=g).half()
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)  # rows 9.. past the last offset: unwritten by contract
    perm = torch.randperm(12, generator=g).to(torch.int32)
    full = torch.tensor([3, 3, 12], dtype=torch.int32)
    return {
        "moe_route": lambda: moe_route.moe_route_triton(logits, 2, "softmax", True, None, 1.0, None, None, True),
        "topk": lambda: topk.topk_triton(x, 3),
        "rms_norm": lambda: rms_norm.rms_norm_triton(x, torch.ones(32), 1e-6, 0.0, False),
        "swiglu": lambda: swiglu.swiglu_triton(gate_up, None),
        "moe_combine": lambda: moe_combine.moe_combine_triton(rows, weights, None, None),
        "grouped_mm": lambda: grouped_mm.grouped_mm_triton(xh, wh, offs, None),
        "moe_grouped_mm": lambda: moe_grouped_mm.moe_grouped_mm_triton(xh, wh, full, perm, 1, False, True, None),
    }


WRITTEN_IN_FULL = {op: op != "grouped_mm" for op in _calls()}  # grouped_mm: rows past the last offset stay unwritten


class _Allocations(TorchFunctionMode):
    """The fill setting at each ``torch.empty``/``empty_like`` call, by the new tensor's address (the interpreter's
    own tensors come and go too; only the outputs' allocations are looked up)."""

    def __init__(self):
        super().__init__()
        self.fill = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.empty, torch.empty_like):
            self.fill[out.data_ptr()] = torch.utils.deterministic.fill_uninitialized_memory
        return out


@pytest.mark.parametrize("op", sorted(_calls()))
def test_backends_allocate_outputs_through_the_helper(op, monkeypatch):
    """Production, deterministic algorithms on: outputs written in full are allocated without the fill (and the
    setting is restored); poisoned (the session's setting), the same call gives the same outputs: the poison is not
    observable by a correct kernel."""
    call = _calls()[op]
    with monkeypatch.context() as patch:
        patch.setattr(outputs, "POISON", False)
        with _deterministic():
            with _Allocations() as seen:
                got = call()
            assert torch.utils.deterministic.fill_uninitialized_memory  # restored
    got = got if isinstance(got, tuple) else (got,)
    filled = [seen.fill[t.data_ptr()] for t in got if t.numel()]
    assert filled == [not WRITTEN_IN_FULL[op]] * len(filled)
    for det in (False, True):
        with _deterministic() if det else contextlib.nullcontext():
            want = call()
        for a, b in zip(got, want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # NaN: grouped_mm's unwritten rows


# --- every output allocation goes through the helper ---------------------------------------------------------------

KERNELS = Path(fly_lightning.kernels.__file__).parent
RAW = {"empty", "empty_like", "empty_strided"}  # torch.<name>
RAW_METHODS = {"new_empty", "new_empty_strided"}  # <tensor>.<name>

# The genuine exceptions, (module, function): each must still hold a raw allocation (stale entries fail the test).
ALLOWED = {
    # FlyDSL compile probes: CPU placeholders with a real call's dtypes and ranks, traced and compiled, never launched
    # (nothing is ever written to them)
    ("flydsl/_rms_norm_kernel.py", "_example_args"),
    ("flydsl/_moe_route_kernel.py", "_example_args"),
    # the scratch Triton asks for at launch to build device-side TMA descriptors (written before they are read by the
    # launch itself): Triton's workspace, not an output of the operator
    ("triton/_grouped_mm_kernel.py", "_tma_allocator"),
}


def raw_allocations(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of each raw ``torch.empty``-style allocation in ``source``: ``torch.empty`` (any
    alias of the torch module), ``empty`` imported from torch, or ``<tensor>.new_empty``, called or referenced."""
    tree = ast.parse(source)
    torch_names, bare = {"torch"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            bare |= {a.asname or a.name for a in node.names if a.name in RAW}
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if isinstance(node, ast.Attribute) and (
            node.attr in RAW_METHODS
            or (node.attr in RAW and isinstance(node.value, ast.Name) and node.value.id in torch_names)
        ):
            found.append((func, node.lineno))
        elif isinstance(node, ast.Name) and node.id in bare:
            found.append((func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_the_scan_finds_raw_allocations():
    src = """
import torch
import torch as th
from torch import empty_like as el

def a(x):
    y = torch.empty(3)
    return th.empty_strided((2,), (1,)), el(x), x.new_empty((0,)), y

def b(x):
    alloc = torch.empty_like
    return outputs.empty(3, dtype=x.dtype, device=x.device), torch.zeros(2), tl.zeros([4], tl.int32), alloc(x)
"""
    assert raw_allocations(src) == [("a", 7), ("a", 8), ("a", 8), ("a", 8), ("b", 11)]


def test_kernel_modules_allocate_outputs_only_through_the_helper():
    modules = sorted([*(KERNELS / "triton").glob("*.py"), *(KERNELS / "flydsl").glob("*.py")])
    assert len(modules) >= 15  # the scan sees the kernel modules
    raw, allowed_seen, helper_calls = [], set(), 0
    for path in modules:
        name = path.relative_to(KERNELS).as_posix()
        source = path.read_text()
        helper_calls += source.count("outputs.empty")
        for func, line in raw_allocations(source):
            if (name, func) in ALLOWED:
                allowed_seen.add((name, func))
            else:
                raw.append(f"{name}:{line} in {func}()")
    assert not raw, f"allocate kernel outputs with fly_lightning.kernels.outputs.empty/empty_like: {raw}"
    assert allowed_seen == ALLOWED, f"stale allow-list entries: {ALLOWED - allowed_seen}"
    assert helper_calls >= 15
