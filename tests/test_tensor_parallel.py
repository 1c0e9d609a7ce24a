"""Tensor parallel x ZeRO and hybrid sharding on 4 gloo ranks, against a single-process run.

One group of 4 ranks runs every sub-case (starting ranks costs seconds); the tests below read
its results. Every run trains in fp32 on the same global batch as the reference (the
DistributedSampler deals one shuffled order out to the data-parallel ranks, and the
reference's batch is their union), so the losses and the whole weights must agree up to float reordering: a
column- or row-parallel matmul sums its products in another order, and gradients are averaged
over ranks instead of over one batch. After 4 AdamW steps that stays below 2e-5 (Adam divides
by sqrt(v), so a relative difference of ~1e-7 in a gradient becomes ~1e-7 of the learning rate
per step); the tolerance is 1e-4 absolute.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from harness import launched_environment, run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPT  # noqa: E402

from lightning_zero import CPUOffloadPolicy, ParallelConfig, ZeroConfig, ZeroStrategy, grad_norm  # noqa: E402
from lightning_zero.parallel import hf_gpt2_state_dict_to_hf, parallelize_gpt, parallelize_hf_gpt2  # noqa: E402

WORLD = 4
VOCAB, SEQ = 32, 8
STEPS = 4
PER_RANK_BATCH = 4
TOLERANCE = 1e-4


def token_data(samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class RecordsLosses(pl.LightningModule):
    """Records each training step's loss (``_loss`` is the model's) and trains with plain AdamW
    (no schedule), so the reference loop is a few lines."""

    losses: list[float]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


class TensorParallelGPT(RecordsLosses, GPT):
    """The demo GPT, split by ``parallelize_gpt`` when the mesh has a tensor dimension, with plain
    AdamW (no schedule) so the reference loop is a few lines."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, weight_decay=0.0)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is not None and "tensor" in (mesh.mesh_dim_names or ()) and mesh["tensor"].size() > 1:
            parallelize_gpt(self, mesh["tensor"])



class NormsGPT(TensorParallelGPT):
    """Logs lightning_zero.grad_norm at every step: each split weight's norm is over both tensor ranks'
    parts, each replicated one counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append({key: float(value) for key, value in grad_norm(self, 2).items()})


class SequenceParallelGPT(TensorParallelGPT):
    """The demo GPT under a plan of the user's own, with sequence parallelism: the norms and the
    residual stream are split along the sequence between the blocks' matmuls (torchtitan's
    layout), so the norms' weights get a partial gradient on each tensor rank."""

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        mesh = self.device_mesh["tensor"]
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),), "use_local_output": True}
        block_plan = {
            "ln_1": SequenceParallel(use_local_output=True),
            "attn": PrepareModuleInput(**gather),
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(use_local_output=True),
            "mlp": PrepareModuleInput(**gather),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        for block in self.blocks:
            parallelize_module(block, mesh, block_plan)
        parallelize_module(self, mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "ln_f": PrepareModuleInput(**gather),
        })


class FrozenGPT(TensorParallelGPT):
    """Some split weights frozen (as the base weights under LoRA): at stages 1/2 they have no
    piece and stay whole on every rank, each tensor rank holding its own part."""

    def __init__(self) -> None:
        super().__init__()
        for param in (*self.blocks[0].mlp.fc.parameters(), self.blocks[1].attn.proj.weight):
            param.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)


