"""Pipeline parallelism (torch.distributed.pipelining) under ZeRO 1/2, from Lightning.

One group of 4 gloo ranks runs every Trainer case (pp4, pp2 x dp2 at zero1/zero2/offload, the
interleaved and zero-bubble schedules, pp2 x tp2, accumulation + clipping + a scheduler, fp16,
validation and ModelCheckpoint, a checkpoint resumed at another pipeline size and without a
pipeline); one group of 2 ranks runs pp2 itself, the bubble measurement and the errors a batch
can cause. The reference is one process with torch.optim.AdamW on the same batches (fp32).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from harness import launched_environment, run_on_ranks
from models import VOCAB, token_data

from lightning_zero import ParallelConfig, PipelineConfig, ZeroConfig, ZeroStrategy
from lightning_zero.offload import CPUOffloadPolicy
from lightning_zero.parallel.mesh import resolve_dims
from lightning_zero.parallel.pipeline import (
    PipelineError,
    build_pipeline,
    check_microbatches,
    check_parameters_in_one_stage,
    pipeline_layers,
    split_batch,
    split_layers,
    stage_indices,
)
from lightning_zero.precision import ZeroPrecision

STEPS = 4
BATCH = 8  # per data-parallel rank
SAMPLES = 128
WEIGHT_ATOL = 1e-6  # fp32: micro-batch sums and the reductions add in another order (measured <= 5e-7)
LOSS_RTOL = 1e-5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class PipeNet(pl.LightningModule):
    """An embedding, blocks and a head: a forward that is its layers in order."""

    def __init__(self, width: int = 16, layers: int = 6, lr: float = 1e-2, scheduler: bool = False,
                 tensor_parallel: bool = False, poison_step: int | None = None) -> None:
        super().__init__()
        self.poison_step = poison_step
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)
        self.lr, self.scheduler, self.tensor_parallel = lr, scheduler, tensor_parallel
        self.losses: list[float] = []
        self.batches: list[tuple[Tensor, Tensor]] = []
        self.logged: list[float] = []

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def on_fit_start(self) -> None:
        # An overflow on the first stage only (only it holds blocks.0) at one step.
        if self.poison_step is not None and isinstance(self.blocks[0], Block):
            def poison(grad: Tensor) -> Tensor:
                return grad * float("inf") if self.trainer.global_step == self.poison_step else grad

            self.blocks[0].fc1.weight.register_hook(poison)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if self.tensor_parallel and mesh is not None and "tensor" in (mesh.mesh_dim_names or ()):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {}
            for index in range(len(self.blocks)):
                plan[f"blocks.{index}.fc1"] = ColwiseParallel()
                plan[f"blocks.{index}.fc2"] = RowwiseParallel()
            parallelize_module(self, mesh["tensor"], plan)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        self.log("tokens_seen", float(targets.numel()), reduce_fx="sum")
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batches.append((batch[0].clone(), batch[1].clone()))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.logged.append(float(self.trainer.callback_metrics["train_loss"]))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("test_loss", nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten()))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def new_model(**kwargs: Any) -> PipeNet:
    torch.manual_seed(0)
    return PipeNet(**kwargs)


def train_loader(batch: int = BATCH) -> DataLoader:
    return DataLoader(token_data(SAMPLES), batch_size=batch, shuffle=False)


def _trainer(strategy: ZeroStrategy, steps: int, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      **kwargs)


def _run(config: ZeroConfig, steps: int = STEPS, module: PipeNet | None = None, precision: Any = None,
         ckpt_path: str | None = None, save: str | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    module = module if module is not None else new_model()
    strategy = ZeroStrategy(config=config)
    if precision is not None:
        trainer_kwargs["plugins"] = [precision]
    with launched_environment():
        trainer = _trainer(strategy, steps, **trainer_kwargs)
        trainer.fit(module, train_dataloaders=train_loader(), ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "losses": module.losses,
        "logged": module.logged,
        "batches": module.batches,
        "params": {name: p.detach().clone() for name, p in module.named_parameters()},
        "metrics": metrics,
        "stage_indices": strategy.pipeline.indices if strategy.pipeline is not None else None,
    }


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test compares the message
        return f"{type(error).__name__}: {error}"
    return "no error"


# ---------------------------------------------------------------------------------------- 4 ranks
def _four_rank_cases(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank()}
    pipe = PipelineConfig
    out["pp4"] = _run(ZeroConfig(stage=1, pipeline=pipe(size=4, microbatches=4)))
    out["pp2_zero1"] = _run(ZeroConfig(stage=1, pipeline=pipe(size=2, microbatches=4)))
    out["pp2_zero2"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4), reduce_bucket_size=500))
    out["pp2_zero2_offload"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4),
                                               offload_optimizer=CPUOffloadPolicy()))
    out["interleaved"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4, stages_per_rank=2,
                                                                schedule="interleaved_1f1b")),
                              save=os.path.join(tmp, "interleaved.ckpt"))
    out["interleaved_ckpt"] = os.path.join(tmp, "interleaved.ckpt")
    out["interleaved_zb"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4, stages_per_rank=2,
                                                                   schedule="interleaved_zero_bubble")))
    out["zbv"] = _run(ZeroConfig(stage=1, pipeline=pipe(size=2, microbatches=4, stages_per_rank=2,
                                                        schedule="zbv_zero_bubble")))
    out["pp2_tp2"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4), parallel=ParallelConfig(tensor=2)),
                          module=new_model(tensor_parallel=True))
    out["accumulate_clip_schedule"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=2)),
                                           module=new_model(scheduler=True), steps=3, accumulate_grad_batches=2,
                                           gradient_clip_val=0.05)
    out["fp16"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4)), precision=ZeroPrecision("16-mixed"),
                       steps=5, module=new_model(poison_step=2))
    # Validation and a ModelCheckpoint monitoring a metric logged on the last stage.
    directory = os.path.join(tmp, "monitored")
    callback = pl.callbacks.ModelCheckpoint(dirpath=directory, monitor="train_loss", save_top_k=1,
                                            every_n_train_steps=2)
    module = new_model()
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4))), STEPS,
                           callbacks=[callback], enable_checkpointing=True, val_check_interval=2)
        val = DataLoader(token_data(32, seed=1), batch_size=BATCH)
        trainer.fit(module, train_dataloaders=train_loader(), val_dataloaders=val)
        validated = trainer.validate(module, val, verbose=False)
    out["monitored"] = {
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "validate": validated[0]["val_loss"],
        "best": callback.best_model_path,
        "best_score": float(callback.best_model_score),
        "params": {name: p.detach().clone() for name, p in module.named_parameters()},
    }
    # A pipelined checkpoint, resumed with another pipeline size and without a pipeline.
    path = os.path.join(tmp, "pp2.ckpt")
    out["saved"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=2, microbatches=4)), steps=3, save=path)
    out["resumed_pp4"] = _run(ZeroConfig(stage=2, pipeline=pipe(size=4, microbatches=4)), steps=5, ckpt_path=path)
    out["resumed_plain"] = _run(ZeroConfig(stage=1), steps=5, ckpt_path=path)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_four_rank_cases, 4, str(tmp_path_factory.mktemp("pipeline")))


# ---------------------------------------------------------------------------------------- reference
def sampler_batches(data: int, steps: int, batch: int = BATCH) -> list[list[tuple[Tensor, Tensor]]]:
    """Each step's batch on every data-parallel rank, as Lightning's DistributedSampler gives them."""
    dataset = token_data(SAMPLES)
    orders = [list(DistributedSampler(dataset, num_replicas=data, rank=r, shuffle=True, seed=0)) for r in range(data)]
    out = []
    for step in range(steps):
        ranks = []
        for order in orders:
            indices = order[step * batch:(step + 1) * batch]
            ranks.append((dataset.tensors[0][indices], dataset.tensors[1][indices]))
        out.append(ranks)
    return out


def reference(steps_batches: list[list[tuple[Tensor, Tensor]]], accumulate: int = 1, clip: float | None = None,
              scheduler: bool = False) -> tuple[list[float], dict[str, Tensor]]:
    """One process: every data-parallel rank's loss averaged, AdamW, as Lightning would step."""
    model = new_model(scheduler=scheduler)
    optimizer_config = model.configure_optimizers()
    optimizer = optimizer_config["optimizer"] if scheduler else optimizer_config
    schedule = optimizer_config["lr_scheduler"]["scheduler"] if scheduler else None
    losses = []
    for index, ranks in enumerate(steps_batches):
        per_rank = [nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in ranks]
        loss = torch.stack(per_rank).mean()
        (loss / accumulate).backward()
        losses.append(float(per_rank[0].detach()))
        if (index + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            if schedule is not None:
                schedule.step()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def whole_model(ranks: list[dict[str, Any]], case: str) -> dict[str, Tensor]:
    """Every rank's parameters together (each pipeline stage holds its own; replicas agree)."""
    whole: dict[str, Tensor] = {}
    for rank in ranks:
        for name, value in rank[case]["params"].items():
            if name in whole:
                assert torch.equal(whole[name], value), f"{case}: {name} differs between ranks holding it"
            whole[name] = value
    return whole


def assert_weights(whole: dict[str, Tensor], expected: dict[str, Tensor], case: str) -> None:
    assert whole.keys() == expected.keys(), case
    worst = max((whole[k] - expected[k]).abs().max().item() for k in whole)
    print(f"{case}: largest weight difference from one process {worst:.2e}")
    assert worst < WEIGHT_ATOL, f"{case}: weights differ from the single-process run by {worst:.2e}"


@pytest.mark.parametrize("case, data", [("pp4", 1), ("pp2_zero1", 2), ("pp2_zero2", 2), ("pp2_zero2_offload", 2),
                                        ("interleaved", 2), ("interleaved_zb", 2), ("zbv", 2)])
def test_pipelines_match_one_process(four: list[dict[str, Any]], case: str, data: int) -> None:
    expected_losses, expected = reference(sampler_batches(data, STEPS))
    assert_weights(whole_model(four, case), expected, case)
    for rank in four:  # every rank of data-parallel rank 0 sees the last stage's loss
        if rank["rank"] % data == 0:
            assert rank[case]["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL)
            assert rank[case]["logged"] == pytest.approx(expected_losses, rel=LOSS_RTOL)


def test_pipeline_ranks_run_their_stages(four: list[dict[str, Any]]) -> None:
    assert [rank["pp4"]["stage_indices"] for rank in four] == [[0], [1], [2], [3]]
    # pp outermost: ranks 0, 1 are stage 0's data-parallel ranks
    assert [rank["pp2_zero1"]["stage_indices"] for rank in four] == [[0], [0], [1], [1]]
    assert [rank["interleaved"]["stage_indices"] for rank in four] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [rank["zbv"]["stage_indices"] for rank in four] == [[0, 3], [0, 3], [1, 2], [1, 2]]
    # each rank holds only its stages' layers
    stage0 = set(four[0]["pp2_zero1"]["params"])
    stage1 = set(four[2]["pp2_zero1"]["params"])
    assert not stage0 & stage1 and "embed.weight" in stage0 and "head.weight" in stage1


def test_interleaved_checkpoint_lists_the_model_in_its_own_order(four: list[dict[str, Any]]) -> None:
    """Rank 0 holds stages 0 and 2: the meta still lists keys and each param group's parameters
    in the model's order, as a consolidated torch-format export numbers them."""
    from lightning_zero.checkpoint.sharded import read_meta, read_metadata, resolve_checkpoint_path

    path = resolve_checkpoint_path(four[0]["interleaved_ckpt"])
    meta = read_meta(path, read_metadata(path))
    model = new_model()
    assert meta.model_keys == list(model.state_dict())
    assert meta.optimizers[0]["param_groups"][0]["params"] == [name for name, _ in model.named_parameters()]


def test_pipeline_with_tensor_parallel_matches_one_process(four: list[dict[str, Any]]) -> None:
    """pp2 x tp2: each rank holds a tensor rank's half of its stage's fc1/fc2."""
    _, expected = reference(sampler_batches(1, STEPS))
    whole: dict[str, Tensor] = {}
    for rank in four:
        tensor_rank = rank["rank"] % 2
        for name, value in rank["pp2_tp2"]["params"].items():
            if ".fc1." in name or (".fc2." in name and name.endswith("weight")):
                whole.setdefault(name, [None, None])[tensor_rank] = value  # type: ignore[assignment]
            else:
                whole[name] = value
    joined = {name: torch.cat(value, dim=0 if ".fc1." in name else 1) if isinstance(value, list) else value
              for name, value in whole.items()}
    assert_weights(joined, expected, "pp2_tp2")


def test_accumulation_clipping_and_scheduler_match_one_process(four: list[dict[str, Any]]) -> None:
    """accumulate_grad_batches=2, gradient_clip_val (the norm over every stage) and a StepLR."""
    _, expected = reference(sampler_batches(2, 6), accumulate=2, clip=0.05, scheduler=True)
    assert_weights(whole_model(four, "accumulate_clip_schedule"), expected, "accumulate_clip_schedule")


def test_fp16_stages_skip_together(four: list[dict[str, Any]]) -> None:
    """fp16 loss scaling: one overflow decision over every stage. A gradient that overflows on
    the first stage only (step 2) makes every rank skip that step (the scale stays at 2**16: the
    default hysteresis of 2 tolerates one overflow)."""
    metrics = [rank["fp16"]["metrics"] for rank in four]
    assert {(m["loss_scale"], m["skipped_steps"]) for m in metrics} == {(2.0 ** 16, 1.0)}
    whole_model(four, "fp16")  # raises if two ranks holding a parameter disagree
    assert all(math.isfinite(loss) for rank in four for loss in rank["fp16"]["losses"])


def test_logged_metrics_reach_every_rank(four: list[dict[str, Any]]) -> None:
    """The last stage's train_loss and val_loss are on every rank: ModelCheckpoint agrees."""
    monitored = [rank["monitored"] for rank in four]
    assert len({m["val_loss"] for m in monitored}) == 1
    assert len({m["best"] for m in monitored}) == 1 and os.path.basename(monitored[0]["best"]).endswith(".ckpt")
    # train_loss is each data-parallel rank's own (as under DDP): the same on every stage of one pipeline
    assert monitored[0]["best_score"] == monitored[2]["best_score"]
    assert monitored[1]["best_score"] == monitored[3]["best_score"]
    assert monitored[0]["validate"] == pytest.approx(monitored[0]["val_loss"], rel=1e-6)
    # validation ran the trained model: its loss is the single-process model's on the same data
    _, expected = reference(sampler_batches(2, STEPS))
    model = new_model()
    model.load_state_dict(expected, strict=True)
    tokens, targets = token_data(32, seed=1).tensors
    with torch.no_grad():
        val = torch.stack([nn.functional.cross_entropy(model(tokens[i:i + BATCH]).flatten(0, 1),
                                                       targets[i:i + BATCH].flatten()) for i in range(0, 32, BATCH)])
    assert monitored[0]["val_loss"] == pytest.approx(float(val.mean()), abs=1e-4)
    sums = [rank["pp2_zero1"]["metrics"]["tokens_seen"] for rank in four]
    assert sums == [BATCH * 8] * 4  # reduce_fx="sum" over the micro-batches: the whole batch's tokens


@pytest.mark.parametrize("case, data", [("resumed_pp4", 1), ("resumed_plain", 4)])
def test_checkpoint_resumes_with_another_pipeline_size(four: list[dict[str, Any]], case: str, data: int) -> None:
    """Saved at pp2 x dp2 after 3 steps; resumed at pp4 and without a pipeline (dp4) for 2 more:
    the weights equal one process that trained on the same batches, so the weights and the
    optimizer state (Adam's moments and step) came back."""
    saved = four[0]["saved"]
    first = sampler_batches(2, 3)
    by_data_rank: dict[int, list[tuple[Tensor, Tensor]]] = {}
    for rank in four:
        data_rank = rank["rank"] % data if data > 1 else 0
        by_data_rank.setdefault(data_rank, rank[case]["batches"])
    later = [[by_data_rank[r][step] for r in range(data)] for step in range(2)]
    assert len(saved["batches"]) == 3
    _, expected = reference(first + later)
    assert_weights(whole_model(four, case), expected, case)


# ---------------------------------------------------------------------------------------- 2 ranks
WIDE, ROWS = 512, 256  # per micro-batch: 8 layers of 256 x 512 x 512, tens of ms against a 0.5 MB message


class Wide(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class WideNet(nn.Module):
    """Compute-heavy layers, so that the bubble shows over the communication."""

    def __init__(self, width: int = 384, layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Wide(width) for _ in range(layers))

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)


def _idle_fractions(schedule: str, stages_per_rank: int, microbatches: int, steps: int = 4) -> float:
    torch.manual_seed(0)
    module = WideNet(WIDE)
    group = dist.new_group(list(range(dist.get_world_size())))
    config = PipelineConfig(size=2, schedule=schedule, stages_per_rank=stages_per_rank, microbatches=microbatches)
    runner = build_pipeline(module, config, group, torch.device("cpu"))
    runner.record_actions()
    batch = torch.randn(microbatches * ROWS, WIDE)
    fractions = []
    for _ in range(steps):
        runner.train_step(batch, batch.shape[0], lambda out, i: out.square().mean())
        fractions.append(runner.timing.idle_fraction)
    # The least disturbed steady-state step: on 2 shared cores one step in a few loses its core to
    # another process, and the idle it measures is then the wait for the descheduled rank.
    return min(fractions[1:])


class NoIndexNet(PipeNet):
    """training_step without batch_idx: Lightning passes only the batch."""

    def training_step(self, batch: tuple[Tensor, Tensor]) -> Tensor:  # type: ignore[override]
        return super().training_step(batch, 0)


def crop_collate(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Every other batch is 6 tokens long instead of 8: the shapes between stages change."""
    tokens = torch.stack([x for x, _ in samples])
    targets = torch.stack([y for _, y in samples])
    length = 6 if int(tokens[0, 0]) % 2 else 8
    return tokens[:, :length], targets[:, :length]


class ViewOutput(nn.Module):
    """A layer whose output is a view (a Linear over a 3-d input)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class ViewNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViewOutput(width) for _ in range(4))

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)


class HeadLrNet(PipeNet):
    """configure_optimizers names the head, which only the last stage holds."""

    def configure_optimizers(self) -> Any:
        head = [self.head.weight, self.head.bias]
        rest = [p for p in self.parameters() if all(p is not q for q in head)]
        return torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 1e-3}], lr=self.lr)


