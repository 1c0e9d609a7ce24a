"""Optimizer and parameter offload (zero2_offload, zero3_offload) on 2 gloo ranks, against DDP."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from harness import run_on_ranks
from lightning_zero import CPUOffloadPolicy, ZeroConfig, ZeroStrategy
from lightning_zero.offload import MasterPlacement
from models import TiedGPT, TinyGPT, fit, max_abs_diff, params_of

WORLD = 2
TOLERANCE = 1e-5


class SGDGPT(TinyGPT):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


class StagingCheck(Callback):
    """After a bf16 offloaded step, the device copy is the CPU master rounded; with the parameters
    on the CPU the step wrote it straight into this rank's chunk of them (no staging buffer)."""

    def __init__(self) -> None:
        self.exact: list[bool] = []
        self.in_place: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for optimizer in trainer.strategy.zero_optimizers:
            for bucket in optimizer.buckets:
                if bucket.staging is not None:
                    self.exact.append(torch.equal(bucket.staging, bucket.master.to(torch.bfloat16)))
                    self.exact.append(torch.equal(bucket.owned_chunk(bucket.param_data), bucket.staging))
                    own = bucket.owned_chunk(bucket.param_data)
                    self.in_place.append(bucket.staging.data_ptr() == own.data_ptr() and bucket.staging.numel() == own.numel())


def _run(strategy: Any, module: pl.LightningModule, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    fit(module, strategy, WORLD, gradient_clip_val=0.5, **kwargs)
    return {"losses": module.losses, "params": params_of(module)}


def _cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    pl.seed_everything(0)
    out["ddp"] = _run("ddp", TinyGPT())
    pl.seed_everything(0)
    out["zero2_offload"] = _run("zero2_offload", TinyGPT())
    pl.seed_everything(0)
    out["zero2_offload_half"] = _run(
        ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700, offload_optimizer=CPUOffloadPolicy(ratio=0.5))),
        TinyGPT(),
    )
    pl.seed_everything(0)
    out["ddp_tied"] = _run("ddp", TiedGPT())
    pl.seed_everything(0)
    out["zero3_offload"] = _run(
        ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=500, offload_optimizer=CPUOffloadPolicy(),
                                       offload_params=CPUOffloadPolicy())),
        TiedGPT(),
    )
    pl.seed_everything(0)
    out["zero3_offload_name"] = _run("zero3_offload", TiedGPT())
    pl.seed_everything(0)
    out["ddp_sgd"] = _run("ddp", SGDGPT())
    pl.seed_everything(0)
    out["zero2_offload_sgd"] = _run("zero2_offload", SGDGPT())
    staging = StagingCheck()
    pl.seed_everything(0)
    out["zero2_offload_bf16"] = _run(
        ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700, offload_optimizer=CPUOffloadPolicy())),
        TinyGPT(), precision="bf16-mixed", callbacks=[staging],
    )
    out["staging_exact"] = staging.exact
    out["staging_in_place"] = staging.in_place
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD)


@pytest.mark.parametrize(
    ("case", "reference"),
    [
        ("zero2_offload", "ddp"),
        ("zero2_offload_half", "ddp"),
        ("zero3_offload", "ddp_tied"),
        ("zero3_offload_name", "ddp_tied"),
        ("zero2_offload_sgd", "ddp_sgd"),
    ],
)
def test_offloaded_runs_match_ddp(results: list[dict[str, Any]], case: str, reference: str) -> None:
    for per_rank in results:
        zero, ddp = per_rank[case], per_rank[reference]
        assert len(zero["losses"]) == len(ddp["losses"]) == 20
        assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= TOLERANCE
        assert max_abs_diff(zero["params"], ddp["params"]) <= TOLERANCE


def test_bf16_offload_stages_the_rounded_master_and_tracks_fp32(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["staging_exact"] and all(per_rank["staging_exact"])
        assert per_rank["staging_in_place"] and all(per_rank["staging_in_place"])
        zero, ddp = per_rank["zero2_offload_bf16"], per_rank["ddp"]
        assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= 0.1


def test_ratio_splits_the_optimizer_between_cpu_and_device() -> None:
    placement = MasterPlacement(CPUOffloadPolicy(ratio=0.5), torch.device("cuda", 0), total_numel=1000)
    devices = [placement.place(100).type for _ in range(10)]
    assert devices == ["cpu"] * 5 + ["cuda"] * 5
    everything = MasterPlacement(CPUOffloadPolicy(), torch.device("cuda", 0), total_numel=1000)
    assert {everything.place(300).type for _ in range(4)} == {"cpu"}
    nothing = MasterPlacement(None, torch.device("cuda", 0), total_numel=1000)
    assert nothing.place(100).type == "cuda"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 2, "offload_params": CPUOffloadPolicy(), "offload_optimizer": CPUOffloadPolicy()}, r"needs stage 3"),
        ({"stage": 3, "offload_params": CPUOffloadPolicy()}, r"offload_optimizer=CPUOffloadPolicy\(\)"),
        ({"stage": 2, "offload_optimizer": "cpu"}, r"must be a CPUOffloadPolicy"),
    ],
)
def test_bad_offload_configuration(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize("ratio", [0, 1.5, -0.1, True])
def test_bad_ratio(ratio: float) -> None:
    with pytest.raises(ValueError, match=rf"ratio={ratio!r} must be in \(0, 1\]"):
        CPUOffloadPolicy(ratio=ratio)


def test_yaml_mapping_becomes_a_policy() -> None:
    config = ZeroConfig(stage=2, offload_optimizer={"pin_memory": False, "ratio": 0.25})  # type: ignore[arg-type]
    assert config.offload_optimizer == CPUOffloadPolicy(pin_memory=False, ratio=0.25)