class HFGPT2(RecordsLosses):
    """Hugging Face GPT-2 built from a config, split by ``parallelize_hf_gpt2``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(config)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is not None and "tensor" in (mesh.mesh_dim_names or ()) and mesh["tensor"].size() > 1:
            parallelize_hf_gpt2(self.model, mesh["tensor"])

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())



class MetaGPT(TensorParallelGPT):
    """The demo GPT built in configure_model (on the meta device at stage 3), then split: every
    part is initialized by reset_parameters as a part of the whole tensor."""

    def _init_layers(self, config: Any) -> None:
        self._config = config  # built in configure_model

    def _init_weights(self) -> None:
        pass

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            GPT._init_layers(self, self._config)
            super().configure_model()

    def on_train_start(self) -> None:
        with self.trainer.strategy.engine.gathered(writeback=False):
            self.initial = {name: p.detach().clone() for name, p in self.named_parameters()}


class ConvertedHFGPT2(HFGPT2):
    """GPT-2 converted by parallelize_hf_gpt2 also where no tensor mesh splits it (tp_mesh=None)."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        split = mesh is not None and "tensor" in (mesh.mesh_dim_names or ()) and mesh["tensor"].size() > 1
        parallelize_hf_gpt2(self.model, mesh["tensor"] if split else None)


MODELS = {"gpt": TensorParallelGPT, "gpt_norms": NormsGPT, "hf_gpt2": HFGPT2, "hf_gpt2_converted": ConvertedHFGPT2, "gpt_meta": MetaGPT, "gpt_sp": SequenceParallelGPT,
          "gpt_frozen": FrozenGPT}


