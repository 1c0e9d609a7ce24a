"""The mesh without a Trainer: sizes and their errors, the groups, and what the engine sends on
each dimension, its clipping norm and its skip decision, on 4 gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor.debug import CommDebugMode

from harness import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPT  # noqa: E402

from lightning_zero import (  # noqa: E402
    CountingCollectives,
    LossScaleConfig,
    LossScaler,
    ParallelConfig,
    ZeroConfig,
    ZeroStrategy,
)
from lightning_zero.parallel import (  # noqa: E402
    ParallelDims,
    TensorParallelParams,
    build_parallel_groups,
    parallelize_gpt,
    resolve_dims,
)
from lightning_zero.zero.engine import make_engine  # noqa: E402

WORLD = 4
VOCAB, SEQ, WIDTH, LAYERS = 32, 8, 32, 2
GLOBAL_BATCH = 8


# ---------------------------------------------------------------------------------------- sizes
def test_sizes_resolve_with_the_rest_and_one_node_per_shard_group() -> None:
    assert resolve_dims(ParallelConfig(), 8, 8) == ParallelDims(world=8, data=8, tensor=1, shard=8)
    assert resolve_dims(ParallelConfig(tensor=2), 8, 8) == ParallelDims(world=8, data=4, tensor=2, shard=4)
    assert resolve_dims(ParallelConfig(data=2, tensor=-1), 8, 8) == ParallelDims(world=8, data=2, tensor=4, shard=2)
    # 2 nodes x 4 processes, tp2: a node holds 2 data-parallel ranks, the shard group of shard_size=-1
    dims = resolve_dims(ParallelConfig(tensor=2, shard_size=-1), 8, 4)
    assert (dims.data, dims.shard, dims.replicas) == (4, 2, 2)


def test_tensor_and_shard_groups_are_adjacent_ranks() -> None:
    """Tensor ranks vary fastest and a shard group's ranks come next, so both stay in a node."""
    dims = ParallelDims(world=8, data=4, tensor=2, shard=2)
    assert dims.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.shard_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # node 0: ranks 0-3, node 1: 4-7
    assert dims.replicate_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for rank in range(8):
        replica, shard_rank, tensor_rank = dims.coordinates(rank)
        assert dims.rank_of(replica, shard_rank, tensor_rank) == rank
        assert dims.data_rank(rank) == replica * 2 + shard_rank


@pytest.mark.parametrize(
    ("config", "world", "per_node", "names"),
    [
        (ParallelConfig(tensor=3), 4, 4, ["tensor=3", "divide the world size 4", "[1, 2, 4]"]),
        (ParallelConfig(data=3), 4, 4, ["data=3", "4"]),
        (ParallelConfig(data=2, tensor=4), 4, 4, ["data=2", "tensor=4", "data=-1"]),
        (ParallelConfig(tensor=4), 8, 2, ["tensor=4", "2 processes per node", "span nodes"]),
        (ParallelConfig(shard_size=3), 4, 4, ["shard_size=3", "[1, 2, 4]"]),
    ],
)
def test_sizes_that_do_not_fit_name_the_value_and_the_fix(config: ParallelConfig, world: int, per_node: int,
                                                        names: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        resolve_dims(config, world, per_node)
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"tensor": 0}, ["ParallelConfig.tensor=0", "-1"]),
        ({"data": -1, "tensor": -1}, ["only one of data and tensor"]),
        ({"shard_size": 0}, ["ParallelConfig.shard_size=0"]),
        ({"tensor": True}, ["ParallelConfig.tensor=True"]),
    ],
)
def test_bad_parallel_config_names_the_field(values: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        ParallelConfig(**values)
    for name in names:
        assert name in str(error.value)


def test_parallel_config_from_yaml_mapping() -> None:
    config = ZeroConfig.from_dict({"stage": 3, "parallel": {"data": -1, "tensor": 2}})
    assert config.parallel == ParallelConfig(tensor=2)
    with pytest.raises(ValueError, match=r"Unknown ZeroConfig.parallel field\(s\) \['tensors'\]"):
        ZeroConfig.from_dict({"parallel": {"tensors": 2}})
    with pytest.raises(ValueError, match="ZeroConfig.parallel=2 must be a ParallelConfig"):
        ZeroConfig(parallel=2)  # type: ignore[arg-type]


def test_unsupported_combinations_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="state_dict_type='full'.*tensor parallelism"):
        ZeroStrategy(config=ZeroConfig(parallel=ParallelConfig(tensor=2)), state_dict_type="full")
    with pytest.raises(ValueError, match="collectives=.*cannot be combined"):
        ZeroStrategy(config=ZeroConfig(parallel=ParallelConfig(shard_size=2)), collectives=object())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- 4 ranks
