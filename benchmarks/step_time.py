"""Step time, peak RSS and model-state bytes per rank: DDP vs FSDP vs ZeRO-1/2 on gloo ranks.

    python benchmarks/step_time.py                       # defaults: 2 ranks, about 70 s on 2 idle cores
    python benchmarks/step_time.py --strategies zero2 --steps 20 --n-embd 384 --bucket-size 500000
    python benchmarks/step_time.py --strategies zero3 --lora-rank 8     # frozen GPT, trained adapters
    git worktree add /tmp/before HEAD~3 && \
    python benchmarks/step_time.py --strategies zero1 zero2 zero3 --compare-tree /tmp/before --repeats 3

Every strategy trains the demo GPT (``examples/gpt/model.py``; a comparable nanoGPT defined here
if that file is missing or does not import) for ``--warmup + --steps`` optimizer steps, in a
fresh set of rank processes, and the table compares each strategy with DDP from the same run:

- step ms: median over the measured steps of the slowest rank's ``on_train_batch_start`` ->
  ``on_train_batch_end`` time (forward, backward, gradient reduction, optimizer step, and for
  ZeRO the parameter all-gather). Data loading is outside that window.
- peak RSS: ``getrusage(RUSAGE_SELF).ru_maxrss`` of each rank at the end of training; the
  largest rank is shown. It includes the interpreter, torch and lightning (a few hundred MiB
  that every strategy pays alike), so its ratios are much closer to 1 than model state's.
- params / grads / optim: :func:`lightning_zero.model_state_bytes` on each rank after the last
  step (distinct storages, padding included); the largest rank is shown. It counts what the
  module and the optimizer hold; communication buffers of DDP's reducer and FSDP's unsharded
  parameters during forward/backward are not model state and are not counted.

Ranks are started the way torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set), so
the Trainer inside each one does not relaunch anything. The data is random tokens: a step's cost
does not depend on what the tokens say, and the benchmark then needs no corpus.

Each rank gets one core's worth of threads, so anything else running on the machine is measured
as the strategies' step time: the run ends with a warning when other processes used more than a
tenth of a core on average. This is a measurement, not a test: nothing here asserts.

``--compare-tree DIR`` measures a change: every ZeRO strategy also runs with the package of
another checkout (``DIR/lightning_zero``, e.g. a git worktree of the commit before the change)
first on the ranks' ``PYTHONPATH``, the two alternating ``--repeats`` times in this one run, and
a second table gives each strategy's median step before and after and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# The parent imports neither torch nor lightning, on purpose: a child started by vfork + exec
# (what subprocess does) inherits its parent's ru_maxrss high-water mark, so a parent holding
# torch would put a floor of several hundred MiB under every rank's "peak RSS". The heavy
# imports live in the worker functions below.

REPO_ROOT = Path(__file__).resolve().parents[1]
GPT_EXAMPLE_DIR = REPO_ROOT / "examples" / "gpt"
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
# Not run by default: ZeRO-3 without the exchange of unit numbers before each all-gather
# (ZeroConfig.check_gather_order=False), to price that check against zero3 in the same run.
EXTRA_STRATEGIES = ("zero3_unchecked",)
BASELINE = "ddp"
MiB = 2**20
# Ranks that outlive a failed peer are most likely waiting on a collective it will never join.
FAILED_PEER_GRACE_S = 15.0


# ---------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelKnobs:
    """Size of the GPT and of each rank's batch."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int
    lora_rank: int = 0
    """Above 0: the GPT is frozen and trains a low-rank adapter of this rank beside every Linear
    (see :func:`add_low_rank_adapters`)."""
    lora_base_dtype: str = "fp32"
    """With ``lora_rank``: the dtype the frozen GPT is held in ("bf16": as a base loaded with
    ``torch_dtype=torch.bfloat16``); the adapters stay fp32."""


