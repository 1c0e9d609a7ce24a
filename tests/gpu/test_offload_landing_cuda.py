"""Offload from a CUDA device at world size 1 on NCCL: reduced chunks land on the host through
pinned buffers and a copy stream ([Note: landing on the host] in zero/reduce.py), the pinned
staging goes back with non_blocking, and the overlapped step ([Note: overlapped step]) is
bit-identical to the plain one; both stay within 1e-5 of torch's AdamW on the GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from harness import run_on_ranks
from lightning_zero import Collectives, CPUOffloadPolicy, ZeroConfig
from lightning_zero.zero.engine import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)).cuda()


def _data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(32, 16, generator=generator).cuda() for _ in range(STEPS)]


def _zero_run(overlap: bool, param_dtype: torch.dtype | None) -> dict[str, Any]:
    model = _model()
    config = ZeroConfig(stage=2, reduce_bucket_size=20_000, overlap_step=overlap, offload_optimizer=CPUOffloadPolicy())
    engine = make_engine(model, Collectives(), config, param_dtype, torch.device("cuda"))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in _data():
        model(batch.to(param_dtype or torch.float32)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    reductions = [bucket.reduction for bucket in optimizer.layout.buckets]
    out = {
        "params": [p.detach().float().cpu() for p in model.parameters()],
        "masters": [piece.master.detach().clone() for piece in optimizer.param_pieces()],
        "pinned_landings": all(r._landing is not None and r._landing.is_pinned() for r in reductions),
        "buckets": len(reductions),
    }
    engine.remove_hooks()
    return out


def _reference() -> list[torch.Tensor]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in _data():
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def _cases() -> dict[str, Any]:
    return {
        "fp32_on": _zero_run(True, None), "fp32_off": _zero_run(False, None),
        "bf16_on": _zero_run(True, torch.bfloat16), "bf16_off": _zero_run(False, torch.bfloat16),
        "reference": _reference(),
    }


def test_offload_lands_through_pinned_buffers_and_overlaps_bit_identically() -> None:
    (runs,) = run_on_ranks(_cases, 1, backend="nccl")
    for dtype in ("fp32", "bf16"):
        on, off = runs[f"{dtype}_on"], runs[f"{dtype}_off"]
        assert on["buckets"] > 2 and on["pinned_landings"] and off["pinned_landings"]
        for a, b in zip(on["params"] + on["masters"], off["params"] + off["masters"]):
            assert torch.equal(a, b), dtype
    for ours, reference in zip(runs["fp32_on"]["params"], runs["reference"]):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
