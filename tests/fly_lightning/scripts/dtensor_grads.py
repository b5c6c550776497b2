"""Two gloo ranks on CPU: ``rms_norm`` on a DTensor sharded over the ranks, weight plain or replicated, against the
plain reference's output and gradients. Run as a subprocess by ``test_dtensor.py``.

    python dtensor_grads.py OUT.json
"""

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

EPS = 1e-5


def _reference(x, w, grad_out):
    from fly_lightning.ops.rms_norm import rms_norm_reference

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm_reference(xr, wr, EPS)[0]
    (y * grad_out).sum().backward()
    return y.detach(), xr.grad, wr.grad


def _rank(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fly_lightning
    from fly_lightning import DISPATCH_LOG

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    x, w, grad_out = torch.randn(4, 6, 8, generator=g), torch.randn(8, generator=g), torch.randn(4, 6, 8, generator=g)
    y_ref, gx_ref, gw_ref = _reference(x, w, grad_out)
    results = {}
    for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
        for kind in ("plain", "replicated"):
            x_dt = distribute_tensor(x, mesh, [placement]).requires_grad_()
            w_arg = w.clone() if kind == "plain" else distribute_tensor(w, mesh, [Replicate()])
            w_arg.requires_grad_()
            y = fly_lightning.rms_norm(x_dt, w_arg, EPS)
            (y * distribute_tensor(grad_out, mesh, [placement])).sum().backward()
            gw = w_arg.grad.full_tensor() if kind == "replicated" else w_arg.grad
            results[f"{placement}/{kind}"] = {
                "y": torch.allclose(y.full_tensor(), y_ref, rtol=1e-5, atol=1e-5),
                "gx": torch.allclose(x_dt.grad.full_tensor(), gx_ref, rtol=1e-4, atol=1e-5),
                "gw": torch.allclose(gw, gw_ref, rtol=1e-4, atol=1e-5),
            }
    results["backends"] = sorted({r["backend"] for r in DISPATCH_LOG.records("rms_norm")})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it (a CI run aborted in teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    mp.spawn(_rank, args=(2, f"file://{out}.pg", out), nprocs=2)
