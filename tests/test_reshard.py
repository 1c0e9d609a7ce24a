"""A stage-3 engine built from the pieces another engine left ([Note: re-sharding a module left in
pieces] in zero/stage3/engine.py), in one process and without a Trainer: the values (the fp32
masters after -mixed training) arrive exactly whatever the new unit layout, precision or offload,
each old unit is gathered once and released as soon as the new units hold its values, and what
cannot be re-sharded is refused before any collective with the pieces put back. The 2-rank runs
through the Trainer are in test_after_error.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero import CPUOffloadPolicy, ZeroConfig
from lightning_zero.zero.comm import Collectives, CountingCollectives
from lightning_zero.zero.engine import make_engine
from lightning_zero.zero.stage3 import Phase, PiecesSource, Zero3Engine, Zero3Optimizer

CPU = torch.device("cpu")
PER_LAYER = ZeroConfig(stage=3, min_unit_numel=1, param_persistence_threshold=0, prefetch_units=0)
ONE_UNIT = ZeroConfig(stage=3, param_persistence_threshold=0, prefetch_units=0)  # min_unit_numel 1M: the root only


@pytest.fixture(autouse=True, scope="module")
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("needs no process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[4].weight = model[0].weight  # tied: one parameter registered twice
    return model


def _trained(config: ZeroConfig, param_dtype: torch.dtype | None) -> tuple[nn.Module, Zero3Engine]:
    """An engine after two optimizer steps, its hooks removed as a teardown after an error leaves it."""
    model = _model()
    engine = make_engine(model, CountingCollectives(Collectives()), config, param_dtype, CPU)
    assert isinstance(engine, Zero3Engine)
    optimizer = Zero3Optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), engine, config)
    for _ in range(2):
        batch = torch.randn(4, 8, dtype=param_dtype or torch.float32)
        model(batch).float().pow(2).sum().backward()
        engine.end_backward()
        optimizer.step()
        optimizer.zero_grad()
    engine.remove_hooks()
    return model, engine


def _whole_masters(engine: Zero3Engine) -> dict[str, Tensor]:
    return {sp.name: value.clone() for unit in engine.units
            for sp, value in unit.gather_master_values(engine.collectives).items()}


def _gathers(engine: Zero3Engine) -> int:
    collectives = engine.collectives
    assert isinstance(collectives, CountingCollectives)
    return sum(1 for call in collectives.calls if call.op == "all_gather")


@pytest.mark.parametrize(("old_config", "new_config", "offload"), [
    (PER_LAYER, PER_LAYER, False), (PER_LAYER, ONE_UNIT, False), (ONE_UNIT, PER_LAYER, True),
], ids=["same-units", "finer-to-one", "one-to-finer-offloaded"])
def test_the_new_engine_holds_the_old_masters_exactly(old_config: ZeroConfig, new_config: ZeroConfig,
                                                      offload: bool) -> None:
    model, old = _trained(old_config, torch.bfloat16)
    masters = _whole_masters(old)
    assert any(not torch.equal(value, value.bfloat16().float()) for value in masters.values())  # not bf16 values
    before = _gathers(old)
    opened: list[int] = []
    whole_values = old.whole_values

    def counted(unit: object, from_master: bool) -> dict:
        opened.append(len(source._open) + 1)
        return whole_values(unit, from_master)  # type: ignore[arg-type]

    old.whole_values = counted  # type: ignore[method-assign]
    source = PiecesSource(old, from_master=True)
    assert all(p.is_meta and p.dtype == torch.float32 for p in model.parameters())  # true shapes, as built
    assert model[4].weight is model[0].weight
    if offload:
        new_config = ZeroConfig(**{**new_config.__dict__, "offload_optimizer": CPUOffloadPolicy(pin_memory=False)})
    new = make_engine(model, CountingCollectives(Collectives()), new_config, torch.bfloat16, CPU, source=source)
    assert isinstance(new, Zero3Engine)
    assert len(new.units) == (1 if new_config.min_unit_numel > 1 else 3)
    assert _gathers(old) - before == len(old.units)  # each old unit once
    if new_config is PER_LAYER and old_config is PER_LAYER:
        assert max(opened) == 1  # each released before the next is gathered
    assert all(unit.full.untyped_storage().nbytes() == 0 for unit in old.units + new.units)
    assert old.phase is Phase.TAKEN  # a stale Trainer saving through it gets the way on, not a KeyError
    with pytest.raises(RuntimeError, match="no longer holds the module.*Use the Trainer .* that ran the module last"):
        old.param_pieces()
    assert model[4].weight is model[0].weight and not any(p.is_meta for p in model.parameters())
    mine = _whole_masters(new)
    assert mine.keys() == masters.keys()
    assert all(torch.equal(mine[name], masters[name]) for name in masters)
    for unit in new.units:
        for sp in unit.params:
            assert torch.equal(sp.shard.reshape(-1)[: sp.numel], masters[sp.name].reshape(-1).bfloat16())


def test_without_masters_the_shards_are_taken_in_their_dtype() -> None:
    """32-true: the shards are the values; a new run in bf16-mixed takes them as its fp32 masters."""
    model, old = _trained(PER_LAYER, None)
    values = _whole_masters(old)
    source = PiecesSource(old, from_master=False)
    new = make_engine(model, CountingCollectives(Collectives()), ONE_UNIT, torch.bfloat16, CPU, source=source)
    assert isinstance(new, Zero3Engine)
    mine = _whole_masters(new)
    assert all(torch.equal(mine[name], values[name]) for name in values)


def test_a_replaced_parameter_keeps_its_new_value_and_a_meta_one_is_refused() -> None:
    model, old = _trained(PER_LAYER, None)
    values = _whole_masters(old)
    head = nn.Linear(8, 8)
    model[2] = head  # a new layer set after the error: its own values, not the old pieces'
    fresh = {"2.weight": head.weight.detach().clone(), "2.bias": head.bias.detach().clone()}
    source = PiecesSource(old, from_master=False)
    assert not head.weight.is_meta
    new = make_engine(model, CountingCollectives(Collectives()), PER_LAYER, None, CPU, source=source)
    assert isinstance(new, Zero3Engine)
    mine = _whole_masters(new)
    assert all(torch.equal(mine[name], fresh.get(name, values[name])) for name in values)

    model, old = _trained(PER_LAYER, None)
    pieces = {name: p for name, p in model.named_parameters()}
    with torch.device("meta"):
        model[2] = nn.Linear(8, 8)  # nothing holds a value for these
    source = PiecesSource(old, from_master=False)
    before = _gathers(old)
    with pytest.raises(ValueError, match=r"Parameters \['2.weight', '2.bias'\] are on the meta device"):
        make_engine(model, CountingCollectives(Collectives()), PER_LAYER, None, CPU, source=source)
    assert _gathers(old) == before
    source.put_back()
    assert all(p is pieces[name] for name, p in model.named_parameters() if not name.startswith("2."))
    assert all(p.is_meta for p in model[2].parameters())  # the user's own, as they were


class Wrapped(nn.Module):
    """Holds a layer as peft's LoRA layers hold theirs (``base_layer``): its parameters, renamed."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x: Tensor) -> Tensor:
        return self.base_layer(x)


