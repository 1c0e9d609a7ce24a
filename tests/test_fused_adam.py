"""The multi-tensor fused Adam op (lightning_zero/ops/fused_adam.py) and its backends, on the CPU.

- "host": csrc/fused_adam.cu's own code (its planner from multi_tensor_apply.cuh and its block
  body from fused_adam.cuh) run on the CPU thread by thread (csrc/fused_adam_host.cpp);
- "triton": the Triton kernel under TRITON_INTERPRET=1;
- "cpu": the C++ CPU Adam, per tensor;
- "torch": torch's fused AdamW plus the separate passes (the fallback).

The first three equal ops/_reference.py bit for bit; "torch" to torch's own rounding. The cases
cover many tensors (several tables of the launcher), tensors of several chunks split across
tables, empty tensors, chunk tails, unaligned views (the kernel's scalar path), every gradient
and copy dtype, Adam and AdamW, both lerp branches, a scale as a float and as a device tensor,
and found_inf. Then: the op's schema and fake implementation (opcheck, torch.compile), checks
that name the bad argument, the fallback's one warning, and that importing builds nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.ops import fused_adam
from lightning_zero.ops._reference import reference_adam_step
from lightning_zero.ops.fused_adam import FusedAdamFallbackWarning, multi_tensor_adam_step, resolve_backend

REPO_ROOT = Path(__file__).resolve().parents[1]
EXACT_BACKENDS = ("host", "triton", "cpu")
CHUNK = 65536
HYPER: dict[str, Any] = {"lr": 1e-2, "beta2": 0.999, "eps": 1e-8}


@pytest.fixture(autouse=True, scope="module")
def _interpret_triton() -> Iterator[None]:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous


def _needs(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    if backend == "host" and fused_adam._HOST_OP.value() is None:
        pytest.fail(f"the host build failed: {fused_adam._HOST_OP.unavailable_reason()}")


def _tensors(sizes: list[int], grad_dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int,
             unaligned: bool = False) -> dict[str, list[Any]]:  # fmt: skip
    """Random shards; ``unaligned`` makes every tensor a view one element into a larger one, so
    no chunk starts on a vector boundary."""
    generator = torch.Generator().manual_seed(seed)
    skip = 1 if unaligned else 0

    def make(n: int, scale: float, dtype: torch.dtype = torch.float32, positive: bool = False) -> torch.Tensor:
        values = torch.rand(n + skip, generator=generator) if positive else torch.randn(n + skip, generator=generator)
        return (values * scale).to(dtype)[skip:]

    return {
        "masters": [make(n, 1.0) for n in sizes],
        "grads": [make(n, 3.0, grad_dtype) for n in sizes],
        "exp_avgs": [make(n, 0.1) for n in sizes],
        "exp_avg_sqs": [make(n, 0.01, positive=True) for n in sizes],
        "outs": [torch.empty(n + skip, dtype=out_dtype)[skip:] if out_dtype is not None else None for n in sizes],
    }


def _clone(tensors: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: [t.clone() if t is not None else None for t in values] for key, values in tensors.items()}


def _reference(tensors: dict[str, list[Any]], step: int, beta1: float, weight_decay: float, adamw_mode: bool,
               scale: float) -> None:  # fmt: skip
    for master, grad, exp_avg, exp_avg_sq, out in zip(*tensors.values()):
        reference_adam_step(
            master, grad, exp_avg, exp_avg_sq, step=step, beta1=beta1, weight_decay=weight_decay,
            adamw_mode=adamw_mode, grad_scale=scale, low_precision_out=out, **HYPER,
        )  # fmt: skip


def _step(tensors: dict[str, list[Any]], backend: str, step: int, beta1: float, weight_decay: float,
          adamw_mode: bool, grad_scale: float | torch.Tensor, found_inf: torch.Tensor | None = None) -> str:  # fmt: skip
    return multi_tensor_adam_step(
        tensors["masters"], tensors["grads"], tensors["exp_avgs"], tensors["exp_avg_sqs"], step=step, beta1=beta1,
        weight_decay=weight_decay, adamw_mode=adamw_mode, grad_scale=grad_scale, found_inf=found_inf,
        low_precision_outs=tensors["outs"], backend=backend, **HYPER,
    )  # fmt: skip


def _assert_equal(actual: dict[str, list[Any]], expected: dict[str, list[Any]], what: str) -> None:
    for key in expected:
        for index, (a, b) in enumerate(zip(actual[key], expected[key])):
            if b is None:
                continue
            if not torch.equal(a, b):
                differing = int((a != b).sum())
                raise AssertionError(f"{what}: {key}[{index}] differs in {differing} of {b.numel()} elements")


# ------------------------------------------------------------------------------ bit-exact backends
# Small and odd sizes, an empty one, and one of 2 chunks plus a tail.
MIXED_SIZES = [1, 7, 0, 1000, 2 * CHUNK + 3, 33]


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
@pytest.mark.parametrize(
    "grad_dtype,out_dtype",
    [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["fp32", "bf16_bf16", "fp16_fp16", "fp32_bf16", "bf16_fp16"],
)  # fmt: skip
def test_backend_equals_the_reference_bit_for_bit(backend: str, grad_dtype: torch.dtype,
                                                 out_dtype: torch.dtype | None) -> None:  # fmt: skip
    _needs(backend)
    tensors = _tensors(MIXED_SIZES, grad_dtype, out_dtype, seed=1)
    expected = _clone(tensors)
    for step, (beta1, weight_decay, adamw_mode) in enumerate([(0.9, 0.1, True), (0.3, 0.1, False), (0.9, 0.0, True)], 1):
        _reference(expected, step, beta1, weight_decay, adamw_mode, scale=0.5)
        assert _step(tensors, backend, step, beta1, weight_decay, adamw_mode, grad_scale=0.5) == backend
        _assert_equal(tensors, expected, f"{backend} step {step}")


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_unaligned_views_take_the_scalar_path_with_the_same_values(backend: str) -> None:
    _needs(backend)
    tensors = _tensors([CHUNK + 5, 12, 3], torch.bfloat16, torch.bfloat16, seed=2, unaligned=True)
    expected = _clone(tensors)
    _reference(expected, 4, 0.9, 0.01, True, scale=0.25)
    _step(tensors, backend, 4, 0.9, 0.01, True, grad_scale=0.25)
    _assert_equal(tensors, expected, backend)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_a_tensor_scale_and_found_inf_are_read_on_the_device(backend: str) -> None:
    _needs(backend)
    tensors = _tensors([100, 2000], torch.bfloat16, torch.bfloat16, seed=3)
    expected = _clone(tensors)
    _reference(expected, 1, 0.9, 0.01, True, scale=0.125)
    _step(tensors, backend, 1, 0.9, 0.01, True, grad_scale=torch.tensor(0.125))
    _assert_equal(tensors, expected, f"{backend} with a tensor scale")
    # A set flag skips the step: nothing is written, the low-precision copies included.
    before = _clone(tensors)
    for out in tensors["outs"]:
        out.fill_(7.0)
    _step(tensors, backend, 2, 0.9, 0.01, True, grad_scale=1.0, found_inf=torch.tensor(1.0))
    for key in ("masters", "exp_avgs", "exp_avg_sqs"):
        _assert_equal({key: tensors[key]}, {key: before[key]}, f"{backend} skipped")
    assert all(bool((out == 7.0).all()) for out in tensors["outs"])
    # A clear flag steps.
    _reference(before, 2, 0.9, 0.01, True, scale=1.0)
    _step(tensors, backend, 2, 0.9, 0.01, True, grad_scale=1.0, found_inf=torch.tensor(0.0))
    _assert_equal(tensors, before, f"{backend} after a clear flag")


def _host(tensors: dict[str, list[Any]], step: int, scale: float, threads: int = 512, max_part_numel: int = 0) -> int:
    """The host build's op directly: returns how many tables it launched."""
    return int(torch.ops.lightning_zero._fused_adam_host(
        tensors["grads"], tensors["masters"], tensors["exp_avgs"], tensors["exp_avg_sqs"],
        [out for out in tensors["outs"] if out is not None], None, None, step, HYPER["lr"], 0.9, HYPER["beta2"],
        HYPER["eps"], 0.0, True, scale, threads, max_part_numel,
    ))  # fmt: skip


