"""Mixed precision under ZeRO on 2 gloo ranks: loss scaling, skipped steps, accuracy against fp32 DDP."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from harness import launched_environment, run_on_ranks
from lightning_zero import Collectives, ZeroConfig, ZeroOptimizer, ZeroPrecision, ZeroStrategy
from lightning_zero.loss_scaler import LossScaleConfig, LossScaler
from models import TinyGPT, loader

WORLD = 2
OVERFLOW_STEPS = {1, 2, 6}  # injected into rank 1's gradient only
EXPECTED_SCALES = [16, 16, 8, 8, 8, 16, 16, 16]  # initial 2**4, window 3, hysteresis 2
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "gpt")


def _scripted_overflow() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    scaler = LossScaler(LossScaleConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    optimizer = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model, Collectives(),
        ZeroConfig(stage=2, reduce_bucket_size=64), param_dtype=torch.float16, loss_scaler=scaler,
    )
    inject = {"now": False}
    if dist.get_rank() == 1:
        model[2].weight.register_hook(lambda grad: torch.full_like(grad, math.inf) if inject["now"] else grad)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank())).half()
    record: dict[str, list[Any]] = {"scales": [], "skipped": [], "unchanged": [], "changed": []}
    for step in range(len(EXPECTED_SCALES)):
        inject["now"] = step in OVERFLOW_STEPS
        params = [p.detach().clone() for p in model.parameters()]
        master = [b.master.clone() for b in optimizer.buckets]
        holders = [piece.holder for piece in optimizer.param_pieces()]
        state = [{k: v.clone() for k, v in optimizer.state.get(h, {}).items()} for h in holders]
        optimizer.zero_grad()
        (model(data).float().pow(2).mean() * scaler.scale).backward()
        optimizer.step()
        same_params = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        same_master = all(torch.equal(a, b.master) for a, b in zip(master, optimizer.buckets))
        same_state = all(
            torch.equal(v, optimizer.state[h][k]) for s, h in zip(state, holders) for k, v in s.items()
        )
        record["scales"].append(scaler.scale)
        record["skipped"].append(optimizer.last_step_skipped)
        record["unchanged"].append(same_params and same_master and same_state)
        record["changed"].append(not same_params and not same_master)
    record["dtype"] = [p.dtype for p in model.parameters()]
    return record


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _trainer(strategy: Any, steps: int, callbacks: list[Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, **kwargs)


def _skipped_steps_keep_the_schedule(directory: str) -> dict[str, Any]:
    pl.seed_everything(0)
    module = TinyGPT(scheduler=True)
    # 2**28 overflows fp16 gradients: the scale halves (no hysteresis) until they fit.
    plugin = ZeroPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale_power=28, hysteresis=1))
    with launched_environment():
        trainer = _trainer(ZeroStrategy(stage=2, state_dict_type="full"), 20, plugins=[plugin], gradient_clip_val=1.0)
        trainer.fit(module, train_dataloaders=loader())
        path = os.path.join(directory, "fp16.ckpt")
        trainer.save_checkpoint(path)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    checkpoint = torch.load(path, weights_only=False)
    return {
        "global_step": trainer.global_step,
        "skipped": plugin.loss_scaler.skipped_steps,
        "scheduler_steps": scheduler.last_epoch,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "scale": plugin.loss_scaler.scale,
        "saved_scaler": checkpoint.get("ZeroPrecision", {}).get("loss_scaler"),
        "param_dtype_after_fit": next(module.parameters()).dtype,
        "checkpoint_dtypes": {v.dtype for v in checkpoint["state_dict"].values() if v.is_floating_point()},
    }


def _demo_gpt_losses(strategy: Any, steps: int, **kwargs: Any) -> list[float]:
    sys.path.insert(0, EXAMPLES)
    from data import CharDataModule
    from model import GPT

    pl.seed_everything(0)
    data = CharDataModule(block_size=32, batch_size=16)
    module = GPT(vocab_size=data.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64, lr=3e-3)
    losses = Losses()
    with launched_environment():
        trainer = _trainer(strategy, steps, callbacks=[losses], limit_val_batches=0, **kwargs)
        trainer.fit(module, datamodule=data)
    return losses.losses


class ManualModule(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        self.losses.append(loss.item())


def _manual(strategy: Any, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = ManualModule()
    with launched_environment():
        trainer = _trainer(strategy, 10, **kwargs)
        trainer.fit(module, train_dataloaders=loader())
    return {"losses": module.losses, "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}


def _all_cases(directory: str) -> dict[str, Any]:
    return {
        "scripted": _scripted_overflow(),
        "schedule": _skipped_steps_keep_the_schedule(directory),
        "gpt_fp32_ddp": _demo_gpt_losses("ddp", 50),
        "gpt_bf16": _demo_gpt_losses(ZeroStrategy(stage=2), 50, precision="bf16-mixed"),
        "gpt_fp16": _demo_gpt_losses(ZeroStrategy(stage=2), 50, plugins=[ZeroPrecision("16-mixed")]),
        "gpt_fp16_zero3": _demo_gpt_losses(ZeroStrategy(config=ZeroConfig(stage=3, unit_modules=("Block",))), 50,
                                           plugins=[ZeroPrecision("16-mixed")]),
        "manual_fp32": _manual(ZeroStrategy(stage=1)),
        "manual_fp16": _manual(ZeroStrategy(stage=1), plugins=[ZeroPrecision("16-mixed")]),
        "batch_norm": {stage: _batch_norm(stage) for stage in (2, 3)},
    }


class BatchNormNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.net(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _batch_norm(stage: int) -> dict[str, Any]:
    """bf16-mixed holds BatchNorm's weight in bf16; its running statistics follow (else it fails)."""
    pl.seed_everything(0)
    module = BatchNormNet()
    data = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8)
    with launched_environment():
        _trainer(ZeroStrategy(stage=stage), 6, precision="bf16-mixed").fit(module, train_dataloaders=data)
    bn = module.net[1]
    return {"losses": module.losses, "handed_back": {bn.weight.dtype, bn.running_mean.dtype, bn.running_var.dtype}}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        return run_on_ranks(_all_cases, WORLD, directory)


