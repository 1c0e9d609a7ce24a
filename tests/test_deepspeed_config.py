"""DeepSpeed JSON configs read into ZeroConfig, precision and the Trainer's settings
(lightning_zero/deepspeed_config.py, [Note: DeepSpeed config import]), on DeepSpeed's and Hugging
Face's typical configs (tests/data/deepspeed/), and through ZeroStrategy on 2 gloo ranks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from harness import run_on_ranks
from lightning_zero import (
    CPUOffloadPolicy,
    DeepSpeedConfigWarning,
    LossScaleConfig,
    ParallelConfig,
    ZeroConfig,
    ZeroPrecision,
    ZeroStrategy,
    read_deepspeed_config,
)

DATA = Path(__file__).parent / "data" / "deepspeed"
WORLD = 2


def _config(**zero: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": 2, **zero}}


# ---------------------------------------------------------------- the typical configs
def test_hugging_face_zero2_config() -> None:
    settings = read_deepspeed_config(DATA / "hf_zero2.json")
    assert settings.zero == ZeroConfig(stage=2, reduce_bucket_size=200_000_000,
                                       offload_optimizer=CPUOffloadPolicy(pin_memory=True))
    # every "auto" leaves the Trainer's and the DataLoader's values alone
    assert (settings.precision, settings.loss_scale, settings.gradient_clipping, settings.gradient_accumulation_steps,
            settings.micro_batch_size, settings.train_batch_size) == (None,) * 6
    assert set(settings.unused) == {"optimizer", "scheduler", "steps_per_print"}
    assert settings.unknown == ()


def test_hugging_face_zero3_config() -> None:
    settings = read_deepspeed_config(DATA / "hf_zero3.json")
    policy = CPUOffloadPolicy(pin_memory=True)
    # prefetch "auto" is DeepSpeed's 5e7 elements, under max_live_parameters=1e9, in fp32 bytes
    assert settings.zero == ZeroConfig(stage=3, offload_optimizer=policy, offload_params=policy,
                                       prefetch_bytes=200_000_000)
    assert set(settings.unused) == {
        "optimizer", "scheduler", "steps_per_print", "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_gather_16bit_weights_on_model_save"}
    message = settings.ignored_keys_message()
    assert message is not None and "hf_zero3.json" in message and "lightning-zero consolidate" in message


def test_deepspeed_examples_zero1_fp16_config() -> None:
    settings = read_deepspeed_config(DATA / "cifar_zero1_fp16.json")
    assert settings.zero == ZeroConfig(stage=1, reduce_bucket_size=50_000_000)
    assert settings.precision == "16-mixed"
    assert settings.loss_scale == LossScaleConfig(initial_scale_power=15, loss_scale_window=500, hysteresis=2,
                                                  min_loss_scale=1)
    assert (settings.gradient_clipping, settings.train_batch_size) == (1.0, 16)
    # switched-off features (prescale_gradients: false, cpu_offload: false, ...) are not reported
    assert set(settings.unused) == {"optimizer", "scheduler", "steps_per_print"}


def test_lightning_docs_zero3_offload_bf16_config() -> None:
    settings = read_deepspeed_config(DATA / "lightning_zero3_offload_bf16.json")
    policy = CPUOffloadPolicy(pin_memory=True)
    assert settings.zero == ZeroConfig(stage=3, reduce_bucket_size=500_000, allow_unknown_optimizer=True,
                                       param_persistence_threshold=100_000, prefetch_bytes=10_000_000,
                                       offload_optimizer=policy, offload_params=policy)
    assert (settings.precision, settings.gradient_clipping, settings.gradient_accumulation_steps,
            settings.micro_batch_size) == ("bf16-mixed", 1.0, 2, 4)
    assert settings.ignored_keys_message() is None


# ---------------------------------------------------------------- each key
@pytest.mark.parametrize(("values", "expected"), [
    (_config(reduce_bucket_size=5e5), ZeroConfig(stage=2, reduce_bucket_size=500_000)),
    (_config(reduce_bucket_size="auto"), ZeroConfig(stage=2)),
    (_config(offload_optimizer={"device": "cpu"}), ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(pin_memory=True))),
    (_config(offload_optimizer={"device": "cpu", "pin_memory": False}),
     ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(pin_memory=False))),
    (_config(cpu_offload=True), ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(pin_memory=True))),
    (_config(offload_optimizer={"device": "cpu", "ratio": 0.25, "pin_memory": True}),
     ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(pin_memory=True, ratio=0.25))),
    (_config(offload_optimizer={"device": "none"}), ZeroConfig(stage=2)),
    (_config(cpu_offload=True, cpu_offload_use_pin_memory=True),
     ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(pin_memory=True))),
    (_config(mics_shard_size=2), ZeroConfig(stage=2, parallel=ParallelConfig(shard_size=2))),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}, ZeroConfig(stage=3, prefetch_bytes=0)),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1000}, "bf16": {"enabled": True}},
     ZeroConfig(stage=3, prefetch_bytes=2000)),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64}},
     ZeroConfig(stage=3, param_persistence_threshold=64)),
    ({**_config(), "communication_data_type": "bfloat16"}, ZeroConfig(stage=2, reduce_dtype="bf16")),
    ({**_config(), "zero_allow_untested_optimizer": True}, ZeroConfig(stage=2, allow_unknown_optimizer=True)),
])
def test_each_zero_key_maps_to_its_field(values: dict[str, Any], expected: ZeroConfig) -> None:
    assert read_deepspeed_config(values).zero == expected


def test_fp16_loss_scale_keys() -> None:
    settings = read_deepspeed_config({**_config(), "fp16": {
        "enabled": True, "loss_scale": 128, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 3,
        "consecutive_hysteresis": True, "min_loss_scale": 0.5}})
    assert settings.precision == "16-mixed"
    assert settings.loss_scale == LossScaleConfig(loss_scale=128.0, initial_scale_power=8, loss_scale_window=50,
                                                  hysteresis=3, consecutive_hysteresis=True, min_loss_scale=0.5)
    assert read_deepspeed_config({**_config(), "fp16": {"enabled": True}}).loss_scale == LossScaleConfig()
    assert read_deepspeed_config({**_config(), "bfloat16": {"enabled": True}}).precision == "bf16-mixed"


def test_keys_not_used_and_unknown_keys_are_reported() -> None:
    settings = read_deepspeed_config({
        "zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9, "overlap_comm": False,
                              "allgather_bucket_size": 1e6, "reduce_bucket_size": 2e6, "reduce_bucket_sise": 1},
        "flops_profiler": {"enabled": True}, "zero_optimisation": {}})
    assert settings.unused == {
        "zero_optimization.stage3_max_live_parameters": "applies to stage 3 only (stage=2)",
        "zero_optimization.overlap_comm": "always on here",
        "zero_optimization.allgather_bucket_size": "the all-gathers use the reduce buckets (reduce_bucket_size)",
        "flops_profiler": "not implemented"}
    assert settings.unknown == ("zero_optimization.reduce_bucket_sise (zero_optimization.reduce_bucket_size?)",
                                "zero_optimisation (zero_optimization?)")
    assert "a typo?" in (settings.ignored_keys_message() or "")


def test_a_typo_inside_a_section_is_reported_as_one_with_the_key_meant() -> None:
    """A misspelt fp16/bf16/offload key was listed as a feature "not implemented" while its value
    fell back to the default."""
    settings = read_deepspeed_config({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True, "buffer_count": 4}},
        "fp16": {"enabled": True, "loss_scale_windw": 50, "auto_cast": True}, "bf16": {"enabeld": False}})
    assert settings.unknown == ("bf16.enabeld (bf16.enabled?)", "fp16.loss_scale_windw (fp16.loss_scale_window?)",
                                "zero_optimization.offload_optimizer.pin_memroy"
                                " (zero_optimization.offload_optimizer.pin_memory?)")
    assert settings.unused == {"fp16.auto_cast": "not implemented: fp16 keeps fp32 masters and autocasts",
                               "zero_optimization.offload_optimizer.buffer_count": "not needed (no NVMe)"}
    assert settings.loss_scale == LossScaleConfig()  # the typo's 50 is not taken


def test_an_auto_fp16_section_gives_its_loss_scale_to_a_trainer_in_fp16() -> None:
    """Hugging Face's {"enabled": "auto", "loss_scale": ...}: the loss-scale keys were dropped without
    a word, and the Trainer's fp16 ran with the default dynamic scaling."""
    config = {**_config(), "fp16": {"enabled": "auto", "loss_scale": 128, "hysteresis": 4}}
    settings = read_deepspeed_config(config)
    wanted = LossScaleConfig(loss_scale=128.0, hysteresis=4)
    assert settings.precision is None and settings.loss_scale == wanted and not settings.unknown
    # On the CPU Lightning turns '16-mixed' into bf16; '16-true' keeps fp16, through the same setter.
    fp16 = pl.Trainer(strategy=ZeroStrategy(deepspeed_config=config), precision="16-true", accelerator="cpu",
                      devices=1, logger=False)
    plugin = fp16.strategy.precision_plugin
    assert isinstance(plugin, ZeroPrecision) and plugin.loss_scaler is not None and plugin.loss_scaler.config == wanted
    bf16 = pl.Trainer(strategy=ZeroStrategy(deepspeed_config=config), precision="bf16-mixed", accelerator="cpu",
                      devices=1, logger=False)
    assert bf16.strategy.precision_plugin.loss_scaler is None
    with pytest.warns(DeepSpeedConfigWarning, match=r"asks for fp16 loss scaling .*loss_scale=128.0.* but the"
                                                    r" precision plugin passed has"):
        pl.Trainer(strategy=ZeroStrategy(deepspeed_config=config), plugins=[ZeroPrecision("16-mixed")],
                   accelerator="cpu", devices=1, logger=False)
    import lightning as L

    from lightning_zero import ZeroFabricStrategy

    fabric = L.Fabric(strategy=ZeroFabricStrategy(deepspeed_config=config), precision="16-true", accelerator="cpu",
                      devices=1)
    assert fabric.strategy.precision.loss_scaler.config == wanted  # type: ignore[attr-defined]


