"""The forms a sharded collective can take ([Note: collective forms] in zero/comm.py): reduce-scatter
as all-reduce plus a local copy, all-gather as one broadcast per rank, and both as one exchange
between two ranks, give the same bits as the plain collectives, on 2 and 4 gloo ranks, for odd
sizes and every dtype, also when the all-gather's input is this rank's chunk of its output."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from lightning_zero.zero.comm import GLOO_HELD, CollectiveForms, Collectives, CountingCollectives, HeldTensors

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
CHUNKS = (1, 7, 1001, 524_289)  # elements per rank; the last is above the gloo rule's 512K
ALTERNATIVE = CollectiveForms(reduce_scatter_as_all_reduce_from=1, all_gather_as_broadcasts_from=1)
EXCHANGE = CollectiveForms(exchange_between_two_ranks=True)  # with more ranks: the native forms


def _compare_forms() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    native = Collectives(forms=CollectiveForms.native())
    alternative = Collectives(forms=ALTERNATIVE)
    exchange = Collectives(forms=EXCHANGE)
    by_rule = Collectives()  # gloo's rules: the exchange at 2 ranks, else the alternatives from 512K
    out: dict[str, Any] = {"mismatches": [], "cases": 0, "rule": by_rule.forms, "polled": True}
    for dtype in DTYPES:
        for chunk in CHUNKS:
            generator = torch.Generator().manual_seed(1000 * rank + chunk)
            grad = (torch.randn(world * chunk, generator=generator) * 3).to(dtype)
            results = {}
            forms = (("native", native), ("alternative", alternative), ("exchange", exchange), ("rule", by_rule))
            for name, collectives in forms:
                output = torch.full((chunk,), float("nan"), dtype=dtype)
                handle = collectives.reduce_scatter(output, grad.clone())
                if name == "alternative" or (name == "exchange" and world == 2):
                    # offload polls reductions during backward: a completed one must hold its chunk
                    # (gloo's own reduce-scatter never reports completion before wait(), so it is not polled)
                    out["polled"] = out["polled"] and _poll(handle)
                handle.wait()
                gathered = torch.full((world * chunk,), float("nan"), dtype=dtype)
                collectives.all_gather(gathered, output.clone()).wait()
                # In place: the input is this rank's chunk of the output (the CPU step writes there)
                in_place = torch.full((world * chunk,), float("nan"), dtype=dtype)
                own = in_place[rank * chunk:(rank + 1) * chunk]
                own.copy_(output)
                collectives.all_gather(in_place, own).wait()
                # From a wider master (an fp32 master of a bf16 parameter): cast on the way, the
                # master left as it was
                wider = torch.full((world * chunk,), float("nan"), dtype=dtype)
                master = output.double()
                collectives.all_gather(wider, master).wait()
                if not torch.equal(master, output.double()):
                    out["mismatches"].append((name, "master written", str(dtype), chunk))
                results[name] = (output, gathered, in_place, wider)
            for name in ("native", "alternative", "exchange", "rule"):
                whats = ("reduce_scatter", "all_gather", "all_gather in place", "all_gather from a wider dtype")
                plains = (*results["native"][:2], results["native"][1], results["native"][1])
                for what, mine, plain in zip(whats, results[name], plains):
                    if not torch.equal(mine, plain):
                        out["mismatches"].append((name, what, str(dtype), chunk))
            out["cases"] += 1
    # CountingCollectives reports the logical operation whatever form carried it
    out["counted"] = []
    for forms_under_count in (alternative, exchange):
        counting = CountingCollectives(forms_under_count)
        counting.reduce_scatter(torch.empty(5), torch.ones(5 * world)).wait()
        counting.all_gather(torch.empty(5 * world), torch.ones(5)).wait()
        out["counted"].append([(call.op, call.numel) for call in counting.calls])
    out["held"] = _held_by_every_form(native, alternative, exchange)
    return out


def _held_by_every_form(*every: Collectives) -> list[tuple[int, bool, int]]:
    """Per form and collective: the entries the holder gained when it was issued, whether the held
    tensors are the collective's own (views of its input or output), and what the holder keeps once
    it settled after the wait (see [Note: tensors outlive the gloo worker])."""
    world = dist.get_world_size()
    seen = []
    for collectives in every:
        for issue in ("reduce_scatter", "all_gather"):
            GLOO_HELD.settle()
            small, large = torch.randn(3), torch.randn(world * 3)
            output, input = (small, large) if issue == "reduce_scatter" else (large, small)
            handle = getattr(collectives, issue)(output, input)
            entries = [tensors for _, tensors, _ in GLOO_HELD._held]
            storages = {output.untyped_storage().data_ptr(), input.untyped_storage().data_ptr()}
            own = all(t.untyped_storage().data_ptr() in storages for tensors in entries for t in tensors)
            handle.wait()
            del handle, output, input, small, large
            GLOO_HELD.settle()
            seen.append((len(entries), own, len(GLOO_HELD)))
    return seen


def _poll(handle: Any, seconds: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if handle.is_completed():
            return True
        time.sleep(0.001)
    return False


@pytest.mark.parametrize("world", [2, 4])
def test_alternative_forms_give_the_plain_collectives_bits(world: int) -> None:
    for out in run_on_ranks(_compare_forms, world):
        assert out["cases"] == len(DTYPES) * len(CHUNKS)
        assert out["mismatches"] == []
        assert out["polled"]
        assert out["counted"] == [[("reduce_scatter", 5 * world), ("all_gather", 5 * world)]] * 2
        assert out["rule"] == CollectiveForms.for_backend("gloo")
        assert out["held"] == [(1, True, 0)] * 6


def test_rules_per_backend() -> None:
    gloo = CollectiveForms.for_backend("gloo")
    for world in (3, 4, 8):
        assert gloo.reduce_scatter_form(512 * 1024, world) == "all_reduce"
        assert gloo.reduce_scatter_form(512 * 1024 - 1, world) == "reduce_scatter"
        assert gloo.all_gather_form(1 << 20, world) == "broadcasts" and gloo.all_gather_form(100, world) == "all_gather"
    for chunk in (1, 100, 512 * 1024, 1 << 26):
        assert gloo.reduce_scatter_form(chunk, 2) == "exchange" and gloo.all_gather_form(chunk, 2) == "exchange"
    nccl = CollectiveForms.for_backend("nccl")
    for world in (2, 4):
        assert nccl.reduce_scatter_form(1 << 30, world) == "reduce_scatter" and nccl.all_gather_form(1 << 30, world) == "all_gather"


def test_held_tensors_wait_for_every_other_owner_within_an_age() -> None:
    held = HeldTensors(max_age=3)
    weights = torch.ones(3, requires_grad=True)
    with held.holding(weights):
        graph = (weights * weights).sum()  # the autograd graph owns ``weights`` too, as a work would
    held.prune()
    assert len(held) == 1
    del graph
    held.prune()
    assert len(held) == 0
    # Held no longer than max_age collectives, whoever still owns it.
    with held.holding(weights):
        graph = (weights * weights).sum()
    for _ in range(3):
        with held.holding(torch.ones(1)):
            pass
    held.prune()
    assert len(held) == 0
    # settle gives up after its timeout, and lets go of everything.
    with held.holding(weights):
        other = (weights * weights).sum()
    held.settle(timeout=0.05)
    assert len(held) == 0 and other.requires_grad and graph.requires_grad