def test_the_launcher_splits_many_tensors_and_long_ones_over_tables() -> None:
    """multi_tensor_apply.cuh packs at most 36 tensors and 640 chunks per launch: 100 small
    tensors take 3 tables, and chunks of one tensor continue from one table into the next."""
    _needs("host")
    for sizes, launches in (([5] * 100, 3), ([10, 639 * CHUNK, 10] + [3] * 40, 3), ([641 * CHUNK + 1], 2)):
        tensors = _tensors(sizes, torch.float32, torch.bfloat16, seed=4)
        expected = _clone(tensors)
        _reference(expected, 1, 0.9, 0.0, True, scale=1.0)
        assert _host(tensors, 1, 1.0) == launches, sizes[:4]
        _assert_equal(tensors, expected, f"{len(sizes)} tensors")
        del tensors, expected


def test_tensors_longer_than_a_table_can_index_are_split_into_parts() -> None:
    """Past 65535 chunks a tensor is split into parts (at most 4.3e9 elements each in the
    kernel); with parts of 2 chunks, 40 tensors of 5 chunks are 120 parts: 4 tables of 36."""
    _needs("host")
    tensors = _tensors([5 * CHUNK - 7] * 40, torch.bfloat16, torch.bfloat16, seed=12)
    expected = _clone(tensors)
    _reference(expected, 1, 0.9, 0.0, True, scale=1.0)
    assert _host(tensors, 1, 1.0, max_part_numel=2 * CHUNK) == 4
    _assert_equal(tensors, expected, "parts")
    with pytest.raises(RuntimeError, match="max_part_numel must be a multiple of 65536"):
        _host(tensors, 1, 1.0, max_part_numel=1000)