@dataclass(frozen=True)
class RunSpec:
    """One strategy's run, as handed to every rank (serialized as JSON on the command line)."""

    strategy: str
    world_size: int
    warmup: int
    steps: int
    bucket_size: int | None
    """Elements per gradient bucket (ZeRO's ``reduce_bucket_size``; DDP gets the same bytes)."""
    model: ModelKnobs
    tree: str | None = None
    """Another checkout whose ``lightning_zero`` the ranks import instead of this one's (--compare-tree)."""

    @property
    def label(self) -> str:
        return self.strategy if self.tree is None else f"{self.strategy}@{Path(self.tree).name}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        values = json.loads(text)
        return cls(**{**values, "model": ModelKnobs(**values["model"])})


@dataclass(frozen=True)
class RankResult:
    """What one rank measured, or why it could not."""

    rank: int
    step_times_s: list[float] = field(default_factory=list)
    peak_rss_bytes: int = 0
    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    num_params: int = 0
    model_source: str = ""
    error: str | None = None
    wrote_result: bool = True
    """False when the rank died (or was killed) before writing anything: its error is secondhand."""


@dataclass(frozen=True)
class StrategyResult:
    """One strategy's row: per-rank measurements reduced to the worst rank."""

    strategy: str
    median_step_s: float | None = None
    peak_rss_bytes: int | None = None
    params: int | None = None
    grads: int | None = None
    optimizer_states: int | None = None
    num_params: int = 0
    model_source: str = ""
    error: str | None = None

    @property
    def state_total(self) -> int | None:
        if self.params is None or self.grads is None or self.optimizer_states is None:
            return None
        # Each column is the largest rank's; with uneven shards their sum could exceed every
        # rank's own total by a few padding bytes, which the MiB rounding hides.
        return self.params + self.grads + self.optimizer_states


# ---------------------------------------------------------------------------------------- rank side
def _rank_main(spec: RunSpec, result_path: Path) -> int:
    """Entry point of one rank: trains, measures, writes a ``RankResult`` as JSON."""
    rank = int(os.environ["RANK"])
    try:
        if spec.tree is not None:
            import lightning_zero

            imported = Path(lightning_zero.__file__).resolve()
            if not imported.is_relative_to(Path(spec.tree).resolve()):
                raise RuntimeError(f"--compare-tree {spec.tree}: the ranks imported {imported} instead")
        result = _train_and_measure(spec, rank)
    except Exception as error:  # noqa: BLE001 - reported to the parent as this strategy's row
        import traceback

        traceback.print_exc()
        result = RankResult(rank=rank, error=_one_line(error))
    result_path.write_text(json.dumps(asdict(result)))
    return 0 if result.error is None else 1


