"""Tensor-parallel parameters as plain local tensors, for the ZeRO engine to shard.

[Note: local tensor-parallel parameters]
A plan applied with ``torch.distributed.tensor.parallel`` leaves DTensor parameters: each tensor
rank holds its part (a row block for ColwiseParallel, a column block for RowwiseParallel) behind a
wrapper whose shape is the global one. The engine flattens, views, shards and re-points
parameters through ``.data``, which a DTensor does not allow, and it needs to shard only the local
part over the data-parallel group. So :class:`TensorParallelParams` replaces each DTensor parameter
by a plain ``nn.Parameter`` holding its local part (same name, same module) and remembers its
placement. Around the forward of each module that owns one, it puts ``DTensor.from_local`` views
of them in place: the layer computes with DTensors as the plan intends (its input and output hooks
run as installed), ``from_local`` is differentiable, so each local parameter receives its local
gradient through autograd and the engine's gradient hooks fire as for any parameter. The view
shares the local parameter's storage: at stage 3 that is the unit's full buffer, whose storage
survives a free and a re-gather (see [Note: stage-3 layout]), so what autograd saved stays valid.

What stays global: checkpoints record each local part's box inside the global tensor, so a
sharded checkpoint holds whole global tensors whatever the tensor and data sizes that wrote it
(see [Note: checkpoint layout]); and the gradient norm adds the tensor ranks' parts of sharded
parameters (see [Note: a step over the mesh]).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True, eq=False)
class TensorParallelParam:
    """Where one parameter's local part lies in its global tensor."""

    name: str
    mesh: DeviceMesh
    placements: tuple[Any, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    dim: int | None  # the dimension split over the tensor ranks; None: replicated on every one

    @property
    def size(self) -> int:
        return self.mesh.size()

    def box_offsets(self, tensor_rank: int) -> tuple[int, ...]:
        """Where tensor rank ``tensor_rank``'s part starts in the global tensor."""
        offsets = [0] * len(self.global_shape)
        if self.dim is not None:
            offsets[self.dim] = tensor_rank * (self.global_shape[self.dim] // self.size)
        return tuple(offsets)

    def as_dtensor(self, local: Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.global_shape), stride=self.global_stride)


# The module a TensorParallelParams localized, until it restores the DTensors: a later strategy
# (a new Trainer on the same module) must start from the plan's DTensors again, not from parts.
_LOCALIZED: weakref.WeakKeyDictionary[nn.Module, TensorParallelParams] = weakref.WeakKeyDictionary()


class TensorParallelParams:
    """Owns the local parameters of a tensor-parallel module and the hooks that show them to its
    layers as DTensors (see [Note: local tensor-parallel parameters])."""

    @staticmethod
    def of(module: nn.Module) -> TensorParallelParams | None:
        """The TensorParallelParams holding ``module``'s parameters as local parts, if any."""
        return _LOCALIZED.get(module)

    def __init__(self, module: nn.Module, tensor_mesh: DeviceMesh) -> None:
        self.tensor_mesh = tensor_mesh
        self.tensor_rank = tensor_mesh.get_local_rank()
        self.size = tensor_mesh.size()
        self.specs: dict[nn.Parameter, TensorParallelParam] = {}
        self._handles: list[RemovableHandle] = []
        self._owners: list[tuple[nn.Module, tuple[str, ...]]] = []
        self._module = weakref.ref(module)
        self._localize(module)
        _LOCALIZED[module] = self

    @staticmethod
    def has_dtensors(module: nn.Module) -> bool:
        return any(isinstance(param, DTensor) for param in module.parameters())

    def _localize(self, module: nn.Module) -> None:
        names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
        replaced: dict[int, nn.Parameter] = {}  # a tied DTensor stays one parameter
        for owner_name, owner in module.named_modules():
            local_names: list[str] = []
            for attr, param in list(owner._parameters.items()):
                if not isinstance(param, DTensor):
                    continue
                local = replaced.get(id(param))
                if local is None:
                    spec = self._spec_of(names.get(id(param), f"{owner_name}.{attr}"), param)
                    local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                    self.specs[local] = spec
                    replaced[id(param)] = local
                owner._parameters[attr] = local
                local_names.append(attr)
            if local_names:
                self._owners.append((owner, tuple(local_names)))

    def install_hooks(self) -> None:
        """Shows the owners' parameters as DTensors during their forward. After the engine's
        hooks: at stage 3 a unit that is itself an owner is gathered before the view is made."""
        for owner, names in self._owners:
            self._install(owner, names)

    def _spec_of(self, name: str, param: DTensor) -> TensorParallelParam:
        mesh = param.device_mesh
        if mesh.ndim != 1 or _ranks(mesh) != _ranks(self.tensor_mesh):
            raise ValueError(
                f"Parameter '{name}' is a DTensor on the mesh {mesh}, not on the strategy's tensor dimension. Apply"
                " the plan with the strategy's mesh: parallelize_module(..., self.device_mesh['tensor'], plan) in"
                " configure_model."
            )
        placement = param.placements[0]
        if isinstance(placement, Shard):
            dim = placement.dim % param.dim()
            if param.shape[dim] % self.size:
                raise ValueError(
                    f"Parameter '{name}' of shape {tuple(param.shape)} is split over {self.size} tensor ranks along"
                    f" dim {dim}, which does not divide evenly; make that size a multiple of {self.size}."
                )
        elif isinstance(placement, Replicate):
            dim = None
        else:
            raise ValueError(
                f"Parameter '{name}' has the placement {placement}; ZeRO under tensor parallelism supports Shard and"
                " Replicate parameters (ColwiseParallel, RowwiseParallel, SequenceParallel)."
            )
        return TensorParallelParam(name, mesh, tuple(param.placements), tuple(param.shape), tuple(param.stride()), dim)

    def _install(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        # One entry per forward entered: the local parameters to put back, or None for a forward
        # run inside the module's own forward (recursion), which already sees the views.
        saved: list[dict[str, nn.Parameter] | None] = []

        def show_dtensors(module: nn.Module, args: Any) -> None:
            params = {name: module._parameters[name] for name in names}
            if any(not isinstance(local, nn.Parameter) or local not in self.specs for local in params.values()):
                saved.append(None)
                return
            saved.append(params)  # type: ignore[arg-type]
            for name, local in params.items():
                # Not a Parameter: only the module's own forward reads it, and autograd reaches the
                # local parameter through from_local.
                module._parameters[name] = self.specs[local].as_dtensor(local)  # type: ignore[index,assignment]

        def show_locals(module: nn.Module, args: Any, output: Any) -> None:
            params = saved.pop() if saved else None
            if params is not None:
                module._parameters.update(params)

        # The pre-hook after the engine's (the gather), the hook before its (the free).
        self._handles.append(owner.register_forward_pre_hook(show_dtensors))
        self._handles.append(owner.register_forward_hook(show_locals, prepend=True, always_call=True))

    # ---- what the rest of the strategy asks
    @property
    def sharded(self) -> frozenset[nn.Parameter]:
        """The local parameters split over the tensor ranks (not replicated)."""
        return frozenset(param for param, spec in self.specs.items() if spec.dim is not None)

    def spec(self, param: nn.Parameter) -> TensorParallelParam | None:
        return self.specs.get(param)

    def items(self) -> Iterator[tuple[nn.Parameter, TensorParallelParam]]:
        return iter(self.specs.items())

    def local_state_dict(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """A whole (global) state dict with each tensor-parallel parameter cut to this rank's part,
        to load into the local parameters; other entries as they are."""
        local = dict(state)
        for key, value in module.state_dict(keep_vars=True).items():
            spec = self.specs.get(value) if isinstance(value, nn.Parameter) else None
            given = state.get(key)
            if spec is None or spec.dim is None or not isinstance(given, Tensor):
                continue
            if tuple(given.shape) != spec.global_shape:
                raise ValueError(
                    f"The state dict's '{key}' has the shape {tuple(given.shape)}, but the model's global tensor is"
                    f" {spec.global_shape} (split over {self.size} tensor ranks). Load a checkpoint of this model."
                )
            chunk = spec.global_shape[spec.dim] // self.size
            local[key] = given.narrow(spec.dim, self.tensor_rank * chunk, chunk)
        return local

    def local_optimizer_state(self, state: dict[str, Any], index_of: dict[nn.Parameter, int]) -> dict[str, Any]:
        """A torch-format optimizer state (global tensors, keyed by parameter index) with each
        tensor-parallel parameter's per-element state cut to this rank's part."""
        by_index = {index: self.specs[param] for param, index in index_of.items() if param in self.specs}
        states = {}
        for index, entry in state.get("state", {}).items():
            spec = by_index.get(index)
            if spec is None or spec.dim is None:
                states[index] = entry
                continue
            chunk = spec.global_shape[spec.dim] // self.size
            states[index] = {
                key: value.narrow(spec.dim, self.tensor_rank * chunk, chunk)
                if isinstance(value, Tensor) and tuple(value.shape) == spec.global_shape else value
                for key, value in entry.items()
            }
        return {**state, "state": states}

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def restore_dtensors(self) -> None:
        """Hands the module back as the plan left it: every local parameter a DTensor parameter
        again (with the values trained), and no hooks."""
        self.remove_hooks()
        restored: dict[nn.Parameter, nn.Parameter] = {}
        for owner, names in self._owners:
            for name in names:
                local = owner._parameters[name]
                if not isinstance(local, nn.Parameter) or local not in self.specs:
                    continue  # replaced by user code since: theirs stays
                if local not in restored:
                    spec = self.specs[local]
                    restored[local] = nn.Parameter(spec.as_dtensor(local.detach()), requires_grad=local.requires_grad)
                owner._parameters[name] = restored[local]
        module = self._module()
        if module is not None and _LOCALIZED.get(module) is self:
            del _LOCALIZED[module]


@torch.no_grad()
def _local_part(whole: Tensor, like: DTensor) -> Tensor:
    """This rank's part of ``whole`` (the global tensor) under ``like``'s placement."""
    placement = like.placements[0]
    if isinstance(placement, Shard):
        mesh = like.device_mesh
        chunk = whole.shape[placement.dim] // mesh.size()
        return whole.narrow(placement.dim, mesh.get_local_rank() * chunk, chunk).clone()
    return whole


def materialize_tensor_parallel(module: nn.Module, device: torch.device,
                                reset: Callable[[nn.Module], None]) -> None:
    """Allocates the parameters of a tensor-parallel module built on the meta device and
    initializes them with ``reset`` (each module's ``reset_parameters``), module by module: a
    DTensor parameter is initialized whole, as the model without tensor parallelism would be
    (with the same seed, the same values), and each rank keeps its part. DTensor's own random ops
    would do that only on CUDA; on the CPU every tensor rank would draw the same part. Only one
    module's whole parameters exist at a time."""
    made: dict[int, nn.Parameter] = {}  # a tied parameter stays one parameter
    for submodule in module.modules():
        params = submodule._parameters
        dtensors: dict[str, DTensor] = {}
        for name, param in list(params.items()):
            if param is None or not (isinstance(param, DTensor) or param.is_meta):
                continue
            if id(param) in made:
                params[name] = made[id(param)]
                continue
            if isinstance(param, DTensor):
                dtensors[name] = param
            params[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                        requires_grad=param.requires_grad)
            made[id(param)] = params[name]
        reset(submodule)
        for name, like in dtensors.items():
            whole = params[name]
            assert whole is not None
            local = _local_part(whole.detach(), like)
            params[name] = made[id(like)] = nn.Parameter(
                DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                   shape=like.shape, stride=like.stride()),
                requires_grad=like.requires_grad,
            )


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


__all__ = ["TensorParallelParam", "TensorParallelParams", "materialize_tensor_parallel"]
