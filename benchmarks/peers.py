"""lightning_zero against its peers: DDP, Lightning's DeepSpeedStrategy and FSDP2, on the same GPT.

    python benchmarks/peers.py --quick                   # smoke run: tiny model, 3 steps, one round
    python benchmarks/peers.py                           # all, 2 gloo ranks, 2 rounds: about 8 min on 2 cores
    python benchmarks/peers.py --configs ds_stage2 zero2 --rounds 3 --precision 32-true
    python benchmarks/peers.py --configs ds_stage2_offload zero2_offload --trace-dir traces/   # per-rank traces
    python benchmarks/peers.py --configs ds_stage3 zero3 --lora-rank 8    # LoRA: frozen GPT, trained adapters

Configurations (``ddp`` always runs: every ratio is to DDP measured in the same run):

- ``ddp``: Lightning's DDPStrategy, the baseline.
- ``floor``: the compute floor: each of the ``--world-size`` processes trains the same GPT alone on
  one device (no process group, nothing communicated: forward, backward and the full optimizer
  step), all at once, so that they share the machine as the ranks of the other rows do.
- ``ds_stage1``, ``ds_stage2``, ``ds_stage3``, ``ds_stage2_offload`` (optimizer offloaded) and
  ``ds_stage3_offload`` (optimizer and parameters offloaded): Lightning's own
  ``lightning.pytorch.strategies.DeepSpeedStrategy`` with the presets of its registry; the offload
  presets step ``deepspeed.ops.adam.DeepSpeedCPUAdam``, the others the demo's ``torch.optim.AdamW``.
- ``fsdp2``: Lightning's ``ModelParallelStrategy`` with ``fully_shard`` on every block and the root
  in ``configure_model`` (data parallel only).
- ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload``: ours, by registered name
  (with ``--reduce-dtype``, the preset with that ``ZeroConfig.reduce_dtype``: DeepSpeed reduces in the
  gradients' dtype, bf16 under bf16-mixed, so ``--reduce-dtype bf16`` compares like with like).

Every configuration trains the demo GPT (``examples/gpt/model.py``, through ``step_time.py``'s
builder) on random tokens for ``--warmup + --steps`` optimizer steps in a fresh set of rank
processes started the way torchrun starts them (``step_time.py``'s launch code). The
configurations run interleaved, ``--rounds`` times (ddp, ds_stage1, zero1, ds_stage2, zero2, ...
in the first round, then in an order shuffled per round with a fixed seed), and each number in the
table is the median over the rounds, so that a drift of the machine lands on every configuration
alike. The shuffle is there because a run's place matters: in the fixed order, zero1 ran right
after the first DeepSpeed run of each round and measured 10-15 ms slower than zero2, while run
after ddp the two were level (95 against 96 ms). Below the table, each of ours over its DeepSpeed
counterpart round by round (the median and range of those ratios): on this machine the step of
every configuration moves by 20% and more from one round to the next, and that spread says how far
the ratio of the medians can be trusted. Measured per configuration:

- step ms: median over the measured steps of the slowest rank's ``on_train_batch_start`` ->
  ``on_train_batch_end`` time, as in ``step_time.py``.
- peak RSS: ``ru_maxrss`` of each rank at the end; the largest rank. It includes the interpreter,
  torch, lightning (and deepspeed for its rows), which every row pays alike (deepspeed a bit more).
- model state: bytes of parameters + gradients + optimizer state (fp32 master copies included)
  that one rank holds just before the last optimizer step (gradients are then present and the
  optimizer state exists), distinct storages counted once; the largest rank. Ours:
  :func:`lightning_zero.model_state_bytes`. DDP and FSDP2: the module's parameters (a DTensor's
  local shard), their ``.grad`` and the optimizer's ``state``. DeepSpeed: the module's parameters
  (``ds_tensor``, the partition, at stage 3), the inner optimizer's parameters (its fp32 master
  partitions) and state as optimizer state, and as gradients every other tensor the engine's ZeRO
  optimizer holds in an attribute (gradient partitions, reduction buckets, ``.grad`` of the masters
  and of the module's parameters). This is what the engine keeps between steps, not only what its
  documentation calls model state, so it is the honest upper count.
- comm MiB/step, two ways, the largest rank's mean over the measured steps:
  ``wire``: bytes the rank wrote to its sockets (``wchar`` of ``/proc/self/io``; gloo talks TCP,
  and with logging, progress bar and checkpoints off nothing else is written in the step), so it
  prices the backend's algorithm too (on gloo a reduce-scatter costs what an all-reduce does).
  ``payload``: bytes handed as input to ``torch.distributed`` collectives, counted by wrapping
  those functions in every rank before any strategy is imported (one wrapper for every
  configuration, DeepSpeed's ``deepspeed.comm`` and FSDP2 included; nested calls count once). DDP
  reduces in C++, past any Python wrapper, so its rows register ``allreduce_hook`` as the DDP
  communication hook: the same all-reduce, issued from Python where the wrapper sees it.
- collectives/step: how many of those ``torch.distributed`` calls a measured step makes (the
  largest rank's mean): latency is paid per call, which is what many small stage-3 gathers cost.

On CPU, "offload" moves nothing (every tensor already lives in host memory): its rows price the
offload code paths (CPU Adam, staging copies), not a memory saving. With ``--device cuda`` (the
default when CUDA is available) ranks use NCCL, no DeepSpeed check is bypassed, and ``wire`` is
not measured (NCCL does not write to sockets on one node); that path is written but untested.

DeepSpeed is not a dependency of lightning_zero; install it for this benchmark only, with no ops
built ahead of time (the CPU Adam op is JIT-built by ninja on first use, about a minute, cached in
``~/.cache/torch_extensions``)::

    DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed

On CPU the ranks run DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) over gloo; the checks
Lightning and DeepSpeed make for CUDA are bypassed in the rank processes only, each one named at
``_bypass_deepspeed_cuda_checks``. A configuration that fails (deepspeed missing, a crash) gets a
row saying why and the others run on. This is a measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# Like step_time.py, the parent imports neither torch nor lightning (a child inherits its parent's
# ru_maxrss); step_time.py itself imports neither at module level, so it is safe to import here.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402 - benchmarks/ is not a package: its own directory goes on sys.path first
from step_time import ModelKnobs, _cpu_seconds, _free_port, _one_line, _positive_int, _rank_environment  # noqa: E402
from step_time import add_model_arguments, model_knobs  # noqa: E402
from step_time import _wait_for_ranks, _warn_if_shared, token_loader  # noqa: E402

MiB = 2**20
BASELINE = "ddp"
TRACED_STEPS = 10  # with --trace-dir: the measured steps each run traces
FLOOR_RANK = "PEERS_FLOOR_RANK"  # the floor's processes are not ranks of a group: which one each is
DEEPSPEED_STAGES: dict[str, dict[str, Any]] = {
    # The keyword arguments of Lightning's own registry presets (DeepSpeedStrategy.register_strategies).
    "ds_stage1": {"stage": 1},
    "ds_stage2": {"stage": 2},
    "ds_stage3": {"stage": 3},
    "ds_stage2_offload": {"stage": 2, "offload_optimizer": True},
    "ds_stage3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}
OURS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
# Each of ours and the DeepSpeed preset at the same stage.
COUNTERPART = dict(zip(OURS, ("ds_stage1", "ds_stage2", "ds_stage3", "ds_stage2_offload", "ds_stage3_offload")))
FLOOR = "floor"
# Interleaved so that each of ours runs next to its DeepSpeed counterpart.
CONFIGS = (
    "ddp",
    FLOOR,
    "ds_stage1", "zero1",
    "ds_stage2", "zero2",
    "ds_stage3", "zero3",
    "ds_stage2_offload", "zero2_offload",
    "ds_stage3_offload", "zero3_offload",
    "fsdp2",
)
PRECISIONS = ("bf16-mixed", "32-true", "16-mixed", "bf16-true")


def _family(config: str) -> str:
    if config in DEEPSPEED_STAGES:
        return "deepspeed"
    if config in OURS:
        return "lightning_zero"
    return {"ddp": "ddp", "fsdp2": "fsdp2", FLOOR: FLOOR}[config]


# ---------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class PeerSpec:
    """One configuration's run, as handed to every rank (JSON on the command line)."""

    config: str
    world_size: int
    warmup: int
    steps: int
    precision: str
    device: str
    """``cpu`` (gloo) or ``cuda`` (nccl)."""
    model: ModelKnobs
    reduce_dtype: str | None = None
    """Ours only: ``ZeroConfig.reduce_dtype`` (None: the preset's, fp32)."""
    trace_to: str | None = None
    """With ``--trace-dir``: the path stem of this run's profiler traces (``<stem>.rank<r>.json``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerSpec:
        values = json.loads(text)
        return cls(**{**values, "model": ModelKnobs(**values["model"])})

    def step_time_spec(self) -> step_time.RunSpec:
        """The same run in step_time.py's terms, for its model builder."""
        return step_time.RunSpec(self.config, self.world_size, self.warmup, self.steps, None, self.model)