def _one_line(error: BaseException) -> str:
    """The exception's type and first sentence: it has to fit in a table cell."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    sentence = lines[0].split(". ")[0].rstrip(".") + "." if lines else ""
    return f"{type(error).__name__}: {sentence}"[:240]


def _train_and_measure(spec: RunSpec, rank: int) -> RankResult:
    import warnings

    import lightning.pytorch as pl
    import torch

    # N ranks share the machine's cores; torch's default of one thread per core in every rank
    # oversubscribes them, and the resulting thrashing would be measured as the strategy's cost.
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    pl.seed_everything(1234, workers=True, verbose=False)

    model, model_source = _build_model(spec)
    # Counted before fit: once FSDP shards the module, its parameters are this rank's pieces.
    num_params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    step_times_s, (params, grads, optimizer_states) = timed_fit(
        model, _build_strategy(spec), spec.world_size, spec.warmup, spec.steps, _build_loader(spec), spec.strategy)
    # ru_maxrss is in KiB on Linux (bytes on macOS, which this CPU benchmark does not target).
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return RankResult(
        rank=rank,
        step_times_s=step_times_s,
        peak_rss_bytes=peak_rss,
        params=params,
        grads=grads,
        optimizer_states=optimizer_states,
        num_params=num_params,
        model_source=model_source,
    )


def _build_strategy(spec: RunSpec) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_zero import ZeroConfig, ZeroStrategy

    if spec.strategy == "ddp":
        kwargs: dict[str, Any] = {}
        if spec.bucket_size is not None:
            kwargs["bucket_cap_mb"] = spec.bucket_size * 4 / MiB  # fp32 gradients
        return DDPStrategy(process_group_backend="gloo", **kwargs)
    if spec.strategy == "fsdp":
        # Lightning's FSDP (FSDP1, use_orig_params=True, one unit for the whole model: no wrap policy).
        return FSDPStrategy(process_group_backend="gloo")
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_unchecked": 3}[spec.strategy]
    bucket = {} if spec.bucket_size is None else {"reduce_bucket_size": spec.bucket_size}
    # Stage 3 gathers one transformer block at a time (both the demo GPT and the stand-in call it Block).
    units = {"unit_modules": ("Block",)} if stage == 3 else {}
    checks = {"check_gather_order": False} if spec.strategy == "zero3_unchecked" else {}
    config = ZeroConfig(stage=stage, **bucket, **units, **checks)
    # popen, the default: it sees the torchrun variables and launches nothing itself.
    return ZeroStrategy(config=config)


def _build_model(spec: RunSpec) -> tuple[Any, str]:
    """The demo GPT if it imports, else the stand-in below; also says which one it is."""
    knobs = spec.model
    kwargs = {
        "vocab_size": knobs.vocab_size,
        "block_size": knobs.block_size,
        "n_layer": knobs.n_layer,
        "n_head": knobs.n_head,
        "n_embd": knobs.n_embd,
    }
    try:
        if not (GPT_EXAMPLE_DIR / "model.py").is_file():
            # Checked first: with the file absent, `import model` could find some other module.
            raise FileNotFoundError(f"{GPT_EXAMPLE_DIR / 'model.py'} does not exist")
        if str(GPT_EXAMPLE_DIR) not in sys.path:
            sys.path.insert(0, str(GPT_EXAMPLE_DIR))
        from model import GPT  # examples/gpt/model.py
    except Exception as error:  # noqa: BLE001 - any import failure means: use the stand-in
        fallback = _fallback_gpt_class()(**kwargs)
        add_low_rank_adapters(fallback, knobs.lora_rank, knobs.lora_base_dtype)
        return fallback, f"benchmark's own nanoGPT (examples/gpt: {_one_line(error)})"
    # Without max_steps the demo asks the trainer for its step budget; give it so that the
    # learning-rate schedule is the same whatever the strategy.
    model = GPT(**kwargs, max_steps=spec.warmup + spec.steps)
    add_low_rank_adapters(model, knobs.lora_rank, knobs.lora_base_dtype)
    return model, "examples/gpt/model.py"


def add_low_rank_adapters(model: Any, rank: int, base_dtype: str = "fp32") -> None:
    """With ``rank`` > 0, freezes ``model`` and gives every ``nn.Linear`` a trained low-rank update
    (``x @ down.T @ up.T`` added to its output; ``up`` starts at zero, as in LoRA), registered on
    the Linear itself after its frozen weight, as peft's LoRA layers hold theirs: at ZeRO-3 each
    unit then mixes frozen and trained parameters. Every strategy sees the same model. The frozen
    parameters are held in ``base_dtype`` ("fp32" or "bf16")."""
    if rank <= 0:
        return
    import torch
    from torch import nn

    model.requires_grad_(False)
    if base_dtype == "bf16":
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for linear in [module for module in model.modules() if isinstance(module, nn.Linear)]:
        down = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5
        linear.register_parameter("lora_down", nn.Parameter(down))
        linear.register_parameter("lora_up", nn.Parameter(torch.zeros(linear.out_features, rank)))
        linear.register_forward_hook(_low_rank_update)


def describe_model(num_params: int, source: str, knobs: ModelKnobs) -> str:
    """The table captions' words for the model that ran."""
    line = f"{num_params / 1e6:.2f} M parameters from {source}"
    if knobs.lora_rank:
        line += f", frozen ({knobs.lora_base_dtype}), with rank-{knobs.lora_rank} adapters beside every Linear"
    return line


