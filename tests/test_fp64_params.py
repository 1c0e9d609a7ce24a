"""A float64 parameter keeps float64 at stages 1 and 2: master, gradient reduction and optimizer
state, so it trains as DDP trains it in float64; and its checkpoints (sharded save and load, the
consolidated file) keep every bit. Two gloo ranks, one spawn."""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from harness import launched_environment, run_on_ranks
from lightning_zero import CPUOffloadPolicy, ZeroConfig, ZeroStrategy, consolidate
from models import VOCAB, TinyGPT, loader, params_of

WORLD = 2
STEPS = 6
TOLERANCE = 1e-5  # the fp32 weights, as in the other parity tests
FP64_TOLERANCE = 1e-12  # the float64 scale: an fp32 master would be ~1e-7 off
# zero1/zero2 step the fp32 weights with torch's AdamW, as DDP does ("off": the default on the CPU
# is the C++ CPU Adam), so that the float64 scale can be held to float64's tolerance.
CASES: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1, "reduce_bucket_size": 500, "fused_adam": "off"},
    "zero2": {"stage": 2, "reduce_bucket_size": 500, "fused_adam": "off"},
    "zero2_offload": {"stage": 2, "reduce_bucket_size": 500, "offload_optimizer": CPUOffloadPolicy()},
}
# With the C++ CPU Adam (offload) the fp32 weights' rounding differs from torch's by ~1e-7; the
# scale's gradient inherits that, so there the float64 scale is only fp32-close.
SCALE_TOLERANCE = {"zero1": FP64_TOLERANCE, "zero2": FP64_TOLERANCE, "zero2_offload": TOLERANCE}


class ScaledGPT(TinyGPT):
    """TinyGPT whose logits are multiplied by a float64 per-token scale (loss in float64)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, VOCAB, dtype=torch.float64))

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens).double() * self.scale


class Snapshot(Callback):
    """Whole weights and the torch-format optimizer state (rank 0's) at the start or the end."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.params: dict[str, Tensor] = {}
        self.optimizer: dict[str, Any] | None = None

    def _take(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.params = params_of(module)
        optimizer = trainer.optimizers[0]
        if hasattr(optimizer, "consolidate_state_dict"):
            optimizer.consolidate_state_dict()  # a collective
        self.optimizer = copy.deepcopy(optimizer.state_dict()) if trainer.is_global_zero else None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.at == "start":
            self._take(trainer, module)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.at == "end":
            self._take(trainer, module)


def _run(
    strategy: Any, steps: int = STEPS, ckpt_path: str | None = None, at: str = "end"
) -> tuple[dict[str, Any], pl.Trainer]:
    pl.seed_everything(0)
    module = ScaledGPT()
    snapshot = Snapshot(at)
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[snapshot])
        trainer.fit(module, train_dataloaders=loader(), ckpt_path=ckpt_path)
    return {"params": params_of(module), "optimizer": snapshot.optimizer, "losses": module.losses,
            "snapshot": snapshot.params, "dtype": module.scale.dtype}, trainer


def _cases(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {"ddp": _run("ddp")[0]}
    for name, config in CASES.items():
        out[name], trainer = _run(ZeroStrategy(config=ZeroConfig(**config)))
        if name != "zero2":
            continue
        # Round trip: a sharded checkpoint of the trained zero2 run, loaded by a fresh run ...
        path = os.path.join(directory, "fp64.ckpt")
        with launched_environment():
            trainer.save_checkpoint(path)
        trainer.strategy.barrier()
        out["resumed"] = _run(ZeroStrategy(config=ZeroConfig(**config)), steps=STEPS + 1, ckpt_path=path,
                              at="start")[0]
        # ... and consolidated into one file.
        if torch.distributed.get_rank() == 0:
            exported = consolidate(path, os.path.join(directory, "fp64.pt"), progress=False)
            out["consolidated"] = torch.load(exported, weights_only=False)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        return run_on_ranks(_cases, WORLD, directory)


def _fp64_index() -> int:
    """The float64 scale's index in the torch-format state (as TinyGPT.configure_optimizers
    orders the parameters: the >=2-d ones, then the rest)."""
    named = list(ScaledGPT().named_parameters())
    names = [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]
    return names.index("scale")


@pytest.mark.parametrize("case", list(CASES))
def test_float64_parameter_trains_like_ddp_in_float64(results: list[dict[str, Any]], case: str) -> None:
    for per_rank in results:
        zero, ddp = per_rank[case], per_rank["ddp"]
        assert zero["dtype"] == ddp["dtype"] == torch.float64
        assert (zero["params"]["scale"] - ddp["params"]["scale"]).abs().max() <= SCALE_TOLERANCE[case]
        # the scale did train: the comparison is not between two untouched copies
        assert (ddp["params"]["scale"] - torch.linspace(0.5, 1.5, VOCAB, dtype=torch.float64)).abs().max() > 1e-3
        others = [k for k in ddp["params"] if k != "scale"]
        assert max((zero["params"][k] - ddp["params"][k]).abs().max().item() for k in others) <= TOLERANCE
    zero_state, ddp_state = results[0][case]["optimizer"], results[0]["ddp"]["optimizer"]
    index = _fp64_index()
    for key in ("exp_avg", "exp_avg_sq"):
        mine, reference = zero_state["state"][index][key], ddp_state["state"][index][key]
        assert mine.dtype == reference.dtype == torch.float64
        assert (mine - reference).abs().max() <= SCALE_TOLERANCE[case]
    assert float(zero_state["state"][index]["step"]) == float(ddp_state["state"][index]["step"]) == STEPS


def test_float64_parameter_round_trips_through_sharded_and_consolidated_checkpoints(
    results: list[dict[str, Any]],
) -> None:
    for per_rank in results:
        trained, resumed = per_rank["zero2"], per_rank["resumed"]
        # loaded bit for bit, in float64, fp32 weights too
        assert resumed["snapshot"].keys() == trained["params"].keys()
        assert all(torch.equal(resumed["snapshot"][k], trained["params"][k]) for k in trained["params"])
        assert resumed["snapshot"]["scale"].dtype == torch.float64
    trained_state, loaded_state = results[0]["zero2"]["optimizer"], results[0]["resumed"]["optimizer"]
    assert trained_state["state"].keys() == loaded_state["state"].keys()
    for index, entry in trained_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded_state["state"][index][key], value), (index, key)
    consolidated = results[0]["consolidated"]
    assert consolidated["state_dict"]["scale"].dtype == torch.float64
    assert torch.equal(consolidated["state_dict"]["scale"], results[0]["zero2"]["params"]["scale"])
    saved_state = consolidated["optimizer_states"][0]["state"][_fp64_index()]
    assert saved_state["exp_avg_sq"].dtype == torch.float64
    assert torch.equal(saved_state["exp_avg_sq"], trained_state["state"][_fp64_index()]["exp_avg_sq"])
