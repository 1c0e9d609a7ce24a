"""The ranks on one DeviceMesh: pipeline x data parallel (optionally hybrid-sharded) x tensor parallel.

[Note: one mesh]
The world is laid out as ``(data, tensor)``, or under hybrid sharding ``(replicate, shard,
tensor)`` with ``data = replicate * shard``, row-major, with ``pipeline`` outermost when there is
a pipeline, so that global rank ``(((p * replicate + q) * shard) + s) * tensor + t``:

- the ``tensor`` ranks are adjacent: a tensor-parallel group (activations all-reduced every layer,
  the chattiest traffic) lives inside one node when ``tensor`` divides the processes per node;
- a ``shard`` group is adjacent too: with ``shard_size`` one node's data-parallel ranks, ZeRO's
  all-gathers and reduce-scatters stay inside the node, and only the all-reduce of each reduced
  gradient chunk across the ``replicate`` groups crosses nodes;
- the ``pipeline`` ranks are the farthest apart: between neighbouring stages only one micro-batch's
  activations (and their gradients) pass, point to point, the lightest traffic of all. Each stage
  is a mesh of its own below it: its data-parallel ranks shard that stage's parameters.

The engine is given collectives over its shard group only; the groups it must not create itself
(they are siblings: every rank of the world makes all of them together) are made here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.utils import _sync_params_and_buffers

from lightning_zero.checkpoint.state import MeshPlacement
from lightning_zero.parallel.tensor import TensorParallelParams

from lightning_zero.config import REST, ParallelConfig
from lightning_zero.zero.comm import Collectives, StepGroups

DATA, TENSOR, SHARD, REPLICATE, PIPELINE = "data", "tensor", "shard", "replicate", "pipeline"
_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # as DDP's initial broadcast


@dataclass(frozen=True)
class ParallelDims:
    """The resolved sizes of every mesh dimension (see [Note: one mesh])."""

    world: int
    data: int
    tensor: int
    shard: int  # the data-parallel ranks ZeRO shards over (== data unless hybrid)
    pipeline: int = 1

    @property
    def per_stage(self) -> int:
        """The ranks of one pipeline stage: data x tensor."""
        return self.data * self.tensor

    @property
    def replicas(self) -> int:
        return self.data // self.shard

    @property
    def hybrid(self) -> bool:
        return self.shard < self.data

    @property
    def trivial(self) -> bool:
        """Plain ZeRO over the world: no mesh needed."""
        return self.tensor == 1 and not self.hybrid and self.pipeline == 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(replica, shard rank, tensor rank) of a global rank, within its pipeline stage."""
        within = rank % self.per_stage
        tensor_rank = within % self.tensor
        data_rank = within // self.tensor
        return data_rank // self.shard, data_rank % self.shard, tensor_rank

    def pipeline_rank(self, rank: int) -> int:
        return rank // self.per_stage

    def rank_of(self, replica: int, shard_rank: int, tensor_rank: int, pipeline_rank: int = 0) -> int:
        return pipeline_rank * self.per_stage + (replica * self.shard + shard_rank) * self.tensor + tensor_rank

    def data_rank(self, rank: int) -> int:
        replica, shard_rank, _ = self.coordinates(rank)
        return replica * self.shard + shard_rank

    def _cells(self) -> list[tuple[int, int, int, int]]:
        """Every (pipeline, replica, shard rank, tensor rank), in rank order."""
        return [(p, q, s, t) for p in range(self.pipeline) for q in range(self.replicas)
                for s in range(self.shard) for t in range(self.tensor)]

    def shard_groups(self) -> list[list[int]]:
        """The global ranks of every shard group (the engine's groups)."""
        return [[self.rank_of(q, s, t, p) for s in range(self.shard)]
                for p in range(self.pipeline) for q in range(self.replicas) for t in range(self.tensor)]

    def replicate_groups(self) -> list[list[int]]:
        return [[self.rank_of(q, s, t, p) for q in range(self.replicas)]
                for p in range(self.pipeline) for s in range(self.shard) for t in range(self.tensor)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank_of(q, s, t, p) for q in range(self.replicas) for s in range(self.shard)]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank_of(q, s, t, p) for t in range(self.tensor)]
                for p in range(self.pipeline) for q in range(self.replicas) for s in range(self.shard)]

    def stage_groups(self) -> list[list[int]]:
        """The ranks of each pipeline stage: its data x tensor mesh."""
        return [list(range(p * self.per_stage, (p + 1) * self.per_stage)) for p in range(self.pipeline)]

    def pipeline_groups(self) -> list[list[int]]:
        """The ranks that run one pipeline's stages: the same data and tensor coordinates."""
        return [[self.rank_of(q, s, t, p) for p in range(self.pipeline)]
                for q in range(self.replicas) for s in range(self.shard) for t in range(self.tensor)]