def _low_rank_update(linear: Any, args: tuple[Any, ...], output: Any) -> Any:
    return output + (args[0] @ linear.lora_down.t().to(args[0].dtype)) @ linear.lora_up.t().to(args[0].dtype)


def _build_loader(spec: RunSpec) -> Any:
    knobs = spec.model
    # Enough windows that no rank runs out before max_steps; Lightning adds the DistributedSampler.
    samples = knobs.batch_size * spec.world_size * (spec.warmup + spec.steps + 1)
    return token_loader(samples, knobs.vocab_size, knobs.block_size, knobs.batch_size)


def token_loader(samples: int, vocab_size: int, block_size: int, batch_size: int) -> Any:
    """``samples`` random token windows (a fixed seed) with their next tokens, in batches per rank."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab_size, (samples, block_size + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (N, T) inputs, (N, T) next tokens
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0)


def timed_fit(model: Any, strategy: Any, world_size: int, warmup: int, steps: int, loader: Any,
              name: str, callbacks: Sequence[Any] = ()) -> tuple[list[float], tuple[int, int, int]]:
    """Fits ``model`` for ``warmup + steps`` optimizer steps on ``world_size`` CPU ranks (no
    validation, logging or checkpoints): the timed steps' durations and the model-state bytes
    (params, grads, optimizer states) at the end of training. ``callbacks`` run before the timer's
    hooks, so what they do at a batch's end is inside its time."""
    import lightning.pytorch as pl

    timer = _step_timer_class()(warmup)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=strategy,
        precision="32-true",
        max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer],
    )
    trainer.fit(model, train_dataloaders=loader)
    if timer.state_bytes is None:
        raise RuntimeError(f"{name}: training ended before on_train_end measured the model state")
    return timer.step_times_s, timer.state_bytes


def _step_timer_class() -> type:
    """The timing callback, built on first use so that the parent never imports lightning."""
    import lightning.pytorch as pl

    import lightning_zero

    class StepTimer(pl.Callback):
        """Times each optimizer step (one batch: no accumulation) and, at the end, the model state."""

        def __init__(self, warmup: int) -> None:
            self.warmup = warmup
            self.step_times_s: list[float] = []
            self.state_bytes: tuple[int, int, int] | None = None
            self._seen_batches = 0
            self._started: float | None = None

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            assert self._started is not None
            elapsed = time.perf_counter() - self._started
            self._seen_batches += 1
            # The first steps pay for lazy allocation (optimizer state, buckets, allocator growth).
            if self._seen_batches > self.warmup:
                self.step_times_s.append(elapsed)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # Before the strategy's teardown, while gradients and optimizer state are still held.
            state = lightning_zero.model_state_bytes(pl_module, trainer.strategy.optimizers)
            self.state_bytes = (state.params, state.grads, state.optimizer_states)

    return StepTimer


