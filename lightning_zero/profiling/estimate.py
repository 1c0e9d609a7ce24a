"""How much memory one rank needs under ZeRO, per category, before anything runs.

[Note: memory of one rank]
With Ψ trainable parameter elements sharded over N ranks, parameters held in P bytes (4 for
fp32, 2 for bf16/fp16), gradients reduced in R bytes (``ZeroConfig.reduce_dtype``), fp32 masters
and an optimizer with K fp32 moments per element (Adam/AdamW: 2), the engine allocates:

=========  ==================  ====================  ===============================
stage      parameters          gradients             optimizer state (master + K)
=========  ==================  ====================  ===============================
1          P Ψ                 R Ψ  +  4 Ψ/N         4 Ψ/N + 4K Ψ/N
2          P Ψ                 4 Ψ/N                 4 Ψ/N + 4K Ψ/N
3          P Ψ/N               4 Ψ/N                 (4 Ψ/N if a copy) + 4K Ψ/N
=========  ==================  ====================  ===============================

- stage 1 keeps each bucket's whole local gradient (R Ψ) for the run; stage 2 frees it once the
  bucket is reduced, so it is counted as a communication buffer (up to two buckets: one
  accumulating, one in flight); every stage keeps the reduced fp32 master-gradient shard (4 Ψ/N).
- the fp32 master is its own tensor at stages 1/2; at stage 3 an fp32 parameter shard that lives
  on the same device as its master *is* the master (no copy).
- ``offload_optimizer`` moves ``ratio`` of the masters, master gradients and moments to the host;
  ``offload_params`` (stage 3) the parameter shards too. With bf16/fp16 parameters on a GPU an
  offloaded step writes its rounded result into a host staging buffer (P Ψ/N, a communication
  buffer).
- at stages 1/2 on CUDA with bf16/fp16 parameters, the fused device Adam (``fused_adam``, see
  [Note: fused device step] in zero/device_step.py) writes its rounded result into a device
  staging chunk per bucket (P Ψ/N of the masters on the device, a communication buffer); at
  stage 3 it writes the parameter shard itself. With the parameters on the CPU both steps write
  straight into this rank's chunk of the flat parameters, which the all-gather sends: no staging.
- stage 3 gathers a unit's parameters whole for its forward and backward: (1 + prefetch) of the
  largest units at once (P each; at most the whole model), and reduces a unit's gradient (R)
  before it is scattered (on the CPU two of the largest, kept for reuse).

Frozen parameters (``requires_grad=False``, Ψf elements) have no gradient and no optimizer state,
but the engine still holds them: at stages 1/2 whole on every rank (P Ψf, outside the flat buffers),
at stage 3 inside their unit like any other parameter (P Ψf/N for the shard, and 4 Ψf/N for the
unit's fp32 master where it is not the shard, unless every frozen parameter of the unit was built
in the shard's dtype: [Note: masters of frozen pieces]), with no master gradient and no part in
the unit's reduction (see [Note: trained pieces first] in zero/stage3/unit.py).

These are the tensors :func:`~lightning_zero.zero.accounting.model_state_bytes` counts for
parameters, gradients and optimizer state (the tests compare the two on 2 and 4 ranks); padding
each bucket (stages 1/2) or unit (stage 3) to a multiple of N adds at most N - 1 elements each.
Activations are not guessed: with a model and a sample micro-batch they are measured by running
its forward once and counting what autograd saves for backward; otherwise they are unknown.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.zero.layout import held_dtype

PARAM_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2}
# The dtype stage 3 holds parameter shards in (None: each parameter's own).
PARAM_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
                "16-true": torch.float16}
# The short flags a Trainer takes for the same modes (Lightning maps them alike).
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes in one place (the training device, or the host), per category."""

    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    comm_buffers: int = 0
    activations: int | None = None  # None: unknown (no sample batch to measure them with)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def total(self) -> int:
        """Every category; unknown activations count as 0 (see ``activations``)."""
        return self.model_states + self.comm_buffers + (self.activations or 0)


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory under a ZeRO configuration (see [Note: memory of one rank])."""

    world_size: int
    stage: int
    precision: str
    num_params: int  # trainable parameter elements of the whole model
    device: MemoryBreakdown
    host: MemoryBreakdown
    frozen_params: int = 0  # elements of parameters with requires_grad=False (held, never stepped)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state, device and host together (what
        ``ZeroStrategy.model_state_bytes()`` measures)."""
        return self.device.model_states + self.host.model_states


