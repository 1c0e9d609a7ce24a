"""Bad input gets a clear error naming the value and the fix (no processes needed)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn

import lightning_zero
from lightning_zero import Collectives, ZeroConfig, ZeroStrategy
from lightning_zero.zero import check_shardable
from models import TinyGPT


@pytest.mark.parametrize("stage", [0, 4, True])
def test_unsupported_stage(stage: int) -> None:
    with pytest.raises(ValueError, match=rf"ZeroConfig.stage={stage!r}"):
        ZeroConfig(stage=stage)


@pytest.mark.parametrize("size", [-1, 0])
def test_bucket_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError, match=rf"reduce_bucket_size={size}.*positive"):
        ZeroConfig(reduce_bucket_size=size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 2, "unit_modules": ("Block",)}, r"stage 3 only, but stage=2"),
        ({"stage": 3, "prefetch_units": -1}, r"prefetch_units=-1"),
        ({"stage": 3, "param_persistence_threshold": -5}, r"param_persistence_threshold=-5"),
        ({"stage": 3, "prefetch_bytes": -1}, r"prefetch_bytes=-1 must be a number of bytes >= 0, e.g. 200_000_000"
                                              r" \(0 turns prefetch off\), or None"),
        ({"stage": 3, "prefetch_bytes": 1.5}, r"prefetch_bytes=1.5 must be of type int"),
        ({"stage": 3, "unit_modules": ("",)}, r"unit_modules=\(''"),
        ({"stage": 3, "unit_modules": 7}, r"unit_modules=7 must be module class names"),
        ({"stage": 3, "min_unit_numel": 0}, r"min_unit_numel=0 must be a positive number of elements, e.g. 1_000_000"
                                            r" \(modules of fewer parameter elements join their parent's unit\)"),
        ({"reduce_dtype": "fp8"}, r"reduce_dtype='fp8'"),
    ],
)
def test_stage3_and_reduce_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**kwargs)


def test_one_unit_class_name_may_be_given_as_a_string() -> None:
    assert ZeroConfig(stage=3, unit_modules="Linear").unit_modules == ("Linear",)
    assert ZeroConfig(stage=3, unit_modules=["Linear", "Block"]).unit_modules == ("Linear", "Block")
    assert ZeroConfig.from_dict({"stage": 3, "unit_modules": "Block"}).unit_modules == ("Block",)


def test_prefetch_bytes_zero_turns_prefetch_off() -> None:
    assert ZeroConfig(stage=3, prefetch_bytes=0).prefetch_bytes == 0


def test_unknown_config_field_is_named() -> None:
    with pytest.raises(ValueError, match=r"\['bucket_size'\].*reduce_bucket_size"):
        ZeroConfig.from_dict({"stage": 2, "bucket_size": 10})


def test_stage_given_twice_must_agree() -> None:
    with pytest.raises(ValueError, match=r"stage=1.*config.stage=3; give the stage once"):
        ZeroStrategy(stage=1, config=ZeroConfig(stage=3))
    assert ZeroStrategy(stage=1).config.stage == 1
    assert ZeroStrategy(config={"stage": 1, "reduce_bucket_size": 10}).config.reduce_bucket_size == 10


def test_stage_fills_in_a_config_that_leaves_it_at_the_default() -> None:
    # A YAML's `stage: 1` with `config: {reduce_bucket_size: ...}`, or a config that LightningCLI
    # completed with ZeroConfig's defaults (stage 2): the user gave the stage once.
    dict_config = ZeroStrategy(stage=1, config={"reduce_bucket_size": 10}).config
    assert (dict_config.stage, dict_config.reduce_bucket_size) == (1, 10)
    assert ZeroStrategy(stage=3, config=ZeroConfig(reduce_bucket_size=10)).config == ZeroConfig(
        stage=3, reduce_bucket_size=10)
    assert ZeroStrategy(stage=1, config={"stage": 2, "reduce_bucket_size": 10}).config.stage == 1


def test_optimizer_that_cannot_be_sharded() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"LBFGS.*AdamW"):
        check_shardable(torch.optim.LBFGS(params), ZeroConfig())

    class Custom(torch.optim.Optimizer):
        def __init__(self, params: list[nn.Parameter]) -> None:
            super().__init__(params, {})

    with pytest.raises(ValueError, match=r"Custom.*allow_unknown_optimizer=True"):
        check_shardable(Custom(params), ZeroConfig())
    check_shardable(Custom(params), ZeroConfig(allow_unknown_optimizer=True))
    check_shardable(torch.optim.AdamW(params), ZeroConfig())

    class LARS(torch.optim.SGD):
        """A whole-tensor trust ratio before SGD's step: silently per slice under ZeRO."""

        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(p.norm() / (p.grad.norm() + 1e-9))
            return super().step(closure)

    class Tuned(torch.optim.AdamW):  # other defaults, torch's step
        def __init__(self, params: list[nn.Parameter]) -> None:
            super().__init__(params, lr=3e-4, betas=(0.9, 0.95))

    lars = LARS(params, lr=0.1)
    torch.optim.SGD(params, lr=0.1)  # torch has wrapped SGD.step and LARS.step in its profiling hook by now
    with pytest.raises(ValueError, match=r"LARS overrides the step\(\) of torch.optim.SGD.*allow_unknown_optimizer=True"):
        check_shardable(lars, ZeroConfig())
    check_shardable(lars, ZeroConfig(allow_unknown_optimizer=True))
    check_shardable(Tuned(params), ZeroConfig())


