"""A stage-3 run stopped by an error (raised on every rank) leaves each rank's piece of every
parameter; gather_after_error gathers them back whole, and the module's next stage-3 run builds
its engine from them unit by unit, so catching the error and going on behaves as under DDP
([Note: pieces after an error] in strategy.py, [Note: re-sharding a module left in pieces] in
zero/stage3/engine.py). 2 gloo ranks."""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from harness import launched_environment, run_on_ranks
from lightning_zero import ZeroConfig, ZeroStrategy, gather_after_error
from lightning_zero.zero import engine as engine_module
from models import TinyGPT, fit, loader, params_of

WORLD = 2


class FailsAtStep2(TinyGPT):
    fail = True

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.fail and self.global_step == 2:
            raise ValueError("the user's error at step 2")
        return super().training_step(batch, batch_idx)


def _run(make: Any, precision: str, explicit: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    module = FailsAtStep2()
    try:
        fit(module, make(), WORLD, steps=5, precision=precision)
    except ValueError as error:
        assert "the user's error at step 2" in str(error)
    after_error = {n: tuple(p.shape) for n, p in module.named_parameters()}
    gathered = gather_after_error(module) if explicit else None
    whole_after_error = params_of(module) if explicit else None
    module.fail = False
    before = dict(module.named_parameters())
    fit(module, make(), WORLD, steps=3, precision=precision)
    # re-sharding replaces the parameter objects (as a build on the meta device does); a gather keeps them
    same_objects = all(param is before[name] for name, param in module.named_parameters())
    return {"shapes_after_error": after_error, "gathered": gathered, "whole_after_error": whole_after_error,
            "final": params_of(module), "again": gather_after_error(module), "same_objects": same_objects}


class FailsMidBackward(TinyGPT):
    """Raises from inside backward at step 2, with reductions of later units already in flight."""

    fail = True

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.fail and self.global_step == 2:
            self.block.linear1.weight.register_hook(self._raise)
        return loss

    def _raise(self, grad: Tensor) -> None:
        if self.fail:
            raise ValueError("the user's error inside backward")


def _mid_backward(make: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    module = FailsMidBackward()
    try:
        fit(module, make(), WORLD, steps=5)
    except ValueError as error:
        assert "inside backward" in str(error)
    module.fail = False
    fit(module, make(), WORLD, steps=3)
    return {"shapes": {n: tuple(p.shape) for n, p in module.named_parameters()}, "final": params_of(module)}


class WithBatchNorm(FailsAtStep2):
    """FailsAtStep2 with a batch norm over the embedding features (running statistics: buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_norm = torch.nn.BatchNorm1d(32)

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens) + self.batch_norm(self.embed(tokens).transpose(1, 2)).mean()


def _norm_statistics_after_mixed(make: Any) -> dict[str, Any]:
    """A bf16-mixed run stopped by an error, then validated at 32-true from its pieces: the norm
    statistics are back in their weights' dtype, as a hand-back leaves them."""
    torch.manual_seed(0)
    module = WithBatchNorm()
    try:
        fit(module, make(), WORLD, steps=5, precision="bf16-mixed")
    except ValueError:
        pass
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=make(), logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        val_loss = trainer.validate(module, dataloaders=loader(samples=32), verbose=False)[0]["val_loss"]
    return {"val_loss": val_loss, "dtypes": {name: value.dtype for name, value in module.batch_norm.named_buffers()}}


def _two_steps(make: Any, precision: str) -> dict[str, Any]:
    """What the module holds after a run that ended normally after the two steps the failing one
    took, and its validation loss."""
    torch.manual_seed(0)
    module = FailsAtStep2()
    trainer = fit(module, make(), WORLD, steps=2, precision=precision)
    with launched_environment():
        metrics = trainer.validate(module, dataloaders=loader(samples=32), verbose=False)
    return {"params": params_of(module), "val_loss": metrics[0]["val_loss"]}


def _setup_fails(make: Any) -> dict[str, Any]:
    """An error while the next fit builds its engine from the pieces: they stay the module's."""
    import lightning_zero.strategy as strategy_module

    torch.manual_seed(0)
    module = FailsAtStep2()
    try:
        fit(module, make(), WORLD, steps=5)
    except ValueError:
        pass
    pieces = params_of(module)
    try:
        with mock.patch.object(strategy_module, "make_engine", side_effect=RuntimeError("the engine could not be built")):
            fit(module, make(), WORLD, steps=3)
        failed = None
    except RuntimeError as error:
        failed = str(error)
    kept = params_of(module)
    return {"failed": failed, "kept": all(torch.equal(kept[k], pieces[k]) for k in pieces) and kept.keys() == pieces.keys(),
            "gathered": gather_after_error(module), "whole": params_of(module)}


def _short_of_memory(make: Any, directory: str) -> dict[str, Any]:
    """A run whose hand-back the host cannot take ([Note: a hand-back that does not fit])."""
    import lightning_zero.strategy as strategy_module

    torch.manual_seed(0)
    module = FailsAtStep2()
    short = mock.patch.object(strategy_module, "host_memory_available", lambda: 2**10)  # 1 KiB: the module does not fit
    with short, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(module, make(), WORLD, steps=2)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    with launched_environment():
        trainer.save_checkpoint(f"{directory}/in_pieces.ckpt")  # the engine still reads its masters
    # While memory is still short: a stage-3 run builds its engine from the pieces, never whole,
    # and leaves them again; a stage-2 run would gather the module whole first, and is refused.
    try:
        with short:
            with launched_environment(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validating = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=make(), logger=False,
                                        enable_progress_bar=False, enable_model_summary=False)
                val_loss = validating.validate(module, dataloaders=loader(samples=32), verbose=False)[0]["val_loss"]
            shapes_after_validate = {n: tuple(p.shape) for n, p in module.named_parameters()}
            try:  # the first Trainer's engine no longer holds the module
                with launched_environment():
                    trainer.save_checkpoint(f"{directory}/stale.ckpt")
                stale = None
            except RuntimeError as error:
                stale = str(error)
            fit(module, ZeroStrategy(config=ZeroConfig(stage=2)), WORLD, steps=3)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    gathered = gather_after_error(module)
    resumed = FailsAtStep2()
    with launched_environment():
        loaded = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=make(), max_steps=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        loaded.fit(resumed, train_dataloaders=loader(), ckpt_path=f"{directory}/in_pieces.ckpt")  # resumes at step 2: no step
    return {"shapes": shapes, "gathered": gathered, "whole": params_of(module), "loaded": params_of(resumed), "refused": refused,
            "val_loss": val_loss, "shapes_after_validate": shapes_after_validate, "stale": stale,
            "warnings": [str(w.message) for w in caught if "not handed back whole" in str(w.message)]}


class _Refs(pl.Callback):
    """Weak references to the run's optimizers, and whether the ones of an earlier run were
    freed by the time this one starts training."""

    def __init__(self, earlier: list[weakref.ref] | None = None) -> None:
        self.refs: list[weakref.ref] = []
        self.earlier = earlier or []
        self.earlier_alive: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.refs = [weakref.ref(optimizer) for optimizer in trainer.strategy.optimizers]
        self.earlier_alive = sum(ref() is not None for ref in self.earlier)


def _dropped_trainer(make: Any, collect_from_bytes: int, fail: bool = True) -> dict[str, Any]:
    """[Note: engines of earlier runs]: the Trainer of a run stopped by an error (or of one that
    ended) is dropped; the next fit frees its optimizers (state, masters) before its own are
    set up once the engines' parameters reach COLLECT_FROM_BYTES. Python's own collector is off,
    so only the engine's collection can free them."""
    torch.manual_seed(0)
    module = FailsAtStep2()
    module.fail = fail
    first = _Refs()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with mock.patch.object(engine_module, "COLLECT_FROM_BYTES", collect_from_bytes), \
                mock.patch.object(engine_module.gc, "collect", side_effect=gc.collect) as collect:
            try:
                fit(module, make(), WORLD, steps=5, callbacks=[first])
            except ValueError:
                pass
            module.fail = False
            second = _Refs(first.refs)
            fit(module, make(), WORLD, steps=2, callbacks=[second])
    finally:
        if enabled:
            gc.enable()
    return {"optimizers": len(first.refs), "earlier_alive": second.earlier_alive, "collections": collect.call_count}


def _cases(directory: str) -> dict[str, Any]:
    stage3 = lambda: ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=1))  # noqa: E731
    return {
        "zero3_short_of_memory": _short_of_memory(stage3, directory),
        "zero3_fp32_two_steps": _two_steps(stage3, "32-true"),
        "ddp": _run(lambda: "ddp", "32-true", explicit=True),
        "zero3": _run(stage3, "32-true", explicit=True),
        "zero3_next_fit": _run(stage3, "32-true", explicit=False),
        "zero3_next_fit_one_unit": _run(lambda: ZeroStrategy(config=ZeroConfig(stage=3)), "32-true", explicit=False),
        "zero3_bf16": _run(stage3, "bf16-mixed", explicit=True),
        "zero3_bf16_next_fit": _run(stage3, "bf16-mixed", explicit=False),
        "zero3_setup_fails": _setup_fails(stage3),
        "zero3_norm_statistics": _norm_statistics_after_mixed(stage3),
        "zero3_bf16_two_steps": _two_steps(stage3, "bf16-mixed"),
        "zero3_mid_backward": _mid_backward(stage3),
        "dropped_trainer": {"collects": _dropped_trainer(stage3, 0),
                            "after_a_finished_fit": _dropped_trainer(stage3, 0, fail=False),
                            "zero2": _dropped_trainer(lambda: "zero2", 0, fail=False),
                            "small_model": _dropped_trainer(stage3, engine_module.COLLECT_FROM_BYTES)},
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD, str(tmp_path_factory.mktemp("after_error")))