# ---------------------------------------------------------------------------------------- ranks
def _trainer(strategy: ZeroStrategy, steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _local_params(module: nn.Module, strategy: ZeroStrategy) -> dict[str, tuple[Tensor, int | None]]:
    """Each parameter as this rank holds it after fit, with the dim it is split along over the tensor ranks."""
    specs = strategy._tensor_parallel.specs if strategy._tensor_parallel is not None else {}
    out = {}
    for name, param in module.named_parameters():
        spec = specs.get(param)
        out[name] = (param.detach().clone(), spec.dim if spec is not None else None)
    return out


def _run(name: str, config: ZeroConfig, data_size: int, steps: int = STEPS, samples: int = 256,
         ckpt_save: str | None = None, ckpt_path: str | None = None, accumulate: int = 1,
         **trainer_kwargs: Any) -> dict[str, Any]:
    module = MODELS[name]()
    strategy = ZeroStrategy(config=config)
    batch = PER_RANK_BATCH * 2 // data_size // accumulate  # every layout trains on a global batch of 8
    loader = DataLoader(token_data(samples), batch_size=batch, shuffle=False)
    with launched_environment():
        trainer = _trainer(strategy, steps, accumulate_grad_batches=accumulate, **trainer_kwargs)
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
        bytes_ = strategy.model_state_bytes()
        if ckpt_save is not None:
            trainer.save_checkpoint(ckpt_save)
    return {"losses": module.losses, "norms": getattr(module, "norms", None),
            "params": _local_params(module, strategy), "bytes": bytes_,
            "dims": strategy.parallel_dims, "initial": getattr(module, "initial", None), "saved": ckpt_save}


class NoPlanGPT(TensorParallelGPT):
    def configure_model(self) -> None:
        pass


class MissingModuleGPT(TensorParallelGPT):
    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel

        from lightning_zero.parallel import apply_plan

        apply_plan(self, self.device_mesh["tensor"], {"blocks.0.attn.qkvv": ColwiseParallel()})


class TwoHeadGPT(TensorParallelGPT):
    def __init__(self) -> None:
        GPT.__init__(self, vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=32)
        self.losses = []


def _error_of(module: pl.LightningModule, parallel: ParallelConfig) -> str:
    """What fit raises on this rank (every rank must raise, none may hang)."""
    try:
        with launched_environment():
            _trainer(ZeroStrategy(config=ZeroConfig(stage=2, parallel=parallel)), 1).fit(
                module, train_dataloaders=DataLoader(token_data(8), batch_size=2))
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_inputs() -> dict[str, str]:
    return {
        "no plan": _error_of(NoPlanGPT(), ParallelConfig(tensor=2)),
        "missing module": _error_of(MissingModuleGPT(), ParallelConfig(tensor=2)),
        "tensor does not divide": _error_of(TensorParallelGPT(), ParallelConfig(tensor=3)),
        "heads do not divide": _error_of(TwoHeadGPT(), ParallelConfig(tensor=4)),
        "shard size does not divide": _error_of(TensorParallelGPT(), ParallelConfig(shard_size=3)),
    }


class DemoGPT(TensorParallelGPT):
    """With the demo's own configure_model, which Lightning calls at every fit/validate."""

    configure_model = GPT.configure_model


def _lifecycle() -> dict[str, float]:
    """fit, validate twice, a new Trainer's fit on the same module, validate, then a forward after
    teardown: each setup starts again from the plan's DTensors."""
    module = DemoGPT()
    loader = DataLoader(token_data(32), batch_size=4)
    config = ZeroConfig(stage=3, parallel=ParallelConfig(tensor=2))
    out = {}
    with launched_environment():
        trainer = _trainer(ZeroStrategy(config=config), 2)
        trainer.fit(module, loader)
        out["first"] = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
        out["again"] = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
        other = _trainer(ZeroStrategy(config=config), 4)
        other.fit(module, loader)
        out["after_more_steps"] = other.validate(module, loader, verbose=False)[0]["val_loss"]
    with torch.no_grad():
        out["forward_after_teardown"] = float(module._loss(next(iter(loader))))
    return out


def _all_cases(tmp: str) -> dict[str, Any]:
    offload = CPUOffloadPolicy()
    tp2 = ParallelConfig(tensor=2)
    results: dict[str, Any] = {"errors": _bad_inputs(), "lifecycle": _lifecycle()}
    for name in ("gpt", "hf_gpt2"):
        for stage in (1, 2, 3):
            saved = f"{tmp}/{name}-tp2-zero{stage}.ckpt" if (name, stage) == ("hf_gpt2", 3) else None
            results[f"{name}-tp2-zero{stage}"] = _run(name, ZeroConfig(stage=stage, parallel=tp2), data_size=2,
                                                      ckpt_save=saved)
        if name == "hf_gpt2":  # its checkpoint resumes without tensor parallelism, the model converted alike
            results["hf_gpt2-tp2-zero3-into-dp4-zero2"] = _run(
                "hf_gpt2_converted", ZeroConfig(stage=2), data_size=4, ckpt_path=f"{tmp}/hf_gpt2-tp2-zero3.ckpt")
        results[f"{name}-tp2-zero2_offload"] = _run(
            name, ZeroConfig(stage=2, offload_optimizer=offload, parallel=tp2), data_size=2)
        results[f"{name}-tp2-zero3_offload"] = _run(
            name, ZeroConfig(stage=3, offload_optimizer=offload, offload_params=offload, parallel=tp2), data_size=2)
    for stage in (2, 3):
        results[f"gpt_norms-tp2-zero{stage}"] = _run("gpt_norms", ZeroConfig(stage=stage, parallel=tp2), data_size=2)
    # Gradient accumulation (micro-batches reduced once per step) and low precision on the mesh.
    results["gpt-tp2-zero3-accumulate"] = _run("gpt", ZeroConfig(stage=3, parallel=tp2), data_size=2, accumulate=2)
    results["gpt-hybrid-zero2-accumulate"] = _run("gpt", ZeroConfig(stage=2, parallel=ParallelConfig(shard_size=2)),
                                                  data_size=4, accumulate=2)
    results["gpt-tp2-zero2-bf16"] = _run("gpt", ZeroConfig(stage=2, parallel=tp2), data_size=2,
                                         precision="bf16-mixed")
    results["gpt-tp2-zero3-fp16"] = _run("gpt", ZeroConfig(stage=3, parallel=tp2), data_size=2,
                                         precision="16-mixed")
    for stage in (2, 3):
        results[f"gpt_sp-tp2-zero{stage}"] = _run("gpt_sp", ZeroConfig(stage=stage, parallel=tp2), data_size=2)
    # Ranks that were not seeded alike: what the tensor ranks replicate must still agree.
    torch.manual_seed(1000 + torch.distributed.get_rank())
    results["gpt_meta-tp2-zero3"] = _run("gpt_meta", ZeroConfig(stage=3, parallel=tp2), data_size=2)
    for stage in (1, 2, 3):
        results[f"gpt-hybrid-zero{stage}"] = _run(
            "gpt", ZeroConfig(stage=stage, parallel=ParallelConfig(shard_size=2)), data_size=4)
    results["gpt-dp4-zero1"] = _run("gpt", ZeroConfig(stage=1), data_size=4)
    # Resume at other data-parallel (and tensor-parallel) sizes: one fixed global batch, so where
    # the resumed run's data loader starts does not matter.
    ckpt = f"{tmp}/tp2.ckpt"
    results["resume-save"] = _run("gpt", ZeroConfig(stage=3, parallel=tp2), data_size=2, steps=2, samples=8,
                                  ckpt_save=ckpt)
    from lightning_zero.checkpoint.sharded import read_meta, read_metadata

    results["saved-meta"] = read_meta(Path(ckpt), read_metadata(Path(ckpt))).parallel
    results["resume-dp4-zero2"] = _run("gpt", ZeroConfig(stage=2), data_size=4, steps=STEPS, samples=8,
                                       ckpt_path=ckpt)
    results["resume-dp1-tp4-zero1"] = _run("gpt", ZeroConfig(stage=1, parallel=ParallelConfig(tensor=4)),
                                           data_size=1, steps=STEPS, samples=8, ckpt_path=ckpt)
    # The same checkpoint exported to one file (whole tensors), resumed under tensor parallelism:
    # every rank takes its part of the weights and of the optimizer state.
    full = f"{tmp}/tp2_full.ckpt"
    if torch.distributed.get_rank() == 0:
        from lightning_zero import consolidate

        consolidate(ckpt, full, progress=False)
    torch.distributed.barrier()
    results["resume-full-tp2-zero2"] = _run("gpt", ZeroConfig(stage=2, parallel=tp2), data_size=2, steps=STEPS,
                                            samples=8, ckpt_path=full)
    frozen = f"{tmp}/frozen.ckpt"
    results["frozen-save"] = _run("gpt_frozen", ZeroConfig(stage=2, parallel=tp2), data_size=2, steps=2,
                                  samples=8, ckpt_save=frozen)
    results["frozen-resume-tp4-zero1"] = _run("gpt_frozen", ZeroConfig(stage=1, parallel=ParallelConfig(tensor=4)),
                                              data_size=1, steps=STEPS, samples=8, ckpt_path=frozen)
    results["resume-hybrid-zero3"] = _run("gpt", ZeroConfig(stage=3, parallel=ParallelConfig(shard_size=2)),
                                          data_size=4, steps=STEPS, samples=8, ckpt_path=ckpt)
    return results


# ---------------------------------------------------------------------------------------- reference
def reference(name: str, steps: int = STEPS, samples: int = 256,
              norms: list[dict[str, float]] | None = None) -> tuple[list[float], dict[str, Tensor]]:
    """One process, the global batch of 8, plain AdamW. Lightning shuffles a training loader
    with a DistributedSampler seeded by its epoch; rank r takes every R-th index of the
    permutation, so a global batch is 8 consecutive indices of it. ``norms`` collects Lightning's
    grad_norm of each step."""
    module = MODELS[name]()
    optimizer = module.configure_optimizers()
    data = token_data(samples)
    per_epoch = samples // (2 * PER_RANK_BATCH)
    losses = []
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
        loss = module._loss(data[order[index * 2 * PER_RANK_BATCH : (index + 1) * 2 * PER_RANK_BATCH]])
        loss.backward()
        if norms is not None:
            norms.append({key: float(value) for key, value in lightning_grad_norm(module, 2).items()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in module.state_dict().items()}


def global_params(ranks: list[dict[str, Any]], tensor: int) -> dict[str, Tensor]:
    """Whole weights from the first data-parallel rank's tensor ranks (ranks 0..tensor-1)."""
    names = ranks[0]["params"]
    out = {}
    for name, (value, dim) in names.items():
        parts = [ranks[t]["params"][name][0] for t in range(tensor)]
        out[name] = torch.cat(parts, dim=dim) if dim is not None else value
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("tensor_parallel"))
    return run_on_ranks(_all_cases, WORLD, tmp)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, Tensor]]]:
    return {name: reference(name) for name in ("gpt", "hf_gpt2")} | {
        "resume": reference("gpt", steps=STEPS, samples=8),
        "frozen": reference("gpt_frozen", steps=STEPS, samples=8),
    }


