"""DTensor inputs: run an op on local shards when the placement allows it, otherwise the reference, recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from fly_lightning.dispatch import record_fallback
from fly_lightning.registry import OpDef

_DTENSOR: list[type | None] = []  # DTensor's class, looked up on first use (not functools.cache: Dynamo warns on it)


def is_dtensor(t: Any) -> bool:
    if not _DTENSOR:  # every public call asks: the import statement cost more than the check
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch built without distributed
            DTensor = None
        _DTENSOR.append(DTensor)
    cls = _DTENSOR[0]
    return cls is not None and isinstance(t, cls)


def replicate_plain(args: tuple) -> tuple:
    """``args`` with every plain tensor made a replicated DTensor on the mesh of the DTensors among them: DTensor ops
    refuse mixed operands, and torch's ``implicit_replication`` treats plain ones as replicated too."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    return tuple(
        DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
        if isinstance(a, Tensor) and not isinstance(a, DTensor)
        else a
        for a in args
    )


def run_on_local_shards(
    op: OpDef,
    local_fn: Callable[..., Tensor],
    reference_fn: Callable[..., Tensor],
    x: Any,
    *others: Any,
    reduced_dims: tuple[int, ...],
    scalars: tuple = (),
) -> Any:
    """Apply ``local_fn`` shard by shard when that computes the same function, else ``reference_fn`` on DTensors.

    The op's arguments are ``(x, *others, *scalars)``; they are validated first, on either path. Local execution is
    exact when ``x`` is not sharded along a dim the op reduces over, has no pending partial sums, and every other
    tensor argument is replicated. A plain tensor beside a DTensor counts as replicated (as torch's
    ``implicit_replication`` treats it), on both paths: its gradient is then summed over the ranks too. The output
    keeps ``x``'s placements.
    """
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if op.validate is not None:
        op.validate(x, *others, *scalars)
    reason = None
    if not isinstance(x, DTensor):
        reason = "x is a plain tensor but another argument is a DTensor"
    else:
        for p in x.placements:
            if isinstance(p, Shard) and p.dim % x.dim() in reduced_dims:
                reason = f"DTensor sharded along reduced dim {p.dim}"
            elif not isinstance(p, (Shard, Replicate)):
                reason = f"DTensor placement {p}"
        for o in others:
            if isinstance(o, DTensor) and not all(isinstance(p, Replicate) for p in o.placements):
                reason = f"DTensor argument with placements {o.placements}"
    if reason is not None:
        placements = tuple(str(p) for p in getattr(x, "placements", ()))
        record_fallback(op, (placements, tuple(x.shape), x.dtype, reason), (x, *others), reason)
        return reference_fn(*replicate_plain((x, *others)))
    # a replicated argument's gradient from this rank's shard is only this shard's part: a partial sum over each mesh
    # dim along which x is sharded (reduced later, as for native DTensor ops), not a replicated value; a plain tensor
    # goes through a replicated DTensor so that its gradient gets that reduction too
    grad_placements = [Partial() if isinstance(p, Shard) else Replicate() for p in x.placements]
    local_others = [
        o.to_local(grad_placements=grad_placements) if isinstance(o, Tensor) else o
        for o in replicate_plain((x, *others))[1:]
    ]
    out = local_fn(x.to_local(), *local_others)
    stride = make_contiguous_strides_for(x.shape)  # our local outputs are contiguous
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=stride)