@dataclass(frozen=True)
class PeerRankResult(step_time.RankResult):
    """What one rank measured (step_time.py's fields, and the bytes communicated), or why it could not."""

    wire_bytes: list[int] = field(default_factory=list)
    """Per measured step: bytes written to sockets (empty where not measured)."""
    payload_bytes: list[int] = field(default_factory=list)
    """Per measured step: bytes handed to torch.distributed collectives."""
    collective_calls: list[int] = field(default_factory=list)
    """Per measured step: torch.distributed collectives called."""


@dataclass(frozen=True)
class PeerResult:
    """One configuration in one round, reduced over its ranks (the worst rank of each)."""

    config: str
    median_step_s: float | None = None
    peak_rss_bytes: int | None = None
    state_bytes: tuple[int, int, int] | None = None
    """(params, grads, optimizer states) of the rank with the most state."""
    wire_bytes_per_step: float | None = None
    payload_bytes_per_step: float | None = None
    calls_per_step: float | None = None
    num_params: int = 0
    model_source: str = ""
    error: str | None = None

    @property
    def state_total(self) -> int | None:
        return None if self.state_bytes is None else sum(self.state_bytes)


# ---------------------------------------------------------------------------------------- rank side
class _PayloadCounter:
    """Bytes handed as input to ``torch.distributed`` collectives by this process.

    [Note: counting collectives]
    Each wrapped function names the argument that is this rank's contribution (the input of a
    gather or scatter, the tensor of an all-reduce or broadcast); its bytes are counted, then the
    real function runs. A collective that calls another one (``_all_gather_base`` ->
    ``all_gather_into_tensor``, a fallback path) counts once: a thread-local depth guards it.
    """

    # function name -> (position, keyword) of the argument that holds this rank's input
    INPUTS: dict[str, tuple[int, str]] = {
        "all_reduce": (0, "tensor"),
        "all_reduce_coalesced": (0, "tensors"),
        "broadcast": (0, "tensor"),
        "reduce": (0, "tensor"),
        "all_gather": (1, "tensor"),
        "all_gather_into_tensor": (1, "input_tensor"),
        "all_gather_single": (1, "input_tensor"),  # torch >= 2.13's names for the *_tensor ones
        "reduce_scatter_single": (1, "input"),
        "_all_gather_base": (1, "input_tensor"),
        "all_gather_coalesced": (1, "input_tensor_list"),
        "reduce_scatter": (1, "input_list"),
        "reduce_scatter_tensor": (1, "input"),
        "_reduce_scatter_base": (1, "input"),
        "all_to_all_single": (1, "input"),
        "all_to_all": (1, "input_tensor_list"),
        "gather": (0, "tensor"),
        "scatter": (1, "scatter_list"),
        "send": (0, "tensor"),
        "isend": (0, "tensor"),
        "batch_isend_irecv": (0, "p2p_op_list"),  # its isend ops: see _tensor_bytes
    }

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0  # collectives issued (a call inside another one counts once, as its bytes do)
        self._local = threading.local()

    def install(self) -> None:
        """Wraps the functions in ``torch.distributed`` and in ``distributed_c10d``, where they are
        defined (code that imports them from there, or that calls one from another, sees the wrapper)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name, (position, keyword) in self.INPUTS.items():
            original = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, position, keyword)
            for module in (dist, distributed_c10d):
                if hasattr(module, name):
                    setattr(module, name, wrapped)

    def _wrap(self, original: Callable[..., Any], position: int, keyword: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.bytes += _tensor_bytes(args[position] if len(args) > position else kwargs.get(keyword))
                self.calls += 1
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted.__name__ = original.__name__
        return counted


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    if type(value).__name__ == "P2POp":  # batch_isend_irecv: what this rank sends, not what it receives
        return _tensor_bytes(value.tensor) if getattr(value.op, "__name__", "") == "isend" else 0
    return 0


def _wire_bytes() -> int | None:
    """Bytes this process has written with write(2)/writev(2) so far, sockets included (Linux)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class _Storages:
    """Bytes of distinct storages, counted once across every category that shares it."""

    def __init__(self, seen: set[tuple[str, int]]) -> None:
        self._seen = seen
        self.bytes = 0

    def add(self, tensors: Iterator[Any] | Sequence[Any]) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        for tensor in tensors:
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()  # FSDP2: this rank's shard
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes += storage.nbytes()


