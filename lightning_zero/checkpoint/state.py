"""Between the ZeRO engine and a sharded checkpoint: what each rank saves, and loading it back
into any layout (see [Note: checkpoint layout] in sharded.py). Plain PyTorch, no Lightning."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_zero.checkpoint.checksums import agree, under, verify_share
from lightning_zero.checkpoint.sharded import (
    META_KEY,
    MODEL_KEY,
    CheckpointError,
    CheckpointMeta,
    FlatShards,
    describe_mismatch,
    from_object_entry,
    is_distributed,
    load_sharded,
    object_entry,
    optimizer_key,
    rank_of,
    read_meta,
    read_metadata,
    resolve_checkpoint_path,
    save_sharded,
    saved_state_keys,
)
from lightning_zero.zero.consistency import AnyCollectives
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.layout import ParamPiece, Range
from lightning_zero.zero.optimizer import ShardedOptimizer, _check_full_optimizer_state

if TYPE_CHECKING:
    from lightning_zero.parallel.tensor import TensorParallelParam, TensorParallelParams


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """State-dict keys whose tensor another key (the first, in order) already holds: tied weights."""
    first: dict[int, str] = {}
    aliases = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            continue
        if id(value) in first:
            aliases[key] = first[id(value)]
        else:
            first[id(value)] = key
    return aliases


def param_names(module: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in module.named_parameters()}


# [Note: checkpoint layout with a mesh]
# On a mesh ([Note: one mesh] in parallel/mesh.py) the engine's pieces split each parameter's
# *local* tensor over the shard group, and the checkpoint still holds *global* tensors, so that
# it loads at another data-parallel, shard or tensor size: a tensor-parallel rank's local tensor is
# one block of the global tensor (rows for ColwiseParallel, columns for RowwiseParallel), and each
# piece's boxes are placed inside that block. The ShardedTensor a rank builds lists every block
# (one per tensor rank, with the global ranks holding its ranges) for a sharded parameter, and its
# own shard group's ranges for a parameter replicated over the tensor ranks. At a save, the ranks
# of the first replica offer their pieces (replicas hold the same), and a replicated parameter
# only from tensor rank 0; at a load every rank reads its own.
@dataclass(frozen=True, eq=False)
class MeshPlacement:
    """Where this rank's pieces lie among every rank's, on a mesh (see the note above)."""

    rank: int  # this rank's index into a piece's ranges: its rank in the shard group
    holders: tuple[tuple[int, ...], ...]  # holders[t]: the global ranks of tensor rank t's shard group
    tensor_rank: int
    first_replica: bool
    tensor: TensorParallelParams | None = None
    # The ranks of this rank's pipeline, one per stage (see [Note: checkpoint layout with a pipeline]),
    # and the whole model's state-dict keys in its own order, which merged lists follow.
    pipeline_group: dist.ProcessGroup | None = None
    key_order: tuple[str, ...] = ()

    def in_model_order(self, names: list[str]) -> list[str]:
        """``names`` (gathered stage by stage) in the whole model's order."""
        position = {name: index for index, name in enumerate(self.key_order)}
        return sorted(names, key=lambda name: position.get(name, len(position)))

    @property
    def leader(self) -> bool:
        """Whether this rank saves what its part of the model holds once (buffers, step counts)."""
        return self.first_replica and self.rank == 0 and self.tensor_rank == 0

    def across_stages(self, obj: Any) -> list[Any]:
        """Every pipeline stage's ``obj``, in stage order (a collective over the pipeline group)."""
        if self.pipeline_group is None or dist.get_world_size(self.pipeline_group) == 1:
            return [obj]
        every: list[Any] = [None] * dist.get_world_size(self.pipeline_group)
        dist.all_gather_object(every, obj, group=self.pipeline_group)
        return every

    def shards(self, piece: ParamPiece) -> FlatShards:
        spec = self.split(piece.param)
        if spec is None:
            origin = (0,) * len(piece.shape)
            return FlatShards(piece.shape, piece.ranges, blocks=((origin, self.holders[self.tensor_rank]),))
        return FlatShards(piece.shape, piece.ranges, spec.global_shape, self._blocks(spec), self.tensor_rank)

    def split(self, param: nn.Parameter) -> TensorParallelParam | None:
        """The placement of a parameter split over the tensor ranks (None: not split)."""
        spec = self.tensor.spec(param) if self.tensor is not None else None
        return spec if spec is not None and spec.dim is not None else None

    def _blocks(self, spec: TensorParallelParam) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """Every tensor rank's block of the global tensor, with the ranks holding its ranges."""
        return tuple((spec.box_offsets(t), self.holders[t]) for t in range(len(self.holders)))

    def whole_local(self, spec: TensorParallelParam, local: Tensor) -> Any:
        """A split parameter without a piece (frozen at stages 1/2: whole on every rank) as its
        tensor rank's block of the global tensor, read and written whole by this rank."""
        ranges = tuple(Range(0, local.numel()) if r == self.rank else Range(local.numel(), local.numel())
                       for r in range(len(self.holders[0])))
        flat = FlatShards(tuple(local.shape), ranges, spec.global_shape, self._blocks(spec), self.tensor_rank)
        return flat.sharded_tensor(local.reshape(-1), self.rank, None)

    def offers(self, piece: ParamPiece) -> bool:
        """Whether this rank's piece goes into a save (see the note above)."""
        return self.first_replica and (self.tensor_rank == 0 or self.split(piece.param) is not None)

    def global_shape(self, param: nn.Parameter, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        spec = self.tensor.spec(param) if self.tensor is not None else None
        return spec.global_shape if spec is not None else local_shape


def _sharded(piece: ParamPiece, local: Tensor, rank: int, group: dist.ProcessGroup | None,
             placement: MeshPlacement | None = None) -> Any:
    if placement is not None:
        return placement.shards(piece).sharded_tensor(local, placement.rank, None)
    return FlatShards(piece.shape, piece.ranges).sharded_tensor(local, rank, group)


def _piece_rank(group: dist.ProcessGroup | None, placement: MeshPlacement | None) -> int:
    """This rank's index into a piece's ranges."""
    return placement.rank if placement is not None else rank_of(group)


def _saves_once(group: dist.ProcessGroup | None, placement: MeshPlacement | None) -> bool:
    """Whether this rank writes the entries saved once per part of the model: rank 0, or on a
    mesh each pipeline stage's first rank (its stage's layers are only there)."""
    return placement.leader if placement is not None else rank_of(group) == 0


# [Note: checkpoint layout with a pipeline]
# Each pipeline stage's ranks hold only that stage's layers (see [Note: pipeline stages] in
# parallel/pipeline.py), but parameter names are the whole model's, so a checkpoint is the whole
# model's too: every stage saves its own keys (what is saved once, by the stage's first rank), and
# the meta lists the keys, dtypes and optimizer param groups of all stages together, gathered over
# the pipeline group. A load checks the checkpoint against all stages' keys and reads each rank's
# own, so the checkpoint loads with another pipeline size or without a pipeline.
@dataclass(frozen=True)
class ModelView:
    """What the checks and the meta see of the model: the whole model's keys and shapes and
    every optimizer's named param groups, over every pipeline stage."""

    keys: list[str]
    shapes: dict[str, tuple[int, ...]]  # global shapes of the tensor entries
    aliases: dict[str, str]
    param_dtypes: dict[str, str]
    param_groups: list[list[dict[str, Any]]]  # per optimizer


def model_view(module: nn.Module, optimizers: Sequence[ShardedOptimizer], pieces: Sequence[ParamPiece] = (),
               placement: MeshPlacement | None = None) -> ModelView:
    """This rank's :class:`ModelView`, merged over the pipeline's stages (a collective over the
    pipeline group when there is one; no communication otherwise)."""
    mine = module.state_dict(keep_vars=True)
    shapes = true_shapes(pieces)
    local = {key: shapes.get(value, tuple(value.shape)) for key, value in mine.items() if isinstance(value, Tensor)}
    if placement is not None:
        local = {key: placement.global_shape(mine[key], shape) if isinstance(mine[key], nn.Parameter) else shape
                 for key, shape in local.items()}
    names = param_names(module)
    view = ModelView(
        keys=list(mine), shapes=local, aliases=tied_aliases(module),
        param_dtypes={k: str(v.dtype) for k, v in mine.items() if isinstance(v, nn.Parameter)},
        param_groups=[named_param_groups(optimizer, names) for optimizer in optimizers],
    )
    if placement is None or placement.pipeline_group is None:
        return view
    stages = placement.across_stages(view)
    keys = placement.in_model_order(list(dict.fromkeys(key for stage in stages for key in stage.keys)))
    groups = [description["param_groups"] for description in _merged_descriptions(
        [[{"param_groups": groups, "per_element": []} for groups in stage.param_groups] for stage in stages],
        placement)]
    return ModelView(
        keys=keys,
        shapes={k: v for stage in stages for k, v in stage.shapes.items()},
        aliases={k: v for stage in stages for k, v in stage.aliases.items()},
        param_dtypes={k: v for stage in stages for k, v in stage.param_dtypes.items()},
        param_groups=groups,
    )


# ---------------------------------------------------------------------------------------- save
def is_extra_state(key: str) -> bool:
    return key == _EXTRA_STATE_KEY_SUFFIX or key.endswith("." + _EXTRA_STATE_KEY_SUFFIX)


def model_entries(module: nn.Module, pieces: Sequence[ParamPiece], group: dist.ProcessGroup | None,
                  placement: MeshPlacement | None = None) -> dict[str, Any]:
    """The module's state dict for a sharded save: a parameter with a master piece is saved as the
    fp32 master values, sharded like the pieces (a stage-3 frozen piece without a master as its
    shard holds it, see [Note: masters of frozen pieces]); everything else whole, from rank 0 only.

    Rank 0's, not any rank's: ZeRO does not re-broadcast buffers every forward as DDP does, so
    e.g. BatchNorm statistics differ between ranks, and DCP would keep an arbitrary rank's copy
    of an entry every rank offers (on a mesh: each pipeline stage's first rank, see [Note:
    checkpoint layout with a pipeline]). A module's extra state is one pickled object.
    """
    by_param = {piece.param: piece for piece in pieces}
    aliases = tied_aliases(module)
    entries: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in aliases:
            continue
        piece = by_param.get(value) if isinstance(value, nn.Parameter) else None
        split = placement.split(value) if placement is not None and isinstance(value, nn.Parameter) else None
        if piece is not None and piece.numel > 0:
            if placement is None or placement.offers(piece):
                entries[key] = _sharded(piece, piece.master, _piece_rank(group, placement), group, placement)
        elif split is not None and placement is not None:
            if placement.first_replica and placement.rank == 0:  # its tensor rank's block, once
                entries[key] = placement.whole_local(split, value.detach())
        elif not _saves_once(group, placement):
            continue
        elif is_extra_state(key):
            entries[key] = object_entry(value)
        else:
            entries[key] = value.detach()
    return entries


# [Note: weight averages in a checkpoint]
# Lightning's WeightAveraging callbacks (EMAWeightAveraging) swap, in on_save_checkpoint, the
# checkpoint's "state_dict" (the model entries this strategy made) into "current_model_state" and
# put their average's state dict in its place; on load they expect the same three keys back. A
# sharded checkpoint keeps the model entries as the model and saves the average under a namespace
# of its own: at stage 3 the average holds this rank's pieces, sharded like the model's
# parameters; at stages 1/2 it is whole, saved once. Loading gives Lightning each rank's average
# and current state in the form its parameters have (pieces at stage 3), which the callback
# copies into them.
AVERAGE_KEY = "weight_average"
# In the Lightning part of a sharded checkpoint: that it holds a WeightAveraging callback's average
# (under AVERAGE_KEY), and the state keys of the StochasticWeightAveraging callbacks whose averages
# it holds, in the order of their namespaces (swa_average_key).
AVERAGE_MARK = "lightning_zero_weight_average"
SWA_MARK = "lightning_zero_swa_averages"


def average_entries(
    module: nn.Module, average: Mapping[str, Any], pieces: Sequence[ParamPiece], group: dist.ProcessGroup | None,
    placement: MeshPlacement | None = None,
) -> dict[str, Any]:
    """A weight average's state dict (keyed like the module's) for a sharded save."""
    by_key = _pieces_by_key(module, pieces)
    entries: dict[str, Any] = {}
    for key, value in average.items():
        piece = by_key.get(key)
        if isinstance(value, Tensor) and piece is not None and value.numel() != piece.numel:
            if placement is None or placement.offers(piece):  # stage 3: this rank's piece
                entries[key] = _sharded(piece, value.detach().reshape(-1), _piece_rank(group, placement), group,
                                        placement)
        elif _saves_once(group, placement):
            if isinstance(value, Tensor) and piece is not None and value.numel() == piece.numel:
                value = value.reshape(piece.shape)  # stage 3 on one rank: the whole piece is 1-d
            entries[key] = value.detach() if isinstance(value, Tensor) else object_entry(value)
    return entries


def load_average(
    path: Path, metadata: Metadata, module: nn.Module, pieces: Sequence[ParamPiece], group: dist.ProcessGroup | None,
    placement: MeshPlacement | None = None, namespace: str = AVERAGE_KEY,
) -> dict[str, Any]:
    """The weight average saved by :func:`average_entries` under ``namespace``, each tensor as this
    rank's parameter holds it (a piece where the parameter shows one). A collective."""
    rank = _piece_rank(group, placement)
    by_key = _pieces_by_key(module, pieces)
    mine = dict(module.state_dict())
    prefix = namespace + "."
    targets: dict[str, Any] = {}
    local: dict[str, Tensor] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        key = fqn[len(prefix):]
        piece = by_key.get(key)
        current = mine.get(key)
        if not isinstance(md, TensorStorageMetadata):
            targets[key] = None
        elif piece is not None and isinstance(current, Tensor) and current.numel() != piece.numel:
            local[key] = torch.zeros(piece.ranges[rank].size, dtype=md.properties.dtype)
            targets[key] = _sharded(piece, local[key], rank, group, placement)
        else:
            local[key] = targets[key] = torch.zeros(md.size, dtype=md.properties.dtype)
    state = {namespace: targets}
    with torch.no_grad():
        load_sharded(path, metadata, state, group)
    loaded = {key: local[key] if key in local else from_object_entry(value) for key, value in state[namespace].items()}
    return {key: _shaped_like(value, mine.get(key)) for key, value in loaded.items()}


def _shaped_like(value: Any, current: Any) -> Any:
    """``value`` in ``current``'s shape where only the shape differs: at stage 3 on one rank a
    parameter shows its whole piece, 1-d."""
    if isinstance(value, Tensor) and isinstance(current, Tensor) and value.shape != current.shape \
            and value.numel() == current.numel():
        return value.reshape(current.shape)
    return value


def swa_average_key(index: int) -> str:
    """Where a sharded checkpoint keeps the average of the ``index``-th StochasticWeightAveraging
    callback (its state key, full of dots and braces, cannot name a checkpoint entry)."""
    return f"swa_average_{index}"


# [Note: weight averages in a whole checkpoint]
# A whole checkpoint (state_dict_type="full", or an export) is read by any strategy, so the weight
# average in it is whole too, as DDP would write it. At stage 3 each rank's average holds its
# pieces: a save gathers them on the saving rank, and a load cuts each rank's pieces out of the
# whole tensors (no communication). Which keys are gathered depends only on the layout (a piece
# with a true shape of its own, the same on every rank), never on the sizes a rank happens to
# hold, so every rank joins the same collectives: a parameter kept whole on every rank (a
# persistent unit) is gathered too, from each rank's range of it.
def whole_average(
    average: Mapping[str, Any], module: nn.Module, pieces: Sequence[ParamPiece], collectives: AnyCollectives,
    keep: bool, device: torch.device,
) -> dict[str, Any]:
    """``average`` (a weight average's state dict keyed like ``module``'s; at stage 3 pieces) with
    whole tensors of the parameters' true shapes, on the CPU of the rank with ``keep`` ({}
    elsewhere). A collective over the ranks the pieces are split over (``collectives``: the ZeRO
    ones, the shard group's on a mesh), through ``device`` (the collectives' device: an average
    kept on the CPU, as SWA's is, still gathers over NCCL)."""
    by_key = _pieces_by_key(module, pieces)
    rank = collectives.rank
    whole: dict[str, Any] = {}
    for key, value in average.items():
        piece = by_key.get(key)
        if isinstance(value, Tensor) and piece is not None and piece.param_shape is not None:
            mine = value.detach().reshape(-1)
            if mine.numel() == piece.numel:  # shown whole here: this rank offers its range
                mine = piece.ranges[rank].slice(mine)
            share = max(r.size for r in piece.ranges)
            padded = torch.zeros(share, dtype=mine.dtype, device=device)
            padded[: mine.numel()] = mine
            every = torch.empty(share * len(piece.ranges), dtype=mine.dtype, device=device)
            collectives.all_gather(every, padded).wait()
            if keep:
                every = every.cpu()
                flat = torch.empty(piece.numel, dtype=mine.dtype)
                for r, part in enumerate(piece.ranges):
                    part.slice(flat).copy_(every[r * share : r * share + part.size])
                whole[key] = flat.view(piece.shape)
        elif keep:
            whole[key] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
    return whole


def state_in_pieces(
    state: Mapping[str, Any], module: nn.Module, pieces: Sequence[ParamPiece], rank: int
) -> dict[str, Any]:
    """A whole state dict keyed like ``module``'s (a weight average from a whole checkpoint) in the
    form this rank's parameters show: at stage 3 each rank's piece, cut out of the whole tensor (see
    the note above)."""
    by_key = _pieces_by_key(module, pieces)
    shown = dict(module.state_dict())
    result: dict[str, Any] = {}
    for key, value in state.items():
        piece, current = by_key.get(key), shown.get(key)
        if (isinstance(value, Tensor) and piece is not None and isinstance(current, Tensor)
                and current.numel() != value.numel() and value.numel() == piece.numel):
            value = piece.ranges[rank].slice(value.reshape(-1)).clone()
        result[key] = _shaped_like(value, current)
    return result


def _pieces_by_key(module: nn.Module, pieces: Sequence[ParamPiece]) -> dict[str, ParamPiece]:
    by_param = {piece.param: piece for piece in pieces}
    return {key: by_param[value] for key, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, nn.Parameter) and value in by_param}


