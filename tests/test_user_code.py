"""ZeRO-3 under real user code (issue: "ZeRO-3 survives real user code"): parameters read and
written outside forward, Lightning's SWA and EMA callbacks, forward outside *_step (a callback,
Hugging Face generate), and ranks that disagree (data length, structure, units run) getting an
error on every rank instead of a hang or an abort. Two gloo ranks, one spawn."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn
from torch.utils.data import DataLoader

from harness import launched_environment, run_on_ranks
from lightning_zero import DataWriteWarning, ParallelConfig, ZeroConfig, ZeroStrategy, consolidate
from lightning_zero.offload import CPUOffloadPolicy
from models import VOCAB, TiedGPT, TinyGPT, fit, loader, max_abs_diff, params_of, token_data

WORLD = 2
UNIT = 500  # min_unit_numel: the blocks and the embedding become units of their own


def zero3(**overrides: Any) -> ZeroStrategy:
    return ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=UNIT, **overrides))


def zero3_offload() -> ZeroStrategy:
    offload = CPUOffloadPolicy()
    return zero3(offload_optimizer=offload, offload_params=offload)


# ---------------------------------------------------------------------------------------- reads and writes
class ReadsOutsideForward(Callback):
    """What the issue saw segfault: a norm and a clone of a parameter between steps."""

    def __init__(self) -> None:
        self.reads: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        weight = pl_module.blocks[0].linear1.weight
        piece = weight.detach().clone()
        norm = float(weight.norm())
        with trainer.strategy.gathered_params(writeback=False):
            whole = weight.detach().clone()
        self.reads.append({"piece": piece, "norm": norm, "whole": whole})


class WritesOutsideForward(Callback):
    """Scales a parameter in place between steps, the way weight-averaging callbacks write."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            pl_module.norm.weight.mul_(0.5)  # root unit (not gathered between steps)
            pl_module.blocks[1].linear2.weight.detach().mul_(0.5)  # a unit of its own


def _reads(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    reads = ReadsOutsideForward()
    fit(TiedGPT(), strategy, WORLD, steps=3, callbacks=[reads])
    return {"reads": reads.reads}


def _writes(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = TiedGPT()
    fit(module, strategy, WORLD, steps=4, callbacks=[WritesOutsideForward()])
    return {"params": params_of(module), "losses": module.losses}


# ---------------------------------------------------------------------------------------- weight averaging
class AveragedPieces(Callback):
    """How many elements this rank's averaged copy holds (sharded like the model, or whole)."""

    def __init__(self, averaging: Callback) -> None:
        self.averaging = averaging
        self.elements = -1
        self.dtypes: set[str] = set()
        self.average: dict[str, Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        average = self.averaging._average_model
        self.elements = sum(p.numel() for p in average.parameters())
        self.dtypes = {str(p.dtype) for p in average.parameters()}
        modules = average.module if isinstance(average, torch.optim.swa_utils.AveragedModel) else average
        self.average = {name: p.detach().reshape(-1).clone() for name, p in modules.named_parameters()}


def _averaged(strategy: Any, averaging: Callback, **trainer_kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0)
    module = TiedGPT()
    pieces = AveragedPieces(averaging)
    _fit_epochs(module, strategy, [averaging, pieces], max_epochs=3, limit_train_batches=4, **trainer_kwargs)
    return {"params": params_of(module), "elements": pieces.elements, "dtypes": pieces.dtypes,
            "average": pieces.average}


def _averaging_cases() -> dict[str, Any]:
    out: dict[str, Any] = {"numel": sum(p.numel() for p in TiedGPT().parameters())}
    for name, strategy in (("zero2", lambda: ZeroStrategy(stage=2)), ("zero3", zero3),
                           ("zero3_offload", zero3_offload)):
        out[f"swa_{name}"] = _averaged(strategy(), StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1))
        out[f"ema_{name}"] = _averaged(strategy(), EMAWeightAveraging(decay=0.8))
    for name, strategy in (("zero2", lambda: ZeroStrategy(stage=2)), ("zero3", zero3)):
        out[f"ema_bf16_{name}"] = _averaged(strategy(), EMAWeightAveraging(decay=0.99), precision="bf16-mixed")
    return out


def _ema_resume(strategy: Any, directory: str) -> dict[str, Any]:
    """bf16-mixed with EMA and a checkpoint every epoch: 3 epochs straight, and 2 then a resume."""
    kwargs = dict(precision="bf16-mixed", limit_train_batches=4, limit_val_batches=2, num_sanity_val_steps=0)
    out = {}
    for name in ("straight", "resumed"):
        pl.seed_everything(0)
        module = TinyGPT()
        callbacks: list[Callback] = [EMAWeightAveraging(decay=0.9)]
        with launched_environment():
            if name == "resumed":
                first = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy(), max_epochs=2, logger=False,
                                   enable_progress_bar=False, enable_model_summary=False, **kwargs,
                                   callbacks=[*callbacks, ModelCheckpoint(dirpath=directory, save_last=True)])
                first.fit(module, loader(), loader(samples=16))
                pl.seed_everything(0)
                module, callbacks = TinyGPT(), [EMAWeightAveraging(decay=0.9)]
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy(), max_epochs=3, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=callbacks, **kwargs)
            trainer.fit(module, loader(), loader(samples=16),
                        ckpt_path=f"{directory}/last.ckpt" if name == "resumed" else None)
        out[name] = {"params": params_of(module), "val": float(trainer.callback_metrics["val_loss"])}
    return out


def _averaging(kind: str) -> Callback:
    return StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1) if kind == "swa" else EMAWeightAveraging(decay=0.9)


def _average_of(callback: Callback) -> dict[str, Tensor]:
    average = callback._average_model
    modules = average.module if isinstance(average, torch.optim.swa_utils.AveragedModel) else average
    return {name: p.detach().reshape(-1).clone() for name, p in modules.named_parameters()}


