"""Model parallelism beside ZeRO: the device mesh (data x tensor, hybrid shard groups), tensor-
parallel plans for common models, and the local view of tensor-parallel parameters the engine
shards. Plain PyTorch: the strategy builds the mesh; everything here is testable without a Trainer."""

from lightning_zero.config import ParallelConfig
from lightning_zero.parallel.mesh import ParallelDims, ParallelGroups, build_parallel_groups, resolve_dims
from lightning_zero.parallel.plans import (
    TensorParallelPlanError,
    apply_plan,
    hf_gpt2_state_dict_to_hf,
    parallelize_gpt,
    parallelize_hf_gpt2,
    parallelize_llama,
)
from lightning_zero.parallel.tensor import TensorParallelParam, TensorParallelParams

__all__ = [
    "ParallelConfig",
    "ParallelDims",
    "ParallelGroups",
    "TensorParallelParam",
    "TensorParallelParams",
    "TensorParallelPlanError",
    "apply_plan",
    "build_parallel_groups",
    "hf_gpt2_state_dict_to_hf",
    "parallelize_gpt",
    "parallelize_hf_gpt2",
    "parallelize_llama",
    "resolve_dims",
]