def optimizer_entries(
    optimizer: ShardedOptimizer, names: Mapping[nn.Parameter, str], group: dist.ProcessGroup | None,
    placement: MeshPlacement | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's state tensors by parameter name, the optimizer's description for the meta).

    State shaped like the master piece is saved with the parameter's shape, sharded; anything else
    (Adam's step count) as it is, once per parameter.
    """
    per_element: set[str] = set()
    entries: dict[str, Any] = {}
    for piece in optimizer.param_pieces():
        state = optimizer.optimizer.state.get(piece.holder, {})
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == piece.holder.numel():
                per_element.add(key)
                if piece.numel > 0 and (placement is None or placement.offers(piece)):
                    entry[key] = _sharded(piece, piece.in_holder.slice(value), _piece_rank(group, placement), group,
                                          placement)
            elif _saves_once(group, placement):  # the same on every rank; saved once (see model_entries)
                entry[key] = value.detach() if isinstance(value, Tensor) else value
        if entry:
            entries[piece.name] = entry
    description = {
        "class": type(optimizer.optimizer).__qualname__,
        "param_groups": named_param_groups(optimizer, names),
        "per_element": sorted(per_element),
    }
    return entries, description


def named_param_groups(optimizer: ShardedOptimizer, names: Mapping[nn.Parameter, str]) -> list[dict[str, Any]]:
    """The param groups' hyperparameters, with parameters listed by name."""
    return optimizer._indexed_param_groups(names)


def model_pieces(engine: ZeroEngine | None, optimizers: Sequence[ShardedOptimizer]) -> list[ParamPiece]:
    """This rank's fp32 master piece of every parameter that has one (all at stage 3; at stages
    1/2 those the optimizers train), from the engine, or without one from the optimizers."""
    if engine is not None:
        return engine.param_pieces()
    return [piece for optimizer in optimizers for piece in optimizer.param_pieces()]


def sharded_state(
    module: nn.Module,
    model: dict[str, Any],
    optimizers: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    lightning: dict[str, Any],
    world_size: int,
    stage: int,
    group: dist.ProcessGroup | None,
    parallel: dict[str, Any] | None = None,
    placement: MeshPlacement | None = None,
) -> dict[str, Any]:
    """The DCP state dict of one rank: its model and optimizer entries; rank 0 adds the meta
    (with ``parallel``, the mesh's description: see CheckpointMeta.parallel), which under a
    pipeline describes every stage (see [Note: checkpoint layout with a pipeline]; then a
    collective over the pipeline group)."""
    state: dict[str, Any] = {MODEL_KEY: model}
    for index, (entries, _) in enumerate(optimizers):
        if entries:  # before the first step an optimizer has no state; DCP would record no key for {}
            state[optimizer_key(index)] = entries
    view = model_view(module, (), placement=placement)
    descriptions = [description for _, description in optimizers]
    if placement is not None and placement.pipeline_group is not None:
        descriptions = _merged_descriptions(placement.across_stages(descriptions), placement)
    if rank_of(group) == 0:
        meta = CheckpointMeta(
            world_size=world_size,
            stage=stage,
            model_keys=view.keys,
            aliases=view.aliases,
            param_dtypes=view.param_dtypes,
            optimizers=descriptions,
            lightning=lightning,
            parallel=dict(parallel or {}),
        )
        state[META_KEY] = meta.to_entry()
    return state


def _merged_descriptions(stages: list[list[dict[str, Any]]], placement: MeshPlacement) -> list[dict[str, Any]]:
    """Every stage's optimizer descriptions as one per optimizer: the param groups list the
    parameters of all stages, in the whole model's order (a consolidated export numbers them so)."""
    merged = []
    for per_stage in zip(*stages):
        first = dict(per_stage[0])
        first["param_groups"] = []
        for groups in zip(*(description["param_groups"] for description in per_stage)):
            group = dict(groups[0])
            group["params"] = placement.in_model_order([name for stage_group in groups for name in stage_group["params"]])
            first["param_groups"].append(group)
        first["per_element"] = sorted({key for description in per_stage for key in description["per_element"]})
        merged.append(first)
    return merged


def save_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizers: Sequence[ShardedOptimizer] = (),
    engine: ZeroEngine | None = None,
    extra: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    checksums: bool = True,
    placement: MeshPlacement | None = None,
) -> None:
    """Saves a ZeRO model (and optimizers) as a sharded checkpoint, without Lightning; ``extra``
    is kept as the checkpoint's Lightning part (``CheckpointMeta.lightning``). ``checksums=False``
    leaves out the records' checksums (to measure their cost). A collective."""
    pieces = model_pieces(engine, optimizers)
    names = param_names(module)
    stage = engine.config.stage if engine is not None else max([o.config.stage for o in optimizers] + [1])
    world = dist.get_world_size(group) if is_distributed() else 1
    state = sharded_state(module, model_entries(module, pieces, group, placement),
                          [optimizer_entries(o, names, group, placement) for o in optimizers], dict(extra or {}), world,
                          stage, group, placement=placement)
    save_sharded(path, state, group, checksums=checksums)