def resolve_dims(config: ParallelConfig, world_size: int, processes_per_node: int, pipeline: int = 1) -> ParallelDims:
    """The mesh sizes ``config`` (and ``pipeline`` stages' ranks) ask for on ``world_size`` ranks,
    or a ValueError naming the value and what would work. Runs before any process group work, so
    a bad size never hangs."""
    if processes_per_node < 1 or world_size % processes_per_node:
        processes_per_node = world_size
    if pipeline < 1 or world_size % pipeline:
        raise ValueError(
            f"PipelineConfig.size={pipeline} does not divide the world size {world_size} (devices x nodes); pick one"
            f" of {_divisors(world_size)}."
        )
    full_world = world_size
    world_size //= pipeline
    # A node holds whole pipeline stages or a part of one: what one stage has of a node.
    processes_per_node = math.gcd(processes_per_node, world_size)
    ranks = f"the world size {world_size}" if pipeline == 1 else \
        f"the {world_size} ranks of each pipeline stage (world {full_world} / pipeline size {pipeline})"
    tensor, data = config.tensor, config.data
    if tensor == REST:
        if world_size % data:
            raise ValueError(
                f"ParallelConfig.data={data} does not divide {ranks}; pick a divisor of"
                f" {world_size}, or -1 for the rest."
            )
        tensor = world_size // data
    if world_size % tensor:
        raise ValueError(
            f"ParallelConfig.tensor={tensor} does not divide {ranks} (devices x nodes);"
            f" pick one of {_divisors(world_size)}."
        )
    if data == REST:
        data = world_size // tensor
    if data * tensor != world_size:
        raise ValueError(
            f"ParallelConfig data={config.data} x tensor={config.tensor} = {data * tensor} ranks, but {ranks};"
            f" set data=-1 to take the rest, or make data x tensor = {world_size}."
        )
    if tensor > 1 and processes_per_node % tensor:
        raise ValueError(
            f"ParallelConfig.tensor={tensor} does not divide the {processes_per_node} processes per node, so a"
            " tensor-parallel group would span nodes (its activations are all-reduced in every layer); pick"
            f" one of {_divisors(processes_per_node)}."
        )
    shard = config.shard_size
    if shard is None:
        shard = data
    elif shard == REST:
        shard = max(1, min(data, processes_per_node // tensor))
    if shard > data or data % shard:
        raise ValueError(
            f"ParallelConfig.shard_size={config.shard_size} must divide the {data} data-parallel ranks into equal"
            f" shard groups; pick one of {_divisors(data)} (e.g. {max(1, processes_per_node // tensor)}, one node's"
            " data-parallel ranks), or None to shard over all of them."
        )
    return ParallelDims(world=full_world, data=data, tensor=tensor, shard=shard, pipeline=pipeline)


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """The mesh and every group built from it, for one rank (see [Note: one mesh])."""

    dims: ParallelDims
    mesh: DeviceMesh
    data_group: dist.ProcessGroup  # every data-parallel rank of this tensor rank: the data is split over it
    shard_group: dist.ProcessGroup  # the ranks ZeRO shards over
    replicate_group: dist.ProcessGroup | None  # hybrid: this rank's replicas across shard groups
    tensor_group: dist.ProcessGroup | None
    shard_control_group: dist.ProcessGroup  # gloo, beside the shard group (agreement exchanges)
    shard_reduce_group: dist.ProcessGroup  # the shard group's gradient reductions
    pipeline_group: dist.ProcessGroup | None = None  # this rank's pipeline: one rank of every stage
    stage_group: dist.ProcessGroup | None = None  # every rank of this rank's pipeline stage (None: the world)

    def placement(self, global_rank: int, tensor_parallel: TensorParallelParams | None,
                  key_order: tuple[str, ...] = ()) -> MeshPlacement:
        """Where this rank's pieces lie among every rank's in a checkpoint's global tensors."""
        replica, shard_rank, tensor_rank = self.dims.coordinates(global_rank)
        stage = self.dims.pipeline_rank(global_rank)
        holders = tuple(tuple(self.dims.rank_of(replica, s, t, stage) for s in range(self.dims.shard))
                        for t in range(self.dims.tensor))
        return MeshPlacement(rank=shard_rank, holders=holders, tensor_rank=tensor_rank, first_replica=replica == 0,
                             tensor=tensor_parallel, pipeline_group=self.pipeline_group, key_order=key_order)

    def describe(self, tensor_parallel: TensorParallelParams | None) -> dict[str, Any]:
        """What a checkpoint records of the mesh: the sizes and each split parameter's placement."""
        placements = {}
        if tensor_parallel is not None:
            placements = {spec.name: ", ".join(map(repr, spec.placements)) for _, spec in tensor_parallel.items()}
        return {"data": self.dims.data, "tensor": self.dims.tensor, "shard": self.dims.shard,
                "pipeline": self.dims.pipeline, "placements": placements}

    @property
    def tensor_mesh(self) -> DeviceMesh:
        return self.mesh[TENSOR]

    def engine_collectives(self, tensor_sharded: frozenset[object] = frozenset()) -> Collectives:
        """Collectives over the shard group for the engine: reductions also across replicas, a
        step's decisions over the world, norms of tensor-parallel shards over the tensor group."""
        everyone = self.stage_group if self.stage_group is not None else dist.group.WORLD
        step_groups = StepGroups(everyone=everyone, tensor=self.tensor_group, tensor_sharded=tensor_sharded,
                                 pipeline=self.pipeline_group)
        return Collectives(self.shard_group, control_group=self.shard_control_group,
                           reduce_group=self.shard_reduce_group, replicate_group=self.replicate_group,
                           step_groups=step_groups)


def sync_module_states(module: nn.Module, group: dist.ProcessGroup, skip: frozenset[Tensor] = frozenset()) -> None:
    """Every rank of ``group`` takes the parameters and buffers (but ``skip``) of its first rank."""
    if dist.get_world_size(group) == 1:
        return
    states = [p.detach() for p in dict.fromkeys(module.parameters()) if p not in skip]
    states += [b.detach() for b in module.buffers() if b not in skip]
    _sync_params_and_buffers(group, states, _BROADCAST_BUCKET_BYTES, 0)


def build_parallel_groups(dims: ParallelDims, device_type: str, backend: str,
                          timeout: timedelta | None) -> ParallelGroups:
    """Builds the mesh and the groups every rank needs, each waiting ``timeout`` (a collective
    over the world: every rank calls it with the same ``dims``)."""
    rank = dist.get_rank()

    def mine(rank_lists: list[list[int]], group_backend: str | None) -> dist.ProcessGroup:
        # Every rank creates every sibling group, in the same order: new_group is collective over
        # the world. Made here rather than by init_device_mesh so that they take the timeout.
        group, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout, backend=group_backend)
        assert group is not None and rank in dist.get_process_group_ranks(group)
        return group

    layout = torch.arange(dims.world)
    tensor_group = mine(dims.tensor_groups(), None)
    data_group = mine(dims.data_groups(), None)
    pipeline_group = mine(dims.pipeline_groups(), None) if dims.pipeline > 1 else None
    stage_group = mine(dims.stage_groups(), None) if dims.pipeline > 1 else None
    # The pipeline dimension leads when there is one (see [Note: one mesh]).
    outer: list[dist.ProcessGroup] = [pipeline_group] if pipeline_group is not None else []
    outer_shape = (dims.pipeline,) if pipeline_group is not None else ()
    outer_names = (PIPELINE,) if pipeline_group is not None else ()
    if dims.hybrid:
        replicate_group, shard_group = mine(dims.replicate_groups(), None), mine(dims.shard_groups(), None)
        mesh = DeviceMesh.from_group([*outer, replicate_group, shard_group, tensor_group], device_type,
                                     layout.view(*outer_shape, dims.replicas, dims.shard, dims.tensor),
                                     mesh_dim_names=(*outer_names, REPLICATE, SHARD, TENSOR))
        # mesh["data"] for user code (its group takes torch's default timeout; ours is data_group)
        mesh[(REPLICATE, SHARD)]._flatten(DATA)
    else:
        replicate_group, shard_group = None, data_group
        mesh = DeviceMesh.from_group([*outer, data_group, tensor_group], device_type,
                                     layout.view(*outer_shape, dims.data, dims.tensor),
                                     mesh_dim_names=(*outer_names, DATA, TENSOR))
    control = shard_group if "gloo" in backend else mine(dims.shard_groups(), "gloo")
    reduce_group = mine(dims.shard_groups(), backend)
    return ParallelGroups(
        dims=dims,
        mesh=mesh,
        data_group=data_group,
        shard_group=shard_group,
        replicate_group=replicate_group,
        tensor_group=tensor_group if dims.tensor > 1 else None,
        shard_control_group=control,
        shard_reduce_group=reduce_group,
        pipeline_group=pipeline_group,
        stage_group=stage_group,
    )


__all__ = ["ParallelDims", "ParallelGroups", "build_parallel_groups", "resolve_dims", "sync_module_states"]
