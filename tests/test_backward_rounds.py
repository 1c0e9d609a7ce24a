"""One round of reductions per backward, on every rank, whatever the backward reaches.

See [Note: what one backward is] in lightning_zero/zero/reduce.py. Two cases that used to break
the rule, at stages 1, 2 and 3 on two gloo ranks (one spawn):

- a rank whose loss reaches no parameter in some step (the other rank's reductions waited for it
  forever): training must finish and equal DDP, where that rank's loss instead reaches every
  parameter with a zero gradient (the same averaged gradients). Stages 1 and 2 only: at stage 3
  every rank must run the same units, and such a rank raises RanksDisagreeError with the others;
- a reentrant activation checkpoint, whose recompute runs a backward of its own (each one was
  counted as a new backward: three rounds per step): one reduce-scatter per bucket or unit and
  step, and the weights of DDP with the same checkpoint;
- a block used twice, each time under a reentrant checkpoint (stages 1/2): its second gradient
  arrives after its bucket went out, and goes in one more round (the weights of DDP);
- a GAN's two optimizers toggled in turn (stages 1/2): each backward reduces only the buckets of
  the optimizer whose parameters require gradients.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from harness import run_on_ranks
from lightning_zero import Collectives, CountingCollectives, ZeroConfig, ZeroStrategy
from models import VOCAB, fit, max_abs_diff, params_of

WORLD = 2
STEPS = 4
TOLERANCE = 1e-5
CONFIGS: dict[int, dict[str, Any]] = {
    1: {"stage": 1, "reduce_bucket_size": 64},
    2: {"stage": 2, "reduce_bucket_size": 64},
    3: {"stage": 3, "unit_modules": ("Block",)},
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(torch.tanh(self.inner(x)))


class Net(pl.LightningModule):
    """Three blocks; the middle one may run under a reentrant checkpoint; rank 1's loss may reach
    no parameter at all in step 1."""

    def __init__(self, reentrant: bool = False, idle_rank_loss: str | None = None, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(VOCAB) for _ in range(3))
        self.reentrant = reentrant
        self.shared = shared  # the middle block runs twice, each time under a reentrant checkpoint
        self.idle_rank_loss = idle_rank_loss  # None, "no_parameter" or "zero_gradient"

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks[0](x)
        if self.shared:
            x = checkpoint(self.blocks[1], x, use_reentrant=True)
            x = checkpoint(self.blocks[1], x, use_reentrant=True)
        elif self.reentrant and torch.is_grad_enabled():
            x = checkpoint(self.blocks[1], x, use_reentrant=True)
        else:
            x = self.blocks[1](x)
        return self.blocks[2](x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x = nn.functional.one_hot(batch[0], VOCAB).float()
        idle = self.idle_rank_loss is not None and self.global_rank == 1 and batch_idx == 1
        if idle and self.idle_rank_loss == "no_parameter":
            # A loss that reaches no parameter: backward runs but produces no gradient on this rank.
            return x.sum() * 0.0 + torch.zeros((), requires_grad=True)
        loss = self(x).pow(2).mean()
        return loss * 0.0 if idle else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class CountReductions(Callback):
    """Reduce-scatters per optimizer step, and how many buckets or units one round has."""

    def __init__(self, counting: CountingCollectives) -> None:
        self.counting = counting
        self.per_step: list[int] = []
        self.round_size = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counting.reset()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.per_step.append(sum(call.op == "reduce_scatter" for call in self.counting.calls))
        optimizer = trainer.strategy.zero_optimizers[0]
        self.round_size = len(optimizer.layout.tiles())


class GAN(pl.LightningModule):
    """Manual optimization of a generator and a discriminator, toggled in turn as Lightning's GAN
    example does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(VOCAB, VOCAB), nn.Tanh(), nn.Linear(VOCAB, VOCAB))
        self.discriminator = nn.Sequential(nn.Linear(VOCAB, VOCAB), nn.Tanh(), nn.Linear(VOCAB, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real = nn.functional.one_hot(batch[0], VOCAB).float()
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        fake = self.generator(real)
        self.manual_backward(-self.discriminator(fake).mean())
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)

    def configure_optimizers(self) -> Any:
        return (torch.optim.AdamW(self.generator.parameters(), lr=1e-2),
                torch.optim.AdamW(self.discriminator.parameters(), lr=1e-2))


def _gan(stage: int) -> dict[str, Any]:
    counting = CountingCollectives(Collectives())
    counter = CountReductions(counting)
    module = GAN()
    strategy = ZeroStrategy(config=ZeroConfig(**CONFIGS[stage]), collectives=counting)
    trainer = fit(module, strategy, WORLD, steps=2 * STEPS, callbacks=[counter])
    buckets = sum(len(list(o.layout.tiles())) for o in trainer.strategy.zero_optimizers)
    return {"params": params_of(module), "per_step": counter.per_step, "buckets": buckets}


def _zero(stage: int, module: Net) -> dict[str, Any]:
    counting = CountingCollectives(Collectives())
    counter = CountReductions(counting)
    strategy = ZeroStrategy(config=ZeroConfig(**CONFIGS[stage]), collectives=counting)
    fit(module, strategy, WORLD, steps=STEPS, callbacks=[counter])
    return {"params": params_of(module), "per_step": counter.per_step, "round": counter.round_size}


def _fit_gan(strategy: Any) -> GAN:
    module = GAN()
    fit(module, strategy, WORLD, steps=2 * STEPS)
    return module


def _ddp(module: Net, strategy: Any = "ddp") -> dict[str, Tensor]:
    fit(module, strategy, WORLD, steps=STEPS)
    return params_of(module)


def _group_timeouts() -> list[timedelta | None]:
    """The timeouts of the groups Collectives makes beside a group created with 42 s."""
    import torch.distributed as dist

    from lightning_zero.zero.comm import _timeout_of

    group = dist.new_group(timeout=timedelta(seconds=42))
    collectives = Collectives(group)
    return [_timeout_of(group), _timeout_of(collectives._reduce_group)]


def _all_cases() -> dict[str, Any]:
    out: dict[str, Any] = {
        "group_timeouts": _group_timeouts(),
        "idle_ddp": _ddp(Net(idle_rank_loss="zero_gradient")),
        "reentrant_ddp": _ddp(Net(reentrant=True)),
        # DDP takes a parameter reused in two reentrant backward passes only with a static graph.
        "shared_ddp": _ddp(Net(shared=True), DDPStrategy(static_graph=True)),
        "gan_ddp": params_of(_fit_gan("ddp_find_unused_parameters_true")),
    }
    for stage in CONFIGS:
        if stage != 3:
            out[f"idle_zero{stage}"] = _zero(stage, Net(idle_rank_loss="no_parameter"))
            out[f"shared_zero{stage}"] = _zero(stage, Net(shared=True))
            out[f"gan_zero{stage}"] = _gan(stage)
        out[f"reentrant_zero{stage}"] = _zero(stage, Net(reentrant=True))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, WORLD)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_whose_loss_reaches_no_parameter_still_joins_the_reductions(
    ranks: list[dict[str, Any]], stage: int
) -> None:
    for per_rank in ranks:
        result = per_rank[f"idle_zero{stage}"]
        assert max_abs_diff(result["params"], per_rank["idle_ddp"]) < TOLERANCE
        # Every rank sent one round per step, the idle rank's round of step 1 included.
        assert result["per_step"] == [result["round"]] * STEPS
    assert ranks[0][f"idle_zero{stage}"]["per_step"] == ranks[1][f"idle_zero{stage}"]["per_step"]


