"""The engine's fused device step (zero/device_step.py) on 2 gloo ranks, without a Trainer.

``ZeroConfig(fused_adam="auto")`` steps device-resident Adam/AdamW masters with the fused
multi-tensor kernel on CUDA and with the C++ CPU Adam on the CPU. Here the masters are on the CPU,
so the other backends are forced: "host"
(the CUDA kernel's own code run on the CPU), "triton" (under TRITON_INTERPRET=1) and "cpu" (the
C++ CPU kernel). All three equal ops/_reference.py bit for bit, so their runs must be identical
to each other at every stage, with bf16 and fp32 parameters, clipping (a tensor coefficient)
and an fp16 loss scale; and close to the optimizer's own step ("off": torch.optim.AdamW, whose
CPU sqrt is sometimes an ulp off). With bf16/fp16 parameters only the first step is compared to
it: from the second on, a master an ulp off can round the parameter to the next bf16 value, and
the gradients then differ by far more than an ulp (seen on an AVX2-only AMD EPYC machine, whose
bf16 matmuls take another path, and not on the machines before it). The bf16 copy the kernel
writes is what the parameters hold after the step (stage 1/2: the all-gathered staging chunk, stage 3: the shard itself).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import recording_fused_backends, run_on_ranks
from lightning_zero import Collectives, ZeroConfig, ZeroOptimizer
from lightning_zero.config import FUSED_ADAM_CHOICES
from lightning_zero.loss_scaler import LossScaleConfig, LossScaler
from lightning_zero.zero.engine import make_engine

WORLD = 2
STEPS = 3
BACKENDS = ("off", "host", "triton", "cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3))


def _engine(model: nn.Module, stage: int, backend: str, param_dtype: torch.dtype | None,
            scaler: LossScaler | None) -> tuple[Any, Any]:  # fmt: skip
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, fused_adam=backend,
                        **({"min_unit_numel": 100} if stage == 3 else {}))  # fmt: skip
    engine = make_engine(model, Collectives(), config, param_dtype, torch.device("cpu"))
    # Two param groups: AdamW with decay, and without.
    params = list(model.parameters())
    torch_optimizer = torch.optim.AdamW(
        [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}], lr=0.05
    )
    return engine, engine.wrap_optimizer(torch_optimizer, scaler)


def _published_equal_rounded_masters(optimizer: Any) -> bool:
    """Every element this rank steps: the parameter holds its master rounded to the parameter's
    dtype (the kernel's low-precision copy, published)."""
    for piece in optimizer.param_pieces():
        mine = piece.ranges[dist.get_rank()]
        flat = piece.param.detach().reshape(-1)
        if not torch.equal(mine.slice(flat), piece.master.to(flat.dtype)):
            return False
    return True


def _run(stage: int, backend: str, dtype: torch.dtype, clip: bool, fp16: bool) -> dict[str, Any]:
    with recording_fused_backends() as ran:
        model = _model()
        param_dtype = None if dtype == torch.float32 else dtype
        scaler = LossScaler(LossScaleConfig(initial_scale_power=10)) if fp16 else None
        engine, optimizer = _engine(model, stage, backend, param_dtype, scaler)
        data = torch.randn(8, 6, generator=torch.Generator().manual_seed(dist.get_rank())).to(dtype)
        first_masters: list[torch.Tensor] = []
        for step in range(STEPS):
            loss = model(data).float().pow(2).mean()
            (loss * scaler.scale if scaler is not None else loss).backward()
            if clip:
                optimizer.clip_grad_norm_(0.05)
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                first_masters = [piece.master.detach().clone() for piece in optimizer.param_pieces()]
        with engine.gathered(writeback=False):
            params = [p.detach().float().clone() for p in model.parameters()]
            rounded = _published_equal_rounded_masters(optimizer)
        masters = [piece.master.detach().clone() for piece in optimizer.param_pieces()]
        if stage == 3:
            staged = [unit.staging is unit.shard for unit in engine.units]
        else:
            staged = [bucket.staging is not None and bucket.staging.device == bucket.param_data.device
                      for bucket in optimizer.layout.buckets]  # fmt: skip
        state_keys = sorted({key for state in optimizer.state.values() for key in state})
        engine.remove_hooks()
    return {"params": params, "masters": masters, "first_masters": first_masters, "ran": sorted(set(ran)), "state_keys": state_keys,
            "rounded": rounded, "staged": staged}  # fmt: skip


def _cases() -> dict[tuple[Any, ...], dict[str, Any]]:
    os.environ["TRITON_INTERPRET"] = "1"
    out = {}
    for stage in (1, 2, 3):
        for dtype in (torch.bfloat16, torch.float32):
            for backend in BACKENDS:
                out[(stage, dtype, backend, False, False)] = _run(stage, backend, dtype, clip=False, fp16=False)
    for backend in BACKENDS:
        out[(2, torch.float16, backend, True, True)] = _run(2, backend, torch.float16, clip=True, fp16=True)
        out[(3, torch.bfloat16, backend, True, False)] = _run(3, backend, torch.bfloat16, clip=True, fp16=False)
    return {"engine": out, "auto": _auto_runs(), "trainer": _trainer_runs()}


def _auto_runs() -> dict[tuple[int, bool], dict[str, Any]]:
    """The default, "auto", on CPU masters at every stage (bf16 parameters): with the C++ op, and
    with it forced off (as where it cannot be built, or LIGHTNING_ZERO_DISABLE_CPP_OPS=1)."""
    from lightning_zero.ops import cpu_adam

    runs = {}
    for forced_off in (False, True):
        cpu_adam._force_fallback(forced_off)
        try:
            for stage in (1, 2, 3):
                runs[(stage, forced_off)] = _run(stage, "auto", torch.bfloat16, clip=False, fp16=False)
        finally:
            cpu_adam._force_fallback(False)
    return runs


def _trainer_runs() -> dict[str, Any]:
    """Through Lightning, as users run it: DDP, and ZeRO with a forced fused backend, with
    clipping and an LR scheduler, 12 steps of the tests' GPT."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy
    from models import TinyGPT, fit, params_of

    runs = {}
    for name, strategy in (
        ("ddp", "ddp"),
        ("zero2_cpu", ZeroStrategy(config=ZeroConfig(stage=2, reduce_bucket_size=700, fused_adam="cpu"))),
        ("zero3_host", ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=500, fused_adam="host"))),
    ):
        pl.seed_everything(0)
        module = TinyGPT(scheduler=True)
        with recording_fused_backends() as ran:
            fit(module, strategy, WORLD, steps=12, gradient_clip_val=0.5)
        runs[name] = params_of(module)
        runs[f"{name} ran"] = sorted(set(ran))
    return runs


_RUNS: list[dict[str, Any]] = []


def _all_runs() -> list[dict[str, Any]]:
    if not _RUNS:
        pytest.importorskip("triton")
        _RUNS.extend(run_on_ranks(_cases, WORLD))
    return _RUNS


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[Any, ...], dict[str, Any]]]:
    return [runs["engine"] for runs in _all_runs()]


def test_through_the_trainer_fused_steps_match_ddp() -> None:
    for runs in _all_runs():
        trainer = runs["trainer"]
        assert trainer["ddp ran"] == [] and trainer["zero2_cpu ran"] == ["cpu"] and trainer["zero3_host ran"] == ["host"]
        for name in ("zero2_cpu", "zero3_host"):
            for key, value in trainer["ddp"].items():
                torch.testing.assert_close(trainer[name][key], value, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")


def _keys(results: list[dict[tuple[Any, ...], dict[str, Any]]]) -> list[tuple[Any, ...]]:
    return sorted({key[:1] + key[1:2] + key[3:] for key in results[0]}, key=str)


def test_every_forced_backend_steps_the_device_masters(results: list[dict[tuple[Any, ...], dict[str, Any]]]) -> None:
    for rank_results in results:
        for (stage, dtype, backend, clip, fp16), run in rank_results.items():
            expected = [] if backend == "off" else [backend]
            assert run["ran"] == expected, (stage, dtype, backend, clip, fp16)
            # The kernel writes the low-precision copy where the parameters are published from.
            low_precision = dtype != torch.float32 and backend != "off"
            assert run["staged"] and all(staged == low_precision for staged in run["staged"]), (stage, dtype, backend)
            assert run["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]


def test_fused_backends_give_identical_runs_at_every_stage(results: list[dict[tuple[Any, ...], dict[str, Any]]]) -> None:
    for rank_results in results:
        for stage, dtype, clip, fp16 in _keys(results):
            host = rank_results[(stage, dtype, "host", clip, fp16)]
            for backend in ("triton", "cpu"):
                other = rank_results[(stage, dtype, backend, clip, fp16)]
                where = (stage, dtype, backend, clip, fp16)
                assert all(torch.equal(a, b) for a, b in zip(host["masters"], other["masters"])), where
                assert all(torch.equal(a, b) for a, b in zip(host["params"], other["params"])), where


def test_fused_step_matches_the_optimizers_own_step(results: list[dict[tuple[Any, ...], dict[str, Any]]]) -> None:
    for rank_results in results:
        for stage, dtype, clip, fp16 in _keys(results):
            own = rank_results[(stage, dtype, "off", clip, fp16)]
            fused = rank_results[(stage, dtype, "host", clip, fp16)]
            # Low-precision parameters: the first step only (see the module's docstring).
            compared = ("first_masters", "masters") if dtype == torch.float32 else ("first_masters",)
            for when in compared:
                assert len(fused[when]) == len(own[when]) > 0
                for a, b in zip(fused[when], own[when]):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=str((stage, dtype, clip, fp16, when)))


def test_parameters_hold_the_rounded_masters(results: list[dict[tuple[Any, ...], dict[str, Any]]]) -> None:
    """The published parameters are the kernel's own low-precision copy, which equals the masters
    rounded to nearest even; and both ranks hold the same parameters."""
    for key in results[0]:
        assert all(rank_results[key]["rounded"] for rank_results in results), key
        runs = [rank_results[key] for rank_results in results]
        assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"])), key


def test_auto_steps_cpu_masters_with_the_cpp_op_or_the_optimizers_own_step() -> None:
    """"auto" on CPU masters is the C++ CPU Adam, bit for bit the forced "cpu" backend, writing
    the bf16 parameters itself; where that op is unavailable, silently the optimizer's own step."""
    for runs in _all_runs():
        for (stage, forced_off), run in runs["auto"].items():
            twin = runs["engine"][(stage, torch.bfloat16, "off" if forced_off else "cpu", False, False)]
            assert run["ran"] == ([] if forced_off else ["cpu"]), (stage, forced_off)
            assert run["staged"] and all(staged != forced_off for staged in run["staged"]), (stage, forced_off)
            assert all(torch.equal(a, b) for a, b in zip(run["masters"], twin["masters"])), (stage, forced_off)
            assert all(torch.equal(a, b) for a, b in zip(run["params"], twin["params"])), (stage, forced_off)


def test_fused_adam_choices_are_the_ops_backends() -> None:
    from lightning_zero.ops.fused_adam import BACKENDS as OP_BACKENDS

    assert set(FUSED_ADAM_CHOICES) == set(OP_BACKENDS) | {"off"}


def test_bad_fused_adam_values_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"fused_adam='fast'.*'auto'"):
        ZeroConfig(fused_adam="fast")
    # A backend for CUDA masters, on CPU masters: refused when the optimizer is wrapped.
    if dist.is_initialized():
        pytest.skip("needs no process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        with pytest.raises(ValueError, match=r"fused_adam='cuda' needs the masters on a CUDA device.*cpu"):
            ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, Collectives(), ZeroConfig(fused_adam="cuda"))
        # A forced backend this machine cannot run is refused at set-up, not in a step.
        previous = os.environ.pop("TRITON_INTERPRET", None)
        try:
            with pytest.raises(ValueError, match=r"fused_adam='triton' cannot step masters on cpu.*TRITON_INTERPRET"):
                ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, Collectives(),
                              ZeroConfig(fused_adam="triton"))  # fmt: skip
        finally:
            if previous is not None:
                os.environ["TRITON_INTERPRET"] = previous
    finally:
        dist.destroy_process_group()
