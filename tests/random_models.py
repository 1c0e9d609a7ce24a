"""Seeded random models and training cases for the differential test against DDP (issue #10).

A *case* is everything one seed decides: a module tree (depth, widths, tied weights, frozen parts,
buffers, parameters used on some steps or some ranks only), the data, the optimizer, and the ZeRO
settings (stage, offload, accumulation, world size, stage-3 units). ``make_case(seed)`` is a pure
function of the seed and the enabled :class:`Features`, so a failure is reproduced from its seed
alone (see :func:`rerun_command`).

The rank side trains the same model twice: once under Lightning with ``ZeroStrategy`` and once
with plain ``torch.nn.parallel.DistributedDataParallel(find_unused_parameters=True)`` and the
same torch optimizer, the reference; :func:`compare` then reads the final parameters.

:func:`run_cases` spawns one group of gloo ranks for many cases and streams each case's result
back as soon as it is done, so a case that fails or hangs costs only itself (the group is
restarted for the cases after it) and a hang is cut off by a per-case deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import os
import queue as queue_module
import random
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from harness import free_port, launched_environment, rank_environment

VOCAB = 16
SEQ = 4
FP32_TOLERANCE = 1e-5
# A bf16 parameter: DDP + torch.optim updates it in bf16 (state and all), ZeRO through an fp32
# master, so the two differ by bf16 roundings (2**-8 relative) each step; the fp32 parameters
# downstream see those differences in their gradients.
BF16_PARAM_TOLERANCE = 4 * 2**-8  # relative to max(|reference|, 1)
BF16_CASE_TOLERANCE = 1e-3  # every other parameter of a case with a bf16 parameter

# Features the drawn cases leave out; a case with one enabled always exercises it. They were the
# bugs (a)-(f) this test found or was written for (see the reasons in test_differential.py), all fixed.
NO_GRAD_ANYWHERE = "no_grad_anywhere"  # (a) a trainable parameter with no gradient on any rank in a step
MIXED_DTYPES = "mixed_dtypes"  # (b) float64 and bf16 parameters beside fp32 ones
RANK_STRUCTURE = "rank_structure"  # (c) rank 0 builds an extra layer: a clear error expected
# Found by this test (hangs): a parameter used on some ranks only, (d) at stages 1/2 with
# reduce_every_micro_step=True and accumulation, (e) at stage 3 when other units than the root exist.
RANK_USE_EVERY_MICRO_STEP = "rank_use_every_micro_step"
RANK_USE_WITH_UNITS = "rank_use_with_units"
# Found by this test (crash): at stage 3 a frozen module that runs before a trainable one of the same
# unit: the unit is freed once its trainable gradients are in, but the frozen weight is still needed
# for the input gradient ("setStorage: ... out of bounds for storage of size 0").
FROZEN_IN_UNIT = "frozen_in_unit"
KNOWN_BROKEN = (NO_GRAD_ANYWHERE, MIXED_DTYPES, RANK_STRUCTURE, RANK_USE_EVERY_MICRO_STEP, RANK_USE_WITH_UNITS,
                FROZEN_IN_UNIT)


# ---------------------------------------------------------------------------- the model tree
@dataclass(frozen=True)
class Node:
    """One module of the tree, as plain data so every rank (and the reference) builds the same."""

    kind: str  # "dense" | "norm" | "block" | "seq" | "stack"
    frozen: bool = False
    bias: bool = True
    hidden: int = 0  # block: inner width
    buffer: bool = False  # block: a constant buffer used in forward
    gain: bool = False  # block: a parameter registered on the block itself
    gated: bool = False  # block: a Linear used on some micro-steps only
    rank_only: int = -1  # block: a Linear used on this rank only (-1: none)
    children: tuple[Node, ...] = ()

    def describe(self) -> str:
        if self.kind in ("seq", "stack"):
            inner = ",".join(child.describe() for child in self.children)
            return f"{self.kind}[{inner}]{'*' if self.frozen else ''}"
        flags = [name for name in ("buffer", "gain", "gated") if getattr(self, name)]
        if self.rank_only >= 0:
            flags.append(f"rank{self.rank_only}")
        if not self.bias:
            flags.append("nobias")
        detail = f"({'+'.join(flags)})" if flags else ""
        return f"{self.kind}{self.hidden or ''}{detail}{'*' if self.frozen else ''}"


@dataclass(frozen=True)
class Features:
    """Which model features the generator may draw. The known-broken ones, when enabled, are put
    into every case (so a test of them always exercises them): (a)-(c) as model features, (d)/(e)
    as the configurations that hang with a parameter used on some ranks only."""

    tied: bool = True
    frozen: bool = True
    buffers: bool = True
    gated: bool = True
    rank_only: bool = True
    no_grad_anywhere: bool = False
    mixed_dtypes: bool = False
    rank_structure: bool = False
    rank_use_every_micro_step: bool = False
    rank_use_with_units: bool = False
    frozen_in_unit: bool = False

    @classmethod
    def with_enabled(cls, names: Iterable[str]) -> Features:
        names = set(names)
        unknown = names - set(KNOWN_BROKEN)
        if unknown:
            raise ValueError(f"unknown feature(s) {sorted(unknown)}; known-broken features are {KNOWN_BROKEN}")
        return cls(**{name: True for name in names})

    def enabled(self) -> list[str]:
        return [name for name in KNOWN_BROKEN if getattr(self, name)]


@dataclass(frozen=True)
class Case:
    seed: int
    features: Features
    world_size: int
    width: int
    body: Node
    tied: bool
    final_norm: bool
    head_bias: bool
    dead: bool  # (a): a Linear never used
    step_gated: bool  # (a): a block skipped on whole optimizer steps, on every rank
    float64_scale: bool  # (b)
    bf16_gain: bool  # (b)
    extra_on_rank0: bool  # (c)
    stage: int
    offload: str  # "none" | "preset" | "policy"
    offload_ratio: float
    offload_params: bool
    accumulate: int
    reduce_every_micro_step: bool
    reduce_bucket_size: int
    unit_modules: tuple[str, ...]
    min_unit_numel: int
    persistence_threshold: int
    prefetch_units: int
    optimizer: str  # "adamw" | "sgd"
    lr: float
    weight_decay: float
    two_groups: bool
    frozen_in_optimizer: bool
    clip: float | None
    steps: int
    batch_size: int

    @property
    def has_bf16(self) -> bool:
        return self.bf16_gain

    def describe(self) -> str:
        if self.offload == "preset":
            offload = f"preset zero{self.stage}_offload"
        elif self.offload == "policy":
            offload = f"policy(ratio={self.offload_ratio}{', params' if self.offload_params else ''})"
        else:
            offload = "none"
        parts = [
            f"seed={self.seed}", f"world={self.world_size}", f"stage={self.stage}", f"offload={offload}",
            f"accumulate={self.accumulate}", f"every_micro_step={self.reduce_every_micro_step}",
            f"opt={self.optimizer}(lr={self.lr}, wd={self.weight_decay}, groups={2 if self.two_groups else 1},"
            f" frozen_in_opt={self.frozen_in_optimizer})",
            f"clip={self.clip}", f"steps={self.steps}", f"batch={self.batch_size}",
        ]
        if self.stage == 3 and self.offload != "preset":
            parts.append(f"units={self.unit_modules or f'min_numel={self.min_unit_numel}'}"
                         f" persist<{self.persistence_threshold} prefetch={self.prefetch_units}")
        elif self.offload != "preset":
            parts.append(f"bucket={self.reduce_bucket_size}")
        extras = [name for name in ("tied", "final_norm", "dead", "step_gated", "float64_scale", "bf16_gain",
                                    "extra_on_rank0") if getattr(self, name)]
        parts.append(f"width={self.width} body={self.body.describe()} extras={extras}")
        return " ".join(parts)


def _draw_node(rng: random.Random, features: Features, world_size: int, accumulate: int, depth: int,
               gated_ok: bool) -> Node:
    container = depth < 3 and rng.random() < 0.4 - 0.1 * depth
    # Each draw is made whatever the features say, so switching a feature changes only that feature.
    frozen = rng.random() < 0.12 and features.frozen
    if container:
        children = tuple(_draw_node(rng, features, world_size, accumulate, depth + 1, gated_ok)
                         for _ in range(rng.randint(1, 3)))
        return Node(kind=rng.choice(("seq", "stack")), frozen=frozen, children=children)
    kind = rng.choice(("dense", "dense", "norm", "block", "block"))
    if kind == "block":
        return Node(
            kind="block", frozen=frozen, bias=rng.random() < 0.7, hidden=rng.choice((4, 8, 12, 24)),
            buffer=rng.random() < 0.5 and features.buffers, gain=rng.random() < 0.4,
            gated=rng.random() < 0.35 and gated_ok and features.gated,
            rank_only=_draw_rank_only(rng, features, world_size),
        )
    return Node(kind=kind, frozen=frozen, bias=rng.random() < 0.7)


def _draw_rank_only(rng: random.Random, features: Features, world_size: int) -> int:
    owner = rng.randrange(max(world_size, 1))
    return owner if rng.random() < 0.3 and features.rank_only and world_size > 1 else -1


def make_case(seed: int, features: Features = Features(), world_size: int | None = None) -> Case:
    """Every choice of the case from ``random.Random(seed)`` (world size too, unless given)."""
    rng = random.Random(seed)
    drawn = rng.randint(1, 4)  # drawn even when given, so make_case(s) == make_case(s, world_size=drawn)
    world = world_size if world_size is not None else drawn
    stage = rng.choice((1, 2, 3))
    accumulate = rng.choice((1, 2))
    every_micro_step = accumulate > 1 and rng.random() < 0.5
    root_only = stage == 3 and rng.random() < 0.3  # stage 3 with the root as the only unit
    offload_draw = rng.random()
    offload = "none" if offload_draw < 0.5 else ("preset" if offload_draw < 0.7 and stage in (2, 3) else "policy")
    if offload == "policy" and stage == 1 and rng.random() < 0.5:
        offload = "none"
    if offload == "preset" and stage == 3:
        root_only = True  # the preset's min_unit_numel (1e6) leaves the root as the only unit here
    if features.rank_use_every_micro_step and stage in (1, 2):
        accumulate, every_micro_step = 2, True
    if (features.rank_use_with_units or features.frozen_in_unit) and stage == 3:
        root_only = False
        offload = "policy" if offload == "preset" else offload
    # Parameters used on some ranks only hang in (d) and (e): leave them out there unless enabled.
    rank_use_ok = world > 1 and not (
        (stage in (1, 2) and every_micro_step and not features.rank_use_every_micro_step)
        or (stage == 3 and not root_only and not features.rank_use_with_units)
    )
    draw_features = features if rank_use_ok else dataclasses.replace(features, rank_only=False)
    if stage == 3 and not root_only and not features.frozen_in_unit:
        # (f): frozen modules only where no unit but the root is held for the whole step.
        draw_features = dataclasses.replace(draw_features, frozen=False)
    # The working gated rule uses a block on (micro-step + rank) even only, so some rank in each
    # optimizer step uses it; with a single micro-step on a single rank that cannot be. With
    # several ranks the rule is rank-dependent, so it needs rank_use_ok too.
    gated_ok = accumulate >= 2 if world == 1 else rank_use_ok
    body = Node(kind=rng.choice(("seq", "stack")),
                children=tuple(_draw_node(rng, draw_features, world, accumulate, 1, gated_ok)
                               for _ in range(rng.randint(1, 4))))
    if (features.rank_use_every_micro_step and stage in (1, 2)) or (features.rank_use_with_units and stage == 3):
        body = _with_rank_only_block(body, rng, world)
    optimizer = rng.choice(("adamw", "adamw", "sgd"))
    units: tuple[str, ...] = ()
    if stage == 3 and not root_only and rng.random() < 0.4:
        # Never "Linear": a Linear used on some ranks only must live in a unit every rank runs.
        units = tuple(sorted(rng.sample(["Block", "Dense", "Stack", "LayerNorm", "Embedding"], rng.randint(1, 2))))
    case = Case(
        seed=seed, features=features, world_size=world, width=rng.choice((4, 6, 8, 16)), body=body,
        tied=features.tied and rng.random() < 0.4, final_norm=rng.random() < 0.6, head_bias=rng.random() < 0.6,
        dead=features.no_grad_anywhere, step_gated=features.no_grad_anywhere and rng.random() < 0.5,
        float64_scale=features.mixed_dtypes, bf16_gain=features.mixed_dtypes and rng.random() < 0.5,
        extra_on_rank0=features.rank_structure,
        stage=stage, offload=offload, offload_ratio=rng.choice((1.0, 1.0, 0.5)),
        offload_params=stage == 3 and rng.random() < 0.5, accumulate=accumulate,
        reduce_every_micro_step=every_micro_step,
        reduce_bucket_size=rng.choice((16, 64, 200, 1000, 25_000_000)), unit_modules=units,
        min_unit_numel=10**9 if root_only else rng.choice((16, 50, 100, 300)), persistence_threshold=rng.choice((0, 0, 5, 20)),
        prefetch_units=rng.choice((0, 1, 2)), optimizer=optimizer,
        lr=rng.choice((1e-2, 3e-3)) if optimizer == "adamw" else rng.choice((0.05, 0.1)),
        weight_decay=rng.choice((0.0, 0.01, 0.1)), two_groups=rng.random() < 0.4,
        frozen_in_optimizer=rng.random() < 0.5, clip=rng.choice((None, None, 0.5, 5.0)),
        steps=rng.choice((2, 3)), batch_size=rng.choice((1, 2, 3)),
    )
    if features.frozen_in_unit and stage == 3:
        # A unit of exactly a frozen Dense then a trainable one: each alone is below the threshold.
        pair = Node(kind="seq", children=(Node(kind="dense", frozen=True), Node(kind="dense")))
        case = dataclasses.replace(case, unit_modules=(), min_unit_numel=case.width * (case.width + 1) + 1,
                                   body=dataclasses.replace(body, children=(*body.children, pair)))
    if case.unit_modules:
        # A named class the tree lacks is a config error, not what this case is about.
        present = _classes_in(case)
        kept = tuple(name for name in case.unit_modules if name in present)
        case = dataclasses.replace(case, unit_modules=kept)
    return case


def _with_rank_only_block(body: Node, rng: random.Random, world: int) -> Node:
    """The body with one more block whose extra Linear only one rank (never rank 0 alone) uses."""
    block = Node(kind="block", hidden=8, rank_only=rng.randrange(1, world) if world > 1 else 0)
    return dataclasses.replace(body, children=(*body.children, block))


def _classes_in(case: Case) -> set[str]:
    names = {"Embedding"}

    def visit(node: Node) -> None:
        names.add({"dense": "Dense", "norm": "LayerNorm", "block": "Block", "seq": "Sequential", "stack": "Stack"}[node.kind])
        for child in node.children:
            visit(child)

    visit(case.body)
    return names


def case_features(case: Case) -> list[str]:
    """The model features this case actually exercises (for the summary of a soak)."""
    found: set[str] = set()

    def visit(node: Node) -> None:
        found.update(name for name in ("buffer", "gain", "gated") if getattr(node, name))
        if node.rank_only >= 0:
            found.add("rank_only")
        if node.frozen:
            found.add("frozen")
        if node.kind in ("seq", "stack") and any(child.kind in ("seq", "stack") for child in node.children):
            found.add("nested")
        for child in node.children:
            visit(child)

    visit(case.body)
    found.update(name for name in ("tied", "dead", "step_gated", "float64_scale", "bf16_gain", "extra_on_rank0")
                 if getattr(case, name))
    return sorted(found)


# ---------------------------------------------------------------------------- modules
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Dense(nn.Module):
    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, bias=bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class Block(nn.Module):
    """Up and down projections, optionally a constant buffer, a gain registered on the block itself,
    a Linear used on some micro-steps only and a Linear used on one rank only."""

    def __init__(self, width: int, node: Node, step_rule: Callable[[int], bool]) -> None:
        super().__init__()
        self.up = nn.Linear(width, node.hidden, bias=node.bias)
        self.down = nn.Linear(node.hidden, width, bias=False)
        if node.buffer:
            self.register_buffer("mix", torch.linspace(0.5, 1.5, width))
        if node.gain:
            self.gain = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
        self.gated = nn.Linear(width, width, bias=False) if node.gated else None
        self.rank_only_linear = nn.Linear(width, width) if node.rank_only >= 0 else None
        self.owner_rank = node.rank_only
        self.step_rule = step_rule
        self.calls = 0  # training forward calls: the same count on every rank

    def forward(self, hidden: Tensor) -> Tensor:
        out = self.down(torch.relu(self.up(hidden)))
        if hasattr(self, "mix"):
            out = out * self.mix
        if hasattr(self, "gain"):
            out = out * self.gain
        if self.gated is not None and self.training:
            if self.step_rule(self.calls):
                out = out + self.gated(hidden)
            self.calls += 1
        if self.rank_only_linear is not None and _rank() == self.owner_rank:
            out = out + self.rank_only_linear(hidden)
        return hidden + out


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden: Tensor) -> Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def gated_rule(case: Case) -> Callable[[int], bool]:
    """When a gated block runs, by its call count, identically on every rank from the seed."""
    if case.step_gated:
        # (a): skipped on every rank for whole optimizer steps.
        return lambda call: (call // case.accumulate) % 2 == 0
    return lambda call: (call + _rank()) % 2 == 0


def _build(node: Node, width: int, rule: Callable[[int], bool]) -> nn.Module:
    if node.kind == "dense":
        module: nn.Module = Dense(width, node.bias)
    elif node.kind == "norm":
        module = nn.LayerNorm(width, bias=node.bias)
    elif node.kind == "block":
        module = Block(width, node, rule)
    else:
        children = [_build(child, width, rule) for child in node.children]
        module = nn.Sequential(*children) if node.kind == "seq" else Stack(children)
    if node.frozen:
        module.requires_grad_(False)
    return module


class RandomNet(pl.LightningModule):
    """Embedding -> random body -> (norm) -> head over the vocabulary, cross-entropy per token."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        width = case.width
        self.case = case
        self.embed = nn.Embedding(VOCAB, width)
        self.body = _build(case.body, width, gated_rule(case))
        self.norm = nn.LayerNorm(width) if case.final_norm else None
        self.head = nn.Linear(width, VOCAB, bias=case.head_bias)
        if case.tied:
            self.head.weight = self.embed.weight
        if case.dead:
            self.dead = nn.Linear(width, width)
        if case.float64_scale:
            self.scale = nn.Parameter(torch.full((width,), 1.1, dtype=torch.float64))
        if case.bf16_gain:
            self.bf16_gain = nn.Parameter(torch.ones(width, dtype=torch.bfloat16))
        if case.extra_on_rank0 and _rank() == 0:
            self.extra = nn.Linear(width, width)
        self.losses: list[float] = []
        self.batches: list[tuple[Tensor, Tensor]] = []

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        if self.case.float64_scale:
            hidden = hidden * self.scale.to(hidden.dtype)
        hidden = self.body(hidden)
        if self.case.bf16_gain:
            hidden = hidden * self.bf16_gain.to(hidden.dtype)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if hasattr(self, "extra"):
            hidden = hidden + self.extra(hidden)
        return self.head(hidden)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.batches.append((batch[0].clone(), batch[1].clone()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.case)


def build_model(case: Case) -> RandomNet:
    torch.manual_seed(case.seed)  # the same initial weights on every rank and for the reference
    return RandomNet(case)


def make_optimizer(module: nn.Module, case: Case) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if case.frozen_in_optimizer or p.requires_grad]
    if case.two_groups:
        groups: Any = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": case.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]
    else:
        groups = [{"params": params, "weight_decay": case.weight_decay}]
    if case.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=case.lr)
    return torch.optim.SGD(groups, lr=case.lr, momentum=0.9)


