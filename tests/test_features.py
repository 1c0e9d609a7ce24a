"""Lightning features under ZeRO-1/2 on 2 gloo ranks, against DDP where a reference exists."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import Tensor, nn

from harness import launched_environment, run_on_ranks
from lightning_zero import ZeroConfig, ZeroStrategy
from models import TinyGPT, fit, loader, max_abs_diff, params_of

WORLD = 2
TOLERANCE = 1e-5


class ManualGAN(pl.LightningModule):
    """Two optimizers, manual optimization, toggling, clipping through self.clip_gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        fake = self.generator(batch[0]).mean(1)
        self.toggle_optimizer(opt_d)
        d_loss = self.discriminator(fake.detach()).pow(2).mean() + (self.discriminator(torch.ones_like(fake)) - 1).pow(2).mean()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = (self.discriminator(fake) - 1).pow(2).mean()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=0.05, gradient_clip_algorithm="value")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.lr_schedulers().step()
        self.losses += [d_loss.item(), g_loss.item()]

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.AdamW(self.generator.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=1e-2, momentum=0.9)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)]


class WithUnusedHead(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.unused_head = nn.Linear(32, 3)


def _gan(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = ManualGAN()
    trainer = fit(module, strategy, WORLD, steps=20)  # max_steps counts both optimizers' steps
    return {"losses": module.losses, "params": params_of(module), "lr": trainer.optimizers[0].param_groups[0]["lr"]}


def _checkpoint_round_trip(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, strategy in (("ddp", "ddp"), ("zero", ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700),
                                                                       state_dict_type="full"))):
        pl.seed_everything(0)
        module = TinyGPT(scheduler=True)
        trainer = fit(module, strategy, WORLD, steps=6)
        path = os.path.join(directory, f"{name}.ckpt")
        with launched_environment():
            trainer.save_checkpoint(path)
        trainer.strategy.barrier()
        out[f"{name}_state"] = torch.load(path, weights_only=False)["optimizer_states"][0]
    # Resume both from the DDP checkpoint for 6 more steps: ZeRO loads torch's full format.
    for name, strategy in (("ddp", "ddp"), ("zero", ZeroStrategy(stage=1))):
        pl.seed_everything(0)
        module = TinyGPT(scheduler=True)
        with launched_environment():
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=12, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, train_dataloaders=loader(), ckpt_path=os.path.join(directory, "ddp.ckpt"))
        out[f"{name}_resumed"] = params_of(module)
        out[f"{name}_resumed_losses"] = module.losses
    return out


def _evaluation(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = TinyGPT()
    trainer = fit(module, strategy, WORLD, steps=5)
    with launched_environment():
        val = trainer.validate(module, dataloaders=loader(), verbose=False)
        predictions = trainer.predict(module, dataloaders=loader(samples=16))
        fresh = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy if isinstance(strategy, str) else ZeroStrategy(),
                           logger=False, enable_progress_bar=False, enable_model_summary=False)
        module.eval()
        fresh_val = fresh.validate(module, dataloaders=loader(), verbose=False)
    return {"val": val[0]["val_loss"], "fresh_val": fresh_val[0]["val_loss"], "predictions": torch.cat(predictions),
            "summary_total": ModelSummary(module).total_parameters,
            "numel": sum(p.numel() for p in module.parameters())}


def _unused_parameter() -> dict[str, Any]:
    """A parameter no rank ever uses: skipped by every step, as torch.optim skips it."""
    pl.seed_everything(0)
    module = WithUnusedHead()
    before = params_of(module)
    fit(module, ZeroStrategy(stage=2), WORLD, steps=2)
    after = params_of(module)
    return {"unused_unchanged": all(torch.equal(before[k], after[k]) for k in before if k.startswith("unused_head.")),
            "others_changed": all(not torch.equal(before[k], after[k]) for k in before if k.startswith("head."))}


class WithBatchNorm(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(32)
        self.bn_types: list[str] = []

    def on_train_start(self) -> None:
        self.bn_types.append(type(self.bn).__name__)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.block(self.embed(tokens))
        return self.head(self.norm(self.bn(hidden.transpose(1, 2)).transpose(1, 2)))


def _sync_batchnorm(strategy: Any) -> dict[str, Any]:
    """Trainer(sync_batchnorm=True) converts BatchNorm as DDP does (it was left alone, the running
    statistics then differing between ranks); torch's SyncBatchNorm needs a GPU in training, so on
    the CPU both refuse it, and the layer is reverted at teardown."""
    module = WithBatchNorm()
    try:
        fit(module, strategy, WORLD, steps=1, sync_batchnorm=True)
        error = "no error"
    except Exception as caught:  # noqa: BLE001 - compared with DDP's
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "types": module.bn_types + [type(module.bn).__name__]}


