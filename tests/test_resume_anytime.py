"""A checkpoint taken at any moment resumes at stages 1, 2 and 3: before the first optimizer step,
mid-accumulation, after a skipped fp16 step; Lightning's learning-rate finder (which saves such
a checkpoint before its sweep and restores it after) at every stage; and the rough edges around
them: the LR-scheduler warning with an offloaded optimizer, prefetch_bytes=0, and a setup error
that teardown must not bury. Two gloo ranks, one spawn."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.tuner import Tuner
from torch import Tensor, nn

from harness import launched_environment, run_on_ranks
from lightning_zero import CPUOffloadPolicy, LossScaleConfig, ZeroConfig, ZeroPrecision, ZeroStrategy
from models import TinyGPT, fit, loader, params_of

WORLD = 2
STAGES = (1, 2, 3)
SCHEDULER_WARNING = "before `optimizer.step()`"


def zero(stage: int, **config: Any) -> ZeroStrategy:
    if stage == 3:
        config.setdefault("min_unit_numel", 500)
    return ZeroStrategy(config=ZeroConfig(stage=stage, **config))


def trainer(strategy: ZeroStrategy, steps: int, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, **kwargs)


def fp16() -> list[ZeroPrecision]:
    # 2**30 overflows fp16 gradients: the first steps are skipped, each halving the scale.
    return [ZeroPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale_power=30, hysteresis=1))]


def training_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """What a checkpoint taken now must give back: whole weights, the optimizer state in torch's
    format, the step, the learning rate and the loss scale (a collective at stage 3)."""
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    with strategy.gathered_params(writeback=False) if strategy.engine is not None else nullcontext():
        params = params_of(module)
    optimizer = trainer.optimizers[0]
    optimizer.consolidate_state_dict()
    precision = strategy.precision_plugin
    scaler = precision.loss_scaler if isinstance(precision, ZeroPrecision) else None
    return {
        "params": params,
        "optimizer": copy.deepcopy(optimizer.state_dict()) if trainer.is_global_zero else None,
        "global_step": trainer.global_step,
        "lr": optimizer.param_groups[0]["lr"],
        "scale": scaler.state_dict()["scale"] if scaler is not None else None,
        "skipped": strategy.zero_optimizers[0].last_step_skipped,
    }


class SaveAt(Callback):
    """Saves ``<name>.ckpt`` at each moment (``"start"``: before the first batch; an int: after
    that batch) and records the state it holds."""

    def __init__(self, directory: str, moments: dict[str, str | int]) -> None:
        self.directory = directory
        self.moments = moments
        self.states: dict[str, dict[str, Any]] = {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for name, moment in self.moments.items():
            if moment == "start":
                self._save(trainer, module, name)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for name, moment in self.moments.items():
            if moment == batch_idx:
                self._save(trainer, module, name)

    def _save(self, trainer: pl.Trainer, module: pl.LightningModule, name: str) -> None:
        with launched_environment():
            trainer.save_checkpoint(os.path.join(self.directory, f"{name}.ckpt"))
        self.states[name] = training_state(trainer, module)


class Restored(Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = training_state(trainer, module)


def _run(strategy: ZeroStrategy, steps: int, callbacks: list[Callback], ckpt_path: str | None = None,
         **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    fitted = trainer(strategy, steps, callbacks, **kwargs)
    with launched_environment():
        fitted.fit(TinyGPT(scheduler=True), train_dataloaders=loader(samples=64), ckpt_path=ckpt_path)
    return fitted


def _resume_cases(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in STAGES:
        folder = os.path.join(directory, f"zero{stage}")
        os.makedirs(folder, exist_ok=True)
        # accumulate_grad_batches=2: batch 2 is the first half of the second step.
        saves = SaveAt(folder, {"before_first_step": "start", "mid_accumulation": 2})
        _run(zero(stage), 3, [saves], accumulate_grad_batches=2)
        skipped = SaveAt(folder, {"after_skipped_step": 0})
        _run(zero(stage), 2, [skipped], plugins=fp16())
        for name, saved in {**saves.states, **skipped.states}.items():
            restored = Restored()
            kwargs: dict[str, Any] = {"plugins": fp16()} if name == "after_skipped_step" else {"accumulate_grad_batches": 2}
            fitted = _run(zero(stage), 4, [restored], ckpt_path=os.path.join(folder, f"{name}.ckpt"), **kwargs)
            out[(stage, name)] = {"saved": saved, "restored": restored.state, "end_step": fitted.global_step}
    return out


def _lr_find(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "zero1": lambda: zero(1),
        "zero2": lambda: zero(2),
        "zero2_offload": lambda: zero(2, offload_optimizer=CPUOffloadPolicy()),
        "zero3": lambda: zero(3),
    }
    for name, make in cases.items():
        pl.seed_everything(0)
        module = TinyGPT()
        before = params_of(module)
        tuner = Tuner(trainer(make(), 100, [], default_root_dir=directory))
        with launched_environment():
            found = tuner.lr_find(module, train_dataloaders=loader(samples=256), min_lr=1e-5, max_lr=1.0,
                                  num_training=20, early_stop_threshold=None)
        out[name] = {"points": len(found.results["lr"]), "suggestion": found.suggestion(), "lr": module.lr,
                     "restored": all(torch.equal(before[k], v) for k, v in params_of(module).items()),
                     "left_behind": sorted(f for f in os.listdir(directory) if f.startswith(".lr_find"))}
    return out


def _scheduler_warnings() -> dict[str, list[str]]:
    out = {}
    for name, config in {
        "zero2_offload": {"stage": 2, "offload_optimizer": CPUOffloadPolicy()},
        "zero3_offload": {"stage": 3, "offload_optimizer": CPUOffloadPolicy(), "offload_params": CPUOffloadPolicy()},
    }.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fitted = fit(TinyGPT(scheduler=True), zero(**config), WORLD, steps=4)
        out[name] = [str(w.message) for w in caught if SCHEDULER_WARNING in str(w.message)]
        out[name + "_lr"] = fitted.optimizers[0].param_groups[0]["lr"]
    return out


def _prefetch_bytes_zero() -> dict[str, dict[str, Tensor]]:
    out = {}
    for name, config in {"bytes_0": {"prefetch_bytes": 0}, "units_0": {"prefetch_units": 0}}.items():
        pl.seed_everything(0)
        module = TinyGPT()
        fit(module, zero(3, **config), WORLD, steps=3)
        out[name] = params_of(module)
    return out


class MetaLlama(pl.LightningModule):
    """A Hugging Face Llama built in configure_model: its rotary ``inv_freq`` buffer is computed
    in __init__, so on the meta device it has no value ZeRO-3 could restore."""

    def configure_model(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[1]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class MetaGPT(TinyGPT):
    def configure_model(self) -> None:
        self.extra = nn.Linear(32, 32)


class WeightNormGPT(TinyGPT):
    """weight_norm on a layer built in configure_model: its weight is computed from parameters of
    another module; with small units, initializing it read pieces already cut (a heap corruption)."""

    def configure_model(self) -> None:
        if not hasattr(self, "extra"):
            self.extra = nn.utils.parametrizations.weight_norm(nn.Linear(32, 32))


class Masked(nn.Module):
    """A parameter with its reset_parameters(), and a buffer only __init__ computes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.register_buffer("mask", (torch.arange(width) % 2).float())

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)