def test_used_without_a_distributed_launch() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"initialized torch.distributed process group.*Trainer\(strategy="):
        Collectives()
    with pytest.raises(RuntimeError, match=r"must be passed to a Trainer"):
        _ = ZeroStrategy().root_device


def test_unsupported_precision_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"DoublePrecision.*'64-true'.*'bf16-mixed'"):
        pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision="64-true")
    with pytest.raises(ValueError, match=r"precision='fp8'.*'16-mixed'"):
        lightning_zero.ZeroPrecision("fp8")


@pytest.mark.parametrize("name,stage", [("zero1", 1), ("zero2", 2), ("zero2_spawn", 2), ("zero3", 3)])
def test_registered_names(name: str, stage: int) -> None:
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.config.stage == stage
    assert isinstance(trainer.strategy.precision_plugin, lightning_zero.ZeroPrecision)


def test_lightning_cli_yaml_class_path() -> None:
    strategy = {
        "class_path": "lightning_zero.ZeroStrategy",
        "init_args": {"config": {"stage": 1, "reduce_bucket_size": 1234, "reduce_every_micro_step": True}},
    }
    cli = LightningCLI(
        TinyGPT,
        run=False,
        args={"trainer": {"strategy": strategy, "accelerator": "cpu", "devices": 2, "logger": False}},
    )
    assert isinstance(cli.trainer.strategy, ZeroStrategy)
    assert cli.trainer.strategy.config == ZeroConfig(stage=1, reduce_bucket_size=1234, reduce_every_micro_step=True)
    # one unit class as a string, as in Python (jsonargparse refused it: "Expected a <class 'tuple'>")
    strategy["init_args"] = {"config": {"stage": 3, "unit_modules": "TransformerEncoderLayer"}}
    cli = LightningCLI(TinyGPT, run=False, args={"trainer": {"strategy": strategy, "accelerator": "cpu", "logger": False}})
    assert cli.trainer.strategy.config.unit_modules == ("TransformerEncoderLayer",)


def test_lightning_cli_rejects_a_bad_stage() -> None:
    with pytest.raises((ValueError, SystemExit)):
        LightningCLI(
            TinyGPT,
            run=False,
            args={"trainer": {"strategy": {"class_path": "lightning_zero.ZeroStrategy", "init_args": {"stage": 5}}}},
        )


def test_the_strategy_pickles_for_spawn_and_fork_launchers() -> None:
    import pickle

    from lightning.pytorch.strategies import StrategyRegistry

    for strategy in (ZeroStrategy(stage=2), StrategyRegistry.get("zero3_spawn")):
        assert pickle.loads(pickle.dumps(strategy)).config == strategy.config


def test_bucket_size_is_sized_from_the_model_unless_given() -> None:
    """reduce_bucket_size=None: an eighth of the trainable elements, between 1M (2M on gloo) and
    25M (see [Note: bucket size]); an explicit size is kept whatever the model and backend."""
    from lightning_zero.config import AUTO_BUCKET_MAX, AUTO_BUCKET_MIN, AUTO_BUCKET_MIN_GLOO

    auto = ZeroConfig()
    assert auto.reduce_bucket_size is None
    assert auto.bucket_size_for(3_200_000) == AUTO_BUCKET_MIN  # an eighth would be 400K: latency-bound
    assert auto.bucket_size_for(80_000_001) == 10_000_001  # rounded up: never nine buckets
    assert auto.bucket_size_for(7_000_000_000) == AUTO_BUCKET_MAX
    assert ZeroConfig(reduce_bucket_size=1234).bucket_size_for(7_000_000_000) == 1234
    # gloo: a higher floor only (each collective stalls the CPU ranks that compute)
    assert auto.bucket_size_for(3_200_000, "gloo") == AUTO_BUCKET_MIN_GLOO > AUTO_BUCKET_MIN
    assert auto.bucket_size_for(3_200_000, "nccl") == auto.bucket_size_for(3_200_000, None) == AUTO_BUCKET_MIN
    assert auto.bucket_size_for(80_000_001, "gloo") == 10_000_001
    assert ZeroConfig(reduce_bucket_size=1234).bucket_size_for(3_200_000, "gloo") == 1234
    with pytest.raises(ValueError, match=r"reduce_bucket_size=0 .*or None to size buckets from the model"):
        ZeroConfig(reduce_bucket_size=0)


def test_model_state_bytes_before_setup_says_when_to_call_it() -> None:
    with pytest.raises(RuntimeError, match=r"there is none yet: call it from a hook.*estimate_memory"):
        ZeroStrategy(stage=2).all_ranks_model_state_bytes()


def test_a_parameter_in_two_optimizers_is_named() -> None:
    from lightning_zero.strategy import _check_params_in_one_optimizer

    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.1), torch.optim.SGD(module[1].parameters(), lr=0.1)]
    with pytest.raises(ValueError, match=r"The parameter '1.weight' of shape \(1, 2\) is in optimizer 0 and in optimizer 1"):
        _check_params_in_one_optimizer(optimizers, module)


def test_sizes_below_a_tenth_of_a_mib_are_not_shown_as_zero() -> None:
    from lightning_zero.autotuning.space import size_label

    assert (size_label(1024), size_label(3 * 2**20), size_label(2**31)) == ("1.0 KiB", "3.0 MiB", "2.00 GiB")