def _fallback_gpt_class() -> type:
    """A nanoGPT comparable to the demo: pre-LN blocks, SDPA attention, tied head, AdamW."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    class Block(nn.Module):
        def __init__(self, n_embd: int, n_head: int) -> None:
            super().__init__()
            self.n_head = n_head
            self.ln_1 = nn.LayerNorm(n_embd)
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
            self.attn_proj = nn.Linear(n_embd, n_embd)
            self.ln_2 = nn.LayerNorm(n_embd)
            self.fc = nn.Linear(n_embd, 4 * n_embd)
            self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

        def forward(self, x: Tensor) -> Tensor:
            batch, time_, channels = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(channels, dim=2)
            # (B, T, C) -> (B, n_head, T, head_dim)
            q, k, v = (t.view(batch, time_, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, time_, channels)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))

    class FallbackGPT(pl.LightningModule):
        def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab_size, n_embd)
            self.wpe = nn.Embedding(block_size, n_embd)
            self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as in the demo

        def forward(self, idx: Tensor) -> Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # parameters() yields the tied weight once, so the optimizer steps it once.
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)

    return FallbackGPT


# ---------------------------------------------------------------------------------------- parent side
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets: Lightning then treats the processes as launched externally."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "NODE_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world_size),
        # Also caps OpenMP pools torch.set_num_threads does not reach (e.g. in MKL/oneDNN init).
        "OMP_NUM_THREADS": "1",
    }


def run_strategy(spec: RunSpec, log_dir: Path, timeout_s: float) -> StrategyResult:
    """Runs one strategy on ``spec.world_size`` fresh processes and reduces their results."""
    port = _free_port()
    processes: list[subprocess.Popen[bytes]] = []
    result_paths = [log_dir / f"{spec.label}.rank{rank}.json" for rank in range(spec.world_size)]
    log_paths = [log_dir / f"{spec.label}.rank{rank}.log" for rank in range(spec.world_size)]
    for rank in range(spec.world_size):
        result_paths[rank].unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--_rank", spec.to_json(), str(result_paths[rank])]
        env = {**os.environ, **_rank_environment(rank, spec.world_size, port)}
        if spec.tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([spec.tree, *filter(None, [os.environ.get("PYTHONPATH")])])
        with log_paths[rank].open("wb") as log:
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT))
    try:
        timed_out = _wait_for_ranks(processes, timeout_s)
    finally:
        # Also on Ctrl-C: ranks left behind would hold the port and two cores.
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = [
        _read_rank_result(rank, path, log_paths[rank], processes[rank]) for rank, path in enumerate(result_paths)
    ]
    if timed_out:
        results = [
            r if r.wrote_result else RankResult(rank=r.rank, error=f"no result within {timeout_s:.0f} s")
            for r in results
        ]
    return _reduce(spec.label, results)


def _wait_for_ranks(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    """Waits for every rank; once one fails, gives the rest a short grace and then kills them.

    Returns whether it timed out: killed ranks that were still running with no failed peer.
    """
    deadline = time.monotonic() + timeout_s
    peer_failed = False
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes):
            return False
        if not peer_failed and any(code not in (None, 0) for code in codes):
            peer_failed = True
            deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
        time.sleep(0.1)
    return not peer_failed  # the caller kills what is still running


def _read_rank_result(rank: int, path: Path, log_path: Path, process: subprocess.Popen[bytes]) -> RankResult:
    if path.exists():
        return RankResult(**json.loads(path.read_text()))
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
    reason = tail[0] if tail else "no output"
    return RankResult(
        rank=rank, error=f"rank exited with code {process.returncode} ({reason[:200]})", wrote_result=False
    )


def _reduce(strategy: str, results: Sequence[RankResult]) -> StrategyResult:
    # A rank's own exception names the cause; a peer killed while waiting on it only saw the
    # collective break, so its "exited with code -9" comes last.
    errors = sorted((r for r in results if r.error), key=lambda r: not r.wrote_result)
    if errors:
        return StrategyResult(strategy=strategy, error=errors[0].error)
    # A step ends when its slowest rank ends: the others wait for it in the next collective.
    per_step = [max(times) for times in zip(*(r.step_times_s for r in results), strict=True)]
    return StrategyResult(
        strategy=strategy,
        median_step_s=statistics.median(per_step) if per_step else None,
        peak_rss_bytes=max(r.peak_rss_bytes for r in results),
        params=max(r.params for r in results),
        grads=max(r.grads for r in results),
        optimizer_states=max(r.optimizer_states for r in results),
        num_params=results[0].num_params,
        model_source=results[0].model_source,
    )


# ---------------------------------------------------------------------------------------- table
def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MiB:.1f}"


def _ratio(value: float | None, baseline: float | None) -> str:
    if value is None or not baseline:
        return "—"
    return f"{value / baseline:.2f}x"


def print_table(results: Sequence[StrategyResult], spec: RunSpec, command: str, wall_s: float) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    ran = next((r for r in results if r.error is None), None)
    knobs = spec.model
    model_line = describe_model(ran.num_params, ran.model_source, knobs) if ran else "no strategy ran"
    table = Table(
        title=(
            f"Per rank, {spec.world_size} gloo ranks on CPU, median of {spec.steps} steps after {spec.warmup}"
            " warm-up; ratios are to ddp in this run"
        ),
        caption=(
            f"GPT n_layer={knobs.n_layer} n_head={knobs.n_head} n_embd={knobs.n_embd} block_size={knobs.block_size}"
            f" vocab={knobs.vocab_size}, batch {knobs.batch_size}/rank: {model_line}; AdamW, fp32.\n"
            "step: the slowest rank's; RSS and model state (MiB): the largest rank's.\n"
            f"{command}   ({wall_s:.0f} s)"
        ),
        caption_justify="left",
    )
    table.add_column("strategy", style="bold")
    # Capped: a failed strategy's reason wraps here instead of stretching every row.
    table.add_column("step ms", justify="right", max_width=40)
    for name in ("×ddp", "peak RSS", "×ddp", "params", "grads", "optim", "state", "×ddp"):
        table.add_column(name, justify="right")
    baseline = next((r for r in results if r.strategy == BASELINE and r.error is None), None)
    for result in results:
        if result.error is not None:
            verb = "did not run on CPU" if result.strategy == "fsdp" else "failed"
            # rich has no colspan: the reason wraps inside the step column, left-aligned to read as prose.
            table.add_row(result.strategy, Text(f"{verb}: {result.error}", style="yellow", justify="left"))
            continue
        table.add_row(
            result.strategy,
            f"{result.median_step_s * 1e3:.0f}" if result.median_step_s is not None else "—",
            _ratio(result.median_step_s, baseline.median_step_s if baseline else None),
            _mib(result.peak_rss_bytes),
            _ratio(result.peak_rss_bytes, baseline.peak_rss_bytes if baseline else None),
            _mib(result.params),
            _mib(result.grads),
            _mib(result.optimizer_states),
            _mib(result.state_total),
            _ratio(result.state_total, baseline.state_total if baseline else None),
        )
    console = Console()
    if not console.is_terminal:
        # Piped or redirected, rich assumes 80 columns; a file has room for the whole row.
        console = Console(width=max(console.width, 120))
    console.print(table)
    _print_stage3_ratios(results, console)


def _print_stage3_ratios(results: Sequence[StrategyResult], console: Any) -> None:
    """ZeRO-3 against ZeRO-2 and FSDP, from the same run (the issue asks for both ratios)."""
    by_name = {r.strategy: r for r in results}
    zero3 = by_name.get("zero3")
    if zero3 is None or zero3.error is not None:
        return
    for other in ("zero2", "fsdp", "zero3_unchecked"):
        reference = by_name.get(other)
        if reference is None:
            continue
        if reference.error is not None:
            console.print(f"zero3 vs {other}: no ratio, {other} did not run on CPU: {reference.error}")
            continue
        console.print(
            f"zero3 vs {other}: step {_ratio(zero3.median_step_s, reference.median_step_s)},"
            f" params {_ratio(zero3.params, reference.params)},"
            f" model state {_ratio(zero3.state_total, reference.state_total)}, peak RSS"
            f" {_ratio(zero3.peak_rss_bytes, reference.peak_rss_bytes)}"
        )


def _median_result(runs: Sequence[StrategyResult]) -> StrategyResult:
    """The run with the median step time (a failed run, if any failed)."""
    failed = [r for r in runs if r.error is not None]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r.median_step_s or 0.0)
    return ordered[(len(ordered) - 1) // 2]


def _each(runs: Sequence[StrategyResult]) -> str:
    """Every run's median step in ms, in the order they ran: the spread the medians hide."""
    return " ".join(f"{r.median_step_s * 1e3:.0f}" for r in runs if r.median_step_s is not None)