class LambdaScheduledGPT(TinyGPT):
    """TinyGPT with a per-step LambdaLR, whose state SWA's SWALR state does not fit."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _average_resume(kind: str, state_dict_type: str, directory: str) -> dict[str, Any]:
    """ZeRO-3 with SWA (and a LambdaLR, which SWA replaces by its SWALR) or EMA, checkpoints of
    ``state_dict_type``: 3 epochs straight, and 2 then a resume; the trained weights and the
    average at the end of each."""
    kwargs = dict(limit_train_batches=4, limit_val_batches=2, num_sanity_val_steps=0)
    model = LambdaScheduledGPT if kind == "swa" else TinyGPT
    out = {}
    for name in ("straight", "resumed"):
        pl.seed_everything(0)
        module, callback = model(), _averaging(kind)
        with launched_environment():
            if name == "resumed":
                strategy = ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=UNIT), state_dict_type=state_dict_type)
                first = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy,
                                   max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                                   callbacks=[callback, ModelCheckpoint(dirpath=directory, save_last=True)], **kwargs)
                first.fit(module, loader(), loader(samples=16))
                out["file"] = _whole_file(f"{directory}/last.ckpt", state_dict_type) if first.global_rank == 0 else {}
                pl.seed_everything(0)
                module, callback = model(), _averaging(kind)
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=zero3(), max_epochs=3, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[callback], **kwargs)
            trainer.fit(module, loader(), loader(samples=16),
                        ckpt_path=f"{directory}/last.ckpt" if name == "resumed" else None)
        out[name] = {"params": params_of(module), "average": _average_of(callback)}
    if state_dict_type == "sharded":  # the export (written by rank 0 above) resumes under DDP
        torch.distributed.barrier()
        pl.seed_everything(0)
        module, callback = model(), _averaging(kind)
        with launched_environment():
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=3, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[callback], **kwargs)
            trainer.fit(module, loader(), loader(samples=16), ckpt_path=f"{directory}/last.ckpt.pt")
        out["ddp"] = {"params": params_of(module), "average": _average_of(callback)}
    return out


def _validate_averaged(kind: str, strategy: Any, directory: str) -> float:
    """Fits with SWA or EMA and a checkpoint, then validates from that checkpoint (with the callback
    still holding its average, as after a fit)."""
    pl.seed_everything(0)
    module = TinyGPT()
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=2, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_train_batches=4,
                             limit_val_batches=2, num_sanity_val_steps=0,
                             callbacks=[_averaging(kind), ModelCheckpoint(dirpath=directory, save_last=True)])
        trainer.fit(module, loader(), loader(samples=16))
        return float(trainer.validate(module, loader(samples=16), ckpt_path="last", verbose=False)[0]["val_loss"])


def _whole_file(path: str, state_dict_type: str) -> dict[str, Any]:
    """The model and the average of a whole checkpoint: the file itself, or a sharded one's export."""
    if state_dict_type == "sharded":
        path = str(consolidate(path, f"{path}.pt", progress=False))
    checkpoint = torch.load(path, weights_only=False)
    swa = [state["average_model_state"] for key, state in checkpoint["callbacks"].items()
           if key.startswith("StochasticWeightAveraging")]
    if swa:
        return {"model": checkpoint["state_dict"], "average": swa[0]}
    return {"model": checkpoint["current_model_state"], "average": checkpoint["state_dict"]}


# ---------------------------------------------------------------------------------------- forward outside steps
class ForwardInCallback(Callback):
    def __init__(self) -> None:
        self.outputs: list[Tensor] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tokens = token_data(4, seed=1).tensors[0]
        with torch.no_grad():
            self.outputs.append(pl_module(tokens))


def _fit_epochs(module: pl.LightningModule, strategy: Any, callbacks: list[Callback], **trainer_kwargs: Any) -> None:
    """Fits by epochs (the callbacks here act at epoch ends), inside the launched ranks."""
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks, **trainer_kwargs)
        trainer.fit(module, train_dataloaders=loader())


def _forward_outside(strategy: Any) -> Tensor:
    pl.seed_everything(0)
    callback = ForwardInCallback()
    # TinyGPT's 4.5K parameters are all in the root unit
    _fit_epochs(TinyGPT(), strategy, [callback], max_epochs=2, limit_train_batches=3)
    return torch.stack(callback.outputs)


class TinyHFGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(input_ids=batch[0]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Generates(Callback):
    """Greedy generation at each epoch's end; with ``uneven``, from another prompt on each rank and
    with rank 0's first new token as its EOS, so rank 0 stops after one token and rank 1 runs on."""

    def __init__(self, uneven: bool = False) -> None:
        self.tokens: list[Tensor] = []
        self.uneven = uneven

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        prompt = torch.tensor([[1, 2, 3, 4]]) + (trainer.global_rank if self.uneven else 0)
        kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
        eos = None
        if self.uneven:
            first = pl_module.model.generate(prompt, max_new_tokens=1, **kwargs)[0, -1]
            eos = int(first) if trainer.global_rank == 0 else None
        self.tokens.append(pl_module.model.generate(prompt, max_new_tokens=6, eos_token_id=eos, **kwargs))


class GeneratesOnRankZero(Callback):
    """The usual sampling callback, written for one rank: rank 0 generates after validation, after
    the first epoch, or after the second training batch (``hook``)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.wrapped_sigterm_broadcast: list[bool] = []  # per training batch: the strategy agrees before it

    def _generate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            prompt = torch.tensor([[1, 2, 3, 4]])
            pl_module.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                                     pad_token_id=0)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.wrapped_sigterm_broadcast.append("_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hook == "on_validation_epoch_end":
            self._generate(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hook == "on_train_epoch_end" and trainer.current_epoch == 0:
            self._generate(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.hook == "on_train_batch_end" and batch_idx == 1:
            self._generate(trainer, pl_module)


class ValidatedHFGPT2(TinyHFGPT2):
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits = self.model(input_ids=batch[0]).logits
        self.log("val_loss", nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten()), sync_dist=True)


GENERATE_HOOKS = ("on_validation_epoch_end", "on_train_epoch_end", "on_train_batch_end")


def _generate_on_rank_zero_only(hook: str) -> dict[str, Any]:
    """At stage 3 rank 0's gather waits for ranks that went on to Lightning's synced validation
    metric (after validation) or to its SIGTERM broadcast at the start of the next training batch
    (after a training batch or epoch): the strategy agrees before both, so every rank raises
    instead of waiting for the process group's timeout (30 minutes by default)."""
    pl.seed_everything(0)
    callback = GeneratesOnRankZero(hook)
    trainer: list[pl.Trainer] = []

    def run() -> None:
        with launched_environment():
            trainer.append(pl.Trainer(accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(config=ZeroConfig(
                stage=3, unit_modules=("GPT2Block",))), logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                max_epochs=2, limit_train_batches=3, limit_val_batches=1))
            trainer[0].fit(ValidatedHFGPT2(), train_dataloaders=loader(), val_dataloaders=loader(samples=8))

    return {**_error_of(run), "wrapped_while_training": callback.wrapped_sigterm_broadcast,
            "wrapped_after": "_broadcast_sigterm_tensor" in vars(trainer[0].fit_loop.epoch_loop)}


class TermsAtBatch1(Callback):
    """SIGTERM to this process at the end of training batch 1, on ``ranks`` only (a preempted node)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == 1 and trainer.global_rank in self.ranks:
            os.kill(os.getpid(), signal.SIGTERM)


def _sigterm(ranks: tuple[int, ...]) -> dict[str, Any]:
    """[Note: the start of a training batch]: the agreement at each batch start carries the
    SIGTERM flag in the place of Lightning's broadcasts, so a SIGTERM on any one rank stops every
    rank at the next batch (Lightning's own handler broadcast from inside the signal handler,
    which met the agreement instead and waited for the process group's timeout)."""
    pl.seed_everything(0)
    handler_before = signal.getsignal(signal.SIGTERM)
    trainer: list[pl.Trainer] = []

    def run() -> None:
        with launched_environment():
            trainer.append(pl.Trainer(accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(config=ZeroConfig(
                stage=3, min_unit_numel=1)), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[TermsAtBatch1(ranks)], max_steps=6))
            trainer[0].fit(TinyGPT(), train_dataloaders=loader())

    return {**_error_of(run), "received_sigterm": trainer[0].received_sigterm, "steps": trainer[0].global_step,
            "handler_restored": signal.getsignal(signal.SIGTERM) == handler_before,
            "hooks_left": sorted({"_broadcast_sigterm_tensor", "_sigterm_notifier_fn"}
                                 & (set(vars(trainer[0].fit_loop.epoch_loop)) | set(vars(trainer[0]._signal_connector))))}


def _generate(strategy: Any, uneven: bool = False) -> list[Tensor]:
    pl.seed_everything(0)
    callback = Generates(uneven)
    _fit_epochs(TinyHFGPT2(), strategy, [callback], max_epochs=2, limit_train_batches=3)
    return callback.tokens


# ---------------------------------------------------------------------------------------- ranks that disagree
def _error_of(run: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        run()
        message = "no error"
    except (Exception, SIGTERMException) as error:  # noqa: BLE001 - the test asserts the type and the text
        message = f"{type(error).__name__}: {error}"
    return {"message": message, "seconds": time.monotonic() - start}


class RankStream(torch.utils.data.IterableDataset):
    """A stream with no length: 5 batches on rank 0, 4 on rank 1."""

    def __iter__(self) -> Any:
        samples = 20 if torch.distributed.get_rank() == 0 else 16
        yield from token_data(samples)


def _uneven_data(strategy: Any, iterable: bool = False, **trainer_kwargs: Any) -> dict[str, Any]:
    samples = 20 if torch.distributed.get_rank() == 0 else 16  # 5 batches against 4
    data = DataLoader(RankStream(), batch_size=4) if iterable else loader(samples=samples)

    def run() -> None:
        with launched_environment():
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1,
                                 use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
            trainer.fit(TiedGPT(), train_dataloaders=data)

    return _error_of(run)


class RankDependentDepth(TiedGPT):
    """A ModuleList whose length depends on the rank: a different model on each rank."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks.append(nn.Linear(32, 32) if torch.distributed.get_rank() == 1 else nn.Identity())

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class RegularizedGPT(TiedGPT):
    """An L2 term over self.parameters() in training_step: outside forward, at stage 3, pieces."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())


class UnevenBackwards(pl.LightningModule):
    """Manual optimization in which rank r calls manual_backward 1 + r times before its step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        for _ in range(1 + self.global_rank):
            loss = nn.functional.cross_entropy(self.net(batch[0]).flatten(0, 1), batch[1].flatten())
            self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SkipsABatchOnOneRank(UnevenBackwards):
    """Manual optimization in which rank 1 skips batch 1 ("a bad batch"): no step there, with
    (``backward=True``) or without its backward."""

    def __init__(self, backward: bool) -> None:
        super().__init__()
        self.backward_on_skip = backward

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = nn.functional.cross_entropy(self.net(batch[0]).flatten(0, 1), batch[1].flatten())
        if self.global_rank == 1 and batch_idx == 1:
            if self.backward_on_skip:
                self.manual_backward(loss)
            return
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()


class RankDependentBranch(TiedGPT):
    """The same model everywhere, but rank 1 runs one block fewer: different units per rank."""

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks[: len(self.blocks) - self.trainer.global_rank]:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class TwoOptimizerGAN(pl.LightningModule):
    """A generator and a critic, each with its own optimizer (manual optimization). On batch 1 the
    ranks step different optimizers: rank 0 only the generator, rank 1 only the critic, each after
    one backward, with (``toggle``, Lightning's docs pattern) or without toggle_optimizer."""

    def __init__(self, toggle: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.critic = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        real = batch[0][:, :8].float()
        noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        step_c, step_g = (self.global_rank == 1, self.global_rank == 0) if batch_idx == 1 else (True, True)
        if step_c:
            self._step(opt_c, lambda: self.critic(self.generator(noise).detach()).mean() - self.critic(real).mean())
        if step_g:
            self._step(opt_g, lambda: -self.critic(self.generator(noise)).mean())

    def _step(self, optimizer: Any, loss: Callable[[], Tensor]) -> None:
        if self.toggle:
            self.toggle_optimizer(optimizer)
        self.manual_backward(loss())
        optimizer.step()
        optimizer.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.generator.parameters(), lr=0.1),
                torch.optim.SGD(self.critic.parameters(), lr=0.1))


class BackwardThroughAStaleGraph(TwoOptimizerGAN):
    """The classic GAN mistake: the critic steps, then the generator's loss backpropagates through the
    critic's graph from before that step (retain_graph=True), which saved the critic's old weights."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        noise = torch.randn(batch[0].shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        judged = self.critic(self.generator(noise))
        self.manual_backward(judged.mean(), retain_graph=True)
        opt_c.step()
        opt_c.zero_grad()
        self.manual_backward(-judged.mean())
        opt_g.step()
        opt_g.zero_grad()


class ClippedCritic(TwoOptimizerGAN):
    """WGAN: both step every batch, then the critic's weights are clipped in place, through ``.data``
    as the WGAN paper's code does (no version counter sees it), or under no_grad."""

    def __init__(self, through_data: bool) -> None:
        super().__init__(toggle=False)
        self.through_data = through_data

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        real = batch[0][:, :8].float()
        noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        self._step(opt_c, lambda: self.critic(self.generator(noise).detach()).mean() - self.critic(real).mean())
        for param in self.critic.parameters():
            if self.through_data:
                param.data.clamp_(-0.05, 0.05)
            else:
                with torch.no_grad():
                    param.clamp_(-0.05, 0.05)
        self._step(opt_g, lambda: -self.critic(self.generator(noise)).mean())


class RankDependentReach(pl.LightningModule):
    """Two optimizers, both stepped every batch; rank 1's loss never reaches ``head`` (the second
    optimizer's). So rank 0's backward completes the head's bucket first and rank 1's the body's,
    while the head's goes out as zeros when its optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        hidden = self.body(batch[0][:, :8].float())
        loss = hidden.pow(2).mean() if self.global_rank == 1 else self.head(hidden).pow(2).mean()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)


def _reach() -> dict[str, dict[str, Tensor]]:
    out = {}
    for name, strategy in (("ddp", lambda: "ddp_find_unused_parameters_true"), ("zero1", lambda: ZeroStrategy(stage=1)),
                           ("zero2", lambda: ZeroStrategy(stage=2)), ("zero2_offload", lambda: "zero2_offload")):
        torch.manual_seed(0)
        module = RankDependentReach()
        fit(module, strategy(), WORLD, steps=3)
        out[name] = params_of(module)
    return out


def _clipped(strategy: Any, through_data: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    module = ClippedCritic(through_data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, strategy, WORLD, steps=6)
    return {"params": params_of(module), "warned": sum(issubclass(w.category, DataWriteWarning) for w in caught)}


def _clipping() -> dict[str, Any]:
    return {f"{name}_{through_data}": _clipped(strategy(), through_data) for through_data in (True, False)
            for name, strategy in (("ddp", lambda: "ddp_find_unused_parameters_true"),
                                   ("zero1", lambda: ZeroStrategy(stage=1)), ("zero2", lambda: ZeroStrategy(stage=2)),
                                   ("zero2_offload", lambda: "zero2_offload"), ("zero3", zero3), ("zero3_units", lambda: ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=100))),
                                   ("zero3_offload", zero3_offload))}


def _stale_graphs() -> dict[str, str]:
    out = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("zero1", lambda: ZeroStrategy(stage=1)),
                           ("zero2", lambda: ZeroStrategy(stage=2)), ("zero2_offload", lambda: "zero2_offload"),
                           ("zero3", zero3), ("zero3_offload", zero3_offload)):
        made = strategy()
        out[name] = _error_of(lambda made=made: fit(BackwardThroughAStaleGraph(False), made, WORLD, steps=2))["message"]
    return out


def _disagreeing_ranks() -> dict[str, Any]:
    out = {}
    for name, strategy in (("zero2", lambda: ZeroStrategy(stage=2)), ("zero3", zero3)):
        out[f"data_{name}"] = _uneven_data(strategy())
        out[f"stream_{name}"] = _uneven_data(strategy(), iterable=True)
        out[f"structure_{name}"] = _error_of(lambda: fit(RankDependentDepth(), strategy(), WORLD, steps=2))
    out["branch_zero3"] = _error_of(lambda: fit(RankDependentBranch(), zero3(), WORLD, steps=2))
    out["regularizer_zero3"] = _error_of(lambda: fit(RegularizedGPT(), zero3(), WORLD, steps=2))
    for name, strategy in (("zero2", lambda: ZeroStrategy(stage=2)), ("zero3", lambda: ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=100)))):
        out[f"backwards_{name}"] = _error_of(lambda: fit(UnevenBackwards(), strategy(), WORLD, steps=2))
        for backward in (False, True):
            out[f"skip_{name}_{backward}"] = _error_of(
                lambda: fit(SkipsABatchOnOneRank(backward), strategy(), WORLD, steps=4))
    for name, strategy in (("zero1", lambda: ZeroStrategy(stage=1)), ("zero2", lambda: ZeroStrategy(stage=2)),
                           ("zero2_offload", lambda: "zero2_offload"), ("zero3", zero3)):
        for toggle in (False, True):
            gan, made = TwoOptimizerGAN(toggle), strategy()
            out[f"gan_{name}_{toggle}"] = _error_of(lambda gan=gan, made=made: fit(gan, made, WORLD, steps=3))
    # The same uneven data trains when the run takes only batches every rank has, as with DDP.
    out["uneven_but_limited"] = _uneven_data(zero3(), limit_train_batches=3)
    return out


# ---------------------------------------------------------------------------------------- several dtypes
class MixedBlock(nn.Module):
    """One module, three parameter dtypes: fp32 weights, a bf16 adapter, a float64 scale."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.adapter = nn.Linear(width, width, bias=False).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.float64))

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = torch.tanh(self.linear(hidden)) + self.adapter(hidden.bfloat16()).float()
        return (hidden.double() * self.scale).float()


class MixedDtypeNet(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(MixedBlock(width) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)
        self.gain = nn.Parameter(torch.ones((), dtype=torch.float64))  # in the root unit

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        hidden = self.embed(batch[0])
        for block in self.blocks:
            hidden = block(hidden)
        logits = (self.head(hidden).double() * self.gain).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self) -> Any:
        wide = [p for p in self.parameters() if p.dtype == torch.float64]
        rest = [p for p in self.parameters() if p.dtype != torch.float64]
        # Updates of 1e-9 vanish in an fp32 master (1 + 1e-9 == 1 in fp32): only a float64 master keeps them.
        return torch.optim.AdamW([{"params": rest, "lr": 1e-2}, {"params": wide, "lr": 1e-9, "weight_decay": 0.0}])


class UnitNames(Callback):
    def __init__(self) -> None:
        self.names: list[str] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self.names = [unit.name for unit in engine.units] if engine is not None else []


def _mixed_dtypes() -> dict[str, Any]:
    out = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("zero2", lambda: ZeroStrategy(stage=2)),
                           ("zero3", lambda: zero3(unit_modules=("MixedBlock",))),
                           ("zero3_offload", lambda: ZeroStrategy(config=ZeroConfig(
                               stage=3, unit_modules=("MixedBlock",), offload_optimizer=CPUOffloadPolicy(),
                               offload_params=CPUOffloadPolicy())))):
        pl.seed_everything(0)
        module = MixedDtypeNet()
        names = UnitNames()
        fit(module, strategy(), WORLD, steps=4, callbacks=[names])
        out[name] = {"params": params_of(module), "units": names.names}
    return out


# ---------------------------------------------------------------------------------------- one spawn
def _compiled_unit(strategy: Any) -> dict[str, Tensor]:
    """A unit module compiled on its own (``module.compile()``, hooks inside the compiled call):
    inductor's graph captured the parameter as its 1-d piece and failed on the whole one (see
    [Note: compiled units]); aot_eager does not check shapes, so only inductor shows it."""
    torch._dynamo.reset()
    pl.seed_everything(0)
    module = TinyGPT()
    module.block.compile()
    fit(module, strategy, WORLD, steps=3)
    return params_of(module)


def _all(directory: str) -> dict[str, Any]:
    return {
        "ema_resume": {name: _ema_resume(strategy, f"{directory}/{name}") for name, strategy in (
            ("zero2", lambda: ZeroStrategy(stage=2)), ("zero3", zero3))},
        "validate_averaged": {f"{kind}_{name}": _validate_averaged(kind, strategy(), f"{directory}/val_{kind}_{name}")
                              for kind in ("swa", "ema") for name, strategy in (
                                  ("ddp", lambda: "ddp"), ("zero3", zero3),
                                  ("zero3_full", lambda: ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=UNIT),
                                                                      state_dict_type="full")))},
        "average_resume": {f"{kind}_{kind_of_file}": _average_resume(kind, kind_of_file, f"{directory}/{kind}_{kind_of_file}")
                           for kind in ("swa", "ema") for kind_of_file in ("sharded", "full")},
        "reads_zero3": _reads(zero3()),
        "reads_zero3_offload": _reads(zero3_offload()),
        "writes": {name: _writes(strategy()) for name, strategy in (
            ("ddp", lambda: "ddp"), ("zero1", lambda: ZeroStrategy(stage=1)), ("zero2", lambda: ZeroStrategy(stage=2)),
            ("zero2_offload", lambda: "zero2_offload"), ("zero3", zero3), ("zero3_offload", zero3_offload))},
        "averaging": _averaging_cases(),
        "forward": {"ddp": _forward_outside("ddp"), "zero3": _forward_outside(ZeroStrategy(stage=3))},
        "generate": {"ddp": _generate("ddp"), "zero3": _generate(ZeroStrategy(config=ZeroConfig(
            stage=3, unit_modules=("GPT2Block",))))},
        "generate_uneven": {"ddp": _generate("ddp", uneven=True), "zero3": _generate(ZeroStrategy(config=ZeroConfig(
            stage=3, unit_modules=("GPT2Block",))), uneven=True)},
        "generate_on_rank_zero": {hook: _generate_on_rank_zero_only(hook) for hook in GENERATE_HOOKS},
        "sigterm": {str(ranks): _sigterm(ranks) for ranks in ((0,), (1,))},
        "compiled_unit": {name: _compiled_unit(strategy()) for name, strategy in (("ddp", lambda: "ddp"), ("zero3", zero3))},
        "disagree": _disagreeing_ranks(),
        "stale_graph": _stale_graphs(),
        "clipping": _clipping(),
        "reach": _reach(),
        "mixed_dtypes": _mixed_dtypes(),
    }


