"""The overlapped step of stages 1/2 ([Note: overlapped step] in zero/optimizer.py) on 2 gloo ranks.

When every master can be stepped alone (a fused kernel steps it, or the optimizer is one of
torch.optim's elementwise classes with no step hooks) and nothing needs the whole gradient first,
each bucket steps and starts its all-gather as soon as its reduction lands. It must be bit-identical
to the plain step (``ZeroConfig(overlap_step=False)``): parameters, masters and optimizer state,
over several buckets, two param groups, accumulation, a parameter without a gradient and bf16
parameters. Through the Trainer it runs only when nothing between the closure and the step reads
the gradients: a callback's ``on_before_optimizer_step`` or clipping turn it off, and then the
hook sees every reduction landed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness import run_on_ranks
from lightning_zero import Collectives, CPUOffloadPolicy, ZeroConfig, ZeroStrategy
from lightning_zero.zero.engine import make_engine
from lightning_zero.zero.flat import FlatLayout
from lightning_zero.zero.optimizer import SyncState
from models import TinyGPT, fit, params_of

WORLD = 2
STEPS = 3
Groups = list[dict[str, Any]]


def _adamw(groups: Groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=0.05)


class _SubclassedAdamW(torch.optim.AdamW):
    """A subclass: its step() may look at every parameter, so it is not stepped bucket by bucket."""


def _hooked_adamw(groups: Groups) -> torch.optim.Optimizer:
    """Step hooks, which would run once per bucket; they record each call on the optimizer, with
    the sum of what its param groups list then (the masters being stepped)."""
    optimizer = torch.optim.AdamW(groups, lr=0.05)
    optimizer.hook_calls = []  # type: ignore[attr-defined]

    def record(name: str) -> Callable[[Any, Any, Any], None]:
        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            total = sum(float(p.detach().double().sum()) for group in opt.param_groups for p in group["params"])
            opt.hook_calls.append((name, args == (opt,), total))
        return hook

    optimizer.register_step_pre_hook(record("pre"))
    optimizer.register_step_post_hook(record("post"))
    return optimizer


# name: ZeroConfig keywords and the optimizer; every one can step all of its masters bucket by
# bucket: a fused kernel steps them (offload, and AdamW on the CPU by default), or the optimizer's
# own step (fused_adam="off": torch.optim's for-loop, foreach and fused implementations; momentum
# SGD) over each bucket's masters.
CONFIGS: dict[str, tuple[dict[str, Any], Callable[[Groups], torch.optim.Optimizer]]] = {
    "zero1_offload": ({"stage": 1, "offload_optimizer": CPUOffloadPolicy()}, _adamw),
    "zero2_offload": ({"stage": 2, "offload_optimizer": CPUOffloadPolicy()}, _adamw),
    "zero2_fused_cpu": ({"stage": 2, "fused_adam": "cpu"}, _adamw),
    "zero2_half_offload": ({"stage": 2, "fused_adam": "cpu", "offload_optimizer": CPUOffloadPolicy(ratio=0.5)}, _adamw),
    "zero1_adamw": ({"stage": 1}, _adamw),
    "zero2_adamw": ({"stage": 2}, _adamw),
    "zero2_adamw_own_step": ({"stage": 2, "fused_adam": "off"}, _adamw),
    "zero2_adamw_foreach": ({"stage": 2, "fused_adam": "off"},
                            lambda groups: torch.optim.AdamW(groups, lr=0.05, foreach=True)),
    "zero2_adamw_fused": ({"stage": 2, "fused_adam": "off"},
                          lambda groups: torch.optim.AdamW(groups, lr=0.05, fused=True)),
    "zero2_sgd": ({"stage": 2}, lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)),
    "zero2_half_offload_sgd": ({"stage": 2, "offload_optimizer": CPUOffloadPolicy(ratio=0.5)},
                               lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9)),
}
# The same, with optimizers that must keep the plain step: the overlapped one never runs.
PLAIN: dict[str, tuple[dict[str, Any], Callable[[Groups], torch.optim.Optimizer]]] = {
    "zero2_subclassed_adamw": ({"stage": 2}, lambda groups: _SubclassedAdamW(groups, lr=0.05)),
    "zero2_hooked_adamw": ({"stage": 2}, _hooked_adamw),
    "zero2_hooked_adamw_own_step": ({"stage": 2, "fused_adam": "off"}, _hooked_adamw),
}


@contextmanager
def counting_landings() -> Iterator[list[int]]:
    """Counts the overlapped steps (FlatLayout.land_step_publish calls) within the block."""
    calls: list[int] = []
    original = FlatLayout.land_step_publish

    def counted(self: FlatLayout, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(self, *args, **kwargs)

    FlatLayout.land_step_publish = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        FlatLayout.land_step_publish = original  # type: ignore[method-assign]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3))
        self.unused_on_rank_1 = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        out = self.body(x)
        return out + self.unused_on_rank_1(x) if dist.get_rank() == 0 else out


def _engine_run(keywords: dict[str, Any], make_optimizer: Callable[[Groups], torch.optim.Optimizer], overlap: bool,
                dtype: torch.dtype) -> dict[str, Any]:
    model = _Net()
    config = ZeroConfig(reduce_bucket_size=500, overlap_step=overlap, **keywords)
    param_dtype = None if dtype == torch.float32 else dtype
    engine = make_engine(model, Collectives(), config, param_dtype, torch.device("cpu"))
    params = list(model.parameters())
    optimizer = engine.wrap_optimizer(make_optimizer(
        [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]))
    generator = torch.Generator().manual_seed(dist.get_rank())
    with counting_landings() as landings:
        for _ in range(STEPS):
            with optimizer.no_sync():  # accumulation: the first micro-step reduces nothing
                model(torch.randn(4, 6, generator=generator).to(dtype)).float().pow(2).mean().backward()
            model(torch.randn(4, 6, generator=generator).to(dtype)).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [piece.master.detach().clone() for piece in optimizer.param_pieces()],
        "state": [{k: v.clone() for k, v in state.items()} for state in optimizer.state.values()],
        "landings": len(landings),
        "buckets": len(list(optimizer.layout.buckets)),
        "hook_calls": list(getattr(optimizer.optimizer, "hook_calls", [])),
    }
    engine.remove_hooks()
    return out


def _post_hook_views() -> dict[str, Any]:
    """A step post hook reading the module (as an EMA would), under bf16 offload, where the CPU
    step writes this rank's chunk of the parameters before the all-gather fills the others."""
    model = _Net()
    config = ZeroConfig(stage=2, reduce_bucket_size=500, offload_optimizer=CPUOffloadPolicy())
    engine = make_engine(model, Collectives(), config, torch.bfloat16, torch.device("cpu"))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    seen: list[list[Tensor]] = []
    optimizer.optimizer.register_step_post_hook(
        lambda opt, args, kwargs: seen.append([p.detach().clone() for p in model.parameters()]))
    generator = torch.Generator().manual_seed(dist.get_rank())
    after: list[list[Tensor]] = []
    for _ in range(2):
        model(torch.randn(4, 6, generator=generator).to(torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    engine.remove_hooks()
    return {"seen": seen, "after": after}


class _ReadsGradients(pl.Callback):
    """A callback reading the gradients before the step: every reduction must have landed."""

    def __init__(self) -> None:
        self.synced: list[bool] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.synced += [opt.sync_state is SyncState.SYNCED for opt in trainer.strategy.zero_optimizers]


def _trainer_run(overlap: bool, callback: pl.Callback | None = None, offload: bool = True,
                 **trainer_kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = TinyGPT(scheduler=True)
    # Without offload, the optimizer's own step (fused_adam="off"; "auto" is the fused CPU Adam).
    strategy = ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700, overlap_step=overlap,
                                              offload_optimizer=CPUOffloadPolicy() if offload else None,
                                              fused_adam="auto" if offload else "off"))
    with counting_landings() as landings:
        fit(module, strategy, WORLD, steps=6, callbacks=[callback] if callback else [], **trainer_kwargs)
    return {"params": params_of(module), "landings": len(landings)}


def _cases() -> dict[str, Any]:
    engine = {}
    for name, (keywords, make_optimizer) in {**CONFIGS, **PLAIN}.items():
        for dtype in (torch.float32, torch.bfloat16):
            for overlap in (True, False):
                engine[(name, dtype, overlap)] = _engine_run(keywords, make_optimizer, overlap, dtype)
    reader = _ReadsGradients()
    trainer = {
        "overlapped": _trainer_run(True),
        "plain": _trainer_run(False),
        "callback": _trainer_run(True, reader),
        "clipped": _trainer_run(True, gradient_clip_val=0.5),
        "overlapped_own_step": _trainer_run(True, offload=False),  # the optimizer's own step, by bucket
        "plain_own_step": _trainer_run(False, offload=False),
    }
    return {"engine": engine, "trainer": trainer, "reader_synced": reader.synced, "global_hooks": _global_hook_runs(),
            "post_hook": _post_hook_views()}


def _global_hook_runs() -> dict[str, list[str]]:
    """torch's global step hooks around the fused step and around the optimizer's own step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    runs = {}
    for fused_adam in ("auto", "off"):
        calls: list[str] = []
        handles = [register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("pre")),
                   register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append("post"))]  # fmt: skip
        try:
            _engine_run({"stage": 2, "fused_adam": fused_adam}, _adamw, True, torch.float32)
        finally:
            for handle in handles:
                handle.remove()
        runs[fused_adam] = calls
    return runs


_RUNS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    if not _RUNS:
        _RUNS.extend(run_on_ranks(_cases, WORLD))
    return _RUNS


def _assert_identical(a: Any, b: Any, what: str) -> None:
    if isinstance(a, Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _assert_identical(a[key], b[key], f"{what} {key}")
    else:
        assert len(a) == len(b), what
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{what}[{index}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_overlapped_step_is_bit_identical_to_the_plain_one(runs: list[dict[str, Any]], name: str,
                                                                dtype: torch.dtype) -> None:
    for rank, run in enumerate(runs):
        on, off = run["engine"][(name, dtype, True)], run["engine"][(name, dtype, False)]
        assert on["buckets"] > 2  # several buckets land one after the other
        assert on["landings"] == STEPS and off["landings"] == 0
        for key in ("params", "masters", "state"):
            _assert_identical(on[key], off[key], f"rank {rank} {name} {key}")


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_subclass_or_a_hooked_optimizer_keeps_the_plain_step(runs: list[dict[str, Any]], name: str) -> None:
    for rank, run in enumerate(runs):
        on, off = run["engine"][(name, torch.float32, True)], run["engine"][(name, torch.float32, False)]
        assert on["landings"] == 0 and off["landings"] == 0
        _assert_identical(on["params"], off["params"], f"rank {rank} {name} params")
        # ... and it computes what the optimizer it derives from computes bucket by bucket: the
        # subclass its own step, the hooked AdamW the fused CPU Adam that AdamW gets by default.
        twin = "zero2_adamw" if name == "zero2_hooked_adamw" else "zero2_adamw_own_step"
        _assert_identical(on["params"], run["engine"][(twin, torch.float32, True)]["params"], name)


@pytest.mark.parametrize("name", ["zero2_hooked_adamw", "zero2_hooked_adamw_own_step"])
def test_the_users_step_hooks_run_once_per_step_around_the_masters_update(runs: list[dict[str, Any]],
                                                                         name: str) -> None:
    """[Note: the user's step hooks]: the fused kernel updates the masters without the optimizer's
    step(), and the optimizer's own step() is called inside ZeroOptimizer's: either way the hooks
    run once per step, pre then post, with args (optimizer,), seeing the masters (the post hook the
    updated ones, which the next pre hook sees unchanged)."""
    for run in runs:
        for overlap in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                calls = run["engine"][(name, dtype, overlap)]["hook_calls"]
                assert [call[0] for call in calls] == ["pre", "post"] * STEPS, (name, dtype, overlap)
                assert all(call[1] for call in calls)
                totals = [call[2] for call in calls]
                assert all(totals[2 * k] != totals[2 * k + 1] for k in range(STEPS)), totals
                assert all(totals[2 * k + 1] == totals[2 * k + 2] for k in range(STEPS - 1)), totals


def test_through_the_trainer_it_runs_only_when_nothing_reads_the_gradients_first(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        trainer = run["trainer"]
        assert trainer["overlapped"]["landings"] == 6 and trainer["plain"]["landings"] == 0
        _assert_identical(trainer["overlapped"]["params"], trainer["plain"]["params"], "overlapped vs plain")
        # A callback's on_before_optimizer_step, or clipping: every reduction lands before it.
        assert trainer["callback"]["landings"] == 0 and trainer["clipped"]["landings"] == 0
        assert run["reader_synced"] and all(run["reader_synced"])
        _assert_identical(trainer["callback"]["params"], trainer["plain"]["params"], "with a callback")
        assert trainer["overlapped_own_step"]["landings"] == 6 and trainer["plain_own_step"]["landings"] == 0
        _assert_identical(trainer["overlapped_own_step"]["params"], trainer["plain_own_step"]["params"], "own step")


def test_torchs_global_step_hooks_run_once_per_step(runs: list[dict[str, Any]]) -> None:
    """On ZeroOptimizer's own step() only: not once more on the wrapped optimizer's step()."""
    for run in runs:
        for fused_adam, calls in run["global_hooks"].items():
            assert calls == ["pre", "post"] * STEPS, fused_adam


def test_overlap_step_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="overlap_step='yes' must be of type bool"):
        ZeroConfig(overlap_step="yes")  # type: ignore[arg-type]


def test_a_step_post_hook_sees_the_stepped_model_on_every_rank(runs: list[dict[str, Any]]) -> None:
    """[Note: the user's step hooks]: the post hook runs after the all-gather, so what it reads of
    the module is what the step leaves, the same on both ranks (not this rank's chunk new and the
    rest old)."""
    views = [run["post_hook"] for run in runs]
    for view in views:
        assert len(view["seen"]) == len(view["after"]) == 2
        for seen, after in zip(view["seen"], view["after"]):
            assert all(torch.equal(a, b) for a, b in zip(seen, after))
    for first, second in zip(views[0]["seen"], views[1]["seen"]):
        assert all(torch.equal(a, b) for a, b in zip(first, second))
