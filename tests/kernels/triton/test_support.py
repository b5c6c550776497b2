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


# --- layout fallback reasons ----------------------------------------------------------------------------------------


def test_every_mx_layout_fallback_names_the_copy_bytes():
    """An input the Triton MX kernels cannot read in its layout runs on ATen, and the dispatch log says what a copy
    into their layout would take (the bytes of the input that needs it)."""
    import fly_lightning

    x = torch.randn(64, 128)
    b, bs = fly_lightning.mx_cast(torch.randn(24, 128), "mxfp8_e4m3")
    a, a_s = fly_lightning.mx_cast(x, "mxfp8_e4m3")
    wd, ws = b.view(2, 12, 128), bs.view(2, 12, 4)
    strided = lambda t: t.t().contiguous().t()  # noqa: E731 (same values, last dim not contiguous)
    calls = {
        ("mx_cast", 32768): lambda: fly_lightning.mx_cast(x.t(), "mxfp8_e4m3"),
        ("mx_cast", 32768, "columns"): lambda: fly_lightning.mx_cast(x.t(), "mxfp8_e4m3", "floor", 0),
        ("mx_fake_quantize", 32768): lambda: fly_lightning.mx_fake_quantize(x.t(), "mxfp8_e4m3"),
        ("mx_dequantize", 3072): lambda: fly_lightning.mx_dequantize(strided(b), bs, "mxfp8_e4m3"),
        ("mx_scaled_mm", 256): lambda: fly_lightning.mx_scaled_mm(a, b, bs, "mxfp8_e4m3", a_scale=strided(a_s),
                                                                  a_fmt="mxfp8_e4m3"),
        ("mx_grouped_mm", 8): lambda: fly_lightning.mx_grouped_mm(
            x, wd, ws, "mxfp8_e4m3", torch.tensor([8, 0, 64, 0], dtype=torch.int32)[::2]
        ),
    }  # fmt: skip
    for key, call in calls.items():
        fly_lightning.DISPATCH_LOG.reset()
        call()
        (record,) = fly_lightning.DISPATCH_LOG.records(key[0])
        triton_reason = record["reason"].split("triton: ")[1]
        assert record["backend"] == "aten" and f"a layout copy of {key[1]} bytes" in triton_reason, (key, record)
        assert len(key) == 2 or key[2] in triton_reason
