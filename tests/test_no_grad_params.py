"""Parameters without a gradient in a step are skipped as torch.optim skips them, at every stage.

Frozen parameters: one frozen after setup trains like DDP until then; one frozen at setup and
unfrozen later, or added to the optimizer later (Lightning's finetuning callbacks), is an error
on every rank naming it, never a parameter that silently does not train ([Note: the trainable set]).

A LayerDrop model (a block skipped on every rank in some steps, by a rule all ranks share) and a
tiny MoE (top-1 routing: one expert gets tokens on rank 0 only, another on no rank in most steps)
train with AdamW (and SGD with momentum) at stages 1, 2, 3 and with offload, with and without
gradient accumulation; weights and the torch-format optimizer state, step counts included, must
equal DDP(find_unused_parameters=True) with the same optimizer. LoRA-style adapters beside frozen
weights in one stage-3 unit train like DDP too. Two gloo ranks, one spawn.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback
from torch import Tensor, nn

from harness import run_on_ranks
from lightning_zero import CPUOffloadPolicy, ZeroConfig, ZeroStrategy
from models import Adapted, TiedGPT, TinyGPT, fit, max_abs_diff, params_of

WORLD = 2
STEPS = 6
TOLERANCE = 1e-5
EXPERTS = 4
# Stage 3: every rank must run the same units; the MoE layer (experts used on some ranks only)
# lives in the root unit, the LayerDrop blocks are units of their own, skipped on every rank.
BLOCK_UNITS = ("TransformerEncoderLayer",)
STRATEGIES: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1, "reduce_bucket_size": 500},
    "zero2": {"stage": 2, "reduce_bucket_size": 500},
    "zero3": {"stage": 3, "unit_modules": BLOCK_UNITS},
    "zero2_offload": {"stage": 2, "reduce_bucket_size": 500, "offload_optimizer": CPUOffloadPolicy()},
    "zero3_offload": {"stage": 3, "unit_modules": BLOCK_UNITS, "offload_optimizer": CPUOffloadPolicy(),
                      "offload_params": CPUOffloadPolicy()},
}


class SGDMixin:
    """configure_optimizers with SGD + momentum (and weight decay) instead of AdamW."""

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]  # type: ignore[attr-defined]
        no_decay = [p for p in self.parameters() if p.dim() < 2]  # type: ignore[attr-defined]
        return torch.optim.SGD([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                               lr=0.05, momentum=0.9)


class LayerDropGPT(TiedGPT):
    """Block i is skipped when (optimizer step + i) % 3 == 0, on every rank; block 1 also on every
    odd micro-batch (so, with accumulation, it gets a gradient in one micro-batch of two)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_idx = 0
        self.used: list[list[bool]] = []  # per micro-batch: which blocks ran

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.batch_idx = batch_idx
        return super().training_step(batch, batch_idx)

    def forward(self, tokens: Tensor) -> Tensor:
        step = self.trainer.global_step
        use = [(step + i) % 3 != 0 and not (i == 1 and self.batch_idx % 2 == 1) for i in range(len(self.blocks))]
        self.used.append(use)
        hidden = self.embed(tokens)
        for block, run in zip(self.blocks, use):
            if run:
                hidden = block(hidden)
        return self.head(self.norm(hidden))