def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=4, n_embd=WIDTH)


def _batch() -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _step(config: ZeroConfig, parallel: ParallelConfig, overflow_on: int | None = None) -> dict[str, Any]:
    dims = resolve_dims(parallel, WORLD, WORLD)
    groups = build_parallel_groups(dims, "cpu", "gloo", None)
    model = _gpt()
    tensor_parallel = None
    if dims.tensor > 1:
        parallelize_gpt(model, groups.tensor_mesh)
        tensor_parallel = TensorParallelParams(model, groups.tensor_mesh)
    sharded = tensor_parallel.sharded if tensor_parallel is not None else frozenset()
    counting = CountingCollectives(groups.engine_collectives(sharded))
    engine = make_engine(model, counting, config, None, torch.device("cpu"))
    if tensor_parallel is not None:
        tensor_parallel.install_hooks()
    scaler = LossScaler(LossScaleConfig(initial_scale_power=4)) if overflow_on is not None else None
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), scaler)
    tokens, targets = _batch()
    per_rank = GLOBAL_BATCH // dims.data
    mine = slice(dims.data_rank(dist.get_rank()) * per_rank, (dims.data_rank(dist.get_rank()) + 1) * per_rank)
    counting.reset()
    with CommDebugMode() as forward_comm:
        loss = model._loss((tokens[mine].contiguous(), targets[mine].contiguous()))
    with CommDebugMode() as backward_comm:
        (loss * (scaler.scale if scaler is not None else 1.0)).backward()
    optimizer.finish_grad_sync()
    if overflow_on is not None and dist.get_rank() == overflow_on:
        next(optimizer.layout.master_grads())[0] = float("inf")
    norm = float(optimizer.clip_grad_norm_(1e9)) if overflow_on is None else None
    optimizer.step()
    calls = [(call.op, call.numel) for call in counting.calls]
    pieces = engine.param_pieces()
    return {
        "norm": norm,
        "calls": calls,
        "local_numel": sum(piece.numel for piece in pieces),
        "parameters": len(pieces),
        "forward_all_reduces": forward_comm.get_comm_counts().get(torch.ops.c10d_functional.all_reduce, 0),
        "backward_all_reduces": backward_comm.get_comm_counts().get(torch.ops.c10d_functional.all_reduce, 0),
        "skipped": optimizer.last_step_skipped,
        "dims": dims,
    }


def _timeouts() -> list[float | None]:
    from datetime import timedelta

    from lightning_zero.zero.comm import _timeout_of

    groups = build_parallel_groups(resolve_dims(ParallelConfig(tensor=2, shard_size=1), WORLD, WORLD), "cpu", "gloo",
                                   timedelta(seconds=77))
    every = [groups.data_group, groups.shard_group, groups.replicate_group, groups.tensor_group,
             groups.shard_control_group, groups.shard_reduce_group, groups.mesh["tensor"].get_group()]
    return [timeout.total_seconds() if (timeout := _timeout_of(g)) is not None else None for g in every]


def _cases() -> dict[str, Any]:
    out: dict[str, Any] = {"timeouts": _timeouts()}
    tp2, hybrid = ParallelConfig(tensor=2), ParallelConfig(shard_size=2)
    for stage in (1, 2, 3):
        out[f"tp2-zero{stage}"] = _step(ZeroConfig(stage=stage), tp2)
        out[f"hybrid-zero{stage}"] = _step(ZeroConfig(stage=stage), hybrid)
    out["tp2-overflow"] = _step(ZeroConfig(stage=2), tp2, overflow_on=1)
    out["hybrid-overflow"] = _step(ZeroConfig(stage=3), hybrid, overflow_on=3)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD)


def _reference_norm() -> float:
    model = _gpt()
    model._loss(_batch()).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))