def estimate_memory(
    model: nn.Module | int,
    world_size: int,
    config: ZeroConfig | None = None,
    precision: str = "32-true",
    sample_batch: Any = None,
    optimizer_moments: int = 2,
    device_type: str = "cuda",
    frozen_params: int = 0,
    trained: Collection[nn.Parameter] | None = None,
) -> MemoryEstimate:
    """One rank's memory for ``model`` (a module, or a trainable parameter count) sharded over
    ``world_size`` data-parallel ranks with ``config`` (stage, offload, bucket, unit and prefetch
    sizes) and ``precision`` (a Trainer precision flag). A module's frozen parameters count as
    held, not trained: those without ``requires_grad``, or those not in ``trained`` when it is
    given (a run's engine knows what it trains); with a count, ``frozen_params`` gives theirs. ``sample_batch`` (one
    micro-batch, with a module) measures the activations; ``optimizer_moments`` is the fp32 state
    per element (Adam: 2, SGD with momentum: 1); ``device_type`` is where training runs ("cpu":
    offloaded state shares the training device's memory). Plain PyTorch: no process group, no
    Trainer."""
    config = config if config is not None else ZeroConfig()
    precision = PRECISION_ALIASES.get(str(precision), precision)
    _check_inputs(model, world_size, config, precision, optimizer_moments, device_type, frozen_params)
    if trained is not None and not isinstance(model, nn.Module):
        raise ValueError(f"estimate_memory(trained=...) names parameters of a module; with a count ({model!r}), give"
                         " frozen_params= instead.")
    is_trained = _trained_test(trained)
    if isinstance(model, nn.Module):
        params = list(dict.fromkeys(model.parameters()))  # a tied weight is held once
        numel = sum(p.numel() for p in params if is_trained(p))
        frozen = sum(p.numel() for p in params if not is_trained(p))
    else:
        numel, frozen = int(model), frozen_params
    n, p_bytes = world_size, PARAM_BYTES[precision]
    r_bytes = _DTYPE_BYTES[config.reduce_dtype]
    notes: list[str] = []
    if numel == 0:
        notes.append("no trainable parameters: nothing to step (only the frozen ones are held)")
    device, host = _Bytes(), _Bytes()
    offload_ratio = config.offload_optimizer.ratio if config.offload_optimizer is not None else 0.0
    # Stage 3 shards the frozen parameters too, and keeps masters of those its shard would round
    # (see [Note: masters of frozen pieces]); master gradients are the trained ones' only.
    held_numel = numel + frozen if config.stage == 3 else numel
    mastered = numel + _frozen_with_masters(model, precision, is_trained, frozen) if config.stage == 3 else numel
    shard, mastered_shard = math.ceil(numel / n), math.ceil(mastered / n)
    on_host, mastered_on_host = shard * offload_ratio, mastered_shard * offload_ratio
    on_device, mastered_on_device = shard - on_host, mastered_shard - mastered_on_host

    # optimizer state: K moments per trained master element, where the masters live
    device.optimizer_states += 4 * optimizer_moments * on_device
    host.optimizer_states += 4 * optimizer_moments * on_host
    # master gradients (every stage): fp32, beside the masters
    device.grads += MASTER_BYTES * on_device
    host.grads += MASTER_BYTES * on_host

    if config.stage in (1, 2):
        device.params += p_bytes * (numel + frozen)  # frozen parameters stay whole, outside the buckets
        device.optimizer_states += MASTER_BYTES * on_device
        host.optimizer_states += MASTER_BYTES * on_host
        buckets = min(numel, config.bucket_size_for(numel, "gloo" if device_type == "cpu" else None))
        if config.stage == 1:
            device.grads += r_bytes * numel  # every bucket's local gradient, kept for the run
        else:
            device.comm_buffers += r_bytes * min(numel, 2 * buckets)  # one accumulating, one in flight
        # With the parameters on the CPU, the fused steps write into this rank's chunk of them: no staging.
        staged = device_type != "cpu"
        if config.offload_optimizer is not None and p_bytes < MASTER_BYTES and staged:
            host.comm_buffers += p_bytes * on_host  # rounded parameters written by the CPU step
        # "auto" on the CPU counts the C++ op as built (it falls back to the optimizer's own step).
        fused_on_device = config.fused_adam != "off" and (config.fused_adam != "auto" or device_type in ("cuda", "cpu"))
        if fused_on_device and optimizer_moments == 2 and p_bytes < MASTER_BYTES and staged:
            device.comm_buffers += p_bytes * on_device  # rounded parameters written by the fused device step
    else:
        params_on_host = config.offload_params is not None
        persistent = _persistent_numel(model, config)  # whole on every rank, never offloaded
        (host if params_on_host else device).params += p_bytes * math.ceil((held_numel - persistent) / n)
        device.params += p_bytes * persistent
        # The parameter shard is the master when it is fp32 and on the master's device.
        shard_on_host = params_on_host and device_type != "cpu"
        for placed, part in ((device, mastered_on_device), (host, mastered_on_host)):
            master_on_host = placed is host and device_type != "cpu"
            if not (p_bytes == MASTER_BYTES and master_on_host == shard_on_host):
                placed.optimizer_states += MASTER_BYTES * part
        largest = _largest_unit_numels(model, config, is_trained)
        if largest is None:
            unit = min(held_numel, config.min_unit_numel)
            trained_unit = min(numel, unit)
            notes.append(f"stage-3 unit size not known from a parameter count: assumed {unit:,} elements"
                         " (ZeroConfig.min_unit_numel)")
        else:
            unit, trained_unit = largest
        prefetch = config.prefetch_units if config.prefetch_bytes is None else max(
            0, config.prefetch_bytes // max(1, p_bytes * unit))
        # The unit being computed and those prefetched, but never more than the whole model.
        gathered = min(held_numel - persistent, unit * (1 + prefetch))
        # A unit's trained gradients before they are reduced; on the CPU two of them stay for reuse
        # (one accumulating, one in flight: see [Note: reused gradient buffers] in zero/reduce.py).
        reducing = min(numel, 2 * trained_unit) if device_type == "cpu" else trained_unit
        device.comm_buffers += p_bytes * gathered + r_bytes * reducing
        if config.offload_optimizer is not None and p_bytes < MASTER_BYTES and not shard_on_host \
                and device_type != "cpu":
            host.comm_buffers += p_bytes * on_host  # rounded parameters written by the CPU step (a shard on the host is its own)
    activations = measure_activations(model, sample_batch, precision) if sample_batch is not None else None
    if activations is None:
        notes.append("activations unknown: give a model and a sample micro-batch to measure them")
    if device_type == "cpu":
        notes.append("device_type='cpu': 'device' and 'host' are the same memory")
    return MemoryEstimate(
        world_size=world_size, stage=config.stage, precision=precision, num_params=numel, frozen_params=frozen,
        device=device.breakdown(activations), host=host.breakdown(None if activations is None else 0),
        notes=tuple(notes),
    )


@dataclass
class _Bytes:
    params: float = 0.0
    grads: float = 0.0
    optimizer_states: float = 0.0
    comm_buffers: float = 0.0

    def breakdown(self, activations: int | None) -> MemoryBreakdown:
        return MemoryBreakdown(int(round(self.params)), int(round(self.grads)), int(round(self.optimizer_states)),
                               int(round(self.comm_buffers)), activations)


def _persistent_numel(model: nn.Module | int, config: ZeroConfig) -> int:
    """Stage 3: the elements of parameters under ``param_persistence_threshold`` (kept whole,
    frozen or not)."""
    if not isinstance(model, nn.Module) or not config.param_persistence_threshold:
        return 0
    return sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.numel() < config.param_persistence_threshold)