class TinyMoE(TinyGPT):
    """A block, then a top-1 MoE layer: each token goes to the expert with the largest router
    logit among those it may use. Tokens t with t % 4 == 2 must use expert 2, which exists on
    rank 0 only (a gradient on one rank); tokens with t % 4 == 3 must use expert 3, which is open
    only on steps with step % 3 == 0 (no token on any rank otherwise); all others pick 0 or 1."""

    def __init__(self) -> None:
        super().__init__()
        width = self.norm.normalized_shape[0]
        self.router = nn.Linear(width, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(EXPERTS))
        self.routed: list[list[int]] = []  # per micro-batch: tokens per expert on this rank

    def _allowed(self, tokens: Tensor) -> Tensor:
        rank, step = self.trainer.global_rank, self.trainer.global_step
        kind = tokens % 4
        allowed = torch.zeros(*tokens.shape, EXPERTS, dtype=torch.bool)
        allowed[..., 0] = allowed[..., 1] = kind < 2
        allowed[..., 2] = kind == 2 if rank == 0 else False
        allowed[..., 3] = kind == 3 if step % 3 == 0 else False
        # a token whose expert is closed here falls back to experts 0 and 1
        closed = ~allowed.any(-1)
        allowed[..., 0] |= closed
        allowed[..., 1] |= closed
        return allowed

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.block(self.embed(tokens))
        logits = self.router(hidden).masked_fill(~self._allowed(tokens), float("-inf"))
        probs = logits.softmax(-1)
        choice = probs.argmax(-1)
        gate = probs.gather(-1, choice.unsqueeze(-1))
        mixed = torch.zeros_like(hidden)
        counts = []
        for number, expert in enumerate(self.experts):
            chosen = choice == number
            counts.append(int(chosen.sum()))
            if counts[-1]:
                mixed[chosen] = gate[chosen] * expert(hidden[chosen])
        self.routed.append(counts)
        return self.head(self.norm(hidden + mixed))


class SGDMoE(SGDMixin, TinyMoE):
    pass