def test_fewer_threads_per_block_loop_over_the_chunk() -> None:
    """A block's threads stride over its chunk; with 3 threads each takes every third vector."""
    _needs("host")
    tensors = _tensors([CHUNK, 999], torch.float16, torch.float16, seed=5)
    expected = _clone(tensors)
    _reference(expected, 2, 0.9, 0.0, True, scale=2.0)
    _host(tensors, 2, 2.0, threads=3)
    _assert_equal(tensors, expected, "3 threads")


def test_the_torch_fallback_matches_to_torchs_rounding() -> None:
    tensors = _tensors(MIXED_SIZES, torch.bfloat16, torch.bfloat16, seed=6)
    expected = _clone(tensors)
    for step in (1, 2):
        _reference(expected, step, 0.9, 0.1, True, scale=0.5)
        _step(tensors, "torch", step, 0.9, 0.1, True, grad_scale=torch.tensor(0.5))
    for key in ("masters", "exp_avgs", "exp_avg_sqs"):
        for a, b in zip(tensors[key], expected[key]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(out, master.to(torch.bfloat16)) for out, master in zip(tensors["outs"], tensors["masters"]))


def test_grouping_by_dtype_mixes_copies_and_gradient_dtypes_in_one_call() -> None:
    _needs("host")
    tensors = _tensors([10, 20, 30, 40], torch.float32, None, seed=7)
    tensors["grads"][1] = tensors["grads"][1].to(torch.bfloat16)
    tensors["outs"][2] = torch.empty(30, dtype=torch.float16)
    tensors["outs"][3] = torch.empty(40, dtype=torch.bfloat16)
    expected = _clone(tensors)
    _reference(expected, 3, 0.9, 0.01, True, scale=1.0)
    _step(tensors, "host", 3, 0.9, 0.01, True, grad_scale=1.0)
    _assert_equal(tensors, expected, "mixed")


# ------------------------------------------------------------------------------ the op
def test_opcheck_schema_fake_and_autograd_registration() -> None:
    tensors = _tensors([10, 300], torch.bfloat16, torch.bfloat16, seed=8)
    args = (tensors["grads"], tensors["masters"], tensors["exp_avgs"], tensors["exp_avg_sqs"], tensors["outs"],
            torch.tensor([0.5]), None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1.0, "cpu")  # fmt: skip
    torch.library.opcheck(torch.ops.lightning_zero.fused_adam_.default, args)


