"""MX checkpoints: a converted model's MX weights and scales in one safetensors file, with metadata.

``save_mx_checkpoint(model, path)`` writes every weight that ``FlyMXConfig`` converted: in training mode
(``FlyMXLinear``, ``FlyMoE`` with ``mx``) the cast of the current high-precision master, what the next forward
multiplies by outside autocast (under bf16 autocast the forward casts the master rounded to bf16 first, so some bytes
differ from the file's); in frozen mode (``FlyMXFrozenLinear``, ``FlyMXFrozenExperts``) the stored buffers. The write
is atomic: a temporary file in the same directory, flushed to disk, then ``os.replace``, so a crash leaves the old
file or the new one, never half of one. ``load_mx_checkpoint(model, path)`` reads one into a model converted the same
way, in either mode, after checking everything it can before writing anything: frozen buffers are copied bit for bit;
training masters are set to values whose cast gives back the file's bytes (``master_values``), so saving again writes
the same tensors. (Bit-exact with fp32 masters; with bf16 ones, but for values under bf16's smallest subnormal. NaN
blocks come back as NaN blocks, their element bytes unspecified, as the cast leaves them.)

File layout. Per weight, under its key (``{module}.weight`` for a Linear, ``{block}.experts.{gate_up | gate | up |
down}`` for MoE experts, each projection as its ``[E, N, K]`` transpose), two ``uint8`` tensors with blocks of 32
along the last dim:

- ``{key}.data``: ``[..., N, K]`` element bytes for MXFP8 (e4m3 / e5m2 bit patterns), ``[..., N, K / 2]`` for MXFP4
  (two e2m1 codes per byte, element ``2j`` in the low nibble);
- ``{key}.scale``: ``[..., N, K / 32]`` E8M0 scales as their biased exponent byte (127 = 2^0, 255 = NaN).

Both are stored as ``uint8`` rather than ``float8_*`` / ``float8_e8m0fnu`` / ``float4_e2m1fn_x2``: every safetensors
reader handles ``U8``, the E8M0 and FP4 dtypes only recent ones, and the metadata says how to read the bytes.
The header's ``__metadata__`` (strings) holds ``fly_lightning.mx.version`` (``VERSION``), ``.block_size`` (32),
``.encoding`` (the sentence above) and ``.weights``: JSON, per key its ``format``, scale ``mode``, logical ``shape``,
``kind`` (``linear`` / ``experts``), the original ``dtype`` and a CRC-32 of each tensor's bytes.

Errors (``MXCheckpointError``, a ``ValueError``) name the file and the problem: not a safetensors file, a truncated
file or a bad header (safetensors' own checks), a file without our metadata, another version, block size, format,
scale mode or shape than the model's, missing or unexpected keys, tensors of the wrong dtype or shape, or bytes
whose CRC-32 differs from the one written (corruption inside the data).

Sharded (DTensor) weights are refused: gather the model (or convert and save before sharding).
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from fly_lightning.dtensor import is_dtensor
from fly_lightning.modules.moe import FlyMoE
from fly_lightning.quant import formats
from fly_lightning.quant.frozen import (
    VERSION,
    FlyMXFrozenExperts,
    FlyMXFrozenLinear,
    dequantize_rows,
    quantize_rows,
)
from fly_lightning.quant.linear import FlyMXLinear

PREFIX = "fly_lightning.mx"
ENCODING = (
    "data: uint8, fp8 element bytes or two e2m1 codes per byte (element 2j in the low nibble); scale: uint8 biased "
    "E8M0 exponent (127 = 2^0, 255 = NaN); blocks of 32 along the last dim"
)


class MXCheckpointError(ValueError):
    """An MX checkpoint that cannot be read into this model (mismatched or corrupted), or a model that cannot be
    saved; the message names the file and the problem."""


@dataclass
class MXTarget:
    """One converted weight: where its MX bytes come from and go to."""

    key: str
    kind: str  # "linear" or "experts"
    fmt: str
    mode: str
    shape: list[int]  # logical [..., N, K]: blocks along the last dim
    dtype: torch.dtype  # the original (or master) weights' dtype
    get: Callable[[], tuple[Tensor, Tensor]] = field(repr=False)  # -> (data, scale), uint8
    set: Callable[[Tensor, Tensor], None] = field(repr=False)  # (data, scale) uint8 -> model
    tensors: tuple[Tensor, ...] = field(default=(), repr=False)  # the model's tensors behind it (sharding check)

    def tensor_shapes(self) -> tuple[list[int], list[int]]:
        *lead, k = self.shape
        return [*lead, k // formats.as_format(self.fmt).per_byte], [*lead, k // formats.BLOCK]


@dataclass
class MXLoadResult:
    """What ``load_mx_checkpoint`` did: keys loaded, model keys the file lacks, file keys the model lacks."""

    loaded: list[str]
    missing: list[str]
    unexpected: list[str]


def _refuse_sharded(key: str, *tensors: Tensor) -> None:
    if any(is_dtensor(t) for t in tensors):
        raise MXCheckpointError(f"MX checkpoint: {key} is sharded (DTensor); gather the model before saving/loading")


def _refuse_meta(key: str, *tensors: Tensor) -> None:
    """Loading into meta tensors would write nothing (``copy_`` there is a no-op) and report success."""
    if any(t.is_meta for t in tensors):
        raise MXCheckpointError(
            f"MX checkpoint: {key} is on the meta device; materialise the model first (module.to_empty(device=...))"
        )


def master_values(data: Tensor, scale: Tensor, fmt: str, mode: str) -> Tensor:
    """fp32 values ``[..., K]`` whose MX cast (``fmt``, ``mode``) is ``(data, scale)`` again: the dequantised values
    except where the cast is not the inverse of dequantising (torchao's conventions, kept by ``formats``):

    - ``floor``, smallest scale (byte 0): the cast divides by 2^-126, dequantising multiplies by 2^-127, so the
      values are doubled;
    - ``rceil``: a block whose largest element rounded down to half the format's largest value dequantises to a
      quotient at a power of two, which casts to the next smaller scale (the same values, other bytes); those
      elements are lifted by 2^-7 (still inside their rounding interval, and representable in bf16).
    """
    f, mode = formats.as_format(fmt), formats.as_mode(mode)
    v = dequantize_rows(data, scale, fmt, torch.float32)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // formats.BLOCK, formats.BLOCK)
    b = scale.view(torch.uint8).to(torch.int32).unsqueeze(-1)
    if mode is formats.ScaleMode.FLOOR:
        blocks = torch.where(b == 0, blocks * 2.0, blocks)
    else:
        elems = dequantize_rows(data, torch.full_like(scale, formats.E8M0_BIAS), fmt, torch.float32)
        elems = elems.reshape(blocks.shape).abs()
        half = f.max / 2
        lift = (elems.amax(-1, keepdim=True) == half) & (elems == half) & (b >= 1) & (b <= 253)
        blocks = torch.where(lift, blocks * (1 + 2.0**-7), blocks)
    return blocks.reshape(v.shape)


def _linear_target(fqn: str, m: nn.Module) -> MXTarget:
    key = f"{fqn}.weight" if fqn else "weight"
    if isinstance(m, FlyMXFrozenLinear):

        def put(data: Tensor, scale: Tensor) -> None:
            m.weight_data.copy_(data)
            m.weight_scale.copy_(scale)

        get = lambda: (m.weight_data, m.weight_scale)  # noqa: E731
        shape = [m.out_features, m.in_features]
        return MXTarget(key, "linear", m.spec.weight, m.spec.mode, shape, m.dtype, get, put, get())
    w = m.weight

    def put_master(data: Tensor, scale: Tensor) -> None:
        w.copy_(master_values(data.to(w.device), scale.to(w.device), m.spec.weight, m.spec.mode))

    def cast() -> tuple[Tensor, Tensor]:
        _refuse_sharded(key, w)
        return quantize_rows(w, m.spec.weight, m.spec.mode)

    return MXTarget(key, "linear", m.spec.weight, m.spec.mode, list(w.shape), w.dtype, cast, put_master, (w,))


def _expert_targets(fqn: str, moe: FlyMoE) -> list[MXTarget]:
    base = f"{fqn}.experts" if fqn else "experts"
    experts = moe.experts
    if isinstance(experts, FlyMXFrozenExperts):
        out = []
        for name in experts.names:
            data, scale = getattr(experts, f"{name}_data"), getattr(experts, f"{name}_scale")

            def put(d: Tensor, s: Tensor, data: Tensor = data, scale: Tensor = scale) -> None:
                data.copy_(d)
                scale.copy_(s)

            get = lambda data=data, scale=scale: (data, scale)  # noqa: E731
            spec = experts.spec
            out.append(MXTarget(f"{base}.{name}", "experts", spec.weight, spec.mode, experts.shapes[name],
                                experts.dtype, get, put, (data, scale)))  # fmt: skip
        return out
    mx = moe.mx
    gate_up, up, down = experts.projections()
    named = {"gate_up": gate_up, "down": down} if up is None else {"gate": gate_up, "up": up, "down": down}
    out = []
    for name, w_EKN in named.items():
        key = f"{base}.{name}"

        def cast(w: Tensor = w_EKN, key: str = key) -> tuple[Tensor, Tensor]:
            _refuse_sharded(key, w)
            return quantize_rows(w.transpose(1, 2), mx.weight_fmt, mx.mode)

        def put(d: Tensor, s: Tensor, w: Tensor = w_EKN) -> None:
            rows = master_values(d.to(w.device), s.to(w.device), mx.weight_fmt, mx.mode)
            w.copy_(rows.transpose(1, 2))  # a view of the master parameter: writes through

        shape = list(w_EKN.transpose(1, 2).shape)
        out.append(MXTarget(key, "experts", mx.weight_fmt, mx.mode, shape, w_EKN.dtype, cast, put, (w_EKN,)))
    return out


def mx_targets(model: nn.Module) -> dict[str, MXTarget]:
    """Every weight of ``model`` that ``FlyMXConfig`` converted (training or frozen), by checkpoint key."""
    targets: dict[str, MXTarget] = {}
    for fqn, m in model.named_modules():
        if isinstance(m, (FlyMXLinear, FlyMXFrozenLinear)):
            found = [_linear_target(fqn, m)]
        elif isinstance(m, FlyMoE) and (m.mx is not None or isinstance(m.experts, FlyMXFrozenExperts)):
            found = _expert_targets(fqn, m)
        else:
            continue
        targets.update((t.key, t) for t in found)
    return targets


def _crc(t: Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())


def save_mx_checkpoint(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Write ``model``'s MX weights and scales to ``path`` (safetensors, atomically); returns the keys written.

    Raises ``MXCheckpointError`` when the model holds no converted weight or a sharded one, or ``path`` is a
    directory.
    """
    from safetensors.torch import save_file

    if Path(path).is_dir():
        raise MXCheckpointError(f"MX checkpoint {path}: a directory; give a file path (model.safetensors, say)")
    targets = mx_targets(model)
    if not targets:
        raise MXCheckpointError(f"MX checkpoint {path}: the model has no weight converted by FlyMXConfig")
    tensors: dict[str, Tensor] = {}
    weights: dict[str, dict] = {}
    with torch.no_grad():
        for key, t in targets.items():
            data, scale = (x.detach().contiguous().cpu() for x in t.get())
            tensors[f"{key}.data"], tensors[f"{key}.scale"] = data, scale
            weights[key] = {
                "format": t.fmt,
                "mode": t.mode,
                "shape": t.shape,
                "kind": t.kind,
                "dtype": str(t.dtype).removeprefix("torch."),
                "crc32": [_crc(data), _crc(scale)],
            }
    metadata = {
        f"{PREFIX}.version": str(VERSION),
        f"{PREFIX}.block_size": str(formats.BLOCK),
        f"{PREFIX}.encoding": ENCODING,
        f"{PREFIX}.weights": json.dumps(weights, sort_keys=True),
    }
    _atomic_write(lambda tmp: save_file(tensors, tmp, metadata=metadata), Path(path))
    return list(targets)


def _atomic_write(write: Callable[[str], None], path: Path) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, flushed to disk, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # the rename itself durable (best effort: not every platform opens directories)
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _read_header(path: Path) -> tuple[object, dict[str, dict]]:
    """Open ``path`` and return (the open safetensors handle, per-key metadata), or raise MXCheckpointError."""
    from safetensors import safe_open

    if not path.is_file():
        raise MXCheckpointError(f"MX checkpoint {path}: no such file")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors' SafetensorError, or an OS error: a truncated or malformed file
        raise MXCheckpointError(f"MX checkpoint {path}: corrupted or not a safetensors file ({e})") from e
    meta = handle.metadata() or {}
    version = meta.get(f"{PREFIX}.version")
    if version is None:
        raise MXCheckpointError(f"MX checkpoint {path}: no '{PREFIX}.version' in the header: not an MX checkpoint")
    if version != str(VERSION):
        raise MXCheckpointError(f"MX checkpoint {path}: version {version}; this code reads version {VERSION}")
    block = meta.get(f"{PREFIX}.block_size")
    if block != str(formats.BLOCK):
        raise MXCheckpointError(f"MX checkpoint {path}: block size {block}; this code uses {formats.BLOCK}")
    try:
        weights = json.loads(meta[f"{PREFIX}.weights"])
        if not isinstance(weights, dict):
            raise TypeError(type(weights).__name__)
    except (KeyError, TypeError, ValueError) as e:
        raise MXCheckpointError(f"MX checkpoint {path}: unreadable '{PREFIX}.weights' metadata ({e})") from e
    return handle, weights


def _check_entry(path: Path, t: MXTarget, entry: object, handle) -> None:
    """Raise MXCheckpointError unless the file's entry and tensors for ``t.key`` fit ``t``."""
    if not isinstance(entry, dict):
        raise MXCheckpointError(f"MX checkpoint {path}: {t.key}: malformed metadata entry {entry!r}")
    for field_name, mine in (("format", t.fmt), ("mode", t.mode), ("shape", t.shape), ("kind", t.kind)):
        if entry.get(field_name) != mine:
            raise MXCheckpointError(
                f"MX checkpoint {path}: {t.key} has {field_name} {entry.get(field_name)!r} in the file, "
                f"{mine!r} in the model"
            )
    names = set(handle.keys())
    for suffix, want in zip(("data", "scale"), t.tensor_shapes(), strict=True):
        name = f"{t.key}.{suffix}"
        if name not in names:
            raise MXCheckpointError(f"MX checkpoint {path}: tensor {name} listed in the metadata is missing")
        sl = handle.get_slice(name)
        shape, dtype = list(sl.get_shape()), sl.get_dtype()
        if shape != want or dtype != "U8":
            raise MXCheckpointError(
                f"MX checkpoint {path}: tensor {name} is {dtype} {shape}, expected U8 {want} ({t.fmt} {t.shape})"
            )


def _read_checked(path: Path, key: str, entry: dict, handle) -> tuple[Tensor, Tensor]:
    data, scale = handle.get_tensor(f"{key}.data"), handle.get_tensor(f"{key}.scale")
    if entry.get("crc32") != [_crc(data), _crc(scale)]:
        raise MXCheckpointError(f"MX checkpoint {path}: {key}: the bytes do not match their CRC-32 (corrupted)")
    return data, scale


def load_mx_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> MXLoadResult:
    """Read ``path`` (written by ``save_mx_checkpoint``) into ``model``, converted by ``FlyMXConfig`` the same way
    (same formats, scale mode and shapes; training or frozen mode, either way round).

    Every key's metadata, tensor names, dtypes and shapes are checked before anything is written; with ``strict``
    (the default) the file and the model must hold the same keys. Each tensor's CRC-32 is checked in that first pass.
    Raises ``MXCheckpointError`` naming the problem.
    """
    path = Path(path)
    targets = mx_targets(model)
    handle, weights = _read_header(path)
    with handle:
        return _load(path, targets, handle, weights, strict)


def _load(path: Path, targets: dict[str, MXTarget], handle, weights: dict, strict: bool) -> MXLoadResult:
    missing = sorted(set(targets) - set(weights))
    unexpected = sorted(set(weights) - set(targets))
    if strict and (missing or unexpected):
        raise MXCheckpointError(
            f"MX checkpoint {path}: keys do not match the model: missing from the file {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, not in the model {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(missing)} and {len(unexpected)})"
        )
    keys = [k for k in targets if k in weights]
    for key in keys:  # everything checked, bytes included, before the model is touched (read twice: no copy kept)
        _refuse_sharded(key, *targets[key].tensors)
        _refuse_meta(key, *targets[key].tensors)
        _check_entry(path, targets[key], weights[key], handle)
        _read_checked(path, key, weights[key], handle)
    with torch.no_grad():
        for key in keys:
            targets[key].set(*_read_checked(path, key, weights[key], handle))
    return MXLoadResult(keys, missing, unexpected)