def _close(a: dict[str, Tensor], b: dict[str, Tensor], tolerance: float) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.allclose(a[k], b[k], atol=tolerance)
                                        for k in a)


def test_gather_after_error_hands_back_what_ddp_holds(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        ours, theirs = rank["zero3"], rank["ddp"]
        assert ours["shapes_after_error"] != theirs["shapes_after_error"]  # the pieces: 1-d
        assert ours["gathered"] is True and theirs["gathered"] is False
        assert _close(ours["whole_after_error"], theirs["whole_after_error"], 1e-5)
        assert _close(ours["final"], theirs["final"], 1e-5)
        assert ours["again"] is False


def test_after_a_mixed_precision_error_the_fp32_masters_come_back(ranks: list[dict[str, Any]]) -> None:
    """As the teardown of a run that ended there would hand them back: fp32, from the masters."""
    for rank in ranks:
        whole, ended = rank["zero3_bf16"]["whole_after_error"], rank["zero3_bf16_two_steps"]["params"]
        assert whole.keys() == ended.keys()
        assert all(whole[k].dtype == torch.float32 and torch.equal(whole[k], ended[k]) for k in whole)


def test_the_next_fit_builds_its_engine_from_the_pieces(ranks: list[dict[str, Any]]) -> None:
    """Exactly what gathering them whole first gives: same units or others, fp32 or from the
    bf16-mixed run's fp32 masters."""
    for rank in ranks:
        for resharded, gathered in (("zero3_next_fit", "zero3"), ("zero3_next_fit_one_unit", "zero3"),
                                    ("zero3_bf16_next_fit", "zero3_bf16")):
            assert rank[resharded]["gathered"] is None and rank[resharded]["again"] is False
            assert rank[resharded]["same_objects"] is False and rank[gathered]["same_objects"] is True
            final, expected = rank[resharded]["final"], rank[gathered]["final"]
            assert final.keys() == expected.keys()
            assert all(torch.equal(final[k], expected[k]) for k in final), resharded
        assert _close(rank["zero3_next_fit"]["final"], rank["ddp"]["final"], 1e-5)


def test_norm_statistics_come_back_in_their_weights_dtype_after_a_mixed_run(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        case = rank["zero3_norm_statistics"]
        assert case["dtypes"] == {"running_mean": torch.float32, "running_var": torch.float32,
                                  "num_batches_tracked": torch.int64}
        assert torch.isfinite(torch.tensor(case["val_loss"]))


def test_a_failed_re_shard_leaves_the_pieces(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        case = rank["zero3_setup_fails"]
        assert case["failed"] == "the engine could not be built"
        assert case["kept"] is True and case["gathered"] is True
        assert _close(case["whole"], rank["ddp"]["whole_after_error"], 1e-5)


def test_an_error_inside_backward_leaves_a_module_the_next_fit_takes(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        after = rank["zero3_mid_backward"]
        assert after["shapes"] == {n: tuple(p.shape) for n, p in TinyGPT().named_parameters()}
        assert all(torch.isfinite(value).all() for value in after["final"].values())


def test_a_module_the_host_cannot_take_whole_stays_in_pieces_and_is_not_lost(ranks: list[dict[str, Any]]) -> None:
    """[Note: a hand-back that does not fit]: with too little host memory for every rank's whole
    copy, teardown leaves the pieces (every rank agreeing) and says why; a next stage-3 run uses
    them as they are (and leaves them again), a stage-2 run is refused; a checkpoint saved after
    fit holds the trained weights, and gather_after_error gives them whole."""
    warned = ranks[0]["zero3_short_of_memory"]["warnings"]
    assert len(warned) == 1 and "FailsAtStep2 is not handed back whole: it takes" in warned[0]
    assert "on each of this node's 2 rank(s)" in warned[0] and "of the 1.0 KiB of host memory available" in warned[0]
    assert ranks[1]["zero3_short_of_memory"]["warnings"] == []  # said once, by rank 0
    for rank in ranks:
        case, ended = rank["zero3_short_of_memory"], rank["zero3_fp32_two_steps"]["params"]
        assert case["shapes"] != {name: tuple(value.shape) for name, value in ended.items()}  # the pieces: 1-d
        assert case["val_loss"] == rank["zero3_fp32_two_steps"]["val_loss"]
        assert case["shapes_after_validate"] == case["shapes"]
        assert case["stale"] is not None and "no longer holds the module" in case["stale"]
        assert case["refused"] is not None and "FailsAtStep2 is still each rank's pieces" in case["refused"]
        assert "this run (ZeRO stage 2) cannot take it: it would gather it whole first" in case["refused"]
        assert "A plain stage-3 run (e.g. strategy='zero3') takes the pieces as they are" in case["refused"]
        assert case["gathered"] is True
        assert case["whole"].keys() == ended.keys() == case["loaded"].keys()
        assert all(torch.equal(case["whole"][k], ended[k]) and torch.equal(case["loaded"][k], ended[k]) for k in ended)


def test_the_next_fit_frees_the_optimizers_of_a_dropped_trainer_first(ranks: list[dict[str, Any]]) -> None:
    """[Note: engines of earlier runs]: a dropped Trainer's optimizer state lives on in reference
    cycles until Python collects them; with a model of COLLECT_FROM_BYTES or more the next engine
    collects first, a small one leaves it to Python (no collection)."""
    for per_rank in ranks:
        cases = per_rank["dropped_trainer"]
        for case in ("collects", "after_a_finished_fit", "zero2"):
            assert cases[case]["optimizers"] == 1 and cases[case]["earlier_alive"] == 0, case
            assert cases[case]["collections"] >= 1, case
        assert cases["small_model"]["collections"] == 0
