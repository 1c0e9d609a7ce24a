"""Sharded checkpoints on gloo ranks: exact resume, resume at another world size and stage,
full checkpoints (DDP's, consolidated, weights only) into ZeRO, bad input, a rank killed mid-save.

Data order depends on the seed (Lightning's DistributedSampler shuffles with it), so every run
and every resumed run seeds the same. Checkpoints are taken at epoch ends.
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from harness import launched_environment, run_on_ranks
from lightning_zero import CheckpointError, CPUOffloadPolicy, LossScaleConfig, ZeroConfig, ZeroPrecision, ZeroStrategy
from lightning_zero import consolidate
from lightning_zero.checkpoint.sharded import read_meta, read_metadata
from models import TiedGPT, TinyGPT, loader, params_of

SAMPLES = 64  # 8 batches of 4 per rank and epoch at 2 ranks
TOLERANCE = 1e-5


def zero(stage: int, **config: Any) -> ZeroStrategy:
    return ZeroStrategy(config=ZeroConfig(stage=stage, min_unit_numel=500, **config))


def trainer(strategy: Any, world: int, epochs: int, callbacks: list[Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)


def run(strategy: Any, world: int, epochs: int, ckpt_path: str | None = None, callbacks: list[Callback] | None = None,
        module: pl.LightningModule | None = None, **kwargs: Any) -> tuple[pl.LightningModule, pl.Trainer]:
    pl.seed_everything(0)
    module = module or TiedGPT(scheduler=True)
    with launched_environment():
        fitted = trainer(strategy, world, epochs, callbacks, **kwargs)
        fitted.fit(module, train_dataloaders=loader(samples=SAMPLES), ckpt_path=ckpt_path)
    return module, fitted


class Restored(Callback):
    """What a resumed run starts from: whole weights and the optimizer state in torch's format."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        with strategy.gathered_params(writeback=False) if isinstance(strategy, ZeroStrategy) else nullcontext():
            self.params = params_of(module)
        optimizer = trainer.optimizers[0]
        if hasattr(optimizer, "consolidate_state_dict"):
            optimizer.consolidate_state_dict()
        # a copy: torch's state_dict() shares the live tensors, which training goes on to change
        self.optimizer = copy.deepcopy(optimizer.state_dict()) if trainer.is_global_zero else None
        self.global_step = trainer.global_step
        self.lr = optimizer.param_groups[0]["lr"]


def save_both(fitted: pl.Trainer, directory: str, name: str) -> None:
    """A sharded checkpoint and, as the reference, the same state gathered into one file."""
    strategy = fitted.strategy
    assert isinstance(strategy, ZeroStrategy)
    with launched_environment():
        fitted.save_checkpoint(os.path.join(directory, f"{name}.ckpt"))
        strategy.state_dict_type = "full"
        fitted.save_checkpoint(os.path.join(directory, f"{name}.full.ckpt"))
        strategy.state_dict_type = "sharded"


