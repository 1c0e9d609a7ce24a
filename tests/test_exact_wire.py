"""Gradients on the wire in their own dtype ([Note: exact on the wire] in zero/comm.py), on 2 gloo ranks.

With bf16/fp16 parameters and the default fp32 reduction, the two-rank exchange sends a bucket in
the gradients' dtype while every value in it is one copied gradient. Training must then give the
same bits as with every bucket sent in fp32 (``Reduction.exact_in`` forced to None): parameters,
masters and optimizer state, at stages 1 and 2 and under offload, with a parameter that gets no
gradient on one rank, with and without accumulation, and through the Trainer. The tests also check
which dtype each reduction's exchange carried.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from harness import run_on_ranks
from lightning_zero import Collectives, CPUOffloadPolicy, ZeroConfig, ZeroStrategy
from lightning_zero.zero.engine import make_engine
from lightning_zero.zero.reduce import Reduction
from models import RankDependentNet, TinyGPT, assert_identical, engine_snapshot, fit, params_of

WORLD = 2
STEPS = 3
CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": CPUOffloadPolicy()},
}


@contextmanager
def wire_dtypes(narrow: bool) -> Iterator[list[torch.dtype]]:
    """Records the dtype each gradient reduction's exchange (``all_to_all_single``) sends; without
    ``narrow`` every reduction claims no narrower dtype, as before [Note: exact on the wire]."""
    sent: list[torch.dtype] = []
    reducing = [False]
    original_exchange = dist.all_to_all_single
    original_reduce_scatter = Collectives.reduce_scatter
    original_exact_in = Reduction.exact_in

    def recording(output: Tensor, input: Tensor, *args: Any, **kwargs: Any) -> Any:
        if reducing[0]:
            sent.append(input.dtype)
        return original_exchange(output, input, *args, **kwargs)

    def reduce_scatter(self: Collectives, output: Tensor, input: Tensor, **how: Any) -> Any:
        reducing[0] = True
        try:
            return original_reduce_scatter(self, output, input, **how)
        finally:
            reducing[0] = False

    dist.all_to_all_single = recording  # type: ignore[assignment]
    Collectives.reduce_scatter = reduce_scatter  # type: ignore[method-assign]
    if not narrow:
        Reduction.exact_in = property(lambda self: None)  # type: ignore[method-assign,assignment]
    try:
        yield sent
    finally:
        dist.all_to_all_single = original_exchange  # type: ignore[assignment]
        Collectives.reduce_scatter = original_reduce_scatter  # type: ignore[method-assign]
        Reduction.exact_in = original_exact_in  # type: ignore[method-assign]


def _engine_run(keywords: dict[str, Any], dtype: torch.dtype, accumulate: bool, narrow: bool) -> dict[str, Any]:
    model = RankDependentNet()
    engine = make_engine(model, Collectives(), ZeroConfig(reduce_bucket_size=500, **keywords), dtype, torch.device("cpu"))
    params = list(model.parameters())
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(
        [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}], lr=0.05))
    generator = torch.Generator().manual_seed(dist.get_rank())
    # Gradients of the size a loss of order one gives, and some far below bf16's normal range.
    scale = torch.tensor(1e-38) if dtype == torch.bfloat16 else torch.tensor(1e-7)
    with wire_dtypes(narrow) as sent:
        for step in range(STEPS):
            if accumulate:
                with optimizer.no_sync():
                    model(torch.randn(4, 6, generator=generator).to(dtype)).float().pow(2).mean().backward()
            loss = model(torch.randn(4, 6, generator=generator).to(dtype)).float().pow(2).mean()
            (loss * scale if step == 1 else loss).backward()
            optimizer.step()
            optimizer.zero_grad()
    out = {**engine_snapshot(model, optimizer), "sent": sorted({str(d) for d in sent})}
    engine.remove_hooks()
    return out


def _trainer_run(narrow: bool, accumulate: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = TinyGPT()
    strategy = ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700))
    with wire_dtypes(narrow) as sent:
        fit(module, strategy, WORLD, steps=4, precision="bf16-mixed",
            accumulate_grad_batches=accumulate)
    return {"params": params_of(module), "sent": sorted({str(d) for d in sent})}


def _cases() -> dict[str, Any]:
    engine = {}
    for name, keywords in CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float16):
            for accumulate in (False, True):
                for narrow in (True, False):
                    engine[(name, dtype, accumulate, narrow)] = _engine_run(keywords, dtype, accumulate, narrow)
    trainer = {(narrow, accumulate): _trainer_run(narrow, accumulate) for narrow in (True, False) for accumulate in (1, 2)}
    return {"engine": engine, "trainer": trainer}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_on_ranks(_cases, WORLD)


@pytest.mark.parametrize("accumulate", [False, True], ids=["one_backward", "accumulated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_narrow_wire_trains_to_the_same_bits(runs: list[dict[str, Any]], name: str, dtype: torch.dtype,
                                                 accumulate: bool) -> None:
    for run in runs:
        narrow, wide = run["engine"][(name, dtype, accumulate, True)], run["engine"][(name, dtype, accumulate, False)]
        assert narrow["buckets"] > 2
        for what in ("params", "masters", "state"):
            assert_identical(narrow[what], wide[what], what)
        # The reductions go in fp32 unless the wire may be narrow and nothing was accumulated.
        assert wide["sent"] == ["torch.float32"]
        assert narrow["sent"] == (["torch.float32"] if accumulate else [str(dtype)])


def test_the_narrow_wire_through_the_trainer(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        trainer = run["trainer"]
        for accumulate in (1, 2):
            narrow, wide = trainer[(True, accumulate)], trainer[(False, accumulate)]
            assert_identical(narrow["params"], wide["params"], f"accumulate {accumulate}")
            assert wide["sent"] == ["torch.float32"]
        assert trainer[(True, 1)]["sent"] == ["torch.bfloat16"]
        # Accumulated over the window, the sum is no bf16 number: it goes in fp32.
        assert trainer[(True, 2)]["sent"] == ["torch.float32"]