_OUTCOME: list[dict[str, Any]] = []


def outcome() -> list[dict[str, Any]]:
    if not _OUTCOME:
        with tempfile.TemporaryDirectory() as directory:
            _OUTCOME.extend(run_on_ranks(_all, WORLD, directory))
    return _OUTCOME


@pytest.mark.parametrize("case", ["reads_zero3", "reads_zero3_offload"])
def test_a_parameter_outside_its_gather_is_this_ranks_piece(case: str) -> None:
    for rank, per_rank in enumerate(outcome()):
        reads = per_rank[case]["reads"]
        assert len(reads) == 3
        for read in reads:
            whole = read["whole"].reshape(-1)
            share = -(-whole.numel() // WORLD)
            expected = whole[rank * share : (rank + 1) * share]
            assert torch.equal(read["piece"], expected)  # 1-d, this rank's elements, no freed memory
            assert read["norm"] == pytest.approx(float(expected.norm()), rel=1e-6)


def test_in_place_writes_outside_forward_are_kept() -> None:
    for per_rank in outcome():
        writes = per_rank["writes"]
        for name in ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"):
            assert max_abs_diff(writes[name]["params"], writes["ddp"]["params"]) <= 1e-5, name
            assert max(abs(a - b) for a, b in zip(writes[name]["losses"], writes["ddp"]["losses"])) <= 1e-5


@pytest.mark.parametrize("averaging", ["swa", "ema"])
def test_weight_averaging_callbacks_match_stage_2_and_average_shards(averaging: str) -> None:
    per_ranks = outcome()
    for per_rank in per_ranks:
        cases = per_rank["averaging"]
        reference = cases[f"{averaging}_zero2"]
        assert reference["elements"] == cases["numel"]  # stage 2: the average is whole
        for name in ("zero3", "zero3_offload"):
            assert max_abs_diff(cases[f"{averaging}_{name}"]["params"], reference["params"]) <= 1e-6, name
    for name in ("zero3", "zero3_offload"):
        elements = [per_rank["averaging"][f"{averaging}_{name}"]["elements"] for per_rank in per_ranks]
        assert sum(elements) == per_ranks[0]["averaging"]["numel"]  # stage 3: each rank averages its pieces


def test_a_bf16_models_average_is_kept_in_fp32_as_at_stage_2() -> None:
    for rank, per_rank in enumerate(outcome()):
        zero2, zero3_ = per_rank["averaging"]["ema_bf16_zero2"], per_rank["averaging"]["ema_bf16_zero3"]
        assert zero2["dtypes"] == zero3_["dtypes"] == {"torch.float32"}  # 0.01 x delta would round away in bf16
        assert zero2["average"].keys() == zero3_["average"].keys()
        for name, whole in zero2["average"].items():  # stage 3 averages this rank's piece of the same values
            share = -(-whole.numel() // WORLD)
            assert (zero3_["average"][name] - whole[rank * share : (rank + 1) * share]).abs().max() <= 1e-6, name


def test_forward_in_a_callback_and_generate_match_ddp() -> None:
    for per_rank in outcome():
        forward = per_rank["forward"]
        assert forward["zero3"].shape == forward["ddp"].shape == (2, 4, 8, VOCAB)
        assert (forward["zero3"] - forward["ddp"]).abs().max() <= 1e-5
        generated = per_rank["generate"]
        assert torch.cat(generated["ddp"]).shape == (2, 10)
        assert torch.equal(torch.cat(generated["zero3"]), torch.cat(generated["ddp"]))


def test_generate_that_stops_early_on_one_rank_matches_ddp_at_stage_3() -> None:
    # Rank 0 hits its EOS after one token while rank 1 runs on: without synced_gpus the ranks ran
    # different numbers of forwards, whose gathers hung.
    for rank, per_rank in enumerate(outcome()):
        generated = per_rank["generate_uneven"]
        assert [tuple(t.shape) for t in generated["ddp"]] == [(1, 5) if rank == 0 else (1, 10)] * 2
        assert all(torch.equal(a, b) for a, b in zip(generated["zero3"], generated["ddp"], strict=True))


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_rank_with_fewer_batches_is_an_error_on_every_rank(stage: str) -> None:
    for per_rank in outcome():
        result = per_rank["disagree"][f"data_{stage}"]
        assert result["message"].startswith("RanksDisagreeError: The train_dataloader has a different number of"
                                            " batches on each rank (by rank: [5, 4]).")
        stream = per_rank["disagree"][f"stream_{stage}"]
        assert stream["message"].startswith("RanksDisagreeError: Rank(s) [1] ran out of batches of the"
                                            " train_dataloader after 4 batches while rank(s) [0] have more.")
        assert result["seconds"] < 60 and stream["seconds"] < 60
    assert all(per_rank["disagree"]["uneven_but_limited"]["message"] == "no error" for per_rank in outcome())


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_model_that_differs_between_ranks_is_an_error_at_setup(stage: str) -> None:
    for per_rank in outcome():
        message = per_rank["disagree"][f"structure_{stage}"]["message"]
        assert message.startswith("RanksDisagreeError: ZeRO needs the same model on every rank, but rank 1 has")
        assert "parameter #" in message and "rank 0 no such parameter" in message and "'blocks.2.weight'" in message


@pytest.mark.parametrize("hook", GENERATE_HOOKS)
def test_a_generate_on_rank_zero_only_is_an_error_on_every_rank_not_a_hang(hook: str) -> None:
    for per_rank in outcome():
        case = per_rank["generate_on_rank_zero"][hook]
        message = case["message"]
        assert message.startswith("RanksDisagreeError: The ranks are at different points of the run: rank 0 gathers")
        elsewhere = {"on_validation_epoch_end": "rank 1 calls trainer.strategy.reduce()",
                     "on_train_epoch_end": "rank 1 starts a training batch (Lightning's broadcast of its SIGTERM flag)",
                     "on_train_batch_end": "rank 1 starts a training batch (Lightning's broadcast of its SIGTERM flag)"}
        assert elsewhere[hook] in message
        assert "`if trainer.is_global_zero: model.generate(...)` in a callback) on every rank" in message
        assert case["seconds"] < 60
        # The agreement stands before Lightning's broadcast at every training batch (none ran when the
        # sanity check's validation raised), and goes at teardown.
        assert all(case["wrapped_while_training"])
        assert len(case["wrapped_while_training"]) == {"on_validation_epoch_end": 0, "on_train_epoch_end": 3,
                                                       "on_train_batch_end": 2}[hook]
        assert not case["wrapped_after"]


@pytest.mark.parametrize("ranks", [(0,), (1,)])
def test_a_sigterm_on_one_rank_stops_every_rank_at_the_next_batch(ranks: tuple[int, ...]) -> None:
    for per_rank in outcome():
        case = per_rank["sigterm"][str(ranks)]
        assert case["message"].startswith("SIGTERMException"), case["message"]
        assert case["seconds"] < 60 and case["received_sigterm"]
        assert case["steps"] == 2  # batches 0 and 1 stepped; every rank stopped before batch 2's forward
        assert case["handler_restored"] and case["hooks_left"] == []


def test_ranks_running_different_units_get_an_error_naming_them() -> None:
    for per_rank in outcome():
        message = per_rank["disagree"]["branch_zero3"]["message"]
        assert message.startswith("RanksDisagreeError: ZeRO-3 ranks disagree on which unit to gather next:")
        assert "rank 0 gathers 'blocks.1' (forward)" in message and "rank 1 gathers" in message


def test_parameters_of_several_dtypes_train_at_stage_3_and_float64_keeps_its_precision() -> None:
    for per_rank in outcome():
        cases = per_rank["mixed_dtypes"]
        ddp = cases["ddp"]["params"]
        assert {str(p.dtype) for p in ddp.values()} == {"torch.float32", "torch.bfloat16", "torch.float64"}
        assert cases["zero3"]["units"] == ["<root>[float64]", "<root>", "blocks.0[float64]", "blocks.0", "blocks.0[bfloat16]",
                                           "blocks.1[float64]", "blocks.1", "blocks.1[bfloat16]"]
        for name in ("zero3", "zero3_offload"):
            params = cases[name]["params"]
            assert {k: v.dtype for k, v in params.items()} == {k: v.dtype for k, v in ddp.items()}
            # fp32 and bf16 parameters: each rounded from an fp32 master, as at stage 2
            for key, value in params.items():
                if value.dtype != torch.float64:
                    tolerance = 1e-5 if value.dtype == torch.float32 else 1e-2
                    assert (value.float() - cases["zero2"]["params"][key].float()).abs().max() <= tolerance, key
            # float64: the 1e-9 updates survive (a float32 master would leave exactly 1.0), equal to DDP's
            # (4 steps of about 1e-9 each; the runs differ by fp32 rounding in the gradients only)
            for key in ("gain", "blocks.0.scale", "blocks.1.scale"):
                assert (ddp[key] - 1).abs().max() > 1e-9 and (params[key] - 1).abs().max() > 1e-9
                assert (params[key] - ddp[key]).abs().max() <= 1e-10, key  # an fp32 master: about 4e-9 off


def test_a_loss_over_parameters_outside_forward_says_why_it_fails_at_stage_3() -> None:
    for per_rank in outcome():
        message = per_rank["disagree"]["regularizer_zero3"]["message"]
        assert message.startswith("RuntimeError: Function PowBackward0 returned an invalid gradient")
        assert "Under ZeRO-3 this usually means the loss used a parameter outside the forward of its module" in message


def test_an_ema_run_resumes_from_its_sharded_checkpoint_exactly() -> None:
    for per_rank in outcome():
        for name in ("zero2", "zero3"):
            runs = per_rank["ema_resume"][name]
            assert max_abs_diff(runs["resumed"]["params"], runs["straight"]["params"]) == 0.0, name
            assert runs["resumed"]["val"] == runs["straight"]["val"]
        assert per_rank["ema_resume"]["zero3"]["straight"]["val"] == per_rank["ema_resume"]["zero2"]["straight"]["val"]


@pytest.mark.parametrize("kind", ["swa", "ema"])
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_weight_average_resumes_exactly_at_stage_3(kind: str, state_dict_type: str) -> None:
    # Each rank's average holds its own pieces: a checkpoint that kept rank 0's (Lightning saves a
    # callback's state once) gave rank 1 rank 0's values back, silently.
    for rank, per_rank in enumerate(outcome()):
        runs = per_rank["average_resume"][f"{kind}_{state_dict_type}"]
        assert max_abs_diff(runs["resumed"]["average"], runs["straight"]["average"]) == 0.0
        assert max_abs_diff(runs["resumed"]["params"], runs["straight"]["params"]) == 0.0
        if state_dict_type == "sharded":  # its export resumes under DDP to the same average
            for name, value in runs["resumed"]["average"].items():
                whole = runs["ddp"]["average"][name]
                share = -(-whole.numel() // WORLD)
                assert (value - whole[rank * share : (rank + 1) * share]).abs().max() <= 1e-5, name
    # The whole file (a "full" save, or the export of a sharded one) holds the average whole, as DDP
    # would write it: the same values both ways, the parameters' true shapes.
    rank0 = outcome()[0]["average_resume"]
    full, export = rank0[f"{kind}_full"]["file"], rank0[f"{kind}_sharded"]["file"]
    shapes = {name: tuple(param.shape) for name, param in TinyGPT().named_parameters()}
    for name, shape in shapes.items():
        assert tuple(full["average"][name].shape) == shape and tuple(full["model"][name].shape) == shape
        assert torch.equal(full["average"][name], export["average"][name]), name
        assert torch.equal(full["model"][name], export["model"][name]), name
    assert any(not torch.equal(full["average"][name], full["model"][name]) for name in shapes)  # an average


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
@pytest.mark.parametrize("backward", [False, True])
def test_a_rank_that_skips_a_step_is_an_error_on_every_rank(stage: str, backward: bool) -> None:
    # Rank 1 went on to the next batch, where Lightning's per-batch broadcast waited for rank 0,
    # which waited in its step's agreement for rank 1: a deadlock.
    for per_rank in outcome():
        run = per_rank["disagree"][f"skip_{stage}_{backward}"]
        # rank 0 is in its step: its agreement (or, at stage 3, the gather of a unit it steps)
        assert run["message"].startswith("RanksDisagreeError: The ranks are at different points of the run: rank 0 ")
        assert "rank 1 ended its training_step after 0 optimizer step(s)." in run["message"]
        assert run["seconds"] < 60


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero2_offload", "zero3"])
@pytest.mark.parametrize("toggle", [False, True])
def test_ranks_that_step_different_optimizers_get_an_error_on_every_rank(stage: str, toggle: bool) -> None:
    # Critic and generator of different sizes: stages 1/2 reduce the buckets of the optimizer each rank
    # toggled during backward, before the step's agreement, and gloo aborted on the size mismatch; of
    # the same size (the Fabric case in test_fabric.py), the ranks landed each other's reductions.
    for per_rank in outcome():
        run = per_rank["disagree"][f"gan_{stage}_{toggle}"]
        if toggle and stage != "zero3":
            assert run["message"].startswith(
                "RanksDisagreeError: The ranks start a backward that reduces the gradients of different optimizers"
                " (rank 0 optimizer(s) #1, rank 1 optimizer(s) #2)"), run["message"]
        else:
            assert run["message"].startswith(
                "RanksDisagreeError: The ranks are about to step different optimizers (rank 0 optimizer #1 after 1"
                " backward(s), rank 1 optimizer #2 after 1 backward(s);"), run["message"]
        assert run["seconds"] < 60


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_a_backward_through_a_graph_from_before_the_step_fails_as_under_ddp(stage: str) -> None:
    # The step publishes the parameters by means autograd does not see: the stale graph used to be
    # accepted, and the generator's gradients computed with the critic's new weights.
    for per_rank in outcome():
        messages = per_rank["stale_graph"]
        expected = "modified by an inplace operation"
        assert expected in messages["ddp"]
        assert messages[stage].startswith("RuntimeError: one of the variables needed for gradient computation has"
                                          " been modified by an inplace operation"), messages[stage]


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_units", "zero3_offload"])
@pytest.mark.parametrize("through_data", [True, False])
def test_weight_clipping_between_steps_matches_ddp(stage: str, through_data: bool) -> None:
    # Through .data no version counter sees the write: the next step published the masters over it
    # (stages 1/2), or the root unit's buffer was freed with it (stage 3). Now the first two steps
    # compare, find it, warn once, and every later step compares.
    for per_rank in outcome():
        ddp = per_rank["clipping"][f"ddp_{through_data}"]
        ours = per_rank["clipping"][f"{stage}_{through_data}"]
        assert max_abs_diff(ours["params"], ddp["params"]) < 1e-6
        critic = [value for name, value in ours["params"].items() if name.startswith("critic.")]
        assert max(value.abs().max().item() for value in critic) > 0.04  # the clipping bound was reached
        assert ours["warned"] == (1 if through_data else 0)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero2_offload"])
def test_optimizers_whose_buckets_complete_in_another_order_per_rank_match_ddp(stage: str) -> None:
    # Each optimizer's buckets launched in an order of their own: rank 0 sent the head's reduction
    # first, rank 1 the body's, and gloo paired reductions of different sizes (an abort). Now the
    # engine's layouts share one launch order (see [Note: one launch order] in reduce.py).
    for per_rank in outcome():
        reach = per_rank["reach"]
        assert max_abs_diff(reach[stage], reach["ddp"]) < 1e-6


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_validating_from_a_weight_averaged_checkpoint_matches_ddp_at_stage_3(kind: str) -> None:
    # SWA's copy outside fit is the whole module, which its state in pieces did not fit (a crash).
    for per_rank in outcome():
        values = per_rank["validate_averaged"]
        for name in ("zero3", "zero3_full"):
            assert values[f"{kind}_{name}"] == pytest.approx(values[f"{kind}_ddp"], abs=1e-5), name


def _fit_ema(world: int, epochs: int, callbacks: list[Callback], ckpt_path: str | None = None) -> None:
    pl.seed_everything(0)
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=zero3(), max_epochs=epochs, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_train_batches=4,
                             limit_val_batches=0, callbacks=callbacks)
        trainer.fit(TinyGPT(), loader(), ckpt_path=ckpt_path)


def _save_ema(directory: str, world: int) -> dict[str, Tensor]:
    """Two epochs at stage 3 with EMA and a sharded checkpoint; this rank's pieces of the average."""
    callback = _averaging("ema")
    _fit_ema(world, 2, [callback, ModelCheckpoint(dirpath=directory, save_last=True)])
    return _average_of(callback)


class AverageAtStart(Callback):
    def __init__(self, averaging: Callback) -> None:
        self.averaging = averaging
        self.average: dict[str, Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.average = _average_of(self.averaging)


def _resumed_ema(directory: str, world: int) -> dict[str, Tensor]:
    """This rank's pieces of the EMA average right after resuming from ``directory``'s checkpoint."""
    callback = _averaging("ema")
    probe = AverageAtStart(callback)
    _fit_ema(world, 3, [callback, probe], ckpt_path=f"{directory}/last.ckpt")
    return probe.average


def _hybrid_ema_full(directory: str) -> dict[str, Any]:
    """Hybrid sharding (2 replicas of 2 shards): EMA with whole checkpoints, saved then resumed."""
    def strategy() -> ZeroStrategy:
        return ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=UNIT, parallel=ParallelConfig(shard_size=2)),
                            state_dict_type="full")

    callback = _averaging("ema")
    pl.seed_everything(0)
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy(), max_epochs=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_train_batches=3,
                             limit_val_batches=0, callbacks=[callback, ModelCheckpoint(dirpath=directory, save_last=True)])
        trainer.fit(TinyGPT(), loader())
    saved = _average_of(callback)
    callback = _averaging("ema")
    probe = AverageAtStart(callback)
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy(), max_epochs=2, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_train_batches=1,
                             limit_val_batches=0, callbacks=[callback, probe])
        trainer.fit(TinyGPT(), loader(), ckpt_path=f"{directory}/last.ckpt")
    return {"saved": saved, "resumed": probe.average}


