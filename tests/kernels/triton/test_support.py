"""``launch_tuned``: the autotuner runs once per tuning key, then the picked config launches straight through the
kernel. (The output allocation these tests once covered, ``written_in_full``, is ``fly_lightning.kernels.outputs``
now: ``tests/kernels/test_outputs.py``.)"""

import torch
import triton
import triton.language as tl

from fly_lightning.kernels.triton._support import launch_tuned

# --- launch_tuned ---------------------------------------------------------------------------------------------------


@triton.jit
def _fill_block(Y, n, BLOCK: tl.constexpr, KEY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.full([BLOCK], BLOCK + KEY, tl.int32)  # which config ran, in the output
    tl.store(Y + offs, value.to(Y.dtype.element_ty), mask=offs < n)


def test_launch_tuned_tunes_once_per_key_then_launches_the_pick(monkeypatch):
    """The autotuner runs the first time a key is seen (and picks the config it measured fastest); later calls launch
    that config straight through the kernel; a new key value or dtype tunes again."""
    tuned = triton.autotune([triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 16})], key=["KEY"])(_fill_block)
    tuned._bench = lambda *args, config, **kwargs: [1.0 if config.kwargs["BLOCK"] == 16 else 2.0]
    runs = []
    real_run = type(tuned).run
    monkeypatch.setattr(type(tuned), "run", lambda self, *a, **k: runs.append(k["KEY"]) or real_run(self, *a, **k))

    def launch(dtype: torch.dtype, key: int) -> torch.Tensor:
        y = torch.zeros(37, dtype=dtype)
        launch_tuned(tuned, lambda meta: (triton.cdiv(37, meta["BLOCK"]),), (y, 37), {"KEY": key})
        return y

    for _ in range(3):
        assert torch.equal(launch(torch.float32, 1), torch.full((37,), 17.0))  # BLOCK 16 ran, every element
    assert runs == [1]
    launch(torch.float32, 2)
    launch(torch.int32, 2)
    assert runs == [1, 2, 2]


def test_interpreter_row_blocks(monkeypatch):
    """Under the CPU interpreter the row-wise kernels take up to INTERPRETER_ROWS rows a program; on a GPU, or with
    0 (as this folder's tests run), the plan's."""
    import torch

    from fly_lightning.kernels.triton import _support

    t = torch.empty(1)
    assert _support.rows_per_program(2064, 32, t) == 32  # this folder's autouse fixture: the GPU plan
    monkeypatch.setattr(_support, "INTERPRETER_ROWS", 1024)
    assert _support.rows_per_program(2064, 32, t) == 1024 and _support.rows_per_program(20, 32, t) == 32
    assert _support.rows_per_program(300, 16, t) == 512
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _support.rows_per_program(2064, 32, t) == 32