def _plain_state_bytes(module: Any, optimizers: Sequence[Any]) -> tuple[int, int, int]:
    """DDP and FSDP2: the module's parameters, their gradients, the optimizer's state."""
    seen: set[tuple[str, int]] = set()
    params, grads, states = _Storages(seen), _Storages(seen), _Storages(seen)
    params.add(list(module.parameters()))
    grads.add([p.grad for p in module.parameters()])
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        states.add([v for state in optimizer.state.values() for v in state.values()])
    return params.bytes, grads.bytes, states.bytes


def _deepspeed_state_bytes(engine: Any) -> tuple[int, int, int]:
    """What the DeepSpeed engine holds: see the module docstring for the three categories."""
    import torch

    seen: set[tuple[str, int]] = set()
    params, grads, states = _Storages(seen), _Storages(seen), _Storages(seen)
    module_params = list(engine.module.parameters())
    # Stage 3 keeps each parameter's partition in ds_tensor; p.data is then an empty placeholder.
    params.add([getattr(p, "ds_tensor", None) for p in module_params])
    params.add([p.data for p in module_params])
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    # The inner optimizer steps the fp32 master partitions: its parameters are optimizer state.
    # Stage 3 hands them to its param_groups only inside step(); its state is keyed by them all along.
    masters = [p for group in inner.param_groups for p in group["params"]]
    masters += [key for key in inner.state if isinstance(key, torch.Tensor)]
    states.add(masters)
    states.add([v for state in inner.state.values() for v in state.values()])
    grads.add([p.grad for p in module_params] + [p.grad for p in masters])
    grads.add(list(_held_tensors(vars(zero))))
    return params.bytes, grads.bytes, states.bytes