def dataset(case: Case) -> TensorDataset:
    samples = case.batch_size * case.world_size * case.accumulate * case.steps
    generator = torch.Generator().manual_seed(10_000 + case.seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def zero_strategy(case: Case) -> Any:
    from lightning_zero import CPUOffloadPolicy, ZeroConfig, ZeroStrategy

    if case.offload == "preset":
        return f"zero{case.stage}_offload"
    offload = CPUOffloadPolicy(ratio=case.offload_ratio) if case.offload == "policy" else None
    kwargs: dict[str, Any] = {}
    if case.stage == 3:
        kwargs = {"unit_modules": case.unit_modules, "min_unit_numel": case.min_unit_numel,
                  "param_persistence_threshold": case.persistence_threshold, "prefetch_units": case.prefetch_units,
                  "offload_params": CPUOffloadPolicy() if offload is not None and case.offload_params else None}
    config = ZeroConfig(stage=case.stage, reduce_bucket_size=case.reduce_bucket_size,
                        reduce_every_micro_step=case.reduce_every_micro_step, offload_optimizer=offload, **kwargs)
    return ZeroStrategy(config=config)


# ---------------------------------------------------------------------------- training, rank side
def params_of(module: nn.Module) -> dict[str, Tensor]:
    return {name: param.detach().cpu().clone() for name, param in module.named_parameters()}


def train_zero(case: Case) -> dict[str, Any]:
    module = build_model(case)
    with launched_environment(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers and logging, per case
        trainer = pl.Trainer(
            accelerator="cpu", devices=case.world_size, strategy=zero_strategy(case), max_steps=case.steps,
            accumulate_grad_batches=case.accumulate, gradient_clip_val=case.clip, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=DataLoader(dataset(case), batch_size=case.batch_size, shuffle=False))
    return {"losses": module.losses, "params": params_of(module), "batches": module.batches}


def train_ddp(case: Case, batches: list[tuple[Tensor, Tensor]]) -> dict[str, Any]:
    """The reference: DDP(find_unused_parameters=True) + the same torch optimizer, Lightning's
    accumulation (loss / accumulate, step every ``accumulate`` micro-batches) and clipping, on the
    micro-batches the Trainer gave this rank (Lightning shuffles training data by a seeded sampler)."""
    module = build_model(case)
    ddp = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
    optimizer = make_optimizer(module, case)
    losses = []
    for index, batch in enumerate(batches):
        tokens, targets = batch
        loss = nn.functional.cross_entropy(ddp(tokens).flatten(0, 1), targets.flatten())
        losses.append(loss.item())
        (loss / case.accumulate).backward()
        if (index + 1) % case.accumulate == 0:
            if case.clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.grad is not None], case.clip)
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "params": params_of(module)}