def _compare_weights(name: str, whole: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    if name == "hf_gpt2":
        whole = {f"model.{k}": v for k, v in hf_gpt2_state_dict_to_hf(
            {k.removeprefix("model."): v for k, v in whole.items()}).items()}
    for key, value in whole.items():
        assert value.shape == expected[key].shape, key
        torch.testing.assert_close(value, expected[key], atol=TOLERANCE, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("stage", [2, 3])
def test_grad_norm_on_the_mesh_equals_one_processs(results: list[dict[str, Any]], stage: int) -> None:
    """lightning_zero.grad_norm on dp2 x tp2: every rank logs the whole model's per-parameter norms."""
    expected: list[dict[str, float]] = []
    reference("gpt", norms=expected)
    for rank in results:
        norms = rank[f"gpt_norms-tp2-zero{stage}"]["norms"]
        assert len(norms) == len(expected) == STEPS
        for ours, theirs in zip(norms, expected):
            assert ours.keys() == theirs.keys()
            assert all(ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6) for k in theirs), (ours, theirs)


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_tensor_parallel_matches_one_process(results: list[dict[str, Any]], references: dict[str, Any],
                                             name: str, variant: str) -> None:
    """dp2 x tp2: every rank's losses and the reassembled whole weights equal one process's."""
    ranks = [rank[f"{name}-tp2-{variant}"] for rank in results]
    assert ranks[0]["dims"].tensor == 2 and ranks[0]["dims"].data == 2
    ref_losses, ref_weights = references[name]
    # tensor ranks share their data-parallel rank's loss; the two halves of the batch average to the reference's
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[2]["losses"] == ranks[3]["losses"]
    means = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])]
    assert means == pytest.approx(ref_losses, abs=TOLERANCE)
    _compare_weights(name, global_params(ranks, tensor=2), ref_weights)
    # the other data-parallel rank holds the same parts
    _compare_weights(name, global_params(ranks[2:], tensor=2), ref_weights)