def test_fabric_names_the_loop_settings_it_leaves_to_the_loop() -> None:
    """DeepSpeed's engine clips and accumulates; Fabric's loop must, and was not told."""
    from lightning_zero import ZeroFabricStrategy

    config = {**_config(), "gradient_clipping": 1.0, "gradient_accumulation_steps": 4,
              "train_micro_batch_size_per_gpu": 8}
    with pytest.warns(DeepSpeedConfigWarning) as caught:
        strategy = ZeroFabricStrategy(deepspeed_config=config)
    message = " ".join(str(w.message) for w in caught)
    assert "gradient_clipping=1: call fabric.clip_gradients(model, optimizer, max_norm=1)" in message
    assert "gradient_accumulation_steps=4: step every 4 backward calls" in message
    assert "train_micro_batch_size_per_gpu=8: build the DataLoader with that batch size" in message
    assert strategy.deepspeed_settings is not None and strategy.deepspeed_settings.gradient_clipping == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroFabricStrategy(deepspeed_config={**_config(), "gradient_clipping": "auto", "gradient_accumulation_steps": 1})


@pytest.mark.parametrize(("values", "match"), [
    ({"zero_optimization": {"stage": 0}}, r"zero_optimization.stage=0: stage 0 is plain data parallelism.*'ddp'"),
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage=4: use 1, 2 or 3"),
    ({}, r"has no zero_optimization section, so DeepSpeed would run ZeRO stage 0"),
    ({"zero_optimisation": {"stage": 2}}, r"no zero_optimization section.*It has 'zero_optimisation': a typo of"
                                          r" 'zero_optimization'\?"),
    ({"zero_optimization": {"stag": 2}}, r"sets no zero_optimization.stage.*It has 'stag': a typo of 'stage'\?"),
    ({"zero_optimization": {"reduce_bucket_size": 10**6}}, r"sets no zero_optimization.stage, which DeepSpeed takes"
                                                          r" as 0 \(plain data parallelism\)\. Set"),
    (_config(offload_optimizer={"device": "nvme", "nvme_path": "/local_nvme"}),
     r"offload_optimizer.device='nvme': NVMe offload is not supported.*\"cpu\""),
    (_config(offload_param={"device": "cpu"}), r"offload_param.device='cpu': parameter offload needs stage 3"),
    (_config(reduce_bucket_size="big"), r"zero_optimization.reduce_bucket_size='big': it must be a whole number"),
    (_config(reduce_bucket_size=1.5), r"reduce_bucket_size=1.5"),
    (_config(offload_optimizer={"device": "cpu", "ratio": 1.5}), r"invalid zero_optimization.offload_optimizer.*ratio"),
    ({**_config(), "fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"enables both fp16 and bf16"),
    ({**_config(), "fp16": {"enabled": "yes"}}, r"fp16.enabled='yes': it must be true or false"),
    ({**_config(), "fp16": {"enabled": True, "min_loss_scale": 2.0**20}}, r"invalid fp16 loss scale.*min_loss_scale"),
    ({**_config(), "gradient_clipping": -1}, r"gradient_clipping=-1: it must be a number >= 0"),
    ({**_config(), "communication_data_type": "int8"}, r"communication_data_type='int8'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     r"maps to an invalid ZeroConfig: ZeroConfig.offload_params without offload_optimizer"),
])
def test_what_cannot_be_honoured_is_an_error_naming_the_key(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_deepspeed_config(values)


def test_files_that_are_not_configs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a file"):
        read_deepspeed_config(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 2,}')
    with pytest.raises(ValueError, match=r"broken.json could not be read as JSON"):
        read_deepspeed_config(broken)
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(ValueError, match=r"twice.json gives 'stage' more than once"):
        read_deepspeed_config(twice)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        read_deepspeed_config(listed)
    with pytest.raises(ValueError, match="must be the path of a DeepSpeed JSON config"):
        read_deepspeed_config(3)  # type: ignore[arg-type]


def test_checks_against_the_trainer_and_the_loader_name_both_values() -> None:
    settings = read_deepspeed_config(DATA / "lightning_zero3_offload_bf16.json")
    settings.check_trainer(1.0, "norm", 2)
    with pytest.raises(ValueError, match=r"gradient_clipping=1 but the Trainer has gradient_clip_val=None"):
        settings.check_trainer(None, None, 2)
    with pytest.raises(ValueError, match=r"gradient_clip_algorithm='value'"):
        settings.check_trainer(1.0, "value", 2)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 but the Trainer has accumulate_grad_batches=1"):
        settings.check_trainer(1.0, "norm", 1)
    settings.check_micro_batch_size(4, 2, 8)
    settings.check_micro_batch_size(None, 2, 8)  # a custom batch sampler: nothing to compare
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=4 but the training DataLoader has batch_size=8"):
        settings.check_micro_batch_size(8, 2, 8)
    cifar = read_deepspeed_config(DATA / "cifar_zero1_fp16.json")
    cifar.check_micro_batch_size(4, 2, 2)
    with pytest.raises(ValueError, match=r"train_batch_size=16, but .*batch_size=4 x accumulate_grad_batches=1 x 2"
                                         r" data-parallel ranks = 8"):
        cifar.check_micro_batch_size(4, 1, 2)


# ---------------------------------------------------------------- the strategy
def test_strategy_from_a_deepspeed_config_and_what_it_refuses() -> None:
    path = DATA / "cifar_zero1_fp16.json"
    with pytest.warns(DeepSpeedConfigWarning, match="configure_optimizers returns the optimizer"):
        strategy = ZeroStrategy.from_deepspeed(path)
    assert strategy.config == read_deepspeed_config(path).zero
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config whose every key is used warns nothing
        quiet = ZeroStrategy(deepspeed_config=json.loads((DATA / "lightning_zero3_offload_bf16.json").read_text()))
    assert quiet.config.stage == 3 and quiet.deepspeed_settings is not None
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy.precision_plugin, ZeroPrecision)
    assert trainer.precision == "16-mixed"
    assert trainer.strategy.precision_plugin.loss_scaler.scale == 2.0**15
    with pytest.raises(ValueError, match=r"deepspeed_config=\.\.\., stage=\.\.\.\): the DeepSpeed config already says"):
        ZeroStrategy(stage=2, deepspeed_config=path)
    with pytest.raises(ValueError, match=r"sets the precision \('16-mixed'\)\. Drop precision_plugin"):
        ZeroStrategy(deepspeed_config=path, precision_plugin=ZeroPrecision("bf16-mixed"))


def test_lightning_cli_yaml_takes_a_deepspeed_config_key(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from models import TinyGPT

    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  accumulate_grad_batches: 2\n"
        "  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n"
        f"      deepspeed_config: {DATA / 'lightning_zero3_offload_bf16.json'}\n"
        "inline:\n  zero_optimization: {stage: 2, reduce_bucket_size: 1000}\n")
    cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config.with_name("cli.yaml"))], save_config_callback=None,
                       parser_kwargs={"default_config_files": []}) if False else None
    del cli
    # the key as LightningCLI parses it: a path ...
    config.write_text(config.read_text().split("inline:")[0])
    cli = LightningCLI(TinyGPT, run=False, args=["--config", str(config)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, ZeroStrategy)
    assert cli.trainer.strategy.config.stage == 3 and cli.trainer.precision == "bf16-mixed"
    # ... or the config itself, inline
    inline = tmp_path / "inline.yaml"
    inline.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n"
        "  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n"
        "      deepspeed_config:\n        zero_optimization: {stage: 2, reduce_bucket_size: 1000}\n")
    cli = LightningCLI(TinyGPT, run=False, args=["--config", str(inline)], save_config_callback=None)
    assert cli.trainer.strategy.config == ZeroConfig(stage=2, reduce_bucket_size=1000)