def load_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizers: Sequence[ShardedOptimizer] | None = None,
    engine: ZeroEngine | None = None,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    verify: bool = True,
    placement: MeshPlacement | None = None,
) -> dict[str, Any]:
    """Loads a sharded checkpoint (any world size and stage) into a ZeRO model and, if given, its
    optimizers, without Lightning; returns the checkpoint's Lightning part. ``verify=False`` skips
    the checksums (to measure their cost). A collective."""
    pieces = model_pieces(engine, optimizers or ())
    meta = load_into(resolve_checkpoint_path(path), module, pieces, optimizers, group, strict, verify, placement)
    publish_masters(engine, optimizers or ())
    return meta.lightning


def publish_masters(engine: ZeroEngine | None, optimizers: Sequence[ShardedOptimizer]) -> None:
    """After masters were loaded: the parameters take their values (a collective)."""
    with torch.no_grad():
        if engine is not None:
            engine.publish_masters()
        else:
            for optimizer in optimizers:
                optimizer.publish_params()


# ---------------------------------------------------------------------------------------- load
def check_model_fits(
    path: Path, metadata: Metadata, meta: CheckpointMeta, view: ModelView, strict: bool,
) -> None:
    """Raises CheckpointError naming every missing, unexpected and mis-shaped key (before anything loads)."""
    prefix = MODEL_KEY + "."
    saved = {k[len(prefix) :]: md.size for k, md in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    shapes = {key: saved[meta.aliases.get(key, key)] for key in meta.model_keys if meta.aliases.get(key, key) in saved}
    _check_fits(path, meta.model_keys, shapes, view, strict)


def true_shapes(pieces: Sequence[ParamPiece]) -> dict[nn.Parameter, tuple[int, ...]]:
    """The parameters' true shapes: a stage-3 parameter outside a gather shows its 1-d piece
    ([Note: a stage-3 parameter outside its gather] in zero/stage3/unit.py)."""
    return {piece.param: piece.shape for piece in pieces}


def _check_fits(
    path: Path, saved_keys: Sequence[str], saved_shapes: Mapping[str, Sequence[int]], view: ModelView, strict: bool,
) -> None:
    """The one comparison of a checkpoint's keys and tensor shapes with the model's (global
    shapes under tensor parallelism: see [Note: checkpoint layout with a mesh]; every stage's
    keys under a pipeline: see [Note: checkpoint layout with a pipeline])."""
    keys = set(saved_keys)
    mine = set(view.keys)
    missing = [k for k in view.keys if k not in keys]
    unexpected = [k for k in saved_keys if k not in mine]
    wrong = {
        key: (tuple(saved_shapes[key]), shape)
        for key, shape in view.shapes.items()
        if key in saved_shapes and tuple(saved_shapes[key]) != shape
    }
    message = describe_mismatch(path, missing, unexpected, wrong, strict)
    if message:
        raise CheckpointError(message)


def check_optimizers_fit(
    path: Path, meta: CheckpointMeta, optimizers: Sequence[ShardedOptimizer], view: ModelView
) -> None:
    if len(meta.optimizers) != len(optimizers):
        raise CheckpointError(
            f"The checkpoint {path} holds the state of {len(meta.optimizers)} optimizer(s) but configure_optimizers"
            f" returned {len(optimizers)}. Resume with the same optimizers, or load the weights only. Nothing was loaded."
        )
    for number, (saved, optimizer, current) in enumerate(zip(meta.optimizers, optimizers, view.param_groups)):
        mine_class = type(optimizer.optimizer).__qualname__
        if saved["class"] != mine_class:
            raise CheckpointError(
                f"Optimizer {number} is {mine_class} but the checkpoint {path} holds a {saved['class']} state."
                " Resume with the same optimizer class, or load the weights only. Nothing was loaded."
            )
        if len(saved["param_groups"]) != len(current):
            raise CheckpointError(
                f"Optimizer {number} has {len(current)} param groups but the checkpoint {path} has"
                f" {len(saved['param_groups'])}: it comes from a different configure_optimizers(). Nothing was loaded."
            )
        for index, (old, new) in enumerate(zip(saved["param_groups"], current)):
            if set(old["params"]) != set(new["params"]):
                only_old = sorted(set(old["params"]) - set(new["params"]))
                only_new = sorted(set(new["params"]) - set(old["params"]))
                raise CheckpointError(
                    f"Param group {index} of optimizer {number} does not hold the parameters it held in {path}:"
                    f" only in the checkpoint {only_old[:10]}, only now {only_new[:10]}. Resume with the same param"
                    " groups. Nothing was loaded."
                )


class _OptimizerLoad:
    """The DCP targets for one optimizer's state, and how they become its state afterwards."""

    def __init__(self, optimizer: ShardedOptimizer, saved: dict[str, Any], metadata: Metadata,
                 index: int, group: dist.ProcessGroup | None, placement: MeshPlacement | None = None) -> None:
        self.optimizer = optimizer
        self.saved = saved
        self.targets: dict[str, dict[str, Any]] = {}
        self.state: dict[int, tuple[Tensor, dict[str, Any]]] = {}  # id(holder) -> (holder, state)
        self._scalars: list[tuple[Tensor, str, str]] = []  # (holder, param name, state key)
        rank = _piece_rank(group, placement)
        per_element = set(saved["per_element"])
        by_name = saved_state_keys(metadata, optimizer_key(index))
        for piece in optimizer.param_pieces():
            holder_state = self.state.setdefault(id(piece.holder), (piece.holder, {}))[1]
            entry: dict[str, Any] = {}
            for state_key, md in by_name.get(piece.name, {}).items():
                if state_key in per_element and isinstance(md, TensorStorageMetadata):
                    full = holder_state.get(state_key)
                    if full is None:
                        full = holder_state[state_key] = torch.zeros_like(piece.holder, dtype=md.properties.dtype)
                    entry[state_key] = _sharded(piece, piece.in_holder.slice(full), rank, group, placement)
                elif isinstance(md, TensorStorageMetadata):
                    entry[state_key] = torch.zeros(md.size, dtype=md.properties.dtype)
                    self._scalars.append((piece.holder, piece.name, state_key))
                elif isinstance(md, BytesStorageMetadata):
                    entry[state_key] = None
                    self._scalars.append((piece.holder, piece.name, state_key))
            if entry:
                self.targets[piece.name] = entry

    def finish(self) -> None:
        """Installs what was read as the optimizer's state and the saved hyperparameters."""
        inner = self.optimizer.optimizer
        on_device = inner.defaults.get("fused") or inner.defaults.get("capturable")
        for holder, name, state_key in self._scalars:
            holder_state = self.state[id(holder)][1]
            if state_key not in holder_state:  # one holder (a bucket) may hold several parameters
                value = self.targets[name][state_key]
                if isinstance(value, Tensor) and on_device:
                    value = value.to(holder.device)
                holder_state[state_key] = value
        inner.state.clear()
        for holder, holder_state in self.state.values():
            if holder_state:
                inner.state[holder] = holder_state
        for group, saved in zip(inner.param_groups, self.saved["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


def load_into(
    path: Path,
    module: nn.Module,
    model_pieces: Sequence[ParamPiece],
    optimizers: Sequence[ShardedOptimizer] | None,
    group: dist.ProcessGroup | None,
    strict: bool = True,
    verify: bool = True,
    placement: MeshPlacement | None = None,
) -> CheckpointMeta:
    """Loads a sharded checkpoint into the module (and, unless ``optimizers`` is None, their
    states), whatever world size and stage wrote it. Checks everything, checksums included, before
    reading any tensor, so a checkpoint that does not fit or is damaged changes nothing; the ranks
    agree first, so every rank raises the same CheckpointError. A collective. The caller publishes
    the loaded masters to the parameters afterwards."""
    failure: str | None = None
    # Before anything that can fail on one rank only: under a pipeline this is a collective.
    view = model_view(module, optimizers or (), model_pieces, placement)
    try:
        metadata = read_metadata(path)
        meta = read_meta(path, metadata)
        check_model_fits(path, metadata, meta, view, strict)
        loaded = [MODEL_KEY]
        if optimizers is not None and meta.optimizers:
            check_optimizers_fit(path, meta, optimizers, view)
            loaded += [optimizer_key(index) for index in range(len(meta.optimizers))]
    except CheckpointError as error:
        failure = str(error)
    if failure is None and verify:
        failure = verify_share(path, metadata, under(loaded), group)
    agree(failure, group)
    rank = _piece_rank(group, placement)
    saved_model = {k[len(MODEL_KEY) + 1 :] for k in metadata.state_dict_metadata if k.startswith(MODEL_KEY + ".")}
    by_param = {piece.param: piece for piece in model_pieces}
    model_targets: dict[str, Any] = {}
    # A saved tensor wanted under two keys (tied in the checkpoint, not in this model) needs a
    # second read: one DCP load fills one target per key.
    second_reads: dict[str, Any] = {}
    extra_state: list[tuple[str, str]] = []
    mine = module.state_dict(keep_vars=True)
    aliases = tied_aliases(module)
    for key, value in mine.items():
        if key in aliases:
            continue
        source = key if key in saved_model else meta.aliases.get(key)
        if source is None or source not in saved_model:
            continue  # missing, allowed by strict=False
        piece = by_param.get(value) if isinstance(value, nn.Parameter) else None
        split = placement.split(value) if placement is not None and isinstance(value, nn.Parameter) else None
        if piece is not None and piece.numel > 0:
            target: Any = _sharded(piece, piece.master, rank, group, placement)
        elif split is not None and placement is not None:
            target = placement.whole_local(split, value.data)
        elif is_extra_state(key):
            target = None  # DCP puts the saved object here
            extra_state.append((key, source))
        else:
            target = value.data
        if source in model_targets:
            second_reads[source] = target
        else:
            model_targets[source] = target
    loads = []
    state: dict[str, Any] = {MODEL_KEY: model_targets}
    if optimizers is not None and meta.optimizers:
        for index, (optimizer, saved) in enumerate(zip(optimizers, meta.optimizers)):
            load = _OptimizerLoad(optimizer, saved, metadata, index, group, placement)
            if load.targets:  # saved before its first step: no state to read, only hyperparameters
                state[optimizer_key(index)] = load.targets
            loads.append(load)
    with torch.no_grad():
        load_sharded(path, metadata, state, group, verified=True)
        if second_reads:
            load_sharded(path, metadata, {MODEL_KEY: second_reads}, group, verified=True)
    for load in loads:
        load.finish()
    for key, source in extra_state:
        owner = module.get_submodule(key[: -len("._extra_state")]) if key.endswith("._extra_state") else module
        owner.set_extra_state(from_object_entry(model_targets[source], path, f"{MODEL_KEY}.{source}"))
    return meta


# ---------------------------------------------------------------------------------------- full files
def check_full_state_fits(
    path: Path, state_dict: Mapping[str, Any], module: nn.Module, strict: bool, pieces: Sequence[ParamPiece] = (),
    view: ModelView | None = None,
) -> None:
    """A whole-weights state dict against the module (or ``view``, every pipeline stage's keys):
    names every missing, unexpected and mis-shaped key before anything is loaded."""
    shapes = {key: value.shape for key, value in state_dict.items() if isinstance(value, Tensor)}
    _check_fits(path, list(state_dict), shapes, view if view is not None else model_view(module, (), pieces), strict)


def check_full_optimizer_states(
    path: Path, states: Any, optimizers: Sequence[ShardedOptimizer], pieces: Sequence[ParamPiece] = ()
) -> None:
    """Torch-format optimizer states (a DDP or consolidated checkpoint) against the optimizers:
    group and parameter counts, and each state tensor's shape, before anything is loaded."""
    if not isinstance(states, list) or len(states) != len(optimizers):
        count = len(states) if isinstance(states, list) else type(states).__name__
        raise CheckpointError(
            f"The checkpoint {path} holds {count} optimizer state(s) but configure_optimizers returned"
            f" {len(optimizers)}. Resume with the same optimizers. Nothing was loaded."
        )
    shapes = true_shapes(pieces)
    for number, (state, optimizer) in enumerate(zip(states, optimizers)):
        try:
            saved_index = _check_full_optimizer_state(state, optimizer._group_params, type(optimizer.optimizer).__name__)
        except ValueError as error:
            raise CheckpointError(f"Optimizer {number} cannot load the state in {path}: {error} Nothing was loaded.") from error
        for param, index in saved_index.items():
            shape = shapes.get(param, tuple(param.shape))
            for key, value in state["state"].get(index, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                    raise CheckpointError(
                        f"Optimizer {number}'s state '{key}' of parameter {index} has"
                        f" shape {tuple(value.shape)} in {path} but the parameter has shape {shape}: the"
                        " state comes from a different model. Nothing was loaded."
                    )