def test_scripted_overflow_on_one_rank_skips_on_every_rank(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        record = per_rank["scripted"]
        assert record["scales"] == EXPECTED_SCALES
        assert [i for i, skipped in enumerate(record["skipped"]) if skipped] == sorted(OVERFLOW_STEPS)
        for step, (unchanged, changed) in enumerate(zip(record["unchanged"], record["changed"])):
            assert unchanged if step in OVERFLOW_STEPS else changed, f"step {step}"
        assert set(record["dtype"]) == {torch.float16}
    assert results[0]["scripted"] == results[1]["scripted"]


def test_skipped_steps_do_not_advance_the_scheduler(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        outcome = per_rank["schedule"]
        assert outcome["skipped"] >= 5  # 2**28 must come down to fp16's range first
        assert outcome["global_step"] == 20  # counts attempted optimizer steps
        assert outcome["scheduler_steps"] == outcome["global_step"] - outcome["skipped"]
        assert outcome["lr"] == pytest.approx(1e-2 * 0.5 ** (outcome["scheduler_steps"] // 3))
        assert outcome["metrics"]["skipped_steps"] == outcome["skipped"]
        assert outcome["metrics"]["loss_scale"] == outcome["scale"] < 2.0**28
        assert math.isfinite(outcome["metrics"]["grad_norm"])
        assert outcome["saved_scaler"]["scale"] == outcome["scale"]
        # trained in fp16, handed back (and checkpointed) in fp32 from the masters, as Lightning's AMP
        assert outcome["param_dtype_after_fit"] == torch.float32
        assert outcome["checkpoint_dtypes"] == {torch.float32}


# Per-step loss tolerance against fp32 DDP on the demo GPT over 50 steps (measured: see the note).
BF16_TOLERANCE = 0.02  # measured max 1.2e-3
FP16_TOLERANCE = 0.005  # measured max 6.7e-5


@pytest.mark.parametrize(
    ("case", "tolerance"),
    [("gpt_bf16", BF16_TOLERANCE), ("gpt_fp16", FP16_TOLERANCE), ("gpt_fp16_zero3", FP16_TOLERANCE)],
)
def test_mixed_precision_tracks_fp32_ddp(results: list[dict[str, Any]], case: str, tolerance: float) -> None:
    for per_rank in results:
        reference, losses = per_rank["gpt_fp32_ddp"], per_rank[case]
        assert len(losses) == len(reference) == 50
        assert reference[-1] < reference[0] - 0.5  # the model really learns in 50 steps
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= tolerance


def test_manual_backward_is_scaled_and_clipping_unscales(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        fp32, fp16 = per_rank["manual_fp32"], per_rank["manual_fp16"]
        assert max(abs(a - b) for a, b in zip(fp16["losses"], fp32["losses"])) <= FP16_TOLERANCE
        assert fp16["metrics"]["grad_norm"] == pytest.approx(fp32["metrics"]["grad_norm"], rel=0.02)
        assert fp16["metrics"]["loss_scale"] == 2.0**16


def _reduce_in_bf16() -> dict[str, Any]:
    from lightning_zero import CountingCollectives

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    counting = CountingCollectives(Collectives())
    optimizer = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model, counting,
        ZeroConfig(stage=2, reduce_bucket_size=64, reduce_dtype="bf16"), param_dtype=torch.bfloat16,
    )
    model(torch.randn(4, 8).bfloat16()).float().pow(2).mean().backward()
    optimizer.step()
    return {
        "reduce_dtypes": {c.dtype for c in counting.calls if c.op == "reduce_scatter"},
        "gather_dtypes": {c.dtype for c in counting.calls if c.op == "all_gather"},
        "master_dtypes": {b.master.dtype for b in optimizer.buckets},
    }


def test_gradients_reduce_in_the_configured_dtype() -> None:
    for outcome in run_on_ranks(_reduce_in_bf16, WORLD):
        assert outcome["reduce_dtypes"] == {torch.bfloat16}
        assert outcome["gather_dtypes"] == {torch.bfloat16}
        assert outcome["master_dtypes"] == {torch.float32}


def test_batch_norm_trains_in_bf16_mixed_and_comes_back_in_fp32(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        for stage, record in per_rank["batch_norm"].items():
            assert len(record["losses"]) == 6 and all(math.isfinite(loss) for loss in record["losses"]), stage
            assert record["handed_back"] == {torch.float32}, stage


class FrozenBase(pl.LightningModule):
    """A frozen Linear (fp32, or already bf16 with ``bf16_base``; trainable but left out of the
    optimizer with ``frozen=False``) and a trained one."""

    def __init__(self, bf16_base: bool, frozen: bool = True) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16).requires_grad_(not frozen)
        if bf16_base:
            self.base.to(torch.bfloat16)
        self.adapter = nn.Linear(16, 16)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.adapter(self.base(batch[0])).float().pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.adapter.parameters(), lr=1e-3)


def _frozen_rounding_warnings() -> dict[str, list[str]]:
    import warnings

    from lightning_zero import FrozenRoundingWarning

    out = {}
    for case, stage, precision, bf16_base, frozen in (
            ("zero2", 2, "bf16-mixed", False, True), ("zero1", 1, "bf16-mixed", False, True),
            ("unoptimized", 2, "bf16-mixed", False, False), ("zero3", 3, "bf16-mixed", False, True),
            ("bf16_base", 2, "bf16-mixed", True, True), ("fp32", 2, "32-true", False, True)):
        torch.manual_seed(0)
        module = FrozenBase(bf16_base, frozen)
        with launched_environment(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), precision=precision,
                                 max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False)
            trainer.fit(module, DataLoader(TensorDataset(torch.randn(4, 16)), batch_size=4))
        out[case] = [str(w.message) for w in caught if issubclass(w.category, FrozenRoundingWarning)]
    return out


def test_frozen_fp32_parameters_rounded_at_stages_1_2_are_named() -> None:
    """Stages 1/2 keep fp32 masters of what the optimizers train only: under -mixed an fp32 weight
    that is frozen, or trainable but in no optimizer, rounds for good, which a warning says once,
    naming it and the ways to keep it exact. Stage 3 (fp32 masters of every piece), a base already
    in bf16 and 32-true lose nothing: no warning."""
    out = run_on_ranks(_frozen_rounding_warnings, 1)[0]
    for case in ("zero2", "zero1", "unoptimized"):
        assert len(out[case]) == 1, out
        assert "2 fp32 parameter(s) that no optimizer trains ('base.weight', 'base.bias') are held in bfloat16" in \
            out[case][0]
        assert "use stage 3" in out[case][0] and "precision='32-true'" in out[case][0]
    assert out["zero3"] == out["bf16_base"] == out["fp32"] == []


class Evaluated(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.seen_dtypes: set[torch.dtype] = set()

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        self.seen_dtypes.add(out.dtype)
        return out

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("loss", self(batch[0]).float().pow(2).mean())

    def test_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("loss", self(batch[0]).float().pow(2).mean())

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])


def _evaluations_keep_the_weights() -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    data = DataLoader(TensorDataset(torch.randn(8, 16)), batch_size=4)
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        for run in ("validate", "test", "predict"):
            torch.manual_seed(0)
            module = Evaluated()
            before = module.linear.weight.detach().clone()
            with launched_environment():
                trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage),
                                     precision="bf16-mixed", logger=False, enable_progress_bar=False,
                                     enable_model_summary=False)
                getattr(trainer, run)(module, data, **({} if run == "predict" else {"verbose": False}))
            out[f"zero{stage}_{run}"] = (module.linear.weight.dtype, torch.equal(module.linear.weight, before),
                                         module.seen_dtypes)
    torch.manual_seed(0)
    with launched_environment():
        fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=2), precision="bf16-mixed")
        fabric.launch()  # the rank exists already: nothing is started
        model = nn.Linear(16, 16)
        before = model.weight.detach().clone()
        fabric_model = fabric.setup_module(model)
        with torch.no_grad():
            output = fabric_model(torch.randn(4, 16))
    out["fabric_inference"] = (model.weight.dtype, torch.equal(model.weight, before), {output.dtype})
    return out


def test_evaluating_at_stages_1_2_under_mixed_precision_keeps_the_weights_exact() -> None:
    """validate/test/predict set no optimizer up, so stages 1/2 hold no fp32 masters: the module
    stays fp32 and runs under autocast (as with DDP), instead of being cast and handed back
    rounded to bf16 for good. Fabric's inference (a module without optimizer) too."""
    out = run_on_ranks(_evaluations_keep_the_weights, 1)[0]
    for case, (dtype, unchanged, seen) in out.items():
        assert dtype == torch.float32 and unchanged, case
        assert seen == {torch.bfloat16}, case  # the compute is bf16 all the same