@pytest.mark.parametrize("layout", ["tp2", "hybrid"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_norm_counts_every_element_once(results: list[dict[str, Any]], layout: str, stage: int) -> None:
    """The clipping norm over the mesh equals torch's over the whole model: tensor-parallel parts
    add up over the tensor ranks, replicated parameters (norms, embeddings) count once, replicas
    of a shard group do not add."""
    expected = _reference_norm()
    for rank in results:
        assert rank[f"{layout}-zero{stage}"]["norm"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tensor_parallel_traffic_per_step(results: list[dict[str, Any]], stage: int) -> None:
    """dp2 x tp2. Tensor dim: each block all-reduces its two row-parallel outputs in forward and
    its two column-parallel inputs' gradients in backward. Data dim: the gradients of this tensor
    rank's local parameters, reduce-scattered over its 2 data-parallel ranks once, and (stage 1/2)
    the updated parameters all-gathered once; the norm adds one scalar over the tensor ranks."""
    for rank in results:
        case = rank[f"tp2-zero{stage}"]
        assert case["forward_all_reduces"] == 2 * LAYERS
        assert case["backward_all_reduces"] == 2 * LAYERS
        local = case["local_numel"]
        scattered = sum(numel for op, numel in case["calls"] if op == "reduce_scatter")
        # padded to a multiple of the 2 data-parallel ranks: per bucket (1/2), per parameter (3)
        assert local <= scattered <= local + case["parameters"]
        if stage < 3:
            gathered = sum(numel for op, numel in case["calls"] if op == "all_gather")
            assert gathered == scattered
        assert [op for op, _ in case["calls"]].count("tensor_all_reduce") == 1
        assert not any(op == "replica_all_reduce" for op, _ in case["calls"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_traffic_across_groups_is_one_shard_chunk_per_reduction(results: list[dict[str, Any]],
                                                                     stage: int) -> None:
    """Hybrid 2 x 2: reduce-scatters and all-gathers stay inside the shard group of 2; only each
    reduced chunk (1/2 of the gradients) is all-reduced across the 2 replicas."""
    for rank in results:
        case = rank[f"hybrid-zero{stage}"]
        assert case["dims"].shard == 2 and case["dims"].replicas == 2
        scattered = [numel for op, numel in case["calls"] if op == "reduce_scatter"]
        across = [numel for op, numel in case["calls"] if op == "replica_all_reduce"]
        assert len(across) == len(scattered) > 0
        assert across == [numel // 2 for numel in scattered]
        assert sum(scattered) >= case["local_numel"]


@pytest.mark.parametrize("layout", ["tp2", "hybrid"])
def test_an_overflow_on_one_rank_skips_the_step_everywhere(results: list[dict[str, Any]], layout: str) -> None:
    """fp16 loss scaling: an inf in one tensor rank's (or one replica's) gradients makes every rank
    of the mesh skip, not only its data-parallel group."""
    assert [rank[f"{layout}-overflow"]["skipped"] for rank in results] == [True] * WORLD
    assert not any(rank["tp2-zero2"]["skipped"] for rank in results)


def test_every_group_of_the_mesh_waits_the_strategys_timeout(results: list[dict[str, Any]]) -> None:
    """A rank that never joins fails its peers after the user's timeout, on every dimension."""
    for rank in results:
        assert rank["timeouts"] == [77.0] * 7


def test_lightning_cli_yaml_takes_the_mesh() -> None:
    """`config: {stage: 3, parallel: {data: -1, tensor: 2}}` in LightningCLI YAML (as in
    examples/gpt/configs/zero3_tp2_cpu.yaml) builds the strategy with a ParallelConfig."""
    from lightning.pytorch.cli import LightningCLI

    from models import TinyGPT

    strategy = {"class_path": "lightning_zero.ZeroStrategy",
                "init_args": {"config": {"stage": 3, "parallel": {"data": -1, "tensor": 2}}}}
    cli = LightningCLI(TinyGPT, run=False, args={"trainer": {"strategy": strategy, "accelerator": "cpu", "devices": 4,
                                                             "logger": False}})
    assert isinstance(cli.trainer.strategy, ZeroStrategy)
    assert cli.trainer.strategy.config == ZeroConfig(stage=3, parallel=ParallelConfig(data=-1, tensor=2))