class MaskedGPT(TinyGPT):
    def configure_model(self) -> None:
        if not hasattr(self, "masked"):
            self.masked = Masked(32)


class BackboneAndMetaHead(TinyGPT):
    """A backbone built whole in __init__ (a pretrained one, say: rank-dependent values here) and a
    layer built in configure_model, on the meta device at stage 3."""

    def __init__(self) -> None:
        torch.manual_seed(100 + torch.distributed.get_rank())
        super().__init__()

    def configure_model(self) -> None:
        if not hasattr(self, "extra"):
            self.extra = nn.Linear(32, 32)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # what setup made of the weights stays


def _whole_beside_meta() -> dict[str, Any]:
    """The backbone's weights were re-initialized by reset_parameters (or refused for a module
    without one, MultiheadAttention); they are kept now, rank 0's on every rank as under DDP."""
    module = BackboneAndMetaHead()
    before = params_of(module)
    fit(module, zero(3, min_unit_numel=500), WORLD, steps=1)
    return {"before": before, "after": params_of(module)}


class LBFGSGPT(TinyGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


def _setup_errors() -> dict[str, list[str]]:
    """Each failing setup: the chain of exceptions fit() raised (the error, then its contexts)."""
    out = {}
    for name, module, stage, config in (
        ("llama_meta_buffer", MetaLlama(), 3, {}),
        ("unknown_unit_class", MetaGPT(), 3, {"unit_modules": "NoSuchBlock"}),
        ("refused_optimizer", LBFGSGPT(), 3, {}),
        ("refused_optimizer_zero2", LBFGSGPT(), 2, {}),
        ("weight_norm_in_configure_model", WeightNormGPT(), 3, {"min_unit_numel": 100}),
        ("buffer_from_init_in_configure_model", MaskedGPT(), 3, {"min_unit_numel": 100}),
    ):
        try:
            fit(module, zero(stage, **config), WORLD, steps=2)
            out[name] = []
        except BaseException as error:  # noqa: BLE001 - the test reads the whole chain
            chain: list[str] = []
            current: BaseException | None = error
            while current is not None:
                chain.append(f"{type(current).__name__}: {current}")
                current = current.__context__
            out[name] = chain
    return out


def _all(directory: str) -> dict[str, Any]:
    return {
        "resume": _resume_cases(directory),
        "lr_find": _lr_find(directory),
        "scheduler": _scheduler_warnings(),
        "prefetch": _prefetch_bytes_zero(),
        "setup_errors": _setup_errors(),
        "whole_beside_meta": _whole_beside_meta(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        return run_on_ranks(_all, WORLD, directory)


def _equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("moment", "global_step"), [("before_first_step", 0), ("mid_accumulation", 1),
                                                     ("after_skipped_step", 1)])  # Lightning counts a skipped step
def test_a_checkpoint_taken_at_any_moment_resumes_to_the_state_it_saved(
    results: list[dict[str, Any]], stage: int, moment: str, global_step: int
) -> None:
    result = results[0]["resume"][(stage, moment)]
    saved, restored = result["saved"], result["restored"]
    assert saved["global_step"] == restored["global_step"] == global_step
    assert _equal(saved["params"], restored["params"])
    assert _same_optimizer_state(saved["optimizer"], restored["optimizer"])
    assert saved["lr"] == restored["lr"]
    assert result["end_step"] == 4  # and trains on to the end
    if moment == "before_first_step":
        assert saved["optimizer"]["state"] == {}
    if moment == "after_skipped_step":
        assert saved["skipped"] and saved["optimizer"]["state"] == {}
        assert saved["scale"] == restored["scale"] == 2.0**29  # one skip halved 2**30
    else:
        assert saved["scale"] is None


@pytest.mark.parametrize("case", ["zero1", "zero2", "zero2_offload", "zero3"])
def test_lr_find_sweeps_and_restores_the_weights(results: list[dict[str, Any]], case: str) -> None:
    for rank in results:
        result = rank["lr_find"][case]
        assert result["points"] == 20
        assert result["suggestion"] is not None and 1e-5 <= result["suggestion"] <= 1.0
        assert result["lr"] == result["suggestion"]  # update_attr: the module's lr is the suggestion
        assert result["restored"]
        assert result["left_behind"] == []  # lr_find removes its checkpoint


@pytest.mark.parametrize("case", ["zero2_offload", "zero3_offload"])
def test_an_offloaded_optimizer_step_counts_as_a_step_for_lr_schedulers(results: list[dict[str, Any]], case: str) -> None:
    scheduler = results[0]["scheduler"]
    assert scheduler[case] == []
    assert scheduler[case + "_lr"] == pytest.approx(1e-2 * 0.5)  # StepLR(step_size=3, gamma=0.5) after 4 steps


def test_prefetch_bytes_zero_prefetches_nothing(results: list[dict[str, Any]]) -> None:
    prefetch = results[0]["prefetch"]
    assert _equal(prefetch["bytes_0"], prefetch["units_0"])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("llama_meta_buffer", "ValueError: Buffer 'model.model.rotary_emb.inv_freq' was created on the meta device"
                              " (configure_model under ZeRO-3) in LlamaRotaryEmbedding, which has no parameters"),
        ("unknown_unit_class", "ValueError: ZeroConfig.unit_modules names ['NoSuchBlock'], but the model has no module"
                               " of that class"),
        ("refused_optimizer", "ValueError: ZeRO cannot shard the optimizer LBFGS"),
        ("refused_optimizer_zero2", "ValueError: ZeRO cannot shard the optimizer LBFGS"),
        ("weight_norm_in_configure_model", "ValueError: 'extra' (ParametrizedLinear) is parametrized (weight:"
                                           " torch.nn.utils.parametrize"),
        ("buffer_from_init_in_configure_model", "ValueError: Buffer 'masked.mask' of Masked was created on the meta"
                                                " device (configure_model under ZeRO-3), where the value __init__ gave"
                                                " it does not exist, and Masked.reset_parameters() did not fill it"),
    ],
)
def test_a_setup_error_is_the_last_thing_the_user_sees(results: list[dict[str, Any]], case: str, message: str) -> None:
    for rank in results:
        chain = rank["setup_errors"][case]
        assert len(chain) == 1, chain  # nothing raised while handling it (teardown)
        assert chain[0].startswith(message), chain


def test_a_backbone_built_whole_beside_a_meta_head_keeps_rank_0s_weights_at_stage_3(results: list[dict[str, Any]]) -> None:
    rank0 = results[0]["whole_beside_meta"]["before"]
    for rank in results:
        after = rank["whole_beside_meta"]["after"]
        for name, value in rank0.items():
            assert torch.equal(after[name], value), name
        extra = after["extra.weight"]
        assert torch.isfinite(extra).all() and 0.01 < float(extra.std()) < 1  # reset_parameters ran on it
    assert not torch.equal(results[1]["whole_beside_meta"]["before"]["head.weight"], rank0["head.weight"])