class FinalOptimizerState(Callback):
    """The optimizer state in torch's format at the end of training (rank 0's)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        if hasattr(optimizer, "consolidate_state_dict"):
            optimizer.consolidate_state_dict()  # a collective
        self.state = copy.deepcopy(optimizer.state_dict()) if trainer.is_global_zero else None


class ZeroedNotNone(LayerDropGPT):
    """Zeroes gradients with ``set_to_none=False``: a block skipped in a step keeps a zero gradient
    and is stepped (weight decay, Adam's moments), as torch does."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


class LoRAGPT(TinyGPT):
    """A frozen TinyGPT with trained adapters beside frozen weights: a frozen block (a unit of its
    own at stage 3), an adapted MLP and head (units that mix frozen and trained parameters), and a
    root unit of the frozen embedding beside the trained norm."""

    def __init__(self) -> None:
        super().__init__()
        width = self.norm.normalized_shape[0]
        self.requires_grad_(False)
        self.norm.requires_grad_(True)
        self.mlp = nn.Sequential(Adapted(width, 2 * width + 1), nn.GELU(), Adapted(2 * width + 1, width))
        self.head = Adapted(width, self.head.out_features)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.block(self.embed(tokens))
        return self.head(self.norm(hidden + self.mlp(hidden)))


LORA_UNITS = BLOCK_UNITS + ("Adapted",)


def _run(module_class: type, strategy: Any, accumulate: int) -> dict[str, Any]:
    pl.seed_everything(0)
    module = module_class()
    final = FinalOptimizerState()
    fit(module, strategy, WORLD, steps=STEPS, accumulate_grad_batches=accumulate, callbacks=[final])
    usage = getattr(module, "used", None) or getattr(module, "routed", None)
    return {"params": params_of(module), "optimizer": final.state, "losses": module.losses, "usage": usage}


class StateAtEnd(Callback):
    """The strategy's model_state_bytes() as training ends, before the module is handed back."""

    def __init__(self) -> None:
        self.state: Any = None

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = trainer.strategy.model_state_bytes()


def _lora_base_in(dtype: torch.dtype, offload: bool) -> dict[str, Any]:
    """LoRAGPT under bf16-mixed at stage 3, its frozen weights holding bf16 values, held in ``dtype``."""
    pl.seed_everything(0)
    module = LoRAGPT()
    frozen = [param for param in module.parameters() if not param.requires_grad]
    for param in frozen:
        param.data = param.data.to(torch.bfloat16).to(dtype)
    offloaded = {"offload_optimizer": CPUOffloadPolicy()} if offload else {}
    state = StateAtEnd()
    fit(module, ZeroStrategy(config=ZeroConfig(stage=3, unit_modules=LORA_UNITS, **offloaded)), WORLD, steps=STEPS,
        precision="bf16-mixed", callbacks=[state])
    return {"params": params_of(module), "losses": module.losses, "state": state.state,
            "frozen_pieces": sum(-(-param.numel() // WORLD) for param in frozen),
            "frozen": {name for name, param in module.named_parameters() if not param.requires_grad}}


def _built_dtypes_kept(stage: int) -> dict[str, Any]:
    """LoRAGPT built in bf16 but for its adapters (the trained norm too), under bf16-mixed."""
    pl.seed_everything(0)
    module = LoRAGPT()
    for name, param in module.named_parameters():
        if "base" in name or not param.requires_grad or name.startswith("norm"):
            param.data = param.data.to(torch.bfloat16)
    built = {name: param.dtype for name, param in module.named_parameters()}
    fit(module, ZeroStrategy(config=ZeroConfig(stage=stage)), WORLD, steps=2, precision="bf16-mixed")
    return {"built": built, "handed_back": {name: param.dtype for name, param in module.named_parameters()}}


class HeadToggled(TinyGPT):
    """The head starts frozen (``frozen_head``), or trainable; ``optimize_frozen`` keeps frozen
    parameters in the optimizer (torch skips them) instead of leaving them out."""

    def __init__(self, frozen_head: bool, optimize_frozen: bool = True) -> None:
        super().__init__()
        self.optimize_frozen = optimize_frozen
        self.head.requires_grad_(not frozen_head)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if self.optimize_frozen or p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-2)


class ToggleHeadAt(Callback):
    """At batch 2: ``"unfreeze"`` (requires_grad_), ``"add_group"`` (BaseFinetuning's
    unfreeze_and_add_param_group, what BackboneFinetuning does) or ``"freeze"``."""

    def __init__(self, action: str) -> None:
        self.action = action

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx != 2:
            return
        head = module.head  # type: ignore[attr-defined]
        if self.action == "add_group":
            BaseFinetuning.unfreeze_and_add_param_group(head, trainer.optimizers[0], lr=1e-2)
        else:
            head.requires_grad_(self.action == "unfreeze")


def _late_trainable(strategy: Any, action: str) -> dict[str, Any]:
    pl.seed_everything(0)
    module = HeadToggled(frozen_head=action != "freeze", optimize_frozen=action != "add_group")
    head_before = module.head.weight.detach().clone()
    try:
        fit(module, strategy, WORLD, steps=STEPS, callbacks=[ToggleHeadAt(action)])
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return {"message": message, "params": params_of(module), "losses": module.losses,
            "head moved": not torch.equal(module.head.weight.detach(), head_before)}


class UnfrozenInConfigure(TinyGPT):
    """The head is frozen in __init__ and made trainable in configure_optimizers, which runs after
    the strategy sharded the module."""

    def __init__(self) -> None:
        super().__init__()
        self.head.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        self.head.requires_grad_(True)
        return super().configure_optimizers()


def _unfrozen_in_configure(strategy: Any, module_class: type = UnfrozenInConfigure) -> dict[str, Any]:
    pl.seed_everything(0)
    module = module_class()
    try:
        fit(module, strategy, WORLD, steps=STEPS)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return {"message": message, "params": params_of(module), "losses": module.losses}


def _cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["freeze_ddp"] = _late_trainable("ddp_find_unused_parameters_true", "freeze")
    for name in ("zero2", "zero3"):
        for action in ("unfreeze", "add_group", "freeze"):
            out[f"{action}_{name}"] = _late_trainable(ZeroStrategy(config=ZeroConfig(**STRATEGIES[name])), action)
    for model_name, module_class in (("layerdrop", LayerDropGPT), ("moe", TinyMoE)):
        for accumulate in (1, 2):
            key = f"{model_name}_acc{accumulate}"
            out[f"{key}_ddp"] = _run(module_class, "ddp_find_unused_parameters_true", accumulate)
            for name, config in STRATEGIES.items():
                out[f"{key}_{name}"] = _run(module_class, ZeroStrategy(config=ZeroConfig(**config)), accumulate)
    # DDP registers its parameters before configure_optimizers too (and would leave the head's
    # gradients unreduced): the reference trains the head from the start.
    out["configure_ddp"] = _unfrozen_in_configure("ddp", TinyGPT)
    for name in ("zero2", "zero3"):
        out[f"configure_{name}"] = _unfrozen_in_configure(ZeroStrategy(config=ZeroConfig(**STRATEGIES[name])))
    out["lora_ddp"] = _run(LoRAGPT, "ddp", 2)
    for name in ("zero2", "zero3", "zero3_offload"):
        config = ZeroConfig(**{**STRATEGIES[name], "unit_modules": LORA_UNITS} if name != "zero2" else STRATEGIES[name])
        out[f"lora_{name}"] = _run(LoRAGPT, ZeroStrategy(config=config), 2)
    for offload in (False, True):
        for dtype in (torch.bfloat16, torch.float32):
            out[f"lora_base_{dtype}_{offload}"] = _lora_base_in(dtype, offload)
    out["built_dtypes_zero2"] = _built_dtypes_kept(2)
    out["zeroed_ddp"] = _run(ZeroedNotNone, "ddp_find_unused_parameters_true", 1)
    for name in ("zero2", "zero3", "zero2_offload"):
        out[f"zeroed_{name}"] = _run(ZeroedNotNone, ZeroStrategy(config=ZeroConfig(**STRATEGIES[name])), 1)
    for accumulate in (1, 2):
        out[f"sgd_acc{accumulate}_ddp"] = _run(SGDMoE, "ddp_find_unused_parameters_true", accumulate)
        for name in ("zero2", "zero3"):
            out[f"sgd_acc{accumulate}_{name}"] = _run(SGDMoE, ZeroStrategy(config=ZeroConfig(**STRATEGIES[name])),
                                                       accumulate)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD)


def _assert_optimizer_states_match(zero: dict[str, Any], ddp: dict[str, Any]) -> None:
    assert [g["params"] for g in zero["param_groups"]] == [g["params"] for g in ddp["param_groups"]]
    # A parameter that never got a gradient has no state in torch; nor in ZeRO.
    assert zero["state"].keys() == ddp["state"].keys()
    for index, ddp_entry in ddp["state"].items():
        assert zero["state"][index].keys() == ddp_entry.keys(), index
        for key, value in ddp_entry.items():
            mine = zero["state"][index][key]
            if key == "step":
                assert float(mine) == float(value), (index, float(mine), float(value))
            else:
                assert mine.shape == value.shape and (mine - value).abs().max() <= TOLERANCE, (index, key)


def _assert_matches(zero: dict[str, Any], ddp: dict[str, Any]) -> None:
    assert len(zero["losses"]) == len(ddp["losses"]) > 0
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= TOLERANCE
    assert max_abs_diff(zero["params"], ddp["params"]) <= TOLERANCE


@pytest.mark.parametrize("accumulate", [1, 2], ids=["acc1", "acc2"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model", ["layerdrop", "moe"])
def test_adamw_skips_parameters_without_gradient_like_ddp(
    results: list[dict[str, Any]], model: str, strategy: str, accumulate: int
) -> None:
    key = f"{model}_acc{accumulate}"
    for per_rank in results:
        _assert_matches(per_rank[f"{key}_{strategy}"], per_rank[f"{key}_ddp"])
    zero, ddp = results[0][f"{key}_{strategy}"]["optimizer"], results[0][f"{key}_ddp"]["optimizer"]
    _assert_optimizer_states_match(zero, ddp)
    # skipping happened: some parameter was stepped fewer times than the others
    steps = {float(entry["step"]) for entry in ddp["state"].values()}
    assert max(steps) == STEPS and min(steps) < STEPS


@pytest.mark.parametrize("accumulate", [1, 2], ids=["acc1", "acc2"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_sgd_momentum_skips_parameters_without_gradient_like_ddp(
    results: list[dict[str, Any]], strategy: str, accumulate: int
) -> None:
    key = f"sgd_acc{accumulate}"
    for per_rank in results:
        _assert_matches(per_rank[f"{key}_{strategy}"], per_rank[f"{key}_ddp"])
    zero, ddp = results[0][f"{key}_{strategy}"]["optimizer"], results[0][f"{key}_ddp"]["optimizer"]
    _assert_optimizer_states_match(zero, ddp)
    assert all("momentum_buffer" in entry for entry in ddp["state"].values())


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero2_offload"])
def test_zero_grad_set_to_none_false_keeps_stepping_like_ddp(results: list[dict[str, Any]], strategy: str) -> None:
    for per_rank in results:
        _assert_matches(per_rank[f"zeroed_{strategy}"], per_rank["zeroed_ddp"])
    zero, ddp = results[0][f"zeroed_{strategy}"]["optimizer"], results[0]["zeroed_ddp"]["optimizer"]
    _assert_optimizer_states_match(zero, ddp)
    # every parameter was stepped every step since its first gradient: fewer skips than with None
    skipped = results[0]["layerdrop_acc1_ddp"]["optimizer"]["state"]
    assert sum(float(entry["step"]) for entry in ddp["state"].values()) > sum(
        float(entry["step"]) for entry in skipped.values())


def test_the_models_exercise_the_cases(results: list[dict[str, Any]]) -> None:
    """The rules above do produce what the tests claim to cover."""
    for accumulate in (1, 2):
        used = results[0][f"layerdrop_acc{accumulate}_ddp"]["usage"]
        per_step = [used[i : i + accumulate] for i in range(0, len(used), accumulate)]
        # a block without a gradient on any rank (the rule is rank-independent) in some steps
        assert any(not any(micro[0] for micro in step) for step in per_step)
        assert any(not any(micro[1] for micro in step) for step in per_step)
        routed = [results[rank][f"moe_acc{accumulate}_ddp"]["usage"] for rank in range(WORLD)]
        # expert 2: tokens on rank 0, none on rank 1; expert 3: no token on any rank in some steps
        assert all(counts[2] > 0 for counts in routed[0]) and all(counts[2] == 0 for counts in routed[1])
        assert any(counts[3] > 0 for counts in routed[0])
        assert any(all(r[i][3] == 0 for r in routed) for i in range(len(routed[0])))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_parameter_frozen_at_setup_and_trained_later_is_named_not_silently_skipped(
    results: list[dict[str, Any]], strategy: str
) -> None:
    for per_rank in results:
        unfrozen = per_rank[f"unfreeze_{strategy}"]["message"]
        assert "'head.weight', 'head.bias' were frozen (requires_grad=False) when the strategy set the optimizer" in unfrozen
        added = per_rank[f"add_group_{strategy}"]["message"]
        assert "2 parameter(s) were added to its param groups since ('head.weight', 'head.bias')" in added
        for message in (unfrozen, added):
            assert "would not train" in message and "trainable from the start" in message
        # the error comes at the first step after the change (batch 2's)
        assert len(per_rank[f"unfreeze_{strategy}"]["losses"]) == len(per_rank[f"add_group_{strategy}"]["losses"]) == 3


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_parameter_frozen_after_setup_stops_training_like_ddp(results: list[dict[str, Any]], strategy: str) -> None:
    for per_rank in results:
        zero, ddp = per_rank[f"freeze_{strategy}"], per_rank["freeze_ddp"]
        assert zero["message"] == ddp["message"] == "no error"
        _assert_matches(zero, ddp)
        assert zero["head moved"]


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_adapters_beside_frozen_weights_train_like_ddp(results: list[dict[str, Any]], strategy: str) -> None:
    """LoRA-style units (frozen base weights and trained adapters in one stage-3 unit, see [Note:
    trained pieces first] in zero/stage3/unit.py) train like DDP, with accumulation; the frozen
    weights stay as they were."""
    for per_rank in results:
        _assert_matches(per_rank[f"lora_{strategy}"], per_rank["lora_ddp"])
    zero, ddp = results[0][f"lora_{strategy}"]["optimizer"], results[0]["lora_ddp"]["optimizer"]
    _assert_optimizer_states_match(zero, ddp)
    assert len(ddp["state"]) == 2 + 3 * 3  # the norm's two and each adapter's three: nothing frozen


@pytest.mark.parametrize("offload", [False, True], ids=["zero3", "zero3_offload"])
def test_a_base_held_in_bf16_keeps_no_fp32_master_and_trains_the_same(results: list[dict[str, Any]],
                                                                       offload: bool) -> None:
    """[Note: masters of frozen pieces] in zero/stage3/unit.py: frozen weights held in the shards'
    bf16 keep no fp32 master (4 bytes per element and rank less), and training and the module
    handed back are exactly those of the same values held in fp32 (whose masters are kept)."""
    for per_rank in results:
        exact, kept = per_rank[f"lora_base_{torch.bfloat16}_{offload}"], per_rank[f"lora_base_{torch.float32}_{offload}"]
        assert exact["losses"] == kept["losses"] and len(exact["losses"]) == STEPS
        assert exact["params"].keys() == kept["params"].keys()
        assert all(torch.equal(exact["params"][name].float(), value) for name, value in kept["params"].items())
        # handed back in the dtypes they were built in, as under DDP: the base in bf16, the adapters in fp32
        assert {str(value.dtype) for value in kept["params"].values()} == {"torch.float32"}
        assert {name for name, value in exact["params"].items() if value.dtype == torch.bfloat16} == exact["frozen"]
        # this rank's (padded) pieces of the frozen weights, at 4 bytes each
        assert kept["state"].optimizer_states - exact["state"].optimizer_states == 4 * exact["frozen_pieces"]
        assert (exact["state"].params, exact["state"].grads) == (kept["state"].params, kept["state"].grads)


def test_a_module_is_handed_back_in_the_dtypes_it_was_built_in(results: list[dict[str, Any]]) -> None:
    """After bf16-mixed at stage 2: the trained norm built in bf16 comes back in bf16 (from its fp32
    master), the adapters in fp32, as DDP leaves them (stage 3: the test above)."""
    for per_rank in results:
        case = per_rank["built_dtypes_zero2"]
        assert case["handed_back"] == case["built"]
        assert {case["built"]["norm.weight"], case["built"]["mlp.0.down"]} == {torch.bfloat16, torch.float32}


def test_a_parameter_unfrozen_in_configure_optimizers_trains_or_is_named(results: list[dict[str, Any]]) -> None:
    """Stages 1/2 build their buckets from the optimizer: such a parameter trains as under DDP.
    Stage 3 shards the module (and takes its trainable set) before configure_optimizers runs: an
    error on every rank naming the parameters and where to set requires_grad, before any step,
    never a head that silently stays as it was."""
    for per_rank in results:
        assert per_rank["configure_zero2"]["message"] == per_rank["configure_ddp"]["message"] == "no error"
        _assert_matches(per_rank["configure_zero2"], per_rank["configure_ddp"])
        message = per_rank["configure_zero3"]["message"]
        assert "'head.weight', 'head.bias' were frozen (requires_grad=False) when ZeRO-3 sharded the model" in message
        assert "set requires_grad before then, e.g. in __init__, setup or configure_model" in message
        assert per_rank["configure_zero3"]["losses"] == []