@pytest.mark.parametrize("stage", sorted(CONFIGS))
def test_a_reentrant_checkpoint_is_one_backward(ranks: list[dict[str, Any]], stage: int) -> None:
    for per_rank in ranks:
        result = per_rank[f"reentrant_zero{stage}"]
        assert result["round"] > 1
        assert result["per_step"] == [result["round"]] * STEPS
        assert max_abs_diff(result["params"], per_rank["reentrant_ddp"]) < TOLERANCE


def test_the_engine_s_groups_wait_as_long_as_the_group_they_serve(ranks: list[dict[str, Any]]) -> None:
    """The reduce group times out when the user's timeout says (a rank that never joins is an
    error then), not after torch's default of 30 minutes."""
    for per_rank in ranks:
        assert per_rank["group_timeouts"] == [timedelta(seconds=42)] * 2


@pytest.mark.parametrize("stage", [1, 2])
def test_a_gradient_after_its_bucket_went_out_goes_in_one_more_round(ranks: list[dict[str, Any]], stage: int) -> None:
    for per_rank in ranks:
        result = per_rank[f"shared_zero{stage}"]
        assert max_abs_diff(result["params"], per_rank["shared_ddp"]) < TOLERANCE
        assert all(count in (result["round"], 2 * result["round"]) for count in result["per_step"])
    assert ranks[0][f"shared_zero{stage}"]["per_step"] == ranks[1][f"shared_zero{stage}"]["per_step"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_toggled_off_optimizer_s_buckets_send_nothing(ranks: list[dict[str, Any]], stage: int) -> None:
    for per_rank in ranks:
        result = per_rank[f"gan_zero{stage}"]
        assert max_abs_diff(result["params"], per_rank["gan_ddp"]) < TOLERANCE
        # one training step = a generator and a discriminator step, each reducing its own buckets once
        assert result["per_step"] == [result["buckets"]] * STEPS