def test_eager_calls_bump_what_they_write_and_modes_still_see_the_op() -> None:
    """[Note: eager calls skip the op's dispatch]: a plain eager call runs the implementation
    directly, bumping the version counters of every tensor it wrote (not the gradients'), with
    the op's results; under a dispatch mode the op itself is dispatched, as the mode expects."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tensors = _tensors([64, 100], torch.bfloat16, torch.bfloat16, seed=11)
    expected = _clone(tensors)
    _reference(expected, 1, 0.9, 0.01, True, scale=0.5)
    before = {key: [t._version for t in values] for key, values in tensors.items()}
    _step(tensors, "cpu", 1, 0.9, 0.01, True, 0.5)
    _assert_equal(tensors, expected, "eager")
    for key, values in tensors.items():
        bumped = [t._version > v for t, v in zip(values, before[key])]
        assert all(bumped) if key != "grads" else not any(bumped), key

    class Recording(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    again = _tensors([64, 100], torch.bfloat16, torch.bfloat16, seed=11)
    with Recording() as mode:
        _step(again, "cpu", 1, 0.9, 0.01, True, 0.5)
    assert any("lightning_zero.fused_adam_" in op for op in mode.ops), mode.ops
    _assert_equal(again, expected, "under a dispatch mode")


def test_torch_compile_traces_through_the_op_in_one_graph() -> None:
    tensors = _tensors([64, 100], torch.bfloat16, torch.bfloat16, seed=9)
    expected = _clone(tensors)
    _reference(expected, 1, 0.9, 0.01, True, scale=0.5)

    def step(masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
             exp_avg_sqs: list[torch.Tensor], outs: list[torch.Tensor], scale: torch.Tensor) -> None:  # fmt: skip
        torch.ops.lightning_zero.fused_adam_(grads, masters, exp_avgs, exp_avg_sqs, outs, scale, None, 1,
                                             HYPER["lr"], 0.9, HYPER["beta2"], HYPER["eps"], 0.01, True, 1.0, "cpu")  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(tensors["masters"], tensors["grads"], tensors["exp_avgs"], tensors["exp_avg_sqs"], tensors["outs"],
             torch.tensor([0.5]))  # fmt: skip
    _assert_equal(tensors, expected, "compiled")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t["masters"].__setitem__(0, t["masters"][0].double()), r"masters\[0\] is torch.float64"),
        (lambda t: t["grads"].__setitem__(1, t["grads"][1][:5]), r"grads\[1\] has 5 elements, its master has 20"),
        (lambda t: t["exp_avgs"].pop(), r"exp_avgs has 1 tensors, masters has 2"),
        (lambda t: t["outs"].__setitem__(0, torch.empty(10)), r"low_precision_outs\[0\] is torch.float32"),
        (lambda t: t["exp_avg_sqs"].__setitem__(1, torch.zeros(40)[::2]), r"exp_avg_sqs\[1\] is not contiguous"),
    ],
    ids=["master_dtype", "grad_size", "list_length", "out_dtype", "not_contiguous"],
)
def test_bad_arguments_are_named(change: Any, message: str) -> None:
    tensors = _tensors([10, 20], torch.float32, torch.bfloat16, seed=10)
    change(tensors)
    with pytest.raises(ValueError, match=message):
        _step(tensors, "cpu", 1, 0.9, 0.0, True, grad_scale=1.0)


def test_bad_step_backend_and_scalars_are_named() -> None:
    tensors = _tensors([10], torch.float32, None, seed=11)
    with pytest.raises(ValueError, match=r"step=0"):
        _step(tensors, "cpu", 0, 0.9, 0.0, True, grad_scale=1.0)
    with pytest.raises(ValueError, match=r"backend='fast' is not one of"):
        _step(tensors, "fast", 1, 0.9, 0.0, True, grad_scale=1.0)
    with pytest.raises(ValueError, match=r"grad_scale must be a one-element float32 tensor"):
        _step(tensors, "cpu", 1, 0.9, 0.0, True, grad_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"backend='cuda' needs CUDA tensors, got cpu tensors"):
        _step(tensors, "cuda", 1, 0.9, 0.0, True, grad_scale=1.0)


def test_auto_on_cuda_without_the_kernel_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Here torch has no CUDA, so the CUDA kernel cannot be built: "auto" for CUDA tensors takes
    Triton (or torch's passes) and says why, once; CPU tensors take the C++ CPU kernel, silently."""
    fused_adam._CUDA_OP.force_fallback(False)  # resets the warn-once flag
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = resolve_backend("auto", torch.device("cuda"))
        second = resolve_backend("auto", torch.device("cuda"))
        on_cpu = resolve_backend("auto", torch.device("cpu"))
    messages = [str(w.message) for w in record if w.category is FusedAdamFallbackWarning]
    assert first == second and first in ("triton", "torch") and on_cpu == "cpu"
    assert len(messages) == 1
    if not torch.cuda.is_available():
        assert "without CUDA" in messages[0] or "no CUDA device" in messages[0], messages[0]
    monkeypatch.setenv("LIGHTNING_ZERO_DISABLE_CPP_OPS", "1")
    fused_adam._CUDA_OP.force_fallback(False)
    with pytest.warns(FusedAdamFallbackWarning, match="LIGHTNING_ZERO_DISABLE_CPP_OPS=1 is set"):
        resolve_backend("auto", torch.device("cuda"))


def test_importing_builds_nothing_and_imports_no_kernel_module_nor_cpp_extension(tmp_path: Path) -> None:
    build_dir = tmp_path / "build"
    script = textwrap.dedent(
        """
        import sys
        import lightning_zero, lightning_zero.ops
        from lightning_zero.ops import fused_adam
        import torch
        print(fused_adam._CUDA_OP.loaded, fused_adam._HOST_OP.loaded, "lightning_zero.ops._triton_kernels" in sys.modules,
              "torch.utils.cpp_extension" in sys.modules, hasattr(torch.ops.lightning_zero, "fused_adam_"))
        """
    )
    env = {**os.environ, "LIGHTNING_ZERO_BUILD_DIR": str(build_dir), "TORCH_EXTENSIONS_DIR": str(build_dir)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False", "False", "True"]
    assert not build_dir.exists()