def run_case(case: Case) -> dict[str, Any]:
    zero = train_zero(case)
    if case.extra_on_rank0:
        # (c): ranks with different structure must fail with an error; there is no reference.
        raise AssertionError("ZeroStrategy trained a model whose structure differs between ranks without an error")
    batches = zero.pop("batches")
    if len(batches) != case.steps * case.accumulate:
        raise RuntimeError(f"the Trainer ran {len(batches)} micro-batches, expected {case.steps * case.accumulate}")
    return {"ddp": train_ddp(case, batches), "zero": zero}


# ---------------------------------------------------------------------------- comparison
@dataclass
class Outcome:
    case: Case
    ok: bool
    error: str = ""  # the first failing rank's traceback, or a hang/mismatch description
    kind: str = ""  # "", "error", "hang", "mismatch"
    max_diff: float = 0.0
    worst: str = ""
    seconds: float = 0.0

    def report(self) -> str:
        head = f"{self.kind.upper()} {self.case.describe()}"
        body = self.error.strip().splitlines()
        tail = "\n".join(body[-12:])
        return f"{head}\n{tail}\nrerun: {rerun_command(self.case)}"


def rerun_command(case: Case) -> str:
    enable = f" --enable {','.join(case.features.enabled())}" if case.features.enabled() else ""
    return f"python benchmarks/soak_differential.py --seed {case.seed} --cases 1 --world {case.world_size}{enable}"