def print_comparison(pairs: dict[str, tuple[list[StrategyResult], list[StrategyResult]]], tree: Path) -> None:
    """Each ZeRO strategy's median step with the other checkout's package (before) and this one's (after)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"before = {tree}, after = {REPO_ROOT}; medians of the alternating runs, same machine, one run")
    for name in ("strategy", "before ms", "after ms", "after/before", "before runs ms", "after runs ms"):
        table.add_column(name, justify="left" if name == "strategy" else "right")
    for strategy, (before_runs, after_runs) in pairs.items():
        before, after = _median_result(before_runs), _median_result(after_runs)
        if before.error or after.error:
            table.add_row(strategy, "—", "—", f"failed: {before.error or after.error}")
            continue
        assert before.median_step_s is not None and after.median_step_s is not None
        table.add_row(strategy, f"{before.median_step_s * 1e3:.1f}", f"{after.median_step_s * 1e3:.1f}",
                      _ratio(after.median_step_s, before.median_step_s), _each(before_runs), _each(after_runs))
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))
    console.print(table)


# ---------------------------------------------------------------------------------------- noise
@dataclass(frozen=True)
class CpuSeconds:
    """CPU time used so far by the whole machine, and by this process with its reaped children."""

    machine: float | None
    ours: float


def _cpu_seconds() -> CpuSeconds:
    machine: float | None
    try:
        # First line of /proc/stat: user nice system idle iowait irq softirq steal ... in clock ticks.
        ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        user, nice, system, _idle, _iowait, irq, softirq = ticks
        machine = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        machine = None  # not Linux: no warning, the numbers are printed all the same
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return CpuSeconds(machine, ours)


def _warn_if_shared(before: CpuSeconds, after: CpuSeconds, wall_s: float) -> None:
    """Says so when other processes used the CPU during the run: ranks get a core each, and
    whatever else ran was measured as the strategies' step time."""
    if before.machine is None or after.machine is None or wall_s <= 0:
        return
    others_s = (after.machine - before.machine) - (after.ours - before.ours)
    if others_s / wall_s > 0.1:
        print(
            f"warning: other processes used {others_s:.0f} CPU-s during this {wall_s:.0f} s run"
            f" ({others_s / wall_s:.1f} cores on average); step times are not clean, run again on an idle machine"
        )