class FailsInForward(nn.Linear):
    fail = True

    def forward(self, x: Tensor) -> Tensor:
        if self.fail:
            raise ValueError("the user's error inside a unit's forward")
        return super().forward(x)


def test_parameters_are_matched_by_object_and_keep_their_attributes() -> None:
    """A layer wrapped since the pieces were left (peft renames ``2.weight`` to
    ``2.base_layer.weight``) takes its own values; attributes set on parameters survive."""
    model, old = _trained(PER_LAYER, None)
    values = _whole_masters(old)
    model[2].weight._no_weight_decay = True  # type: ignore[attr-defined]
    model[2] = Wrapped(model[2])
    source = PiecesSource(old, from_master=False)
    new = make_engine(model, CountingCollectives(Collectives()), PER_LAYER, None, CPU, source=source)
    assert isinstance(new, Zero3Engine)
    renamed = {name.replace("2.base_layer.", "2."): value for name, value in _whole_masters(new).items()}
    assert renamed.keys() == values.keys() and all(torch.equal(renamed[k], values[k]) for k in values)
    assert getattr(model[2].base_layer.weight, "_no_weight_decay", False) is True


def test_old_units_still_held_or_persistent_are_freed() -> None:
    """A unit an error left gathered inside its forward (still held), and a persistent unit, are
    freed once the new engine holds their values, as the hand-back frees them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), FailsInForward(8, 8), nn.Linear(8, 2))
    config = ZeroConfig(stage=3, min_unit_numel=1, param_persistence_threshold=3, prefetch_units=0)
    old = make_engine(model, CountingCollectives(Collectives()), config, None, CPU)
    assert isinstance(old, Zero3Engine)
    with pytest.raises(ValueError, match="inside a unit's forward"):
        model(torch.randn(2, 8))
    old.remove_hooks()
    held = [unit for unit in old.units if unit.refcount]
    persistent = [unit for unit in old.units if unit.persistent]
    assert held and persistent  # the failing layer's unit, and the head's 2-element bias
    values = _whole_masters(old)
    model[2].fail = False
    new = make_engine(model, CountingCollectives(Collectives()), config, None, CPU,
                      source=PiecesSource(old, from_master=False))
    assert isinstance(new, Zero3Engine)
    assert all(unit.refcount == 0 and unit.full.untyped_storage().nbytes() == 0 for unit in old.units)
    mine = _whole_masters(new)
    assert all(torch.equal(mine[name], values[name]) for name in values)


def test_a_failure_while_re_sharding_frees_what_it_gathered_and_puts_the_pieces_back() -> None:
    model, old = _trained(PER_LAYER, None)
    pieces = dict(model.named_parameters())
    values = _whole_masters(old)
    source = PiecesSource(old, from_master=False)
    taken = source.values_for

    def fails_on_the_second_unit(unit: object) -> dict:
        values = taken(unit)  # type: ignore[arg-type]
        if any(sp.name.startswith("2.") for sp in unit.params):  # type: ignore[attr-defined]
            assert any(old_unit.full.untyped_storage().nbytes() for old_unit in old.units)  # gathered, not yet taken
            raise RuntimeError("out of memory")
        return values

    source.values_for = fails_on_the_second_unit  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        make_engine(model, CountingCollectives(Collectives()), PER_LAYER, None, CPU, source=source)
    source.put_back()
    assert old.phase is Phase.IDLE  # still the module's engine
    assert all(param is pieces[name] for name, param in model.named_parameters())
    assert all(unit.refcount == 0 and unit.full.untyped_storage().nbytes() == 0 for unit in old.units)
    again = make_engine(model, CountingCollectives(Collectives()), ONE_UNIT, None, CPU,
                        source=PiecesSource(old, from_master=False))
    assert isinstance(again, Zero3Engine)
    mine = _whole_masters(again)
    assert all(torch.equal(mine[name], values[name]) for name in values)
