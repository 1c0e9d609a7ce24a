"""How a module becomes stage-3 units: which modules are units, which parameters each holds,
and the parameters built on the meta device.

[Note: one unit per dtype]
A unit's buffers have one dtype, so a module whose parameters have several (fp32 norms beside
bf16 weights, a float64 scale) gets one unit per dtype, gathered and freed together by the
module's hooks. A precision's param_dtype applies to parameters of up to 32 bits; wider ones
keep their dtype, with a master of their own dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.config import ZeroConfig
from lightning_zero.offload import CPU, MasterPlacement
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.layout import held_dtype, reduce_dtype_for
from lightning_zero.zero.stage3.unit import ShardedUnit


def check_dtypes(module: nn.Module) -> None:
    non_float = [n for n, p in module.named_parameters() if not p.is_floating_point()]
    if non_float:
        raise ValueError(f"ZeRO-3 shards floating-point parameters only; these are not: {non_float[:5]}.")


def build_units(
    module: nn.Module,
    collectives: Collectives | CountingCollectives,
    config: ZeroConfig,
    param_dtype: torch.dtype | None,
    device: torch.device,
) -> list[ShardedUnit]:
    """The units of ``module``: one per unit module and dtype, plus the persistent ones (small
    parameters kept whole on every rank), numbered in order."""
    owner_of: dict[nn.Parameter, tuple[str, nn.Module | None]] = {}
    unit_modules = choose_unit_modules(module, config.unit_modules, config.min_unit_numel)
    # Each parameter belongs to the innermost unit module that registers it first.
    for prefix, submodule in module.named_modules():
        unit_prefix = innermost_prefix(prefix, unit_modules)
        for _, param in submodule.named_parameters(recurse=False):
            if param not in owner_of:
                owner_of[param] = (unit_prefix, unit_modules[unit_prefix])
    names = {p: n for n, p in module.named_parameters()}
    # See [Note: one unit per dtype].
    groups: dict[tuple[str, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
    persistent: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for param, (unit_prefix, _) in owner_of.items():
        entry = (names[param], param)
        dtype = held_dtype(param.dtype, param_dtype)
        if param.numel() < config.param_persistence_threshold:
            persistent.setdefault(dtype, []).append(entry)
        else:
            groups.setdefault((unit_prefix, dtype), []).append(entry)
    world, rank = collectives.world_size, collectives.rank
    total = sum(p.numel() for entries in groups.values() for _, p in entries)
    total += sum(p.numel() for entries in persistent.values() for _, p in entries)
    offload_optimizer, offload_params = config.offload_optimizer, config.offload_params
    placement = MasterPlacement(offload_optimizer, device, total // world)
    shard_device = CPU if offload_params is not None else device
    pin = any(policy is not None and policy.pin_memory for policy in (offload_optimizer, offload_params))
    # the unit of a module's main dtype (the most elements) is named after the module
    main_dtype: dict[str, tuple[int, torch.dtype]] = {}
    for (prefix, dtype), entries in groups.items():
        size = sum(p.numel() for _, p in entries)
        if prefix not in main_dtype or size > main_dtype[prefix][0]:
            main_dtype[prefix] = (size, dtype)
    first_dtype = {prefix: dtype for prefix, (_, dtype) in main_dtype.items()}
    named_groups = [
        (prefix, _unit_name(prefix or "<root>", dtype, first_dtype[prefix]), unit_modules[prefix], dtype, entries,
         False)
        for (prefix, dtype), entries in groups.items()
    ]
    first_persistent = next(iter(persistent), None)
    named_groups += [(None, _unit_name("<persistent>", dtype, first_persistent), None, dtype, entries, True)
                     for dtype, entries in persistent.items()]
    units: list[ShardedUnit] = []
    index = 0
    for prefix, name, unit_module, dtype, entries, is_persistent in named_groups:
        master_device = placement.place(sum(p.numel() for _, p in entries) // world)
        unit = ShardedUnit(name, unit_module, entries, index, world, rank, device, dtype,
                           reduce_dtype_for(dtype, config.reduce_torch_dtype), persistent=is_persistent,
                           master_device=master_device, shard_device=shard_device, pin=pin,
                           offloaded=offload_optimizer is not None and master_device == CPU)
        unit.prefix = prefix
        unit.number = len(units)
        units.append(unit)
        index += len(entries)
    return units


# [Note: units too small to pay their latency]
# Every stage-3 unit costs three collectives per step (its all-gather in forward, again in
# backward, its gradients' reduce-scatter), and each collective has a fixed latency. Below about
# these many elements gathered, that latency is most of a collective's time: on gloo, measured
# with benchmarks/comm.py on this project's CPU machine (about 0.6 ms whatever the size up to 16K
# elements; a 64K-element gather costs about twice that); on NCCL, from its published figures
# (tens of microseconds against hundreds of GB/s), not measured here. DeepSpeed's stage 3 shows
# what many small gathers cost (DeepSpeed issues #5047, #3901), hence the warning below rather
# than silence; the defaults (min_unit_numel=1M, prefetch one unit ahead) keep units above both.
LATENCY_BOUND_NUMEL = {"gloo": 65_536, "nccl": 1_048_576}
SMALL_UNITS_MIN_COUNT = 4  # a model of a few small units is small: its collectives are few anyway


class SmallUnitsWarning(UserWarning):
    """Stage-3 units so small that the latency of their collectives dominates (see [Note: units
    too small to pay their latency])."""


def small_units_message(units: Sequence[ShardedUnit], backend: str, config: ZeroConfig) -> str | None:
    """Why the units are latency-bound and what to change, or None when they are not (see [Note:
    units too small to pay their latency])."""
    bound = next((numel for name, numel in LATENCY_BOUND_NUMEL.items() if name in backend), None)
    gathered = [(unit.shard_numel * unit.world_size, unit.name) for unit in units if not unit.persistent]
    small = sorted(entry for entry in gathered if bound is not None and entry[0] < bound)
    if len(small) < SMALL_UNITS_MIN_COUNT or 2 * len(small) <= len(gathered):
        return None
    chosen = (f"unit_modules={config.unit_modules!r} makes a unit of every such module: name a larger class"
              if config.unit_modules else
              f"raise min_unit_numel (now {config.min_unit_numel:,}) so that small modules join their parent's unit")
    return (
        f"{len(small)} of the {len(gathered)} ZeRO-3 units gather fewer than {bound:,} elements each (the smallest:"
        f" {small[0][1]!r}, {small[0][0]:,} elements). Each unit costs three collectives per step (an all-gather in"
        f" forward and in backward, a reduce-scatter of its gradients), and at this size a collective's time on"
        f" {backend} is mostly its fixed latency: {3 * len(small)} such collectives per step. Gather larger units:"
        f" {chosen}, or keep small parameters whole with param_persistence_threshold."
    )


def replace_meta_params(module: nn.Module, units: Sequence[ShardedUnit]) -> set[nn.Parameter]:
    """Meta parameters cannot take real data through ``.data``; each is replaced (in every
    module that registers it, so ties survive) by a parameter viewing its unit's full buffer.
    Only possible before an optimizer holds them, which is when the strategy builds the engine.
    Returns the new parameters (those that still need initializing)."""
    replaced: dict[nn.Parameter, nn.Parameter] = {}
    for unit in units:
        if not any(sp.param.is_meta for sp in unit.params):
            continue
        # Parameters built whole beside them keep their values (materialize_and_shard copies them in).
        whole = [(sp, sp.param.data) for sp in unit.params if not sp.param.is_meta]
        unit.allocate()  # views can only be cut from an allocated buffer; freed right after
        for sp in unit.params:
            if sp.param.is_meta:
                new = param_like(sp.param, unit.view_of(sp))
                replaced[sp.param] = new
                sp.param = new
        unit.free()
        for sp, value in whole:
            sp.param.data = value
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is not None and param in replaced:
                submodule._parameters[name] = replaced[param]
    return set(replaced.values())


def param_like(param: nn.Parameter, data: Tensor) -> nn.Parameter:
    """A parameter of ``param``'s class, ``requires_grad`` and attributes (``_no_weight_decay``, a
    peft marker, ...) over ``data``, to stand in for it in the module."""
    new = torch.Tensor._make_subclass(type(param), data, param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def _unit_name(base: str, dtype: torch.dtype, first: torch.dtype | None) -> str:
    """A module's unit of its main dtype is named after the module; the others add their dtype."""
    return base if dtype == first else f"{base}[{str(dtype).replace('torch.', '')}]"