def tolerance_for(case: Case, name: str, param: Tensor) -> Tensor | float:
    if not case.has_bf16:
        return FP32_TOLERANCE
    if param.dtype == torch.bfloat16:
        return BF16_PARAM_TOLERANCE * param.float().abs().clamp(min=1.0)
    return BF16_CASE_TOLERANCE


def compare(case: Case, per_rank: list[dict[str, Any]]) -> Outcome:
    """Final parameters of ZeRO against DDP on every rank, and every rank's ZeRO weights equal."""
    worst_diff, worst_name = 0.0, ""
    for rank, result in enumerate(per_rank):
        zero, ddp = result["zero"]["params"], result["ddp"]["params"]
        if zero.keys() != ddp.keys():
            return Outcome(case, False, f"rank {rank}: parameter names differ: {sorted(zero.keys() ^ ddp.keys())}",
                           "mismatch")
        for name, reference in ddp.items():
            value = zero[name]
            if value.shape != reference.shape or value.dtype != reference.dtype:
                return Outcome(case, False, f"rank {rank}: {name} is {value.dtype}{tuple(value.shape)}, DDP's"
                               f" {reference.dtype}{tuple(reference.shape)}", "mismatch")
            excess = ((value.double() - reference.double()).abs() - torch.as_tensor(
                tolerance_for(case, name, reference)).double()).max().item()
            diff = (value.double() - reference.double()).abs().max().item()
            if diff > worst_diff or not math.isfinite(diff):
                worst_diff, worst_name = diff, f"{name} (rank {rank})"
            if excess > 0 or not math.isfinite(diff):
                return Outcome(case, False, f"rank {rank}: {name} differs from DDP by {diff:.3g}", "mismatch",
                               diff, name)
        steps = len(result["ddp"]["losses"])
        if len(result["zero"]["losses"]) != steps:
            return Outcome(case, False, f"rank {rank}: {len(result['zero']['losses'])} training steps, DDP {steps}",
                           "mismatch")
    for rank, result in enumerate(per_rank[1:], start=1):
        for name, value in result["zero"]["params"].items():
            if not torch.equal(value, per_rank[0]["zero"]["params"][name]):
                return Outcome(case, False, f"ZeRO weights differ between rank 0 and rank {rank} at {name}",
                               "mismatch", worst_diff, name)
    return Outcome(case, True, max_diff=worst_diff, worst=worst_name)