def test_a_tensor_parallel_gpt2_checkpoint_resumes_without_tensor_parallelism(
    results: list[dict[str, Any]], references: dict[str, Any]
) -> None:
    # saved after STEPS steps at dp2 x tp2, resumed at dp4 with max_steps=STEPS: the saved weights
    ranks = [rank["hf_gpt2-tp2-zero3-into-dp4-zero2"] for rank in results]
    assert ranks[0]["dims"] is None or ranks[0]["dims"].tensor == 1
    _compare_weights("hf_gpt2", global_params(ranks, tensor=1), references["hf_gpt2"][1])


def test_a_tensor_parallel_gpt2_checkpoint_exports_to_hugging_face_in_gpt2s_own_layout(
    results: list[dict[str, Any]], references: dict[str, Any], tmp_path: Path
) -> None:
    """parallelize_hf_gpt2 converts the blocks (q/k/v Linears, transposed projections), so the
    checkpoint holds that layout; the export writes GPT-2's own, which from_pretrained loads."""
    from transformers import GPT2LMHeadModel

    from lightning_zero import consolidate_hf

    checkpoint = results[0]["hf_gpt2-tp2-zero3"]["saved"]
    consolidate_hf(checkpoint, tmp_path / "hf", progress=False)
    HFGPT2().model.config.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")  # raises on a missing, unexpected or mis-shaped key
    _, expected = references["hf_gpt2"]
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[f"model.{key}"], atol=TOLERANCE, rtol=0, msg=lambda m: f"{key}: {m}")
    # split over several files, q/k/v stay together: the same tensors
    consolidate_hf(checkpoint, tmp_path / "hf_split", max_shard_size=20_000, progress=False)
    assert len(list((tmp_path / "hf_split").glob("model-*.safetensors"))) > 1
    HFGPT2().model.config.save_pretrained(tmp_path / "hf_split")
    split = GPT2LMHeadModel.from_pretrained(tmp_path / "hf_split").state_dict()
    assert all(torch.equal(split[key], value) for key, value in loaded.state_dict().items())