# ------------------------------------------------------------------------------ 2 ranks, first
def _same_world(directory: str) -> dict[str, Any]:
    """Exact resume at the same world size, and the 2-rank source checkpoint for other layouts."""
    out: dict[str, Any] = {}
    cases = {
        "zero2": lambda: zero(2),
        "zero3": lambda: zero(3),
        "zero2_offload": lambda: zero(2, offload_optimizer=CPUOffloadPolicy()),
        "zero3_offload": lambda: zero(3, offload_optimizer=CPUOffloadPolicy(), offload_params=CPUOffloadPolicy()),
        "zero2_bf16": lambda: zero(2),
        "zero1_fp16": lambda: zero(1),
    }
    for name, make in cases.items():
        kwargs: dict[str, Any] = {}
        if name.endswith("bf16"):
            kwargs["precision"] = "bf16-mixed"
        plugins = lambda: [ZeroPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale_power=24,  # noqa: E731
                                                                                 hysteresis=1))]
        if name.endswith("fp16"):
            kwargs["plugins"] = plugins()
        whole, _ = run(make(), 2, 4, **kwargs)
        save_dir = os.path.join(directory, name)
        checkpoints = ModelCheckpoint(dirpath=save_dir, every_n_epochs=1, save_top_k=-1)
        latest_dir = os.path.join(directory, name + "_latest")  # keeps one: the older one is removed
        latest = ModelCheckpoint(dirpath=latest_dir, every_n_train_steps=8, save_top_k=1)
        if name.endswith("fp16"):
            kwargs["plugins"] = plugins()
        first, _ = run(make(), 2, 2, callbacks=[checkpoints, latest], **kwargs)
        saved = os.path.join(save_dir, "epoch=1-step=16.ckpt")
        if name.endswith("fp16"):
            kwargs["plugins"] = plugins()
        restored = Restored()
        resumed, fitted = run(make(), 2, 4, ckpt_path=saved, callbacks=[restored], **kwargs)
        scaler = kwargs["plugins"][0].loss_scaler.state_dict() if "plugins" in kwargs else None
        out[name] = {
            "whole": params_of(whole), "resumed": params_of(resumed), "whole_losses": whole.losses,
            "resumed_losses": resumed.losses, "files": sorted(os.listdir(saved)), "is_dir": os.path.isdir(saved),
            "saved": sorted(os.listdir(save_dir)), "latest": sorted(os.listdir(latest_dir)), "global_step": restored.global_step, "end_step": fitted.global_step,
            "scaler": scaler,
        }
    # The source of the 2 -> 1 and 2 -> 4 cases: ZeRO-2, 2 ranks, 2 epochs.
    _, fitted = run(zero(2), 2, 2)
    save_both(fitted, directory, "two_ranks")
    # Saved into a directory of the user's: every rank refuses, nothing in it is lost.
    users = Path(directory) / "users_dir"
    if fitted.global_rank == 0:
        users.mkdir()
        (users / "data.csv").write_text("kept")
    start = time.monotonic()
    try:
        with launched_environment():
            fitted.save_checkpoint(users)
        out["into_users_dir"] = "saved"
    except CheckpointError as error:
        out["into_users_dir"] = str(error)
    out["into_users_dir_seconds"] = time.monotonic() - start
    out["users_dir_after"] = sorted(p.name for p in users.iterdir())
    # A whole checkpoint saved where a sharded one is replaces it (Lightning's file save moved its file
    # into the directory and kept the old checkpoint); into the user's directory it is refused too.
    swap = Path(directory) / "swap.ckpt"
    strategy = fitted.strategy
    assert isinstance(strategy, ZeroStrategy)
    with launched_environment():
        fitted.save_checkpoint(swap)
        out["swap_sharded_was_dir"] = swap.is_dir()
        strategy.state_dict_type = "full"
        try:
            fitted.save_checkpoint(swap)
            try:
                fitted.save_checkpoint(users)
                out["full_into_users_dir"] = "saved"
            except CheckpointError as error:
                out["full_into_users_dir"] = str(error)
        finally:
            strategy.state_dict_type = "sharded"
    out["swap_is_file"] = swap.is_file()
    out["swap_step"] = torch.load(swap, weights_only=False)["global_step"] if swap.is_file() else None
    out["swap_leftovers"] = sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(".swap"))
    out["users_dir_after_full"] = sorted(p.name for p in users.iterdir())
    # A DDP checkpoint, and a run that trains on from it with ZeRO-3 (and with DDP, the reference).
    _, fitted = run("ddp", 2, 2)
    with launched_environment():
        fitted.save_checkpoint(os.path.join(directory, "ddp.ckpt"))
    for name, strategy in (("ddp", "ddp"), ("zero3", zero(3))):
        restored = Restored()
        module, _ = run(strategy, 2, 4, ckpt_path=os.path.join(directory, "ddp.ckpt"), callbacks=[restored])
        out[f"from_ddp_{name}"] = {"params": params_of(module), "start": restored.params, "optimizer": restored.optimizer}
    return out