def _all_cases(directory: str) -> dict[str, Any]:
    return {
        "syncbn_ddp": _sync_batchnorm("ddp"),
        **{f"syncbn_zero{stage}": _sync_batchnorm(ZeroStrategy(stage=stage)) for stage in (1, 2, 3)},
        "gan_ddp": _gan("ddp_find_unused_parameters_true"),
        "gan_zero1": _gan(ZeroStrategy(stage=1)),
        "gan_zero2": _gan(ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=100))),
        "checkpoint": _checkpoint_round_trip(directory),
        "eval_ddp": _evaluation("ddp"),
        "eval_zero2": _evaluation(ZeroStrategy(stage=2)),
        "unused": _unused_parameter(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        return run_on_ranks(_all_cases, WORLD, directory)


@pytest.mark.parametrize("stage", [1, 2])
def test_manual_optimization_two_optimizers_clipping_and_scheduler_match_ddp(results: list[dict[str, Any]], stage: int) -> None:
    for per_rank in results:
        zero, ddp = per_rank[f"gan_zero{stage}"], per_rank["gan_ddp"]
        assert len(zero["losses"]) == len(ddp["losses"]) == 20
        assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= TOLERANCE
        assert max_abs_diff(zero["params"], ddp["params"]) <= TOLERANCE
        assert zero["lr"] == ddp["lr"] == pytest.approx(1e-2 * 0.5**5)


def test_checkpoint_holds_full_optimizer_state_equal_to_ddp(results: list[dict[str, Any]]) -> None:
    checkpoint = results[0]["checkpoint"]
    zero, ddp = checkpoint["zero_state"], checkpoint["ddp_state"]
    assert zero["state"].keys() == ddp["state"].keys()
    for index, ddp_entry in ddp["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert zero["state"][index][key].shape == ddp_entry[key].shape
            assert (zero["state"][index][key] - ddp_entry[key]).abs().max() <= TOLERANCE
        assert float(zero["state"][index]["step"]) == float(ddp_entry["step"]) == 6
    assert [g["params"] for g in zero["param_groups"]] == [g["params"] for g in ddp["param_groups"]]


def test_resume_from_a_ddp_checkpoint_matches_ddp(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        checkpoint = per_rank["checkpoint"]
        assert len(checkpoint["zero_resumed_losses"]) == 6
        assert max(abs(a - b) for a, b in zip(checkpoint["zero_resumed_losses"], checkpoint["ddp_resumed_losses"])) <= TOLERANCE
        assert max_abs_diff(checkpoint["zero_resumed"], checkpoint["ddp_resumed"]) <= TOLERANCE


def test_validate_predict_and_summary(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        zero, ddp = per_rank["eval_zero2"], per_rank["eval_ddp"]
        assert zero["val"] == pytest.approx(ddp["val"], abs=TOLERANCE)
        assert zero["fresh_val"] == pytest.approx(zero["val"], abs=TOLERANCE)
        assert torch.equal(zero["predictions"], ddp["predictions"])
        assert zero["summary_total"] == zero["numel"] == ddp["summary_total"]


def test_parameter_without_gradient_is_left_unchanged(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["unused"] == {"unused_unchanged": True, "others_changed": True}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sync_batchnorm_converts_like_ddp(results: list[dict[str, Any]], stage: int) -> None:
    for per_rank in results:
        ddp, zero = per_rank["syncbn_ddp"], per_rank[f"syncbn_zero{stage}"]
        # DDP refuses it when wrapping, torch's SyncBatchNorm at the first forward: both want a GPU
        assert all("SyncBatchNorm" in run["error"] and "GPU" in run["error"] for run in (ddp, zero))
        # trained as SyncBatchNorm, handed back as Lightning's revert makes it (DDP failed before training)
        assert zero["types"] == ["SyncBatchNorm", "_BatchNormXd"] and ddp["types"] == ["_BatchNormXd"]