def _held_tensors(value: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors in a dict/list/tuple tree (three levels): the ZeRO optimizer's attributes, not the
    objects they point to (its timers, groups and coordinator hold no model state)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _held_tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _held_tensors(item, depth + 1)


def _rank_main(spec: PeerSpec, result_path: Path) -> int:
    """Entry point of one rank: trains, measures, writes a ``PeerRankResult`` as JSON."""
    rank = int(os.environ.get("RANK", os.environ.get(FLOOR_RANK, "0")))
    try:
        result = _train_and_measure(spec, rank)
    except Exception as error:  # noqa: BLE001 - reported to the parent as this configuration's row
        import traceback

        traceback.print_exc()
        result = PeerRankResult(rank=rank, error=_one_line(error))
    result_path.write_text(json.dumps(asdict(result)))
    return 0 if result.error is None else 1


def _train_and_measure(spec: PeerSpec, rank: int) -> PeerRankResult:
    import warnings

    import torch

    # Before any strategy (or deepspeed.comm) is imported: see [Note: counting collectives].
    payload = _PayloadCounter()
    payload.install()
    if spec.device == "cpu":
        # As in step_time.py: N ranks on the machine's cores, one thread each.
        torch.set_num_threads(1)
    if _family(spec.config) == "deepspeed" and spec.device == "cpu":
        _bypass_deepspeed_cuda_checks()

    import lightning.pytorch as pl

    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    pl.seed_everything(1234, workers=True, verbose=False)

    model, model_source = step_time._build_model(spec.step_time_spec())
    num_params = sum(p.numel() for p in model.parameters())  # before any sharding
    _adapt_model(model, spec.config)
    probe = _probe_class(_family(spec.config))(spec.warmup, spec.warmup + spec.steps, payload, spec.trace_to, rank)
    trainer = pl.Trainer(
        accelerator="gpu" if spec.device == "cuda" else "cpu",
        devices=1 if spec.config == FLOOR else spec.world_size,
        num_nodes=1,
        strategy=_build_strategy(spec),
        precision=spec.precision,
        max_steps=spec.warmup + spec.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    samples = spec.model.batch_size * spec.world_size * (spec.warmup + spec.steps + 1)
    trainer.fit(model, train_dataloaders=token_loader(
        samples, spec.model.vocab_size, spec.model.block_size, spec.model.batch_size))
    if probe.state_bytes is None:
        raise RuntimeError(f"{spec.config}: training ended before the last optimizer step measured the model state")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    params, grads, optimizer_states = probe.state_bytes
    return PeerRankResult(
        rank=rank,
        step_times_s=probe.step_times_s,
        wire_bytes=probe.wire_bytes if spec.device == "cpu" else [],
        payload_bytes=probe.payload_bytes,
        collective_calls=probe.collective_calls,
        peak_rss_bytes=peak_rss,
        params=params,
        grads=grads,
        optimizer_states=optimizer_states,
        num_params=num_params,
        model_source=model_source,
    )


def _bypass_deepspeed_cuda_checks() -> None:
    """Lets Lightning's DeepSpeedStrategy run on DeepSpeed's CPU accelerator, in this rank only.

    Each bypass, and why it is safe for a measurement:

    1. ``DS_ACCELERATOR=cpu`` is set by the parent for these ranks (``_peer_environment``), so
       DeepSpeed picks its CPU accelerator (gloo when oneCCL is absent, as here) instead of failing
       to find CUDA. Nothing is patched for it.
    2. ``DeepSpeedStrategy.setup_environment`` raises unless the accelerator is a
       ``CUDAAccelerator``; it is replaced by its parent's (``DDPStrategy.setup_environment``),
       i.e. the same method minus that one ``isinstance`` check.
    3. ``DeepSpeedStrategy.setup_distributed`` checks that the devices' CUDA indices are the local
       ranks (``_validate_device_index_selection``); CPU devices have no index, so the check,
       looked up in Lightning's deepspeed module, is made a no-op there.
    4. Lightning calls ``deepspeed.initialize(args=Namespace(device_rank=root_device.index))``, and
       a CPU device's index is None, which DeepSpeedEngine compares with 0; ``deepspeed.initialize``
       is wrapped to pass the local rank instead (what DeepSpeed uses when no ``device_rank`` is
       given; its CPU accelerator maps every rank to the device ``cpu``).
    """
    import argparse as argparse_

    import deepspeed

    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.pytorch.strategies import deepspeed as lightning_deepspeed

    DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment  # type: ignore[method-assign]
    lightning_deepspeed._validate_device_index_selection = lambda parallel_devices: None
    initialize = deepspeed.initialize

    def initialize_on_cpu(*args: Any, **kwargs: Any) -> Any:
        if getattr(kwargs.get("args"), "device_rank", 0) is None:
            kwargs["args"] = argparse_.Namespace(device_rank=int(os.environ["LOCAL_RANK"]))
        return initialize(*args, **kwargs)

    deepspeed.initialize = initialize_on_cpu


def _adapt_model(model: Any, config: str) -> None:
    """Gives the model the hooks a peer needs, by switching it to a subclass that adds only them
    (so step_time.py builds the model, demo or stand-in, unchanged)."""
    base = type(model)
    if config == "fsdp2":

        class FullyShardedGPT(base):  # type: ignore[misc, valid-type]
            def configure_model(self) -> None:
                from torch.distributed.fsdp import fully_shard

                # One unit per block, then the root (embeddings, final norm, the tied head).
                mesh = self.device_mesh["data_parallel"]
                for block in self.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        model.__class__ = FullyShardedGPT
    elif config in DEEPSPEED_STAGES and DEEPSPEED_STAGES[config].get("offload_optimizer"):

        class CpuAdamGPT(base):  # type: ignore[misc, valid-type]
            def configure_optimizers(self) -> Any:
                # ZeRO-Offload wants its own CPU Adam (a torch optimizer is refused by default);
                # same groups, hyper-parameters and schedule as the demo's AdamW.
                import torch
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                configured = super().configure_optimizers()
                adamw = configured["optimizer"]
                defaults = adamw.defaults
                groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in adamw.param_groups]
                optimizer = DeepSpeedCPUAdam(
                    groups,
                    lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                    weight_decay=defaults["weight_decay"], adamw_mode=True,
                )
                schedule = configured["lr_scheduler"]["scheduler"]
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
                return {"optimizer": optimizer, "lr_scheduler": {**configured["lr_scheduler"], "scheduler": scheduler}}

        model.__class__ = CpuAdamGPT


def _build_strategy(spec: PeerSpec) -> Any:
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.config == FLOOR:
        return "auto"  # one device, no process group: nothing is communicated
    if spec.config == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        # Its communication hook is registered by PeerProbe.on_train_start.
        return DDPStrategy(process_group_backend=backend)
    if spec.config == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=spec.world_size, tensor_parallel_size=1,
                                     process_group_backend=backend)
    if spec.config in DEEPSPEED_STAGES:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(process_group_backend=backend,
                                     logging_batch_size_per_gpu=spec.model.batch_size, **DEEPSPEED_STAGES[spec.config])
        # DeepSpeed prints a line every 10 steps by default; nothing may be written in the step (wire bytes).
        strategy.config["steps_per_print"] = 10**9
        return strategy
    import importlib

    importlib.import_module("lightning_zero")  # registers the zero* names
    if spec.reduce_dtype is None:
        return spec.config
    from lightning.pytorch.strategies import StrategyRegistry

    # The registered preset's own arguments, with the reduction dtype changed.
    entry = StrategyRegistry[spec.config]
    params = dict(entry["init_params"])
    params["config"] = replace(params["config"], reduce_dtype=spec.reduce_dtype)
    return entry["strategy"](**params)