# ---------------------------------------------------------------------------- rank groups
def _worker(rank: int, world_size: int, port: int, cases: list[Case], timeout_s: float, results: Any) -> None:
    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(1)  # N ranks share 2 cores
    # Hundreds of Trainers: their banners would bury the progress lines.
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    try:
        # The process-group timeout backs up the parent's deadline: a rank stuck in a collective
        # raises instead of waiting forever.
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        for index, case in enumerate(cases):
            start = time.monotonic()
            try:
                payload = run_case(case)
            except BaseException:  # noqa: BLE001 - reported to the parent with the rank's traceback
                results.put((index, rank, False, traceback.format_exc(), time.monotonic() - start))
                if world_size > 1:
                    return  # other ranks may be mid-collective: the parent restarts the group
                continue
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            results.put((index, rank, True, buffer.getvalue(), time.monotonic() - start))
    except BaseException:  # noqa: BLE001
        results.put((-1, rank, False, traceback.format_exc(), 0.0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cases(cases: list[Case], world_size: int, case_timeout_s: float = 120.0, startup_s: float = 120.0,
              on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Runs every case on one group of ``world_size`` ranks (restarted after a failure or hang);
    a case with no result from every rank within ``case_timeout_s`` fails as a hang."""
    context = mp.get_context("spawn")
    outcomes: list[Outcome] = []
    remaining = list(cases)
    while remaining:
        results = context.Queue()
        port = free_port()
        processes = [context.Process(target=_worker, args=(rank, world_size, port, remaining, case_timeout_s, results),
                                     daemon=True) for rank in range(world_size)]
        with _cpp_log_level("ERROR"):  # DDP's "find_unused_parameters found none" warning, per case
            for process in processes:
                process.start()
        try:
            done = _collect(remaining, world_size, processes, results, case_timeout_s, startup_s, outcomes, on_outcome)
        finally:
            for process in processes:
                process.join(timeout=30 if done == len(remaining) else 1)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        remaining = remaining[done:]
    return outcomes


@contextlib.contextmanager
def _cpp_log_level(level: str) -> Iterator[None]:
    """Sets torch's C++ log level for the ranks started inside (they read it when torch loads)."""
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = level
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = saved


def _collect(cases: list[Case], world_size: int, processes: list[Any], results: Any, case_timeout_s: float,
             startup_s: float, outcomes: list[Outcome], on_outcome: Callable[[Outcome], None] | None) -> int:
    """Reads results in case order; returns how many cases are decided (the group is done after a failure)."""
    per_case: dict[int, dict[int, tuple[bool, Any, float]]] = {}
    deadline = time.monotonic() + startup_s + case_timeout_s
    index = 0
    while index < len(cases):
        got = per_case.setdefault(index, {})
        failed = any(not ok for ok, _, _ in got.values())
        silent_dead = all(processes[rank].exitcode not in (None, 0) for rank in range(world_size) if rank not in got)
        if len(got) == world_size or (failed and (time.monotonic() > deadline or silent_dead)):
            outcome = _decide(cases[index], world_size, got)
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            index += 1
            deadline = time.monotonic() + case_timeout_s
            if outcome.kind in ("error", "hang") and world_size > 1:
                return index
            continue
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(got))
            outcome = Outcome(cases[index], False, f"no result from rank(s) {missing} within {case_timeout_s:.0f} s"
                              " (a hang in a collective?)", "hang")
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            return index + 1
        try:
            case_index, rank, ok, payload, seconds = results.get(timeout=0.2)
        except queue_module.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead and not failed:
                outcome = Outcome(cases[index], False, f"a rank exited with code {dead[0].exitcode}", "error")
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)
                return index + 1
            continue
        if case_index < 0:
            outcome = Outcome(cases[index], False, f"rank {rank} could not start:\n{payload}", "error")
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            return index + 1
        if not ok and world_size > 1 and not failed:
            # The other ranks get a short while to fail too (their error may be the telling one).
            deadline = min(deadline, time.monotonic() + 10.0)
        per_case.setdefault(case_index, {})[rank] = (ok, payload, seconds)
    return index


def _decide(case: Case, world_size: int, got: dict[int, tuple[bool, Any, float]]) -> Outcome:
    seconds = max((s for _, _, s in got.values()), default=0.0)
    errors = [(rank, payload) for rank, (ok, payload, _) in sorted(got.items()) if not ok]
    if errors:
        missing = sorted(set(range(world_size)) - set(got))
        note = f"\n(rank(s) {missing} gave no result: waiting in a collective)" if missing else ""
        rank, text = errors[0]
        # A collective the other ranks never join ends in gloo's timeout: that is a hang.
        kind = "hang" if "Timed out" in text or "timeout caused pair closure" in text else "error"
        return Outcome(case, False, f"rank {rank}:\n{text}{note}", kind, seconds=seconds)
    per_rank = [torch.load(io.BytesIO(got[rank][1]), weights_only=False) for rank in range(world_size)]
    outcome = compare(case, per_rank)
    outcome.seconds = seconds
    return outcome


def first_line_of_error(outcome: Outcome) -> str:
    """The exception line of a traceback (its last line that looks like ``SomeError: ...``)."""
    lines = [line.strip() for line in outcome.error.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]:
            return line[:300]
    return lines[0][:300] if lines else outcome.kind