@pytest.mark.parametrize("case", ["gpt-tp2-zero3-accumulate", "gpt-hybrid-zero2-accumulate"])
def test_gradient_accumulation_on_the_mesh_matches_one_process(results: list[dict[str, Any]],
                                                               references: dict[str, Any], case: str) -> None:
    """Two micro-batches per step (no communication on the first): the same steps as one process.
    Lightning records each micro-batch's loss; a step's loss is their mean over every data rank."""
    ranks = [rank[case] for rank in results]
    ref_losses, ref_weights = references["gpt"]
    data_ranks = ranks[::2] if ranks[0]["dims"].tensor == 2 else ranks
    steps = [sum(r["losses"][2 * i] + r["losses"][2 * i + 1] for r in data_ranks) / (2 * len(data_ranks))
             for i in range(STEPS)]
    assert steps == pytest.approx(ref_losses, abs=TOLERANCE)
    _compare_weights("gpt", global_params(ranks, tensor=ranks[0]["dims"].tensor), ref_weights)


@pytest.mark.parametrize(("case", "tolerance"), [("gpt-tp2-zero2-bf16", 0.03), ("gpt-tp2-zero3-fp16", 0.01)])
def test_low_precision_on_the_mesh_follows_fp32(results: list[dict[str, Any]], references: dict[str, Any],
                                                case: str, tolerance: float) -> None:
    """bf16-mixed and fp16-mixed (loss scaling, skip on overflow over the whole mesh) under dp2 x
    tp2: the tensor ranks agree exactly, and the losses stay within bf16's / fp16's rounding of
    the fp32 run's (8 and 11 bits of mantissa over 4 steps)."""
    ranks = [rank[case] for rank in results]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[2]["losses"] == ranks[3]["losses"]
    means = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])]
    assert means == pytest.approx(references["gpt"][0], abs=tolerance)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_users_sequence_parallel_plan_matches_one_process(results: list[dict[str, Any]],
                                                             references: dict[str, Any], stage: int) -> None:
    """torch's SequenceParallel / PrepareModuleInput / Rowwise(output_layouts=Shard(1)) applied by
    the user: the norms' partial gradients are summed over the tensor ranks before ZeRO reduces them."""
    ranks = [rank[f"gpt_sp-tp2-zero{stage}"] for rank in results]
    ref_losses, ref_weights = references["gpt"]
    means = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])]
    assert means == pytest.approx(ref_losses, abs=TOLERANCE)
    _compare_weights("gpt", global_params(ranks, tensor=2), ref_weights)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_matches_one_process(results: list[dict[str, Any]], references: dict[str, Any],
                                             stage: int) -> None:
    """Shard within 2 ranks, replicate across 2 groups: the same training as one process."""
    ranks = [rank[f"gpt-hybrid-zero{stage}"] for rank in results]
    dims = ranks[0]["dims"]
    assert (dims.data, dims.shard, dims.replicas, dims.tensor) == (4, 2, 2, 1)
    ref_losses, ref_weights = references["gpt"]
    for rank in ranks:
        # each data-parallel rank's loss is over its own quarter of the batch; their mean is the reference's
        assert len(rank["losses"]) == STEPS
    means = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(STEPS)]
    assert means == pytest.approx(ref_losses, abs=TOLERANCE)
    for rank in ranks:
        _compare_weights("gpt", global_params([rank], tensor=1), ref_weights)


