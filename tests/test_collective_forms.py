"""The forms a sharded collective can take ([Note: collective forms] in zero/comm.py): reduce-scatter
as all-reduce plus a local copy, all-gather as one broadcast per rank, give the same bits as the
plain collectives, on 2 and 4 gloo ranks, for odd sizes and every dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from lightning_zero.zero.comm import CollectiveForms, Collectives, CountingCollectives

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
CHUNKS = (1, 7, 1001, 524_289)  # elements per rank; the last is above the gloo rule's 512K
ALTERNATIVE = CollectiveForms(reduce_scatter_as_all_reduce_from=1, all_gather_as_broadcasts_from=1)


def _compare_forms() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    native = Collectives(forms=CollectiveForms.native())
    alternative = Collectives(forms=ALTERNATIVE)
    by_rule = Collectives()  # gloo's rules: the alternative forms from 512K elements per rank
    out: dict[str, Any] = {"mismatches": [], "cases": 0, "rule": by_rule.forms}
    for dtype in DTYPES:
        for chunk in CHUNKS:
            generator = torch.Generator().manual_seed(1000 * rank + chunk)
            grad = (torch.randn(world * chunk, generator=generator) * 3).to(dtype)
            results = {}
            for name, collectives in (("native", native), ("alternative", alternative), ("rule", by_rule)):
                output = torch.full((chunk,), float("nan"), dtype=dtype)
                handle = collectives.reduce_scatter(output, grad.clone())
                if name == "alternative":
                    # offload polls reductions during backward: a completed one must hold its chunk
                    # (gloo's own reduce-scatter never reports completion before wait(), so it is not polled)
                    out["polled"] = out.get("polled", True) and _poll(handle)
                handle.wait()
                gathered = torch.full((world * chunk,), float("nan"), dtype=dtype)
                collectives.all_gather(gathered, output.clone()).wait()
                results[name] = (output, gathered)
            for name in ("alternative", "rule"):
                for what, mine, plain in zip(("reduce_scatter", "all_gather"), results[name], results["native"]):
                    if not torch.equal(mine, plain):
                        out["mismatches"].append((name, what, str(dtype), chunk))
            out["cases"] += 1
    # CountingCollectives reports the logical operation whatever form carried it
    counting = CountingCollectives(alternative)
    counting.reduce_scatter(torch.empty(5), torch.ones(5 * world)).wait()
    counting.all_gather(torch.empty(5 * world), torch.ones(5)).wait()
    out["counted"] = [(call.op, call.numel) for call in counting.calls]
    return out


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
        assert out["counted"] == [("reduce_scatter", 5 * world), ("all_gather", 5 * world)]
        assert out["rule"] == CollectiveForms.for_backend("gloo")


def test_rules_per_backend() -> None:
    gloo = CollectiveForms.for_backend("gloo")
    assert gloo.reduce_scatter_form(512 * 1024) == "all_reduce" and gloo.reduce_scatter_form(512 * 1024 - 1) == "reduce_scatter"
    assert gloo.all_gather_form(1 << 20) == "broadcasts" and gloo.all_gather_form(100) == "all_gather"
    nccl = CollectiveForms.for_backend("nccl")
    assert nccl.reduce_scatter_form(1 << 30) == "reduce_scatter" and nccl.all_gather_form(1 << 30) == "all_gather"