def _frozen_with_masters(model: nn.Module | int, precision: str, is_trained: Callable[[nn.Parameter], bool], frozen: int) -> int:
    """Stage 3: the frozen elements that keep an fp32 master, those built in another dtype than the
    shard's (see [Note: masters of frozen pieces] in zero/stage3/unit.py). At 32-true each
    parameter is held in its own dtype, so none; of a parameter count under bf16/fp16 (built in
    fp32, presumably), all of them."""
    held = PARAM_DTYPES[precision]
    if held is None:
        return 0
    if not isinstance(model, nn.Module):
        return frozen
    return sum(param.numel() for param in dict.fromkeys(model.parameters())
               if not is_trained(param) and param.dtype != held_dtype(param.dtype, held))


def _params_by_unit(model: nn.Module, config: ZeroConfig) -> Iterator[tuple[str | None, nn.Parameter]]:
    """Each parameter once (tied ones too), with the prefix of the stage-3 unit module it lands
    in, or None for one kept whole (under ``param_persistence_threshold``)."""
    from lightning_zero.zero.stage3 import partition

    units = partition.choose_unit_modules(model, config.unit_modules, config.min_unit_numel)
    seen: set[nn.Parameter] = set()
    for name, param in model.named_parameters():
        if param in seen:
            continue
        seen.add(param)
        if param.numel() < config.param_persistence_threshold:
            yield None, param
        else:
            yield partition.innermost_prefix(name.rpartition(".")[0], units), param


def _trained_test(trained: Collection[nn.Parameter] | None) -> Callable[[nn.Parameter], bool]:
    """Whether a parameter is trained: in ``trained`` when given, else by its ``requires_grad``."""
    if trained is None:
        return lambda param: param.requires_grad
    members = set(trained)
    return lambda param: param in members


