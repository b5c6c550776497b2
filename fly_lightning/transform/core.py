"""The transform engine: a small table of matchers, each recognising modules by structure and building a replacement
with the original state_dict keys and shapes. Norms, fused expert tensors (transformers v5, torchtitan) and routers
share the original parameters; per-expert ``nn.Linear`` lists are restacked into ``[E, ...]`` parameters whose
state_dict entries are per-expert views (see ``FlyMoE``), so those blocks have fewer parameter objects.

A matcher may confirm a structural match with a probe: run the original and the replacement on a small random input
and compare, so a look-alike module with different math is left alone (with the reason) instead of silently changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from fly_lightning.dtensor import is_dtensor
from fly_lightning.modules._state import carry_module_state


@dataclass(frozen=True)
class Matcher:
    """Recognises one kind of module.

    ``match(module)`` returns None (not this kind), or a variant name (recognised). ``build(module, variant, root)``
    returns the replacement, or raises ``Unsupported(reason)`` to leave the module with that reason; ``root`` is the
    model being transformed (for model-wide settings such as a Hugging Face config).
    """

    name: str
    family: str  # what a user enables or disables, e.g. "rms_norm", "moe"
    match: Callable[[nn.Module], str | None]
    build: Callable[[nn.Module, str, nn.Module], nn.Module]


class Unsupported(Exception):
    """Raised by a matcher's build: recognised, but this instance cannot be swapped (the message says why)."""


MATCHERS: list[Matcher] = []
SHARDED = "parameters already sharded (DTensor): transform before fully_shard / parallelize_module"
ACCELERATE = "accelerate hooks (_hf_hook: device map or offload) wrap its forward: a swap would drop them"

# class-name endings of modules a user may expect us to handle, for the "not recognised" list
_INTERESTING = ("norm", "moe", "moeblock", "experts", "router", "gate")


def register_matcher(matcher: Matcher) -> Matcher:
    if any(m.name == matcher.name for m in MATCHERS):
        raise ValueError(f"matcher {matcher.name!r} registered twice")
    MATCHERS.append(matcher)
    return matcher


def families() -> list[str]:
    return sorted({m.family for m in MATCHERS})


@dataclass
class TransformSummary:
    swapped: list[tuple[str, str, str]] = field(default_factory=list)  # (path, original class, matcher:variant)
    left: list[tuple[str, str, str]] = field(default_factory=list)  # (path, class, reason)
    unrecognised: Counter = field(default_factory=Counter)  # class name -> count (norm/MoE-looking modules only)

    def __str__(self) -> str:
        """One line per module class (e.g. per MoE block family): what was swapped, and what was left and why."""
        left_by_class: dict[str, Counter] = {}
        for _, c, r in self.left:
            left_by_class.setdefault(c, Counter())[r] += 1
        swapped_classes = {c for _, c, _ in self.swapped}

        def left_part(cls: str) -> str:
            return "; ".join(f"{n} left: {r}" for r, n in left_by_class[cls].items())

        lines, shown = [f"swapped {len(self.swapped)} module(s)"], set()
        for (c, m), n in Counter((c, m) for _, c, m in self.swapped).items():
            mixed = f"; {left_part(c)}" if c in left_by_class and c not in shown else ""  # partly left: same line
            shown.add(c)
            lines.append(f"  {n} x {c} -> {m}{mixed}")
        only_left = [c for c in left_by_class if c not in swapped_classes]
        if only_left:
            lines.append(f"left {sum(sum(left_by_class[c].values()) for c in only_left)} recognised module(s):")
            for c in only_left:
                lines.append("  " + "; ".join(f"{n} x {c}: {r}" for r, n in left_by_class[c].items()))
        if self.unrecognised:
            lines.append("not recognised: " + ", ".join(f"{c} x{n}" for c, n in sorted(self.unrecognised.items())))
        return "\n".join(lines)

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="fly-lightning transform")
        for col in ("status", "module", "count", "detail"):
            table.add_column(col, overflow="fold")
        for kind, n in Counter((c, m) for _, c, m in self.swapped).items():
            table.add_row("swapped", kind[0], str(n), kind[1], style="green")
        for kind, n in Counter((c, r) for _, c, r in self.left).items():
            table.add_row("left", kind[0], str(n), kind[1], style="yellow")
        for c, n in sorted(self.unrecognised.items()):
            table.add_row("not recognised", c, str(n), "")
        Console().print(table)


def transform(model: nn.Module, *, ops: Iterable[str] | None = None, verbose: bool = False) -> TransformSummary:
    """Swap supported modules of ``model`` in place and return what was swapped, left (with reasons) and unknown.

    Args:
        model: any ``nn.Module`` (a LightningModule, a Hugging Face model, a torchtitan model...).
        ops: module families to swap (see ``fly_lightning.transform.core.families()``); ``None`` means all.
        verbose: print the summary as a rich table.
    """
    if isinstance(ops, str):  # set("rms_norm") would be its letters
        raise TypeError(f"ops must be a collection of op family names, e.g. ops=[{ops!r}], not a string")
    wanted = set(families() if ops is None else ops)
    unknown = wanted - set(families())
    if unknown:
        raise ValueError(f"unknown op families {sorted(unknown)}; known: {families()}")
    summary = TransformSummary()
    _walk(model, "", wanted, summary, model)
    if verbose:
        summary.print()
    return summary


def _walk(parent: nn.Module, prefix: str, wanted: set[str], summary: TransformSummary, root: nn.Module) -> None:
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        if getattr(child, "_fly_swapped", False):
            continue  # already ours (the transform is idempotent)
        outcome = _try_swap(child, wanted, root)
        if isinstance(outcome, nn.Module):
            outcome._fly_swapped = True
            setattr(parent, name, outcome)
            summary.swapped.append((path, type(child).__name__, outcome._fly_matcher))
            continue
        if outcome is not None:
            summary.left.append((path, type(child).__name__, outcome))
            continue
        cls = type(child).__name__
        if cls.lower().endswith(_INTERESTING):
            summary.unrecognised[cls] += 1
        _walk(child, f"{path}.", wanted, summary, root)


def _try_swap(module: nn.Module, wanted: set[str], root: nn.Module) -> nn.Module | str | None:
    """The replacement, a reason it was left, or None when no matcher recognises it."""
    for m in MATCHERS:
        variant = m.match(module)
        if variant is None:
            continue
        if m.family not in wanted:
            return f"family {m.family!r} not selected"
        if any(is_dtensor(p) for p in module.parameters()):
            # FSDP2 / TP keep references to this module (parameter swaps, hooks): swapping it now would break them
            return SHARDED
        if hasattr(module, "_hf_hook"):
            return ACCELERATE
        try:
            new = m.build(module, variant, root)
        except Unsupported as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a module we misread is left as it is, never a crashed fit
            return f"conversion failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
        new._fly_matcher = f"{m.name}:{getattr(new, '_fly_variant', variant)}"  # a probe may settle the variant
        new.train(module.training)
        return carry_module_state(new, module)  # hooks on the block or norm keep firing
    return None