# ---------------------------------------------------------------------------------------- CLI
def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, batch_size: int) -> None:
    """The GPT's size and each rank's batch (see :class:`ModelKnobs`), as every benchmark on the
    demo GPT takes them; :func:`model_knobs` reads them back."""
    parser.add_argument("--n-layer", type=_positive_int, default=4)
    parser.add_argument("--n-head", type=_positive_int, default=4)
    parser.add_argument("--n-embd", type=_positive_int, default=256)
    parser.add_argument("--block-size", type=_positive_int, default=64)
    parser.add_argument("--vocab-size", type=_positive_int, default=65)
    parser.add_argument("--batch-size", type=_positive_int, default=batch_size, help="samples per rank per step")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="above 0: freeze the GPT and train a low-rank adapter of this rank beside every Linear")
    parser.add_argument("--lora-base-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="with --lora-rank: the dtype the frozen GPT is held in (bf16: as a base loaded in bf16)")


def model_knobs(args: argparse.Namespace) -> ModelKnobs:
    """The :class:`ModelKnobs` of arguments declared by :func:`add_model_arguments`."""
    return ModelKnobs(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size, args.batch_size,
                      max(0, args.lora_rank), args.lora_base_dtype)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=_positive_int, default=50, help="measured optimizer steps per strategy")
    parser.add_argument("--warmup", type=int, default=5, help="steps run first and not measured")
    parser.add_argument("--world-size", type=_positive_int, default=2, help="gloo ranks per strategy")
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES + EXTRA_STRATEGIES,
        default=list(STRATEGIES),
        help=f"subset to run; {BASELINE} is always run too, as the reference for the ratios",
    )
    add_model_arguments(parser, batch_size=16)
    parser.add_argument(
        "--bucket-size",
        type=_positive_int,
        default=None,
        help="gradient bucket in elements: ZeRO's reduce_bucket_size, and the same bytes as DDP's"
        " bucket_cap_mb (default: each strategy's own default)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per strategy")
    parser.add_argument("--log-dir", type=Path, default=None, help="where rank logs go (default: a temp dir)")
    parser.add_argument(
        "--compare-tree",
        type=Path,
        default=None,
        help="another checkout (with lightning_zero/ in it): each ZeRO strategy also runs on its package, and a"
        " before/after table compares the two from this run",
    )
    parser.add_argument("--repeats", type=_positive_int, default=1, help="with --compare-tree: alternating runs of each")
    args = parser.parse_args(argv)
    if args.compare_tree is not None and not (args.compare_tree / "lightning_zero" / "__init__.py").is_file():
        parser.error(f"--compare-tree {args.compare_tree} has no lightning_zero/__init__.py: give a checkout's root")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be 0 or more")
    if args.lora_base_dtype == "bf16":
        parser.error("--lora-base-dtype bf16 needs a bf16 precision; this benchmark runs 32-true (use peers.py)")
    return args


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--_rank"]:
        return _rank_main(RunSpec.from_json(argv[1]), Path(argv[2]))
    args = parse_args(argv)
    strategies = [name for name in STRATEGIES + EXTRA_STRATEGIES if name in args.strategies or name == BASELINE]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="step_time_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    knobs = model_knobs(args)
    cpu_before = _cpu_seconds()
    started = time.monotonic()
    results: list[StrategyResult] = []
    baseline = RunSpec(BASELINE, args.world_size, args.warmup, args.steps, args.bucket_size, knobs)
    pairs: dict[str, tuple[list[StrategyResult], list[StrategyResult]]] = {}
    for name in strategies:
        spec = replace(baseline, strategy=name)
        if args.compare_tree is None or not name.startswith("zero"):
            print(f"running {name} on {args.world_size} ranks ...", flush=True)
            results.append(run_strategy(spec, log_dir, args.timeout))
            continue
        before_runs, after_runs = pairs.setdefault(name, ([], []))
        other = replace(spec, tree=str(args.compare_tree.resolve()))
        for repeat in range(args.repeats):
            # Alternating which goes first spreads any drift of the machine over both.
            for which in ((other, spec) if repeat % 2 == 0 else (spec, other)):
                print(f"running {which.label} on {args.world_size} ranks ({repeat + 1}/{args.repeats}) ...", flush=True)
                (before_runs if which.tree else after_runs).append(run_strategy(which, log_dir, args.timeout))
        results.append(_median_result(after_runs))
    command = " ".join(["python benchmarks/step_time.py", *argv])
    wall_s = time.monotonic() - started
    print_table(results, baseline, command, wall_s)
    if pairs:
        print_comparison(pairs, args.compare_tree)
        results += [run for before_runs, _ in pairs.values() for run in before_runs]
    print(f"rank logs: {log_dir}")
    _warn_if_shared(cpu_before, _cpu_seconds(), wall_s)
    # FSDP is allowed not to run on CPU; any other failure is worth a non-zero exit.
    return 1 if any(r.error and r.strategy != "fsdp" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