def innermost_prefix(prefix: str, candidates: Iterable[str]) -> str:
    """The longest candidate module prefix that contains the module at ``prefix`` ("" contains all)."""
    return max((c for c in candidates if c == "" or prefix == c or prefix.startswith(c + ".")), key=len)


def _check_called(module: nn.Module, prefix: str, submodule: nn.Module) -> None:
    """Refuses a unit module named by class whose forward never runs: a unit is gathered by its
    module's forward hooks, so its parameters would stay 1-d pieces where they are read."""
    name = type(submodule).__name__
    if type(submodule).forward is nn.Module.forward and "forward" not in vars(submodule):
        why = f"{name} has no forward of its own (a container the model loops over), so no hook of its ever runs"
    else:
        parent_prefix, _, child_name = prefix.rpartition(".")
        parent = module.get_submodule(parent_prefix)
        if not (isinstance(parent, nn.MultiheadAttention) and child_name == "out_proj"):
            return
        why = ("nn.MultiheadAttention reads its out_proj's weight and bias in its own forward without calling"
               " out_proj, so out_proj's hooks never run")
    raise ValueError(
        f"ZeroConfig.unit_modules names {name!r}, but '{prefix}' cannot be a ZeRO-3 unit: {why}, and its"
        " parameters would stay each rank's 1-d piece where they are read. Leave it out of unit_modules (its"
        " parameters then join the unit of the module around it) and name the module that runs it, e.g. the"
        " block it belongs to."
    )