# ------------------------------------------------------------------------------ 4 ranks
def _four_ranks(directory: str) -> dict[str, Any]:
    """Source: ZeRO-3 with offloaded optimizer state on 4 ranks. Target: the 2-rank ZeRO-2
    checkpoint resumed at stage 3 on 4 ranks, and DDP on 4 ranks from its full twin."""
    out: dict[str, Any] = {}
    _, fitted = run(zero(3, offload_optimizer=CPUOffloadPolicy()), 4, 2)
    save_both(fitted, directory, "four_ranks")
    for name, strategy, path in (("zero3", zero(3), "two_ranks.ckpt"), ("ddp", "ddp", "two_ranks.full.ckpt")):
        restored = Restored()
        module, _ = run(strategy, 4, 4, ckpt_path=os.path.join(directory, path), callbacks=[restored])
        out[name] = {"start": restored.params, "optimizer": restored.optimizer, "params": params_of(module),
                     "lr": restored.lr, "global_step": restored.global_step}
    return out


# ------------------------------------------------------------------------------ 2 ranks, from 4
def _from_four(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    consolidated = os.path.join(directory, "four_ranks.consolidated.pt")
    weights = os.path.join(directory, "four_ranks.weights.pt")
    tensors = os.path.join(directory, "four_ranks.safetensors")
    if torch.distributed.get_rank() == 0:
        consolidate(os.path.join(directory, "four_ranks.ckpt"), consolidated, progress=False)
        consolidate(os.path.join(directory, "four_ranks.ckpt"), weights, weights_only=True, progress=False)
        consolidate(os.path.join(directory, "four_ranks.ckpt"), tensors, progress=False)
    torch.distributed.barrier()
    out["load_from_checkpoint"] = params_of(TiedGPT.load_from_checkpoint(consolidated, map_location="cpu"))
    for name, strategy, path in (
        ("zero2", zero(2), "four_ranks.ckpt"),
        ("ddp", "ddp", "four_ranks.full.ckpt"),
        ("consolidated_zero2", zero(2), consolidated),
        ("weights_zero2", zero(2), weights),
        ("safetensors_zero3", zero(3), tensors),
    ):
        restored = Restored()
        module, _ = run(strategy, 2, 4, ckpt_path=os.path.join(directory, path), callbacks=[restored])
        out[name] = {"start": restored.params, "optimizer": restored.optimizer, "params": params_of(module),
                     "global_step": restored.global_step}
    return out


# ------------------------------------------------------------------------------ 1 rank
def _one_rank(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, strategy, path in (("zero2", zero(2), "two_ranks.ckpt"), ("ddp", "ddp", "two_ranks.full.ckpt")):
        restored = Restored()
        module, _ = run(strategy, 1, 3, ckpt_path=os.path.join(directory, path), callbacks=[restored])
        out[name] = {"start": restored.params, "optimizer": restored.optimizer, "params": params_of(module)}
    out["errors"] = _errors(directory)
    return out


class SGDGPT(TiedGPT):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OneGroupGPT(TiedGPT):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class WiderGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__(width=48)


def _errors(directory: str) -> dict[str, Any]:
    """Each bad checkpoint: the message, and whether the weights were left as they were."""
    base = Path(directory)
    (base / "empty_dir").mkdir(exist_ok=True)
    (base / "noise.ckpt").write_bytes(os.urandom(1000))
    full = (base / "two_ranks.full.ckpt").read_bytes()
    (base / "truncated.ckpt").write_bytes(full[: len(full) // 2])
    truncated_dir = base / "truncated_shards.ckpt"
    if not truncated_dir.exists():
        import shutil

        shutil.copytree(base / "two_ranks.ckpt", truncated_dir)
        shard = truncated_dir / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    cases: list[tuple[str, Any, str]] = [
        ("missing", TiedGPT(), str(base / "nowhere.ckpt")),
        ("empty_dir", TiedGPT(), str(base / "empty_dir")),
        ("noise", TiedGPT(), str(base / "noise.ckpt")),
        ("truncated_file", TiedGPT(), str(base / "truncated.ckpt")),
        ("truncated_shards", TiedGPT(), str(truncated_dir)),
        ("other_model_sharded", TinyGPT(), str(base / "two_ranks.ckpt")),
        ("other_model_full", TinyGPT(), str(base / "two_ranks.full.ckpt")),
        ("wider_sharded", WiderGPT(), str(base / "two_ranks.ckpt")),
        ("wider_full", WiderGPT(), str(base / "two_ranks.full.ckpt")),
        ("other_optimizer_sharded", SGDGPT(), str(base / "two_ranks.ckpt")),
        ("other_groups_sharded", OneGroupGPT(), str(base / "two_ranks.ckpt")),
        ("other_groups_full", OneGroupGPT(), str(base / "two_ranks.full.ckpt")),
    ]
    out: dict[str, Any] = {}
    for name, module, path in cases:
        pl.seed_everything(0)
        before = params_of(module)
        try:
            with launched_environment():
                trainer(zero(2), 1, 1).fit(module, train_dataloaders=loader(samples=SAMPLES), ckpt_path=path)
            out[name] = {"error": None}
        except Exception as error:  # noqa: BLE001 - the test reads the type and the message
            after = params_of(module)
            out[name] = {"type": type(error).__name__, "message": str(error),
                         "unchanged": all(torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)}
    # strict_loading=False loads the keys both have and says nothing about the rest
    module = TinyGPT()
    module.strict_loading = False
    with launched_environment():
        pl.Trainer(accelerator="cpu", devices=1, strategy=zero(3), logger=False, enable_progress_bar=False,
                   enable_model_summary=False).validate(module, loader(samples=8), ckpt_path=str(base / "two_ranks.ckpt"),
                                                        verbose=False)
    out["non_strict_embed"] = module.embed.weight.detach().clone()
    return out


# ------------------------------------------------------------------------------ a rank killed mid-save
def _kill_rank_one_mid_save(directory: str) -> None:
    """Fits, saves; trains on and saves to the same path again, but rank 1 dies half-way through
    writing its shard file."""
    from torch.distributed.checkpoint import FileSystemWriter

    path = os.path.join(directory, "crash.ckpt")
    _, fitted = run(zero(2), 2, 2)
    with launched_environment():
        fitted.save_checkpoint(path)
    _, fitted = run(zero(2), 2, 3, ckpt_path=path)
    if torch.distributed.get_rank() == 1:
        def write_half_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
            shard = Path(self.path) / "__1_0.distcp"
            with open(shard, "wb") as file:
                file.write(b"\0" * 4096)
                file.flush()
                os.fsync(file.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_half_then_die  # type: ignore[method-assign]
    with launched_environment():
        fitted.save_checkpoint(path)


def _resume_after_crash(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "crash.ckpt")
    restored = Restored()
    resumed, _ = run(zero(2), 2, 3, ckpt_path=path, callbacks=[restored])
    whole, fitted = run(zero(2), 2, 3)
    # A new save to the same path replaces the stale partial directory and succeeds.
    with launched_environment():
        fitted.save_checkpoint(path)
    return {"global_step": restored.global_step, "resumed": params_of(resumed), "whole": params_of(whole)}


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        out = {"same": run_on_ranks(_same_world, 2, directory)[0]}
        out["four"] = run_on_ranks(_four_ranks, 4, directory)[0]
        out["from_four"] = run_on_ranks(_from_four, 2, directory)[0]
        out["one"] = run_on_ranks(_one_rank, 1, directory)[0]
        for name in ("two_ranks", "four_ranks"):
            out[f"{name}_full"] = torch.load(os.path.join(directory, f"{name}.full.ckpt"), weights_only=False)
        out["four_ranks_meta"] = read_meta(Path(directory) / "four_ranks.ckpt")
        out["four_ranks_files"] = sorted(os.listdir(os.path.join(directory, "four_ranks.ckpt")))
        out["four_ranks_shapes"] = {
            key: tuple(md.size) for key, md in read_metadata(Path(directory) / "four_ranks.ckpt").state_dict_metadata.items()
            if key.startswith("model.")
        }
        with pytest.raises(RuntimeError, match="a rank failed"):
            run_on_ranks(_kill_rank_one_mid_save, 2, directory)
        crash = Path(directory) / "crash.ckpt"
        out["after_crash"] = {"exists": (crash / ".metadata").is_file(), "partial": (Path(directory) / ".crash.ckpt.partial").exists(),
                              "meta_step": read_meta(crash).lightning["global_step"]}
        out["crash_resume"] = run_on_ranks(_resume_after_crash, 2, directory)[0]
        out["after_resave"] = {"partial": (Path(directory) / ".crash.ckpt.partial").exists(),
                               "meta_step": read_meta(crash).lightning["global_step"]}
    return out


def _equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _weights(full: dict[str, Any]) -> dict[str, Tensor]:
    """A checkpoint's weights named like params_of() (tied duplicates dropped)."""
    return {k: v for k, v in full["state_dict"].items() if k != "head.weight"}


def _same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", ["zero2", "zero3", "zero2_offload", "zero3_offload", "zero2_bf16", "zero1_fp16"])
def test_resume_at_the_same_world_size_equals_the_uninterrupted_run(results: dict[str, Any], case: str) -> None:
    result = results["same"][case]
    assert result["is_dir"] and result["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert result["saved"] == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]  # ModelCheckpoint, every epoch
    assert result["latest"] == ["epoch=1-step=16.ckpt"]  # save_top_k=1 removed the first directory
    assert result["global_step"] == 16 and result["end_step"] == 32
    assert _equal(result["whole"], result["resumed"]), case
    assert result["whole_losses"][16:] == result["resumed_losses"]


def test_fp16_resume_restores_the_loss_scaler(results: dict[str, Any]) -> None:
    # Had the scale restarted at 2**24 the resumed run would skip steps again and diverge; it is
    # bit-identical (the test above), and the scaler ends where the uninterrupted one did.
    scaler = results["same"]["zero1_fp16"]["scaler"]
    assert scaler["scale"] < 2**24


def test_sharded_checkpoint_records_global_shapes_and_one_file_per_rank(results: dict[str, Any]) -> None:
    assert results["four_ranks_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    full = results["four_ranks_full"]["state_dict"]
    shapes = results["four_ranks_shapes"]
    assert {k[len("model."):]: v for k, v in shapes.items()} == {k: tuple(v.shape) for k, v in full.items()
                                                                  if k != "head.weight"}
    meta = results["four_ranks_meta"]
    assert meta.world_size == 4 and meta.stage == 3 and meta.aliases == {"head.weight": "embed.weight"}
    assert meta.optimizers[0]["per_element"] == ["exp_avg", "exp_avg_sq"]
    assert {"loops", "lr_schedulers", "callbacks", "epoch", "global_step"} <= set(meta.lightning)


@pytest.mark.parametrize(
    ("group", "case", "source"),
    [
        ("from_four", "zero2", "four_ranks_full"),  # 4 ranks ZeRO-3 (offloaded) -> 2 ranks ZeRO-2
        ("one", "zero2", "two_ranks_full"),  # 2 -> 1
        ("four", "zero3", "two_ranks_full"),  # 2 ranks ZeRO-2 -> 4 ranks ZeRO-3
    ],
)
def test_resume_at_another_world_size_and_stage_starts_from_the_saved_state(
    results: dict[str, Any], group: str, case: str, source: str
) -> None:
    result, reference = results[group], results[source]
    assert _equal(result[case]["start"], _weights(reference))
    assert _same_optimizer_state(result[case]["optimizer"], reference["optimizer_states"][0])
    # and trains on like DDP resumed from the same state at the new world size
    assert _max_diff(result[case]["params"], result["ddp"]["params"]) <= TOLERANCE


def test_resume_at_another_world_size_keeps_the_schedule(results: dict[str, Any]) -> None:
    assert results["four"]["zero3"]["lr"] == results["four"]["ddp"]["lr"]
    assert results["four"]["zero3"]["global_step"] == 16


def test_consolidated_checkpoint_resumes_like_the_sharded_one(results: dict[str, Any]) -> None:
    result = results["from_four"]
    assert _equal(result["consolidated_zero2"]["start"], result["zero2"]["start"])
    assert _same_optimizer_state(result["consolidated_zero2"]["optimizer"], result["zero2"]["optimizer"])
    assert _equal(result["consolidated_zero2"]["params"], result["zero2"]["params"])


def test_consolidated_file_loads_with_load_from_checkpoint(results: dict[str, Any]) -> None:
    assert _equal(results["from_four"]["load_from_checkpoint"], _weights(results["four_ranks_full"]))


@pytest.mark.parametrize("case", ["weights_zero2", "safetensors_zero3"])
def test_weights_only_file_loads_weights_and_starts_the_optimizer_afresh(results: dict[str, Any], case: str) -> None:
    result = results["from_four"][case]
    assert _equal(result["start"], _weights(results["four_ranks_full"]))
    assert result["optimizer"]["state"] == {}
    assert result["global_step"] == 0


def test_ddp_checkpoint_into_zero3(results: dict[str, Any]) -> None:
    same = results["same"]
    assert _equal(same["from_ddp_zero3"]["start"], same["from_ddp_ddp"]["start"])
    assert _same_optimizer_state(same["from_ddp_zero3"]["optimizer"], same["from_ddp_ddp"]["optimizer"])
    assert _max_diff(same["from_ddp_zero3"]["params"], same["from_ddp_ddp"]["params"]) <= TOLERANCE


@pytest.mark.parametrize(
    ("case", "patterns"),
    [
        ("missing", ["No checkpoint at", "nowhere.ckpt", "does not exist"]),
        ("empty_dir", ["empty_dir", "not a complete checkpoint", ".metadata"]),
        ("noise", ["noise.ckpt", "cannot be read as a checkpoint", "truncated"]),
        ("truncated_file", ["truncated.ckpt", "cannot be read as a checkpoint", "truncated"]),
        ("truncated_shards", ["__1_0.distcp is truncated", "100 bytes"]),
        ("other_model_sharded", ["does not fit the model", "missing keys", "'block.", "unexpected keys", "'blocks.0.",
                                 "strict_loading = False", "Nothing was loaded"]),
        ("other_model_full", ["does not fit the model", "missing keys", "unexpected keys", "Nothing was loaded"]),
        ("wider_sharded", ["shape mismatches", "'embed.weight' checkpoint (32, 32) vs model (32, 48)"]),
        ("wider_full", ["shape mismatches", "'embed.weight' checkpoint (32, 32) vs model (32, 48)"]),
        ("other_optimizer_sharded", ["Optimizer 0 is SGD", "holds a AdamW state", "Nothing was loaded"]),
        ("other_groups_sharded", ["Optimizer 0 has 1 param groups", "has 2", "Nothing was loaded"]),
        ("other_groups_full", ["Optimizer 0 cannot load the state", "2 param groups", "Nothing was loaded"]),
    ],
)
def test_bad_checkpoints_fail_clearly_and_load_nothing(results: dict[str, Any], case: str, patterns: list[str]) -> None:
    result = results["one"]["errors"][case]
    assert result.get("type") == "CheckpointError", result
    for pattern in patterns:
        assert pattern in result["message"], (pattern, result["message"])
    assert result["unchanged"]


def test_non_strict_loading_takes_the_keys_both_models_have(results: dict[str, Any]) -> None:
    assert torch.equal(results["one"]["errors"]["non_strict_embed"], results["two_ranks_full"]["state_dict"]["embed.weight"])


def test_a_save_into_a_directory_that_is_not_a_checkpoint_is_refused_on_every_rank(results: dict[str, Any]) -> None:
    same = results["same"]
    assert "users_dir: it is a directory that is not a checkpoint (it holds data.csv)" in same["into_users_dir"]
    assert same["users_dir_after"] == ["data.csv"] and same["into_users_dir_seconds"] < 30


def test_a_whole_checkpoint_replaces_a_sharded_one_at_its_path(results: dict[str, Any]) -> None:
    same = results["same"]
    assert same["swap_sharded_was_dir"] and same["swap_is_file"] and same["swap_step"] == 16
    assert same["swap_leftovers"] == []
    assert "Cannot save a whole checkpoint file at" in same["full_into_users_dir"]
    assert "not a checkpoint (it holds data.csv)" in same["full_into_users_dir"]
    assert same["users_dir_after_full"] == ["data.csv"]


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(results: dict[str, Any]) -> None:
    after = results["after_crash"]
    assert after["exists"] and after["partial"] and after["meta_step"] == 16  # the epoch-2 save, not epoch 3
    resumed = results["crash_resume"]
    assert resumed["global_step"] == 16
    assert _equal(resumed["resumed"], resumed["whole"])
    assert results["after_resave"] == {"partial": False, "meta_step": 24}


def test_checkpoint_error_is_a_value_error() -> None:
    assert issubclass(CheckpointError, ValueError)