def _largest_unit_numels(model: nn.Module | int, config: ZeroConfig,
                         is_trained: Callable[[nn.Parameter], bool]) -> tuple[int, int] | None:
    """The largest stage-3 unit's elements (frozen parameters included: they are gathered too) and
    the largest unit's trained elements (those it reduces), from the module's own unit choice
    (None for a count)."""
    if not isinstance(model, nn.Module):
        return None
    sizes: dict[str, int] = {}
    trained: dict[str, int] = {}
    for owner, param in _params_by_unit(model, config):
        if owner is None:
            continue  # kept whole: no unit gathers or reduces it
        sizes[owner] = sizes.get(owner, 0) + param.numel()
        trained[owner] = trained.get(owner, 0) + (param.numel() if is_trained(param) else 0)
    return max(sizes.values(), default=0), max(trained.values(), default=0)


def measure_activations(model: nn.Module | int, sample_batch: Any, precision: str = "32-true") -> int:
    """Bytes autograd saves for backward in one forward of ``sample_batch`` (one micro-batch): a
    LightningModule's ``training_step(batch, 0)``, or ``model(batch)``; under ``precision``'s
    autocast (the mixed modes) or dtype. Each storage counts once."""
    if not isinstance(model, nn.Module):
        raise ValueError("estimate_memory(sample_batch=...) needs the model itself, not a parameter count.")
    from lightning_zero.profiling.measure import SavedActivations

    # "-true" modes run the module in bf16/fp16: a probe of the (fp32) module counts each floating
    # activation at that size instead of casting the user's weights.
    counter = SavedActivations(model, dtype_bytes=PARAM_BYTES[precision] if precision.endswith("-true") else None)
    step: Callable[[], Any]
    if callable(getattr(type(model), "training_step", None)):  # a LightningModule (without importing Lightning)
        step = lambda: model.training_step(sample_batch, 0)  # noqa: E731
    else:
        step = lambda: model(sample_batch)  # noqa: E731
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    context: Any = torch.autocast(device_type, dtype=torch.bfloat16 if precision.startswith("bf16") else torch.float16) \
        if precision.endswith("-mixed") else torch.autocast(device_type, enabled=False)
    was_training = model.training
    model.train()
    counter.start()
    try:
        with context, _quiet_log(model):
            step()
    finally:
        counter.stop()
        model.train(was_training)
    return counter.bytes


class _quiet_log:
    """``self.log`` outside a Trainer raises: the probe runs training_step without one."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        if hasattr(self.model, "log"):
            self.model.__dict__["log"] = lambda *args, **kwargs: None

    def __exit__(self, *exc: object) -> None:
        self.model.__dict__.pop("log", None)


def _check_inputs(model: nn.Module | int, world_size: int, config: ZeroConfig, precision: str,
                  optimizer_moments: int, device_type: str, frozen_params: int) -> None:
    if isinstance(model, nn.Module):
        if next(model.parameters(), None) is None:
            raise ValueError(
                f"estimate_memory(model=<{type(model).__name__}>): the module has no parameters (yet). A model"
                " whose layers are built in configure_model() needs it called first (under"
                " `with torch.device('meta'):` it allocates nothing), or give its parameter count."
            )
        if frozen_params:
            raise ValueError(f"estimate_memory(frozen_params={frozen_params!r}) is for a parameter count: a module's"
                             " frozen parameters are counted from it.")
    elif isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"estimate_memory(model={model!r}): give an nn.Module or a positive parameter count.")
    if isinstance(frozen_params, bool) or not isinstance(frozen_params, int) or frozen_params < 0:
        raise ValueError(f"estimate_memory(frozen_params={frozen_params!r}) must be a count >= 0 of frozen elements.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate_memory(world_size={world_size!r}) must be a positive number of ranks.")
    if precision not in PARAM_BYTES:
        raise ValueError(
            f"estimate_memory(precision={precision!r}) is not supported: use one of"
            f" {', '.join(map(repr, [*PARAM_BYTES, *PRECISION_ALIASES]))}."
        )
    if isinstance(optimizer_moments, bool) or not isinstance(optimizer_moments, int) or optimizer_moments < 0:
        raise ValueError(
            f"estimate_memory(optimizer_moments={optimizer_moments!r}) must be >= 0 (Adam/AdamW: 2, SGD+momentum: 1)."
        )
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"estimate_memory(device_type={device_type!r}) must be 'cuda' or 'cpu'.")


def with_stage(config: ZeroConfig, stage: int) -> ZeroConfig:
    """``config`` at another stage (parameter offload only where it applies)."""
    return replace(config, stage=stage, offload_params=config.offload_params if stage == 3 else None)


__all__ = ["MemoryBreakdown", "MemoryEstimate", "estimate_memory", "measure_activations", "with_stage"]