def test_memory_per_rank_follows_the_split(results: list[dict[str, Any]]) -> None:
    """Parameters at tp2 are the replicated part plus half of the split ones; stage 1's optimizer
    state (fp32 masters + Adam's two moments) is the local parameters over the data-parallel ranks."""
    module = TensorParallelGPT()
    split_suffixes = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight", "mlp.fc.bias",
                      "mlp.proj.weight")  # column-parallel weights and biases, row-parallel weights
    split = sum(p.numel() for n, p in module.named_parameters() if n.endswith(split_suffixes))
    total = sum(p.numel() for p in module.parameters())
    local = total - split // 2
    tp2 = results[0]["gpt-tp2-zero1"]["bytes"]
    dp4 = results[0]["gpt-dp4-zero1"]["bytes"]
    # fp32 parameters; the flat buffers pad each bucket to a multiple of the data-parallel size
    assert 4 * local <= tp2.params <= 4 * (local + 64)
    assert 4 * total <= dp4.params <= 4 * (total + 64)
    assert tp2.params / dp4.params == pytest.approx(local / total, rel=0.01)
    assert split > 0.8 * total and 0.5 < local / total < 0.6
    # masters + exp_avg + exp_avg_sq: 3 fp32 copies of 1/dp of the local parameters, i.e. of the
    # split ones 1/(dp x tp)
    assert 3 * 4 * local / 2 <= tp2.optimizer_states <= 3 * 4 * (local / 2 + 64)
    assert 3 * 4 * total / 4 <= dp4.optimizer_states <= 3 * 4 * (total / 4 + 64)


def test_checkpoint_resumes_at_other_data_and_tensor_sizes(results: list[dict[str, Any]],
                                                          references: dict[str, Any]) -> None:
    """Saved at dp2 x tp2 (stage 3) after 2 steps; resumed at dp4 (stage 2), dp1 x tp4 (stage 1),
    hybrid 2 x 2 (stage 3), and exported with consolidate to one file that resumes at dp2 x tp2
    (stage 2): the next steps are the reference's."""
    ref_losses, ref_weights = references["resume"]
    saved = [rank["resume-save"] for rank in results]
    saved_means = [(a + b) / 2 for a, b in zip(saved[0]["losses"], saved[2]["losses"])]
    assert saved_means == pytest.approx(ref_losses[:2], abs=TOLERANCE)
    recorded = results[0]["saved-meta"]
    assert (recorded["data"], recorded["tensor"], recorded["shard"]) == (2, 2, 2)
    assert recorded["placements"]["blocks.0.attn.qkv.weight"] == "Shard(dim=0)"
    assert recorded["placements"]["blocks.0.attn.proj.weight"] == "Shard(dim=1)"
    assert recorded["placements"]["blocks.0.attn.proj.bias"] == "Replicate()"
    assert "wte.weight" not in recorded["placements"]
    for case, tensor in (("resume-dp4-zero2", 1), ("resume-dp1-tp4-zero1", 4), ("resume-hybrid-zero3", 1),
                         ("resume-full-tp2-zero2", 2)):
        ranks = [rank[case] for rank in results]
        if tensor == 1:
            means = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(STEPS - 2)]
        elif tensor == 2:
            means = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])]
        else:
            means = ranks[0]["losses"]
        assert means == pytest.approx(ref_losses[2:], abs=TOLERANCE), case
        _compare_weights("gpt", global_params(ranks, tensor=tensor), ref_weights)