class GatheringNet(PipeNet):
    """Gathers its loss over the ranks in validation_step, as under DDP: a collective in a step
    that runs on the last stage only."""

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.all_gather(nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten()))


class FailingNet(PipeNet):
    """A user error in training_step (run on the last stage only) at the second step, or a loss
    detached from the graph."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.detach = detach

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 1 and not self.detach:
            raise ValueError("the user's loss failed")
        loss = super().training_step(batch, batch_idx)
        return loss.detach() if self.detach else loss


def _two_rank_cases(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank()}
    # Whole-model files (an export, DDP's): weights-only resumes, each stage taking its layers;
    # torch-format optimizer state (indexed over the whole model) is refused with the fix.
    from safetensors.torch import save_file

    tensors, full = os.path.join(tmp, "whole.safetensors"), os.path.join(tmp, "whole.ckpt")
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        other = PipeNet()
        save_file({k: v.contiguous() for k, v in other.state_dict().items()}, tensors)
        optimizer = torch.optim.AdamW(other.parameters())
        torch.save({"state_dict": other.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 0,
                    "global_step": 0, "pytorch-lightning_version": pl.__version__}, full)
    dist.barrier()
    out["from_safetensors"] = _run(ZeroConfig(stage=2, pipeline=PipelineConfig(size=2, microbatches=4)), steps=1,
                                   ckpt_path=tensors)
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=2, pipeline=PipelineConfig(size=2))), 1)
        out["from_full"] = _error(lambda: trainer.fit(new_model(), train_dataloaders=train_loader(), ckpt_path=full))
    out["pp2"] = _run(ZeroConfig(stage=2, pipeline=PipelineConfig(size=2, microbatches=4)))
    # test and predict after fit, on the same (split) module: forward only through the pipeline
    module = new_model()
    evaluation = DataLoader(token_data(16, seed=2), batch_size=BATCH)
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=2, pipeline=PipelineConfig(size=2, microbatches=4))),
                           STEPS)
        trainer.fit(module, train_dataloaders=train_loader())
        tested = trainer.test(module, evaluation, verbose=False)
        predicted = trainer.predict(module, evaluation)
    out["evaluated"] = {"test_loss": tested[0]["test_loss"], "predicted": predicted}
    out["gpipe"] = _run(ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=2, schedule="gpipe")))
    out["idle_1f1b"] = _idle_fractions("1f1b", 1, 4, steps=6)
    out["idle_zbv"] = _idle_fractions("zbv_zero_bubble", 2, 4, steps=6)
    # A batch no micro-batch count fits (1f1b needs 2 or more at pp2; 7 samples split only as 1 or 7)
    # fails on both ranks alike, before any stage runs.
    module = new_model()
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=4))), 2)
        out["indivisible"] = _error(lambda: trainer.fit(module, train_dataloaders=train_loader(7)))
    # 3 micro-batches asked of full batches of 4: refused, not run as 2 without a word
    module = new_model()
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=3))), 2)
        out["indivisible_full"] = _error(lambda: trainer.fit(module, train_dataloaders=train_loader(4)))
    # Short last batches: 22 samples in batches of 8 (the last one 6: 3 micro-batches of 2, not 4),
    # and a validation set of 10 (the last batch 2).
    module = new_model()
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=2, pipeline=PipelineConfig(size=2, microbatches=4))), 3)
        trainer.fit(module, train_dataloaders=DataLoader(token_data(22), batch_size=BATCH),
                    val_dataloaders=DataLoader(token_data(10, seed=1), batch_size=BATCH))
    out["short"] = {"params": {name: p.detach().clone() for name, p in module.named_parameters()},
                    "batches": module.batches, "val_loss": float(trainer.callback_metrics["val_loss"])}
    # A validation set smaller than one batch (6 samples, 4 micro-batches asked): forward only, it
    # runs as the largest count that divides it, even as the first evaluation batch.
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=4))), 1)
        out["small_val"] = _error(lambda: out.__setitem__("small_val_loss", trainer.validate(
            new_model(), DataLoader(token_data(6, seed=1), batch_size=BATCH), verbose=False)[0]["val_loss"]))
    # Batches of 1 under 1f1b (2 micro-batches at least): the fix names a schedule that takes them.
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=2))), 1)
        out["batch_of_one"] = _error(lambda: trainer.fit(new_model(), train_dataloaders=train_loader(1)))
    # A collective in a step, which runs on the last stage only: an error on every rank, not a hang.
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=2))), 1)
        out["collective"] = _error(lambda: trainer.validate(GatheringNet(), DataLoader(token_data(8), batch_size=BATCH),
                                                            verbose=False))
    # Stage 2 reduces each bucket once per optimizer step, whatever the micro-batch count.
    from lightning_zero.zero.comm import Collectives

    calls = [0]
    original = Collectives.reduce_scatter

    def counting(self: Collectives, output: Tensor, input: Tensor) -> Any:
        calls[0] += 1
        return original(self, output, input)

    Collectives.reduce_scatter = counting  # type: ignore[method-assign]
    try:
        counts = {}
        for microbatches in (2, 8):
            calls[0] = 0
            strategy = ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=300,
                                                      pipeline=PipelineConfig(size=2, microbatches=microbatches)))
            with launched_environment():
                _trainer(strategy, 3).fit(new_model(), train_dataloaders=train_loader())
            buckets = sum(len(list(layout.buckets)) for layout in strategy.engine.layouts)
            counts[microbatches] = (calls[0], buckets)
        out["reductions"] = counts
    finally:
        Collectives.reduce_scatter = original  # type: ignore[method-assign]
    # training_step(self, batch) with accumulation: the window's first batch zeroes the gradients.
    torch.manual_seed(0)
    out["no_index"] = _run(ZeroConfig(stage=2, pipeline=PipelineConfig(size=2, microbatches=4)), steps=2,
                           module=NoIndexNet(), accumulate_grad_batches=2)
    # Batches of two sequence lengths: every rank builds the stages for a new shape together.
    module = new_model()
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=2))), 4)
        trainer.fit(module, train_dataloaders=DataLoader(token_data(SAMPLES), batch_size=BATCH,
                                                         collate_fn=crop_collate))
    out["cropped"] = {"params": {name: p.detach().clone() for name, p in module.named_parameters()},
                      "batches": module.batches}
    # The zero-bubble input backward detaches stage outputs in place: a view output is copied.
    torch.manual_seed(0)
    runner = build_pipeline(ViewNet(), PipelineConfig(size=2, schedule="zbv_zero_bubble", stages_per_rank=2,
                                                      microbatches=2), dist.new_group([0, 1]), torch.device("cpu"))
    runner.train_step(torch.randn(4, 3, 8), 4, lambda output, index: output.square().mean())
    out["view_outputs"] = "ran"
    # Evaluation under the V schedule is refused on every rank alike (torch has no forward-only V).
    zbv = ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2, microbatches=2, stages_per_rank=2,
                                                                          schedule="zbv_zero_bubble")))
    with launched_environment():
        out["zbv_eval"] = _error(lambda: _trainer(zbv, 1).validate(new_model(), DataLoader(token_data(16), batch_size=8),
                                                                   verbose=False))
    # A module split by a pipelined run cannot then run without a pipeline.
    split = new_model()
    with launched_environment():
        _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2))), 1).fit(
            split, train_dataloaders=train_loader())
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1)), 1)
        out["split_reused"] = _error(lambda: trainer.fit(split, train_dataloaders=train_loader()))
    # Weight averaging would copy the whole model on every rank: refused.
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2))), 1,
                           callbacks=[pl.callbacks.EMAWeightAveraging(decay=0.9)])
        out["ema"] = _error(lambda: trainer.fit(new_model(), train_dataloaders=train_loader()))
    # configure_optimizers failing on one stage only fails every rank.
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2))), 1)
        out["optimizer_error"] = _error(lambda: trainer.fit(HeadLrNet(), train_dataloaders=train_loader()))
    # An error in the user's step on the last stage: every rank raises it, none waits for gradients.
    torch.manual_seed(0)
    failing = FailingNet()
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=2, pipeline=PipelineConfig(size=2))), 3)
        out["user_error"] = _error(lambda: trainer.fit(failing, train_dataloaders=train_loader()))
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=2, pipeline=PipelineConfig(size=2))), 3)
        out["detached"] = _error(lambda: trainer.fit(FailingNet(detach=True), train_dataloaders=train_loader()))
    # Tied weights across stages: refused at setup, on both ranks.
    tied = new_model()
    tied.head.weight = tied.embed.weight
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=ZeroConfig(stage=1, pipeline=PipelineConfig(size=2))), 2)
        out["tied"] = _error(lambda: trainer.fit(tied, train_dataloaders=train_loader()))
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_two_rank_cases, 2, str(tmp_path_factory.mktemp("pipeline2")))


@pytest.mark.parametrize("case", ["pp2", "gpipe"])
def test_pp2_matches_one_process(two: list[dict[str, Any]], case: str) -> None:
    expected_losses, expected = reference(sampler_batches(1, STEPS))
    assert_weights(whole_model(two, case), expected, case)
    assert two[0][case]["losses"] == pytest.approx(expected_losses, rel=LOSS_RTOL)
    assert two[0][case]["losses"] == two[1][case]["losses"]


def test_stage_2_reduces_once_per_step_not_per_micro_batch(two: list[dict[str, Any]]) -> None:
    for rank in two:
        for microbatches, (calls, buckets) in rank["reductions"].items():
            assert buckets > 1
            assert calls == 3 * buckets, (microbatches, calls, buckets)  # 3 steps, one reduction per bucket


def test_training_step_without_batch_idx_accumulates(two: list[dict[str, Any]]) -> None:
    _, expected = reference(sampler_batches(1, 4), accumulate=2)
    assert_weights(whole_model(two, "no_index"), expected, "no_index")


def test_changing_shapes_rebuild_the_stages_on_every_rank(two: list[dict[str, Any]]) -> None:
    cropped = two[0]["cropped"]
    assert {x.shape[1] for x, _ in cropped["batches"]} == {6, 8}
    _, expected = reference([[batch] for batch in cropped["batches"]])
    assert_weights(whole_model(two, "cropped"), expected, "cropped")


def test_zero_bubble_copies_view_outputs(two: list[dict[str, Any]]) -> None:
    assert [rank["view_outputs"] for rank in two] == ["ran", "ran"]


def test_refusals_on_every_rank(two: list[dict[str, Any]]) -> None:
    assert "'Identity' object has no attribute 'weight'" in two[0]["optimizer_error"]
    assert two[1]["optimizer_error"].startswith("RuntimeError: configure_optimizers failed on rank 0")
    for rank in two:
        assert "WeightAveraging callbacks are not supported with pipeline parallelism" in rank["ema"]
        assert "no forward-only schedule for the V placement" in rank["zbv_eval"]
        assert "was split into pipeline stages by an earlier run" in rank["split_reused"]


def test_short_last_batches_run_as_fewer_micro_batches(two: list[dict[str, Any]]) -> None:
    short = two[0]["short"]
    assert [len(x) for x, _ in short["batches"]] == [8, 8, 6]
    _, expected = reference([[batch] for batch in short["batches"]])
    assert_weights(whole_model(two, "short"), expected, "short")
    model = new_model()
    model.load_state_dict(expected)
    tokens, targets = token_data(10, seed=1).tensors
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(model(tokens[a:b]).flatten(0, 1), targets[a:b].flatten()) for a, b in
                  ((0, 8), (8, 10))]
    expected_val = (8 * float(losses[0]) + 2 * float(losses[1])) / 10  # Lightning weighs by batch size
    assert [rank["short"]["val_loss"] for rank in two] == pytest.approx([expected_val] * 2, abs=1e-5)


def test_whole_model_files_load_into_the_stages(two: list[dict[str, Any]]) -> None:
    torch.manual_seed(1)
    other = PipeNet()
    batches = sampler_batches(1, 1)
    optimizer = torch.optim.AdamW(other.parameters(), lr=other.lr, weight_decay=0.1)
    x, y = batches[0][0]
    nn.functional.cross_entropy(other(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    assert_weights(whole_model(two, "from_safetensors"), {n: p.detach() for n, p in other.named_parameters()},
                   "from_safetensors")
    for rank in two:
        assert "whole-model checkpoint with torch-format optimizer state" in rank["from_full"]
        assert "Resume from a sharded checkpoint" in rank["from_full"]


def test_test_and_predict_run_through_the_pipeline(two: list[dict[str, Any]]) -> None:
    _, expected = reference(sampler_batches(1, STEPS))
    model = new_model()
    model.load_state_dict(expected)
    tokens, targets = token_data(16, seed=2).tensors
    with torch.no_grad():
        logits = model(tokens)
    loss = float(nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert [rank["evaluated"]["test_loss"] for rank in two] == pytest.approx([loss, loss], abs=1e-5)
    assert two[0]["evaluated"]["predicted"] == [None, None]  # the first stage has no output
    assert torch.equal(torch.cat(two[1]["evaluated"]["predicted"]), logits.argmax(-1))


def test_bubble_is_near_theory_and_zero_bubble_is_lower(two: list[dict[str, Any]]) -> None:
    """Per-rank idle time within a step, from timing each F/B/W action: 1F1B with p=2, m=4
    idles (p-1)/(m+p-1) = 0.2 of the step (plus the time activations take to pass); the V
    zero-bubble schedule fills that time with weight gradients."""
    theory = (2 - 1) / (4 + 2 - 1)
    idle_1f1b = [rank["idle_1f1b"] for rank in two]
    idle_zbv = [rank["idle_zbv"] for rank in two]
    print(f"idle 1f1b {idle_1f1b}, zbv {idle_zbv}, theory 1f1b {theory}")
    assert all(abs(idle - theory) < 0.12 for idle in idle_1f1b), idle_1f1b
    assert max(idle_zbv) < max(idle_1f1b), (idle_zbv, idle_1f1b)


def test_bad_batches_fail_on_every_rank(two: list[dict[str, Any]]) -> None:
    assert two[1]["user_error"] == "ValueError: the user's loss failed"
    assert two[0]["user_error"].startswith("PipelineError: training_step failed on the last pipeline stage (global rank 1)")
    assert "the user's loss failed" in two[0]["user_error"]
    for rank in two:
        assert "returned a loss that does not require grad" in rank["detached"]
    for rank in two:
        assert "microbatches=4 does not divide the training batch size 7" in rank["indivisible"]
        assert "Use microbatches in [7]," in rank["indivisible"]  # 1 divides 7, but 1f1b needs one per stage
        assert "microbatches=3 does not divide the training batch size 4" in rank["indivisible_full"]
        assert "Use microbatches in [2, 4]," in rank["indivisible_full"]
        assert "tied weights" in rank["tied"] and "stage 0 and stage 1" in rank["tied"]
        assert "does not divide the training batch size 1" in rank["batch_of_one"]
        assert "schedule='gpipe' takes any" in rank["batch_of_one"]
        assert "GatheringNet.validation_step called self.all_gather under pipeline parallelism" in rank["collective"]


def test_a_validation_set_smaller_than_one_batch_runs(two: list[dict[str, Any]]) -> None:
    model = new_model()
    tokens, targets = token_data(6, seed=1).tensors
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
    for rank in two:
        assert rank["small_val"] == "no error"
        assert rank["small_val_loss"] == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------------------------------- no ranks
def test_split_by_parameter_count_and_at_split_points() -> None:
    module = new_model(layers=6)
    layers = pipeline_layers(module)
    assert [name for name, _ in layers][:2] == ["embed", "blocks.0"]
    stages = split_layers(layers, PipelineConfig(size=2))
    assert [[n for n, _ in stage] for stage in stages] == [["embed", "blocks.0", "blocks.1", "blocks.2"],
                                                          ["blocks.3", "blocks.4", "blocks.5", "head"]]
    sizes = [sum(p.numel() for _, m in stage for p in m.parameters()) for stage in split_layers(
        layers, PipelineConfig(size=4))]
    assert max(sizes) <= 2 * min(sizes)
    stages = split_layers(layers, PipelineConfig(size=2, split_points=("blocks.4",)))
    assert [n for n, _ in stages[1]] == ["blocks.4", "blocks.5", "head"]
    assert stage_indices(1, PipelineConfig(size=2, stages_per_rank=2, schedule="interleaved_1f1b")) == [1, 3]
    assert stage_indices(1, PipelineConfig(size=2, stages_per_rank=2, schedule="zbv_zero_bubble")) == [1, 2]


def test_bad_splits_are_refused_with_the_fix() -> None:
    layers = pipeline_layers(new_model(layers=2))  # 4 layers
    with pytest.raises(PipelineError, match="asks for 8 stages .* only 4 pipeline layers"):
        split_layers(layers, PipelineConfig(size=8))
    with pytest.raises(PipelineError, match="leaves stage 1 empty"):
        split_layers(layers, PipelineConfig(size=3, split_points=("blocks.0", "blocks.0")))
    with pytest.raises(PipelineError, match="Did you mean 'blocks.1'"):
        split_layers(layers, PipelineConfig(size=2, split_points=("block.1",)))
    with pytest.raises(PipelineError, match="leaves stage 0 empty"):
        split_layers(layers, PipelineConfig(size=2, split_points=("embed",)))
    tied = new_model(layers=2)
    tied.head.weight = tied.embed.weight
    with pytest.raises(PipelineError, match="tied weights"):
        check_parameters_in_one_stage(tied, split_layers(pipeline_layers(tied), PipelineConfig(size=2)))
    stray = new_model(layers=2)
    stray.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(PipelineError, match=r"\['scale'\] belong to no layer"):
        check_parameters_in_one_stage(stray, split_layers(pipeline_layers(stray), PipelineConfig(size=2)))
    gelu = new_model(layers=2)
    gelu.act = nn.GELU()
    gelu.pipeline_layers = lambda: [gelu.embed, gelu.act, *gelu.blocks, gelu.head]  # type: ignore[method-assign]
    with pytest.raises(PipelineError, match=r"stage 1 \(act\) has no trainable parameter"):
        check_parameters_in_one_stage(gelu, split_layers(pipeline_layers(gelu), PipelineConfig(
            size=3, split_points=("act", "blocks.0"))))
    with pytest.raises(PipelineError, match="has no pipeline_layers"):
        pipeline_layers(nn.Linear(2, 2))
    with pytest.raises(PipelineError, match="microbatches=3 does not divide the training batch size 8"):
        check_microbatches(8, 3, "training")


def test_bad_configs_are_refused_before_launch() -> None:
    with pytest.raises(ValueError, match="schedule='looped' is not a schedule we know"):
        PipelineConfig(size=2, schedule="looped")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        PipelineConfig(size=2, stages_per_rank=2)
    with pytest.raises(ValueError, match="exactly 2 stages"):
        PipelineConfig(size=2, stages_per_rank=3, schedule="zbv_zero_bubble")
    with pytest.raises(ValueError, match="gives 3 stages"):
        PipelineConfig(size=2, split_points=("a", "b"))
    with pytest.raises(ValueError, match="needs at least one micro-batch per stage"):
        PipelineConfig(size=4, microbatches=2)
    with pytest.raises(ValueError, match="run the micro-batches in rounds of 2"):
        PipelineConfig(size=2, microbatches=5, stages_per_rank=2, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="microbatches=0 must be a positive integer"):
        PipelineConfig(size=2, microbatches=0)
    with pytest.raises(ValueError, match="stage=3. cannot be combined with pipeline parallelism"):
        ZeroConfig(stage=3, pipeline={"size": 2})
    with pytest.raises(ValueError, match=r"Unknown ZeroConfig.pipeline field\(s\) \['stages'\]"):
        ZeroConfig(pipeline={"size": 2, "stages": 2})
    with pytest.raises(ValueError, match="PipelineConfig.size=3 does not divide the world size 4"):
        resolve_dims(ParallelConfig(), 4, 4, pipeline=3)
    with pytest.raises(ValueError, match="tensor=4 does not divide the 2 ranks of each pipeline stage"):
        resolve_dims(ParallelConfig(tensor=4), 4, 4, pipeline=2)
    with pytest.raises(ValueError, match="state_dict_type='full'. is not supported with pipeline"):
        ZeroStrategy(config=ZeroConfig(pipeline={"size": 2}), state_dict_type="full")
    dims = resolve_dims(ParallelConfig(tensor=2), 8, 8, pipeline=2)
    assert (dims.pipeline, dims.data, dims.tensor) == (2, 2, 2)
    assert dims.pipeline_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.shard_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_a_stage_returning_a_dict_names_the_fix() -> None:
    from lightning_zero.parallel.pipeline import StageModule

    class Heads(nn.Module):
        def forward(self, x: Tensor) -> dict[str, Tensor]:
            return {"y": x * 2, "h": x}

    with pytest.raises(PipelineError, match="layer Heads returned a dict: .*Return a tuple.*return_dict=False"):
        StageModule([nn.Linear(2, 2), Heads()])(torch.zeros(1, 2))


def test_micro_batches_split_every_tensor_of_the_batch() -> None:
    tokens, targets = torch.arange(8).view(4, 2), torch.arange(4)
    pieces = split_batch({"x": tokens, "y": targets, "name": "a"}, 2, 4)
    assert torch.equal(pieces[1]["x"], tokens[2:]) and torch.equal(pieces[0]["y"], targets[:2])
    assert pieces[0]["name"] == "a"
    pieces = split_batch((tokens, targets), 4, 4)
    assert isinstance(pieces[3], tuple) and torch.equal(pieces[3][1], targets[3:])


def test_lightning_cli_yaml_takes_the_pipeline() -> None:
    from lightning.pytorch.cli import LightningCLI

    strategy = {"class_path": "lightning_zero.ZeroStrategy",
                "init_args": {"config": {"stage": 2, "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 8,
                                                                  "stages_per_rank": 1}}}}
    cli = LightningCLI(PipeNet, run=False, args={"trainer": {"strategy": strategy, "accelerator": "cpu", "devices": 2,
                                                             "logger": False}})
    assert cli.trainer.strategy.config.pipeline == PipelineConfig(size=2, schedule="1f1b", microbatches=8)


def test_demo_gpt_pipeline_layers_are_its_forward() -> None:
    """The demo's layers (a token + position embedding wrapper over wte/wpe, the blocks, a head
    wrapper over ln_f/lm_head) run one after the other give its forward; untied it splits."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
    from model import GPT

    from lightning_zero.parallel.pipeline import StageModule

    torch.manual_seed(0)
    gpt = GPT(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_embeddings=False)
    layers = pipeline_layers(gpt)
    assert [name for name, _ in layers] == ["wte+wpe+drop", "blocks.0", "blocks.1", "ln_f+lm_head"]
    stages = split_layers(layers, PipelineConfig(size=2))
    check_parameters_in_one_stage(gpt, stages)
    tokens = torch.randint(0, VOCAB, (2, 8))
    x = tokens
    for stage in stages:
        x = StageModule([layer for _, layer in stage])(x)
    assert torch.equal(x, gpt(tokens))
    tied = GPT(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(PipelineError, match="tied weights"):
        check_parameters_in_one_stage(tied, split_layers(pipeline_layers(tied), PipelineConfig(size=2)))


def test_demo_pipeline_config_builds_the_strategy() -> None:
    import yaml

    path = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "configs" / "zero2_pp2_cpu.yaml"
    config = yaml.safe_load(path.read_text())
    strategy = ZeroStrategy(**config["trainer"]["strategy"]["init_args"])
    assert strategy.config.pipeline == PipelineConfig(size=2, schedule="1f1b", microbatches=4)
    assert strategy.config.stage == 2 and config["model"]["tie_embeddings"] is False