# ---------------------------------------------------------------- on 2 ranks
def _fit_cases() -> dict[str, Any]:
    import models
    from models import TinyGPT, fit, params_of

    path = DATA / "lightning_zero3_offload_bf16.json"
    settings = read_deepspeed_config(path)
    out: dict[str, Any] = {}
    for name, strategy, kwargs in (
        ("deepspeed_config", lambda: ZeroStrategy.from_deepspeed(path), {}),
        ("same ZeroConfig", lambda: ZeroStrategy(config=settings.zero), {"precision": "bf16-mixed"}),
    ):
        pl.seed_everything(0)
        module = TinyGPT()
        trainer = fit(module, strategy(), WORLD, steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0, **kwargs)
        out[name] = params_of(module)
        out[f"{name} precision"] = trainer.precision
    for name, kwargs in (
        ("accumulation", {"gradient_clip_val": 1.0}),
        ("clipping", {"accumulate_grad_batches": 2}),
        ("precision", {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, "precision": "16-true"}),
        ("micro-batch", {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, "batch_size": 8}),
    ):
        batch_size = kwargs.pop("batch_size", 4)
        original = models.loader  # models.fit builds a loader of 4; the micro-batch case needs 8
        models.loader = lambda: original(batch_size=batch_size)
        try:
            fit(TinyGPT(), ZeroStrategy.from_deepspeed(path), WORLD, steps=2, **kwargs)
            out[f"{name} error"] = None
        except ValueError as error:
            out[f"{name} error"] = str(error)
        finally:
            models.loader = original
    return out


@pytest.fixture(scope="module")
def fits() -> list[dict[str, Any]]:
    return run_on_ranks(_fit_cases, WORLD)


def test_a_deepspeed_config_trains_exactly_as_its_zero_config(fits: list[dict[str, Any]]) -> None:
    for runs in fits:
        assert runs["deepspeed_config precision"] == runs["same ZeroConfig precision"] == "bf16-mixed"
        for key, value in runs["same ZeroConfig"].items():
            assert torch.equal(runs["deepspeed_config"][key], value), key


def test_mismatches_with_the_trainer_and_the_loader_fail_on_every_rank(fits: list[dict[str, Any]]) -> None:
    for runs in fits:
        assert "gradient_accumulation_steps=2 but the Trainer has accumulate_grad_batches=1" in runs["accumulation error"]
        assert "gradient_clipping=1 but the Trainer has gradient_clip_val=None" in runs["clipping error"]
        assert "asks for precision 'bf16-mixed' (its bf16 section) but the Trainer has precision='16-true'" \
            in runs["precision error"]
        assert "train_micro_batch_size_per_gpu=4 but the training DataLoader has batch_size=8" in runs["micro-batch error"]