def test_frozen_split_weights_are_saved_as_their_global_tensors(results: list[dict[str, Any]],
                                                                references: dict[str, Any]) -> None:
    """Saved at dp2 x tp2 (stage 2) with split weights frozen, resumed at tp4: each tensor rank's
    frozen part comes back from the global tensor, and training continues as in one process."""
    ref_losses, ref_weights = references["frozen"]
    saved = [rank["frozen-save"] for rank in results]
    assert [(a + b) / 2 for a, b in zip(saved[0]["losses"], saved[2]["losses"])] == pytest.approx(
        ref_losses[:2], abs=TOLERANCE)
    ranks = [rank["frozen-resume-tp4-zero1"] for rank in results]
    assert ranks[0]["losses"] == pytest.approx(ref_losses[2:], abs=TOLERANCE)
    whole = global_params(ranks, tensor=4)
    _compare_weights("gpt", whole, ref_weights)
    torch.testing.assert_close(whole["blocks.0.mlp.fc.weight"], TensorParallelGPT().blocks[0].mlp.fc.weight.detach())


def test_model_built_on_meta_is_initialized_as_whole_tensors(results: list[dict[str, Any]]) -> None:
    """Stage 3, configure_model on the meta device, ranks seeded differently: each tensor rank's
    part is a different part of one initialization (kaiming bounds from the global fan-in), the
    replicated parameters are the same on every rank, and training runs."""
    ranks = [rank["gpt_meta-tp2-zero3"] for rank in results]
    for rank in ranks:
        assert len(rank["losses"]) == STEPS and all(math.isfinite(loss) for loss in rank["losses"])
    for name, (value, dim) in ranks[0]["params"].items():
        others = [rank["params"][name][0] for rank in ranks[1:]]
        if dim is None:
            assert all(torch.equal(value, other) for other in others), name
        else:
            assert not torch.equal(value, others[0]), name  # tensor rank 1 holds another part
            assert torch.equal(value, others[1]), name  # data-parallel rank 1 the same part
    # row-parallel weight [32, 128], split along its input: nn.Linear's kaiming_uniform(a=sqrt(5))
    # bounds it by 1/sqrt(fan_in) with the global fan-in 128, not the local 64
    for rank in ranks[:2]:
        proj = rank["initial"]["blocks.0.mlp.proj.weight"]
        assert proj.shape == (32, 64)
        assert 0.9 / math.sqrt(128) < proj.abs().max() <= 1 / math.sqrt(128)


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("no plan", ["ValueError", "tensor=2", "no tensor-parallel parameters", "parallelize_gpt", "tensor=1"]),
        ("missing module", ["TensorParallelPlanError", "blocks.0.attn.qkvv", "blocks.0.attn.qkv"]),
        ("tensor does not divide", ["ValueError", "tensor=3", "world size 4", "[1, 2, 4]"]),
        ("heads do not divide", ["TensorParallelPlanError", "n_head", "2", "4"]),
        ("shard size does not divide", ["ValueError", "shard_size=3", "[1, 2, 4]"]),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(results: list[dict[str, Any]], case: str, names: list[str]) -> None:
    """Each raises the same error on all 4 ranks, before any collective could leave one waiting."""
    messages = [rank["errors"][case] for rank in results]
    assert len(set(messages)) == 1, messages
    for name in names:
        assert name in messages[0], messages[0]


def test_fit_validate_and_a_new_trainer_on_the_same_module(results: list[dict[str, Any]]) -> None:
    """Lightning calls configure_model at every fit/validate: the plan is not applied twice, and
    the module trains on under a new Trainer; every rank agrees."""
    runs = [rank["lifecycle"] for rank in results]
    assert all(run == runs[0] for run in runs)
    run = runs[0]
    assert run["again"] == run["first"] and run["after_more_steps"] < run["first"]
    assert math.isfinite(run["forward_after_teardown"])
