"""ZeRO under Lightning Fabric (lightning_zero/fabric.py, [Note: the engine under Fabric]): a
litgpt-style loop (accumulation with no_backward_sync, clipping, an LR scheduler) against Fabric's
DDP on 2 gloo ranks, sharded save/load across stages and with the Trainer's format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness import launched_environment, run_on_ranks

WORLD = 2
STEPS = 4
ACCUMULATE = 2


class _Scale(nn.Module):
    """A parameter and no reset_parameters()."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _fabric(strategy: Any, precision: str = "32-true") -> Any:
    import importlib

    from lightning.fabric import Fabric

    importlib.import_module("lightning_zero")  # registers the strategy names with Fabric
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=WORLD, precision=precision)
    fabric.launch()  # the ranks exist already (torchrun's environment): nothing is started
    return fabric


def _setup(fabric: Any, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    from models import TinyGPT

    torch.manual_seed(seed)
    module = TinyGPT()
    optimizer = module.configure_optimizers()  # AdamW, two param groups
    model, optimizer = fabric.setup(module, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return module, model, optimizer, scheduler


def _train(fabric: Any, model: Any, optimizer: Any, scheduler: Any, steps: int, start: int = 0) -> list[float]:
    """litgpt's loop: micro-batches with no_backward_sync, then clip, step, zero_grad."""
    from models import token_data

    data = token_data(256)
    losses = []
    for step in range(start, start + steps):
        for micro in range(ACCUMULATE):
            index = (step * ACCUMULATE + micro) * WORLD + fabric.global_rank
            tokens, targets = data[index * 4:(index + 1) * 4]
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                fabric.backward(loss / ACCUMULATE)
            losses.append(loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses


def _whole(fabric: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    gathered = getattr(fabric.strategy, "gathered_params", None)
    context = gathered(writeback=False) if gathered is not None else torch.no_grad()
    with context:
        return {name: p.detach().float().clone() for name, p in module.named_parameters()}


def _cases(tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy, consolidate
    from lightning_zero.zero.consistency import RanksDisagreeError
    from models import TinyGPT, fit, loader, token_data

    out: dict[str, Any] = {}
    for name in ("ddp", "zero1", "zero2", "zero3", "zero3_offload"):
        fabric = _fabric(name)
        module, model, optimizer, scheduler = _setup(fabric)
        out[f"{name} losses"] = _train(fabric, model, optimizer, scheduler, STEPS)
        out[name] = _whole(fabric, module)
        if name == "zero3":
            out["zero3 piece shape"] = tuple(module.head.weight.shape)

    # fabric.save at stage 3 mid-run, fabric.load into stage 2: the run goes on as if uninterrupted
    fabric = _fabric("zero3")
    module, model, optimizer, scheduler = _setup(fabric)
    _train(fabric, model, optimizer, scheduler, 2)
    path = Path(fabric.broadcast(tmp)) / "fabric_zero3"
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2}
    fabric.save(path, state)
    out["saved"] = _whole(fabric, module)
    _train(fabric, model, optimizer, scheduler, 2, start=2)
    out["uninterrupted"] = _whole(fabric, module)
    fabric = _fabric("zero2")
    module, model, optimizer, scheduler = _setup(fabric, seed=1)
    resumed = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(path, resumed)
    out["loaded step"], out["remainder"] = resumed["step"], sorted(remainder)
    out["loaded scheduler"] = scheduler.state_dict()["last_epoch"]
    out["loaded"] = _whole(fabric, module)
    _train(fabric, model, optimizer, scheduler, 2, start=2)
    out["resumed"] = _whole(fabric, module)
    try:
        fabric.load(path)
        out["load without state"] = None
    except ValueError as error:
        out["load without state"] = str(error)
    fabric.barrier()
    if fabric.global_rank == 0:  # the same format as the Trainer's: consolidate reads it
        consolidate(path, Path(tmp) / "fabric.pt", weights_only=True, progress=False)
        out["consolidated"] = torch.load(Path(tmp) / "fabric.pt", weights_only=True)["state_dict"]
    fabric.barrier()

    # a whole checkpoint of Fabric's DDP loads into ZeRO
    fabric = _fabric("ddp")
    module, model, optimizer, scheduler = _setup(fabric, seed=2)
    _train(fabric, model, optimizer, scheduler, 1)
    ddp_path = Path(tmp) / "ddp.ckpt"
    fabric.save(ddp_path, {"model": model, "optimizer": optimizer})
    out["ddp saved"] = _whole(fabric, module)
    fabric = _fabric("zero3")
    module, model, optimizer, scheduler = _setup(fabric, seed=3)
    fabric.load(ddp_path, {"model": model, "optimizer": optimizer})
    out["ddp loaded"] = _whole(fabric, module)
    # fabric.load_raw(path, model) of a bare state dict (torch.save(model.state_dict())), as Fabric's own
    # strategies take it (it was refused: "has no 'model'")
    torch.manual_seed(7)
    plain = TinyGPT()
    raw_path = Path(tmp) / "raw_state.pt"
    if fabric.global_rank == 0:
        torch.save(plain.state_dict(), raw_path)
    fabric.barrier()
    fabric.load_raw(raw_path, model)
    out["raw loaded"] = _whole(fabric, module)
    out["raw saved"] = {name: p.detach().clone() for name, p in plain.named_parameters()}

    # a checkpoint the Trainer wrote loads into Fabric
    pl.seed_everything(4)
    trained = TinyGPT()
    trainer = fit(trained, ZeroStrategy(stage=2), WORLD, steps=2)
    trainer_path = Path(tmp) / "trainer.ckpt"
    trainer.save_checkpoint(trainer_path)
    out["trainer saved"] = {name: p.detach().clone() for name, p in trained.named_parameters()}
    fabric = _fabric("zero3")
    module, model, optimizer, scheduler = _setup(fabric, seed=5)
    remainder = fabric.load(trainer_path, {"model": model, "optimizer": optimizer})
    out["trainer loaded"] = _whole(fabric, module)
    out["trainer remainder"] = sorted(remainder)

    # a step thrown away with optimizer.zero_grad() on the wrapper Fabric returns: a NaN gradient on
    # rank 1 makes clip_gradients raise on every rank; the loop skips the batch and trains on, as
    # under DDP (the wrapper's zero_grad left the optimizer's NaN clip factor in place for good)
    for name in ("ddp", "zero2", "zero3"):
        fabric = _fabric(name)
        module, model, optimizer, scheduler = _setup(fabric)
        tokens = torch.arange(16).view(2, 8) % 32
        skipped = []
        for step in range(4):
            poison = float("nan") if step == 1 and fabric.global_rank == 1 else 1.0
            fabric.backward(model(tokens).float().pow(2).mean() * poison)
            try:
                fabric.clip_gradients(model, optimizer, max_norm=0.5, error_if_nonfinite=True)
            except RuntimeError:
                optimizer.zero_grad()
                skipped.append(step)
                continue
            optimizer.step()
            optimizer.zero_grad()
        out[f"recovered {name}"] = {"params": _whole(fabric, module), "skipped": skipped}

    # a checkpoint Fabric wrote resumes a Trainer fit: weights and optimizer state, the LR scheduler
    # and the loops afresh (it has neither; Lightning raised a KeyError blaming save_weights_only)
    class StartWeights(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.weights = {name: p.detach().clone() for name, p in module.named_parameters()}
            self.steps = [float(s["step"]) for s in trainer.optimizers[0].state.values()]

    start = StartWeights()
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(stage=2), max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[start])
        trainer.fit(TinyGPT(), train_dataloaders=loader(), ckpt_path=str(path))
    out["fabric into trainer"] = {"weights": start.weights, "steps": start.steps, "global_step": trainer.global_step}

    # bf16-mixed: bf16 parameters over fp32 masters, training as fp32 does (to bf16's precision)
    fabric = _fabric("zero2", precision="bf16-mixed")
    module, model, optimizer, scheduler = _setup(fabric)
    out["bf16 dtype"] = module.head.weight.dtype
    out["bf16 losses"] = _train(fabric, model, optimizer, scheduler, STEPS)
    out["bf16"] = _whole(fabric, module)
    out["bf16 state dtypes"] = sorted({str(v.dtype) for state in optimizer.optimizer.optimizer.state.values()
                                       for k, v in state.items() if k.startswith("exp_avg")})

    # fabric.init_module(empty_init=True) at stage 3: built on the meta device, never whole
    fabric = _fabric("zero3")
    with fabric.init_module(empty_init=True):
        meta = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    try:
        fabric.setup(meta, torch.optim.AdamW(meta.parameters()))
        out["meta joint"] = None
    except ValueError as error:
        out["meta joint"] = str(error)
    meta_model = fabric.setup_module(meta)
    meta_optimizer = fabric.setup_optimizers(torch.optim.AdamW(meta_model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(fabric.global_rank))
    meta_losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(meta_model(tokens).flatten(0, 1), tokens.flatten())
        fabric.backward(loss)
        meta_optimizer.step()
        meta_optimizer.zero_grad()
        meta_losses.append(loss.item())
    out["meta losses"] = meta_losses
    out["meta numel"] = sum(p.numel() for p in meta.parameters())
    # a module on the meta device that nothing can initialize: refused, not left uninitialized
    fabric = _fabric("zero3")
    with fabric.init_module(empty_init=True):
        unresettable = nn.Sequential(nn.Linear(16, 16), _Scale(16))
    try:
        fabric.setup_module(unresettable)
        out["meta unresettable"] = None
    except ValueError as error:
        out["meta unresettable"] = str(error)

    # a rank with an extra backward: every rank raises at the step instead of hanging
    fabric = _fabric("zero2")
    module, model, optimizer, scheduler = _setup(fabric)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    try:
        for _ in range(1 + fabric.global_rank):
            fabric.backward(model(tokens).sum())
        optimizer.step()
        out["disagree"] = None
    except RanksDisagreeError as error:
        out["disagree"] = str(error)

    # rank 1 skips a step the others take, then calls one of the loop's collectives: without the
    # agreement before it, rank 1 waits there and the others in the step, for ever
    for stage, call in (("zero2", "barrier"), ("zero3", "save")):
        fabric = _fabric(stage)
        module, model, optimizer, scheduler = _setup(fabric)
        try:
            for step in range(2):
                fabric.backward(model(tokens).sum())
                if fabric.global_rank == 0 or step == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            if call == "barrier":
                fabric.barrier()
            else:
                fabric.save(Path(tmp) / "skipped", {"model": model, "optimizer": optimizer})
            out[f"skip then {call}"] = None
        except RanksDisagreeError as error:
            out[f"skip then {call}"] = str(error)
    # rank 1 runs one backward more, then both reach an all_reduce (its next step would pair that
    # backward's reductions with the others' next ones)
    fabric = _fabric("zero2")
    module, model, optimizer, scheduler = _setup(fabric)
    try:
        fabric.backward(model(tokens).sum())
        optimizer.step()
        optimizer.zero_grad()
        if fabric.global_rank == 1:
            fabric.backward(model(tokens).sum())
        fabric.all_reduce(torch.tensor(1.0))
        out["extra backward then all_reduce"] = None
    except RanksDisagreeError as error:
        out["extra backward then all_reduce"] = str(error)
    # two optimizers of the same size, each rank steps the other one: without the optimizer in the
    # step's agreement, each rank lands the other's reductions and both end with the same wrong weights
    fabric = _fabric("zero2")
    torch.manual_seed(0)
    pair = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    pair, *optimizers = fabric.setup(pair, *(torch.optim.SGD(part.parameters(), lr=0.1) for part in pair))
    try:
        fabric.backward(pair(torch.ones(2, 8)).sum())
        optimizers[fabric.global_rank].step()
        out["steps another optimizer"] = None
    except RanksDisagreeError as error:
        out["steps another optimizer"] = str(error)
    # bf16-mixed with two optimizers set up one by one, together (fabric.setup(model, opt1, opt2))
    # or apart (setup_module, then setup_optimizers(opt1, opt2)): both train as one optimizer with
    # the same two param groups (see [Note: optimizers set up one by one])
    import contextlib
    import warnings

    from lightning_zero import FrozenRoundingWarning

    data = token_data(64)
    for name in ("zero1", "zero2", "zero3"):
        for how in ("one", "together", "apart", "left out"):
            if how == "left out" and name != "zero2":
                continue
            fabric = _fabric(name, "bf16-mixed")
            torch.manual_seed(0)
            module = TinyGPT()
            decay = [p for p in module.parameters() if p.dim() >= 2]
            no_decay = [p for p in module.parameters() if p.dim() < 2]
            if how == "left out":
                decay = decay[1:]  # the embedding: random values, which bf16 rounds
            with warnings.catch_warnings(record=True) as caught, contextlib.suppress(RuntimeError):
                warnings.simplefilter("always")
                out[f"{name} bf16 {how}"] = None  # until the steps ran: a setup that raised leaves None
                if how == "one":
                    model, only = fabric.setup(module, torch.optim.AdamW([{"params": decay}, {"params": no_decay}]))
                    optimizers = [only]
                elif how == "together":
                    model, *optimizers = fabric.setup(module, torch.optim.AdamW(decay), torch.optim.AdamW(no_decay))
                else:
                    model = fabric.setup_module(module)
                    optimizers = list(fabric.setup_optimizers(torch.optim.AdamW(decay), torch.optim.AdamW(no_decay)))
                for step in range(3):
                    index = step * WORLD + fabric.global_rank
                    tokens, targets = data[index * 4:(index + 1) * 4]
                    fabric.backward(nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
                    for optimizer in optimizers:
                        optimizer.step()
                        optimizer.zero_grad()
                out[f"{name} bf16 {how}"] = _whole(fabric, module)
            out[f"{name} bf16 {how} warned"] = [str(w.message) for w in caught
                                                 if issubclass(w.category, FrozenRoundingWarning)]
    # agreed collectives still compute what they did
    fabric = _fabric("zero2")
    module, model, optimizer, scheduler = _setup(fabric)
    out["agreed all_reduce"] = float(fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum"))
    out["agreed broadcast"] = fabric.broadcast(fabric.global_rank + 5)
    fabric.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD, str(tmp_path_factory.mktemp("fabric")))


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_fabric_loop_matches_fabric_ddp(runs: list[dict[str, Any]], name: str) -> None:
    for out in runs:
        assert out[f"{name} losses"] == pytest.approx(out["ddp losses"], rel=1e-5, abs=1e-5)
        for key, value in out["ddp"].items():
            torch.testing.assert_close(out[name][key], value, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
    assert runs[0]["zero3 piece shape"] != (32, 32)  # stage 3 really sharded the parameters


def test_fabric_save_and_load_across_stages(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        for key, value in out["saved"].items():
            torch.testing.assert_close(out["loaded"][key], value, rtol=0, atol=0, msg=key)
            torch.testing.assert_close(out["resumed"][key], out["uninterrupted"][key], rtol=1e-5, atol=1e-5, msg=key)
        assert out["loaded step"] == 2 and out["loaded scheduler"] == 2
        assert out["remainder"] == []
        assert "pass them, e.g. fabric.load(path, {'model': model, 'optimizer': optimizer})" in out["load without state"]
    for key, value in runs[0]["saved"].items():
        torch.testing.assert_close(runs[0]["consolidated"][key], value, rtol=0, atol=0, msg=key)


def test_fabric_loads_ddp_and_trainer_checkpoints(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        for key, value in out["ddp saved"].items():
            torch.testing.assert_close(out["ddp loaded"][key], value, rtol=0, atol=0, msg=key)
        for key, value in out["trainer saved"].items():
            torch.testing.assert_close(out["trainer loaded"][key], value, rtol=0, atol=0, msg=key)
        assert "global_step" in out["trainer remainder"]  # the Trainer's loop state is handed back


def test_fabric_load_raw_takes_a_bare_state_dict_at_stage_3(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        for key, value in out["raw saved"].items():
            torch.testing.assert_close(out["raw loaded"][key], value, rtol=0, atol=0, msg=key)


def test_fabric_bf16_mixed_trains_bf16_parameters(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        assert out["bf16 dtype"] == torch.bfloat16
        assert out["bf16 losses"] == pytest.approx(out["zero2 losses"], abs=0.05)
        assert out["bf16 state dtypes"] == ["torch.float32"]  # Adam steps fp32 masters
        for key, value in out["zero2"].items():  # Adam's updates of lr=1e-2 are sign-like: 4 steps differ < 0.1
            assert (out["bf16"][key] - value).abs().max() < 0.1, key


def test_fabric_builds_a_stage3_model_on_the_meta_device(runs: list[dict[str, Any]]) -> None:
    whole = 32 * 16 + 16 * 32 + 32
    for out in runs:
        assert "Set the model up first, then build the optimizer" in out["meta joint"]
        assert out["meta numel"] < whole  # this rank's pieces only
        assert out["meta losses"][-1] < out["meta losses"][0]  # the same batch three times
        assert out["meta unresettable"] is not None and "_Scale was built on the meta device" in out["meta unresettable"]
    assert sum(out["meta numel"] for out in runs) >= whole


def test_fabric_ranks_that_disagree_raise_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        assert out["disagree"] is not None and "different numbers of backward calls" in out["disagree"]
        assert "by rank: [1, 2]" in out["disagree"]


def test_fabric_refuses_a_mesh_with_the_fix() -> None:
    from lightning_zero import ParallelConfig, ZeroConfig, ZeroFabricStrategy

    with pytest.raises(ValueError, match="tensor and pipeline parallelism need the Trainer"):
        ZeroFabricStrategy(config=ZeroConfig(parallel=ParallelConfig(tensor=2)))


def test_fabric_takes_a_deepspeed_config_and_names_what_it_refuses() -> None:
    from lightning_zero import CPUOffloadPolicy, ZeroConfig, ZeroFabricPrecision, ZeroFabricStrategy

    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}
    strategy = ZeroFabricStrategy(deepspeed_config=ds)
    assert strategy.config == ZeroConfig(stage=3, offload_optimizer=CPUOffloadPolicy(pin_memory=True))
    assert isinstance(strategy.precision, ZeroFabricPrecision) and strategy.precision.precision == "bf16-mixed"
    with pytest.raises(ValueError, match=r"ZeroFabricStrategy\(deepspeed_config=\.\.\., precision=\.\.\.\).*Drop precision,"):
        ZeroFabricStrategy(deepspeed_config=ds, precision=ZeroFabricPrecision("bf16-mixed"))
    with pytest.raises(ValueError, match=r"ZeroFabricStrategy\(deepspeed_config=\.\.\., stage=\.\.\.\)"):
        ZeroFabricStrategy(stage=2, deepspeed_config=ds)


def test_fabric_rank_that_skips_a_step_raises_at_the_next_collective(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        for call in ("barrier", "save"):  # rank 0 is inside its step's agreement
            message = out[f"skip then {call}"]
            assert message is not None, call
            assert f"rank 1 calls fabric.{call}() with 1 backward(s) not stepped" in message
            assert "rank 0 reduces the gradients of 1 backward(s)" in message
        message = out["extra backward then all_reduce"]  # both at the all_reduce, one holding a backward
        assert message is not None and "not stepped yet (by rank: [0, 1])" in message
        assert "reduce_boolean_decision" in message
        assert out["agreed all_reduce"] == 1.0 and out["agreed broadcast"] == 5
        assert out["steps another optimizer"] is not None
        assert out["steps another optimizer"].startswith(
            "The ranks are about to step different optimizers (rank 0 optimizer #1 after 1 backward(s), rank 1"
            " optimizer #2 after 1 backward(s);")


def test_a_fabric_checkpoint_resumes_a_trainer_fit(runs: list[dict[str, Any]]) -> None:
    for out in runs:
        resumed = out["fabric into trainer"]
        for key, value in out["saved"].items():
            torch.testing.assert_close(resumed["weights"][key], value, rtol=0, atol=0, msg=key)
        assert resumed["steps"] and set(resumed["steps"]) == {2.0}  # Adam's state after Fabric's 2 steps
        assert resumed["global_step"] == 1  # the loops start afresh: one step of this fit


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_a_step_thrown_away_with_zero_grad_on_fabrics_optimizer_trains_on_like_ddp(
    runs: list[dict[str, Any]], name: str
) -> None:
    for out in runs:
        ddp, zero = out["recovered ddp"], out[f"recovered {name}"]
        assert ddp["skipped"] == zero["skipped"] == [1]
        for key, value in ddp["params"].items():
            assert torch.isfinite(zero["params"][key]).all(), key
            torch.testing.assert_close(zero["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_fabric_bf16_optimizers_set_up_one_by_one_train_as_one(runs: list[dict[str, Any]], name: str) -> None:
    """[Note: optimizers set up one by one]: the second optimizer's fp32 masters come from the
    values before the first one's cast (it was refused before, as if a forward had rounded them)."""
    for out in runs:
        for how in ("together", "apart"):
            assert out[f"{name} bf16 {how}"] is not None, f"{how}: the setup raised"
            for key, value in out[f"{name} bf16 one"].items():
                torch.testing.assert_close(out[f"{name} bf16 {how}"][key], value, rtol=0, atol=0, msg=f"{how} {key}")
            assert out[f"{name} bf16 {how} warned"] == []  # every parameter has an optimizer
    if name == "zero2":  # the one parameter no optimizer trains is named, and only it
        (message,) = runs[0]["zero2 bf16 left out warned"]
        assert "1 fp32 parameter(s) that no optimizer trains ('embed.weight')" in message