def test_an_ema_average_in_a_whole_checkpoint_round_trips_under_hybrid_sharding() -> None:
    # The average's pieces span the shard group only (2 of the 4 ranks): gathered over the world,
    # the save failed, and ranks 2 and 3 had no range of their own to cut on load.
    with tempfile.TemporaryDirectory() as directory:
        per_rank = run_on_ranks(_hybrid_ema_full, 4, directory)
    for rank in per_rank:
        assert max_abs_diff(rank["resumed"], rank["saved"]) == 0.0
    assert all(torch.equal(per_rank[r]["saved"][name], per_rank[r + 2]["saved"][name])  # replicas hold the same
               for r in (0, 1) for name in per_rank[0]["saved"])


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(1, 2), (2, 1)])
def test_an_ema_average_resumes_at_stage_3_on_another_number_of_ranks(saved_on: int, resumed_on: int) -> None:
    # On one rank a stage-3 parameter shows its whole piece, 1-d: the average was saved in that
    # shape and did not load elsewhere (nor a true-shaped one into it).
    with tempfile.TemporaryDirectory() as directory:
        saved = run_on_ranks(_save_ema, saved_on, directory, saved_on)
        resumed = run_on_ranks(_resumed_ema, resumed_on, directory, resumed_on)
    whole = {name: torch.cat([per_rank[name] for per_rank in saved]) for name in saved[0]}
    for rank, per_rank in enumerate(resumed):
        assert per_rank.keys() == whole.keys()
        for name, value in per_rank.items():
            share = -(-whole[name].numel() // resumed_on)
            assert torch.equal(value, whole[name][rank * share : (rank + 1) * share]), name


def test_a_rank_dependent_number_of_backward_calls_is_an_error_on_every_rank() -> None:
    for per_rank in outcome():
        stage2 = per_rank["disagree"]["backwards_zero2"]
        assert stage2["message"].startswith("RanksDisagreeError: The ranks ran different numbers of backward calls"
                                            " before this optimizer step (by rank: [1, 2])")
        # at stage 3, rank 1's second forward gathers while rank 0 is at its step: they meet there
        stage3 = per_rank["disagree"]["backwards_zero3"]
        assert stage3["message"].startswith("RanksDisagreeError: The ranks are at different points of the run: rank 0"
                                            " reduces the gradients of 1 backward(s) for optimizer #1's step, rank 1"
                                            " gathers ZeRO-3 unit #")
        assert stage2["seconds"] < 60 and stage3["seconds"] < 60


def test_a_unit_compiled_on_its_own_trains_like_ddp_at_stage_3() -> None:
    for per_rank in outcome():
        runs = per_rank["compiled_unit"]
        assert max_abs_diff(runs["zero3"], runs["ddp"]) <= 1e-5