def choose_unit_modules(module: nn.Module, unit_classes: Sequence[str], min_unit_numel: int) -> dict[str, nn.Module | None]:
    """Module prefixes that become units ("" is the root, always a unit).

    With ``unit_classes``, every module of those classes is a unit. Otherwise modules are chosen
    bottom-up among the root's children and the elements of containers (ModuleList, Sequential,
    ModuleDict), the modules a forward calls as a whole: a module nested deeper may have its
    parameters read by its parent without its own forward running (e.g. MultiheadAttention's
    out_proj), so no hook of its own would gather them; a container without a forward of its own
    (ModuleList, ModuleDict) is never one, since no hook of its would run. A candidate becomes a unit once the
    parameters under it that no smaller unit took reach ``min_unit_numel``; small modules are
    grouped into their parent's unit.
    """
    units: dict[str, nn.Module | None] = {"": module}
    if unit_classes:
        wanted = set(unit_classes)
        for prefix, submodule in module.named_modules():
            if prefix and type(submodule).__name__ in wanted:
                _check_called(module, prefix, submodule)
                units[prefix] = submodule
        present = {type(m).__name__ for m in units.values() if m is not module}
        if wanted - present:
            classes = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"ZeroConfig.unit_modules names {sorted(wanted - present)}, but the model has no module of that"
                f" class. Its module classes are: {classes}."
            )
        return units
    taken: set[nn.Parameter] = set()
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

    def visit(prefix: str, submodule: nn.Module, eligible: bool) -> int:
        free = 0
        for child_name, child in submodule.named_children():
            child_eligible = submodule is module or isinstance(submodule, containers)
            free += visit(f"{prefix}.{child_name}" if prefix else child_name, child, child_eligible)
        for param in submodule.parameters(recurse=False):
            if param not in taken:
                taken.add(param)
                free += param.numel()
        # A ModuleList or ModuleDict has no forward: its hooks would never run, so its parameters
        # go up to the enclosing unit (the elements themselves may still be units).
        has_forward = type(submodule).forward is not nn.Module.forward
        if prefix and eligible and has_forward and free >= min_unit_numel:
            units[prefix] = submodule
            return 0
        return free

    visit("", module, False)
    return units