def _probe_class(family: str) -> type:
    """The measuring callback, built on first use so that the parent never imports lightning."""
    import lightning.pytorch as pl

    import lightning_zero

    timer_class = step_time._step_timer_class()

    class PeerProbe(timer_class):  # type: ignore[misc, valid-type]
        """step_time.py's timer, plus bytes sent per measured step and the model state just
        before the last optimizer step (rather than at the end, when DeepSpeed has freed its
        gradients)."""

        def __init__(
            self, warmup: int, total_steps: int, payload: _PayloadCounter, trace_to: str | None, rank: int
        ) -> None:
            super().__init__(warmup)
            self.total_steps = total_steps
            self.payload = payload
            self.trace_to = trace_to
            self.rank = rank  # the process's own (the floor's processes are all global rank 0)
            self._profiler: Any = None
            self.wire_bytes: list[int] = []
            self.payload_bytes: list[int] = []
            self.collective_calls: list[int] = []
            self._at_start: tuple[int, int, int] = (0, 0, 0)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            # The same all-reduce as DDP's built-in C++ one, issued from Python where the payload
            # counter sees it. Registered here, on the wrapped module before its first backward,
            # because DDPStrategy(ddp_comm_hook=...) registers hooks on CUDA only.
            if isinstance(trainer.strategy.model, DistributedDataParallel):
                trainer.strategy.model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.trace_to is not None and self._seen_batches == self.warmup:
                import torch

                # Before the timer starts: starting the profiler is not part of a step.
                self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._profiler.__enter__()
            self._at_start = (_wire_bytes() or 0, self.payload.bytes, self.payload.calls)
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self._seen_batches > self.warmup:
                self.wire_bytes.append((_wire_bytes() or 0) - self._at_start[0])
                self.payload_bytes.append(self.payload.bytes - self._at_start[1])
                self.collective_calls.append(self.payload.calls - self._at_start[2])
            if self._profiler is not None and self._seen_batches == min(self.warmup + TRACED_STEPS, self.total_steps):
                self._write_trace()

        def _write_trace(self) -> None:
            """The traced steps as a Chrome trace (timestamps shared by the ranks of a run, so both
            line up in one viewer) and torch.profiler's table of ops by self time."""
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)
            stem = f"{self.trace_to}.rank{self.rank}"
            profiler.export_chrome_trace(f"{stem}.json")
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            Path(f"{stem}.txt").write_text(table + "\n")

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self._seen_batches != self.total_steps - 1:
                return
            strategy = trainer.strategy
            if type(strategy).__name__ == "DeepSpeedStrategy":
                self.state_bytes = _deepspeed_state_bytes(strategy.deepspeed_engine)
            elif isinstance(strategy, lightning_zero.ZeroStrategy):
                state = lightning_zero.model_state_bytes(pl_module, strategy.optimizers)
                self.state_bytes = (state.params, state.grads, state.optimizer_states)
            else:
                self.state_bytes = _plain_state_bytes(pl_module, strategy.optimizers)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            pass  # measured in on_before_optimizer_step instead

    class OurProbe(PeerProbe):
        """For ours: a callback's on_before_optimizer_step may read the gradients, so its mere
        presence makes ZeroStrategy land every reduction before the hook, turning the overlapped
        step off (see [Note: overlapped step]). The state is measured after the last step instead,
        where ours still holds the same gradients (they are dropped by the next zero_grad)."""

        on_before_optimizer_step = pl.Callback.on_before_optimizer_step

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self._seen_batches == self.total_steps:
                state = lightning_zero.model_state_bytes(pl_module, trainer.strategy.optimizers)
                self.state_bytes = (state.params, state.grads, state.optimizer_states)

    return OurProbe if family == "lightning_zero" else PeerProbe


# ---------------------------------------------------------------------------------------- parent side
def _peer_environment(spec: PeerSpec, rank: int, port: int) -> dict[str, str]:
    env = {**os.environ, **_rank_environment(rank, spec.world_size, port)}
    if spec.config == FLOOR:
        # A process on its own: without torchrun's variables Lightning starts no process group.
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(name, None)
        env[FLOOR_RANK] = str(rank)
    # This checkout's lightning_zero, whatever is installed (a rank's sys.path starts at benchmarks/).
    env["PYTHONPATH"] = os.pathsep.join([str(step_time.REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if _family(spec.config) == "deepspeed" and spec.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # bypass 1 of _bypass_deepspeed_cuda_checks
    return env


def run_peer(
    spec: PeerSpec, log_dir: Path, timeout_s: float, round_index: int, trace_dir: Path | None = None
) -> PeerResult:
    """Runs one configuration on ``spec.world_size`` fresh processes and reduces their results."""
    port = _free_port()
    stem = f"{spec.config}.round{round_index}"
    if trace_dir is not None:
        spec = replace(spec, trace_to=str(trace_dir / stem))
    result_paths = [log_dir / f"{stem}.rank{rank}.json" for rank in range(spec.world_size)]
    log_paths = [log_dir / f"{stem}.rank{rank}.log" for rank in range(spec.world_size)]
    processes: list[subprocess.Popen[bytes]] = []
    for rank in range(spec.world_size):
        result_paths[rank].unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--_rank", spec.to_json(), str(result_paths[rank])]
        with log_paths[rank].open("wb") as log:
            processes.append(subprocess.Popen(command, env=_peer_environment(spec, rank, port), stdout=log,
                                              stderr=subprocess.STDOUT, cwd=step_time.REPO_ROOT))
    try:
        timed_out = _wait_for_ranks(processes, timeout_s)
    finally:
        for process in processes:  # also on Ctrl-C: leftover ranks would hold the port and the cores
            if process.poll() is None:
                process.kill()
                process.wait()
    results = [_read_rank_result(rank, result_paths[rank], log_paths[rank], processes[rank])
               for rank in range(spec.world_size)]
    if timed_out:
        results = [r if r.wrote_result else replace(r, error=f"no result within {timeout_s:.0f} s") for r in results]
    return _reduce(spec.config, results)


def _read_rank_result(rank: int, path: Path, log_path: Path, process: subprocess.Popen[bytes]) -> PeerRankResult:
    if path.exists():
        return PeerRankResult(**json.loads(path.read_text()))
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
    reason = tail[0] if tail else "no output"
    return PeerRankResult(rank=rank, error=f"rank exited with code {process.returncode} ({reason[:200]})",
                          wrote_result=False)


def _mean(values: Sequence[int]) -> float | None:
    return statistics.fmean(values) if values else None


def _reduce(config: str, results: Sequence[PeerRankResult]) -> PeerResult:
    # A rank's own exception names the cause; a peer killed while waiting on it comes last.
    errors = sorted((r for r in results if r.error), key=lambda r: not r.wrote_result)
    if errors:
        return PeerResult(config=config, error=errors[0].error)
    per_step = [max(times) for times in zip(*(r.step_times_s for r in results), strict=True)]
    most_state = max(results, key=lambda r: r.params + r.grads + r.optimizer_states)
    wire = [m for m in (_mean(r.wire_bytes) for r in results) if m is not None]
    payload = [m for m in (_mean(r.payload_bytes) for r in results) if m is not None]
    calls = [m for m in (_mean(r.collective_calls) for r in results) if m is not None]
    return PeerResult(
        config=config,
        median_step_s=statistics.median(per_step) if per_step else None,
        peak_rss_bytes=max(r.peak_rss_bytes for r in results),
        state_bytes=(most_state.params, most_state.grads, most_state.optimizer_states),
        wire_bytes_per_step=max(wire) if wire else None,
        payload_bytes_per_step=max(payload) if payload else None,
        calls_per_step=max(calls) if calls else None,
        num_params=results[0].num_params,
        model_source=results[0].model_source,
    )


def _median_or_none(values: Sequence[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _over_rounds(config: str, rounds: Sequence[PeerResult]) -> PeerResult:
    """Each metric's median over the rounds that ran; the first error where none did."""
    ran = [r for r in rounds if r.error is None]
    if not ran:
        return rounds[0]
    states = sorted((r.state_bytes for r in ran if r.state_bytes is not None), key=sum)
    peak = _median_or_none([r.peak_rss_bytes for r in ran])
    return PeerResult(
        config=config,
        median_step_s=_median_or_none([r.median_step_s for r in ran]),
        peak_rss_bytes=None if peak is None else int(peak),
        # The state is the same every round; the lower median keeps the three parts consistent.
        state_bytes=states[(len(states) - 1) // 2] if states else None,
        wire_bytes_per_step=_median_or_none([r.wire_bytes_per_step for r in ran]),
        payload_bytes_per_step=_median_or_none([r.payload_bytes_per_step for r in ran]),
        calls_per_step=_median_or_none([r.calls_per_step for r in ran]),
        num_params=ran[0].num_params,
        model_source=ran[0].model_source,
    )


# ---------------------------------------------------------------------------------------- output
METRICS: tuple[tuple[str, Callable[[PeerResult], float | None]], ...] = (
    ("step time", lambda r: r.median_step_s),
    ("peak RSS", lambda r: r.peak_rss_bytes),
    ("model state", lambda r: r.state_total),
    ("comm (wire)", lambda r: r.wire_bytes_per_step),
    ("comm (payload)", lambda r: r.payload_bytes_per_step),
)


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or not baseline else value / baseline


def _x(value: float | None, baseline: float | None) -> str:
    ratio = _ratio(value, baseline)
    return "—" if ratio is None else f"{ratio:.2f}x"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:.1f}"


def paired_ratios(runs: dict[str, list[PeerResult]]) -> dict[str, list[float]]:
    """Per configuration of ours: its step over its DeepSpeed counterpart's in each round both ran.
    Both run within minutes of each other in a round, so a drift of the machine over the run cancels
    out of these more than out of the ratio of the medians over rounds."""
    paired: dict[str, list[float]] = {}
    for config, counterpart in COUNTERPART.items():
        ratios = [ours.median_step_s / theirs.median_step_s
                  for ours, theirs in zip(runs.get(config, []), runs.get(counterpart, []))
                  if ours.median_step_s and theirs.median_step_s]
        if ratios:
            paired[config] = ratios
    return paired


def _paired_line(paired: dict[str, list[float]]) -> str:
    parts = [f"{config} {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" for config, r in paired.items()]
    return "x DeepSpeed round by round (median, range): " + "; ".join(parts) + "."


def markdown_table(results: Sequence[PeerResult], spec: PeerSpec, rounds: int, command: str, wall_s: float,
                   paired: dict[str, list[float]] | None = None) -> str:
    baseline = next((r for r in results if r.config == BASELINE and r.error is None), None)
    ran = next((r for r in results if r.error is None), None)
    knobs = spec.model
    model_line = step_time.describe_model(ran.num_params, ran.model_source, knobs) if ran else "nothing ran"
    backend = "nccl on CUDA" if spec.device == "cuda" else "gloo on CPU"
    lines = [
        f"Per rank, {spec.world_size} ranks, {backend}, {spec.precision}; median of {spec.steps} steps after"
        f" {spec.warmup} warm-up, median over {rounds} interleaved round(s); ratios (x) are to ddp in this run.",
        "",
        "| config | step ms | x | x floor | x DeepSpeed | peak RSS MiB | x | state MiB (params/grads/optim) | x"
        " | wire MiB/step | x | payload MiB/step | x | collectives/step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    by_config = {r.config: r for r in results if r.error is None}
    floor = by_config.get(FLOOR)
    for r in results:
        label = f"{r.config} ({spec.reduce_dtype} reduce)" if spec.reduce_dtype and r.config in OURS else r.config
        if r.error is not None:
            lines.append(f"| {label} | failed: {r.error.replace('|', '/')} |" + " |" * 12)
            continue
        p, g, o = r.state_bytes or (None, None, None)
        b = baseline
        counterpart = by_config.get(COUNTERPART.get(r.config, ""))
        lines.append(
            f"| {label} | {r.median_step_s * 1e3:.0f} | {_x(r.median_step_s, b and b.median_step_s)}"
            f" | {_x(r.median_step_s, floor and floor.median_step_s)}"
            f" | {_x(r.median_step_s, counterpart.median_step_s) if counterpart else ''}"
            f" | {_mib(r.peak_rss_bytes)} | {_x(r.peak_rss_bytes, b and b.peak_rss_bytes)}"
            f" | {_mib(r.state_total)} ({_mib(p)}/{_mib(g)}/{_mib(o)}) | {_x(r.state_total, b and b.state_total)}"
            f" | {_mib(r.wire_bytes_per_step)} | {_x(r.wire_bytes_per_step, b and b.wire_bytes_per_step)}"
            f" | {_mib(r.payload_bytes_per_step)} | {_x(r.payload_bytes_per_step, b and b.payload_bytes_per_step)}"
            f" | {'—' if r.calls_per_step is None else f'{r.calls_per_step:.0f}'} |"
        )
    lines += [
        "",
        f"GPT n_layer={knobs.n_layer} n_head={knobs.n_head} n_embd={knobs.n_embd} block_size={knobs.block_size}"
        f" vocab={knobs.vocab_size}, batch {knobs.batch_size}/rank: {model_line}.",
        "x floor: step time over the floor's (each rank training alone, no communication, all at once);"
        " x DeepSpeed: ours over Lightning's DeepSpeedStrategy at the same stage.",
        "step: the slowest rank's; RSS, state and comm: the largest rank's. state: held just before the last"
        " optimizer step. wire: bytes written to sockets; payload: bytes handed to torch.distributed collectives;"
        " collectives/step: calls of them (beyond 2 ranks, our gloo all-gathers count one broadcast per rank).",
        *([_paired_line(paired)] if paired else []),
        f"`{command}` ({wall_s:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_machine()})",
    ]
    return "\n".join(lines)


def _machine() -> str:
    import platform

    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {platform.machine()},"
            f" Python {platform.python_version()}")


def write_chart(results: Sequence[PeerResult], path: Path, title: str) -> None:
    """Grouped bars: each configuration's ratio to DDP for every metric; failed ones are left out."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    baseline = next((r for r in results if r.config == BASELINE and r.error is None), None)
    shown = [r for r in results if r.error is None and r.config != BASELINE]
    if baseline is None or not shown:
        print(f"no chart: {'ddp failed' if baseline is None else 'no peer ran'}")
        return
    width = 0.8 / len(METRICS)
    figure, axes = plt.subplots(figsize=(max(8.0, 1.0 * len(shown) + 2), 5.4))
    for index, (name, metric) in enumerate(METRICS):
        ratios = [_ratio(metric(r), metric(baseline)) for r in shown]
        positions = [i + (index - (len(METRICS) - 1) / 2) * width for i in range(len(shown))]
        axes.bar(positions, [0.0 if x is None else x for x in ratios], width, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(shown)), [r.config for r in shown], rotation=30, ha="right")
    axes.set_ylabel("ratio to DDP (same run)")
    axes.set_title(title, fontsize=9)
    # Below the axes: tall bars (DeepSpeed's stage 3 on CPU) would hide under a legend inside them.
    axes.legend(fontsize=8, ncols=len(METRICS), loc="upper center", bbox_to_anchor=(0.5, -0.28))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"chart: {path}")


# ---------------------------------------------------------------------------------------- CLI
QUICK = {"steps": 3, "warmup": 1, "rounds": 1, "n_layer": 2, "n_head": 2, "n_embd": 64, "batch_size": 4}


def _default_device(world_size: int) -> str:
    """``cuda`` when there is a GPU for every rank, else ``cpu``."""
    try:  # probed in a child: the parent keeps torch out of its address space (see the imports)
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, timeout=120)
        return "cuda" if int(probe.stdout.strip() or 0) >= world_size else "cpu"
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return "cpu"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), metavar="CONFIG",
                        help=f"subset of {', '.join(CONFIGS)}; {BASELINE} always runs too, as the reference for the ratios")
    # 20, not fewer: a run is over in seconds, and a stall of the machine lasting one would be most of it.
    parser.add_argument("--steps", type=_positive_int, default=20, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    parser.add_argument("--rounds", type=_positive_int, default=2, help="interleaved repeats of every configuration")
    parser.add_argument("--world-size", type=_positive_int, default=2)
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="ours: ZeroConfig.reduce_dtype (default: the presets' fp32; DeepSpeed reduces in the"
                             " gradients' dtype, bf16 under bf16-mixed)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu: gloo; cuda: nccl, one GPU per rank (untested); auto: cuda with enough GPUs")
    add_model_arguments(parser, batch_size=8)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run of a configuration")
    parser.add_argument("--out", type=Path, default=step_time.REPO_ROOT / "docs" / "images" / "peers.png",
                        help="where the chart goes")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--log-dir", type=Path, default=None, help="where rank logs go (default: a temp dir)")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help=f"write a torch.profiler trace of the first {TRACED_STEPS} measured steps of every run "
                             "there (<config>.round<k>.rank<r>.json and .txt); those steps run slower, so read the "
                             "table of a traced run for nothing but the traces")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.warmup < 1:
        # The first step builds optimizer state and buffers lazily in every strategy.
        parser.error(f"--warmup {args.warmup} must be 1 or more")
    if args.lora_base_dtype == "bf16" and not args.precision.startswith("bf16"):
        parser.error(f"--lora-base-dtype bf16 needs a bf16 --precision (a bf16 weight meets {args.precision} inputs)")
    return args


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--_rank"]:
        return _rank_main(PeerSpec.from_json(argv[1]), Path(argv[2]))
    args = parse_args(argv)
    configs = [c for c in CONFIGS if c in args.configs or c == BASELINE]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="peers_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    knobs = model_knobs(args)
    device = _default_device(args.world_size) if args.device == "auto" else args.device
    base = PeerSpec(BASELINE, args.world_size, args.warmup, args.steps, args.precision, device, knobs,
                    reduce_dtype=args.reduce_dtype)
    cpu_before, started = _cpu_seconds(), time.monotonic()
    runs: dict[str, list[PeerResult]] = {c: [] for c in configs}
    for round_index in range(args.rounds):
        # The first round in the listed order, the others shuffled (see the module docstring).
        order = list(configs) if round_index == 0 else random.Random(round_index).sample(configs, len(configs))
        for config in order:
            previous = runs[config]
            if previous and all(r.error for r in previous):
                continue  # a configuration that failed once (deepspeed missing, a crash) fails again
            print(f"round {round_index + 1}/{args.rounds}: {config} on {args.world_size} ranks ...", flush=True)
            result = run_peer(replace(base, config=config), log_dir, args.timeout, round_index, args.trace_dir)
            if result.error:
                print(f"  {config} failed: {result.error}", flush=True)
            previous.append(result)
    results = [_over_rounds(c, runs[c]) for c in configs]
    wall_s = time.monotonic() - started
    command = " ".join(["python benchmarks/peers.py", *argv])
    table = markdown_table(results, base, args.rounds, command, wall_s, paired_ratios(runs))
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")
    write_chart(results, args.out, f"{args.world_size} ranks, {device}, {args.precision}, GPT"
                f" {knobs.n_layer}x{knobs.n_embd}: ratio to DDP (lower is better)")
    print(f"rank logs: {log_dir}")
    if args.trace_dir is not None:
        print(f"traces: {args.trace_dir}")
    if device == "cpu":
        _warn_if_shared(cpu_before, _cpu_seconds(), wall_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
