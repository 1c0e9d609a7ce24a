"""One-pass multi-tensor Adam(W) for device-resident shards: :func:`multi_tensor_adam_step`.

torch's ``_fused_adamw_`` wants params, grads and both moments in one dtype, so a ZeRO shard
with fp32 masters, a bf16/fp16 gradient and bf16/fp16 model weights pays an upcast-and-unscale
pass, a clip pass and a cast-and-copy pass around it. The kernels here take the gradient in its
own dtype, multiply it by the combined unscale x clip factor (a float, or a device tensor: no
host sync), skip the whole step when a found-inf flag is set (on the device, no host sync),
update the fp32 master and its moments, and write the rounded bf16/fp16 copy straight into the
buffer that is all-gathered next. Per element with a bf16 gradient and a bf16 copy: 28 bytes,
against 48 for torch's fused AdamW plus the separate passes.

[Note: backends of the fused Adam op]
One op, ``torch.ops.lightning_zero.fused_adam_`` (a ``torch.library`` custom op with a schema
and a fake implementation, so ``torch.compile`` traces through it), and one contract, with
these backends (``backend=``):

- ``"cuda"``: ``csrc/fused_adam.cu``, a multi-tensor kernel (one launch per table of up to 36
  tensors), built with ninja on first use and cached like the CPU op (see [Note: building on
  first use] in cpu_adam.py), never at import.
- ``"triton"``: the same contract in Triton (``triton_adam.py``); on the CPU only under
  ``TRITON_INTERPRET=1``, which is how the test suite checks it.
- ``"cpu"``: the one-pass C++ CPU Adam (``cpu_adam.py``), one call per tensor.
- ``"torch"``: torch's fused AdamW with the separate upcast/unscale and copy passes around it:
  the fallback, and the baseline of ``benchmarks/fused_adam.py``.
- ``"host"``: the CUDA kernel's own code run on the CPU, block by block and thread by thread
  (``csrc/fused_adam_host.cpp``, see [Note: the kernel on the host] there). Slow; it exists so
  the test suite checks the CUDA code without a GPU.

``"auto"`` takes ``"cuda"`` for CUDA tensors, else ``"triton"``, else ``"torch"`` with one
:class:`FusedAdamFallbackWarning` naming why; and ``"cpu"`` for CPU tensors. Every backend
equals ``ops/_reference.py`` bit for bit on the CPU (the tests); on a GPU,
``benchmarks/gpu_check.sh`` measures them against it and against ``torch.optim.AdamW``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from lightning_zero.ops._build import LazyExtension, check_toolchain, load_extension, source_path
from lightning_zero.ops._checks import check_tensor

__all__ = [
    "BACKENDS",
    "FusedAdamFallbackWarning",
    "backend_unavailable_reason",
    "cuda_adam_available",
    "multi_tensor_adam_step",
    "resolve_backend",
]

BACKENDS = ("auto", "cuda", "triton", "cpu", "torch", "host")
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)  # not a subclass that dispatches on its own
_CUDA_SOURCES = ("fused_adam.cu", "fused_adam.cuh", "multi_tensor_apply.cuh", "adam_constants.h")
_HOST_SOURCES = ("fused_adam_host.cpp", "fused_adam.cuh", "multi_tensor_apply.cuh", "adam_constants.h")
# --fmad=false: nvcc must not fuse multiplies and adds the source did not fuse (see [Note: the
# same bits on the host and on the device] in csrc/fused_adam.cuh); -O3 for the host side.
_NVCC_FLAGS = ["-O3", "--fmad=false", "-lineinfo"]
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedAdamFallbackWarning(UserWarning):
    """The fused CUDA Adam is not in use for device tensors; Triton's or torch's is."""


# ------------------------------------------------------------------------------ the extensions
def _cuda_arch_tag() -> str:
    """The architectures the library is built for, in its name, so a cache shared between
    machines never hands one a library built for another GPU."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if listed:
        return "sm" + "_".join(part.replace(".", "").replace("+PTX", "ptx") for part in listed.replace(";", " ").split())
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def _build_cuda() -> bool:
    if torch.version.cuda is None:
        raise RuntimeError(f"this torch ({torch.__version__}) is built without CUDA")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False)")
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("no CUDA toolkit found (nvcc): set CUDA_HOME or put nvcc on PATH")
    check_toolchain()
    # Every file is looked up, so a wheel without the headers fails here, naming the file.
    sources = [source_path(name) for name in _CUDA_SOURCES]
    load_extension(
        f"lightning_zero_fused_adam_cuda_{_cuda_arch_tag()}", sources[:1],
        extra_cflags=["-O3"], extra_cuda_cflags=_NVCC_FLAGS,
    )  # fmt: skip
    return True


def _build_host() -> bool:
    check_toolchain()
    sources = [source_path(name) for name in _HOST_SOURCES]
    load_extension("lightning_zero_fused_adam_host", sources[:1], extra_cflags=["-O2", "-ffp-contract=off"])
    return True


_CUDA_OP: LazyExtension[bool] = LazyExtension(
    _build_cuda, label="CUDA fused Adam", force_hook="lightning_zero.ops.fused_adam._force_fallback"
)
_HOST_OP: LazyExtension[bool] = LazyExtension(
    _build_host, label="host build of the CUDA fused Adam", force_hook="lightning_zero.ops.fused_adam._force_fallback"
)


def _force_fallback(enabled: bool = True) -> None:
    """Makes ``"auto"`` skip the CUDA kernel (for tests); resets the warn-once flag."""
    _CUDA_OP.force_fallback(enabled)


def cuda_adam_available() -> bool:
    """Whether the CUDA kernel is in use for CUDA tensors; builds it (or loads it from cache)."""
    return _CUDA_OP.value() is not None


# ------------------------------------------------------------------------------ the op
def _fused_adam_impl(
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    low_precision_outs: list[Tensor],
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    scale: float,
    backend: str,
) -> None:
    """One step over checked lists of one (grad dtype, out dtype); see :func:`multi_tensor_adam_step`."""
    hyper: dict[str, Any] = {
        "step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        "adamw_mode": adamw_mode,
    }  # fmt: skip
    lists = (grads, masters, exp_avgs, exp_avg_sqs, low_precision_outs)
    if backend in ("cuda", "host") and masters:
        _check_backend_can_run(backend, masters[0].device)  # builds the op for a direct call
    if backend == "cuda":
        device = masters[0].device
        with torch.cuda.device(device):
            torch.ops.lightning_zero._fused_adam_cuda(
                *lists, grad_scale, found_inf, step, lr, beta1, beta2, eps, weight_decay, adamw_mode, scale,
                torch.cuda.current_stream(device).cuda_stream,
            )  # fmt: skip
    elif backend == "host":
        torch.ops.lightning_zero._fused_adam_host(
            *lists, grad_scale, found_inf, step, lr, beta1, beta2, eps, weight_decay, adamw_mode, scale, 512, 0
        )
    elif backend == "triton":
        from lightning_zero.ops.triton_adam import triton_adam_

        triton_adam_(*lists, grad_scale, found_inf, scale=scale, **hyper)
    elif backend == "cpu":
        _cpu_adam(*lists, grad_scale, found_inf, scale=scale, **hyper)
    elif backend == "torch":
        _torch_adam(*lists, grad_scale, found_inf, scale=scale, **hyper)
    else:
        raise ValueError(f"fused_adam_: backend={backend!r} is not one of {BACKENDS[1:]}")


_fused_adam_op = torch.library.custom_op(
    "lightning_zero::fused_adam_", _fused_adam_impl,
    mutates_args=("masters", "exp_avgs", "exp_avg_sqs", "low_precision_outs"),
)


@_fused_adam_op.register_fake
def _fused_adam_fake(*args: Any) -> None:
    return None  # in-place only: no output to describe


def _skip_on_host(found_inf: Tensor | None) -> bool:
    """The CPU and torch backends read the flag on the host (a sync on GPU, for the fallback only)."""
    return found_inf is not None and bool(found_inf.item() != 0)


def _cpu_adam(
    grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    outs: list[Tensor], grad_scale: Tensor | None, found_inf: Tensor | None, *, scale: float, **hyper: Any,
) -> None:  # fmt: skip
    from lightning_zero.ops.cpu_adam import fused_adam_steps

    if _skip_on_host(found_inf):
        return
    factor = float(grad_scale.item()) if grad_scale is not None else scale
    fused_adam_steps(masters, grads, exp_avgs, exp_avg_sqs, outs if outs else [None] * len(masters),
                     grad_scale=factor, **hyper)  # fmt: skip


def _torch_adam(
    grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    outs: list[Tensor], grad_scale: Tensor | None, found_inf: Tensor | None, *, step: int, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool, scale: float,
) -> None:  # fmt: skip
    """torch's fused Adam(W) with the passes it lacks around it: the upcast x scale (into new fp32
    tensors: the caller's gradients are read only), and the low-precision copy."""
    if _skip_on_host(found_inf):
        return
    factor: Tensor | float = grad_scale if grad_scale is not None else scale
    if grads[0].dtype != torch.float32:
        scaled = [g.float() for g in grads]  # the upcast pass, into new tensors
        if isinstance(factor, Tensor) or factor != 1.0:
            torch._foreach_mul_(scaled, factor)  # type: ignore[arg-type]
    elif isinstance(factor, Tensor) or factor != 1.0:
        scaled = torch._foreach_mul(list(grads), factor)  # type: ignore[arg-type]
    else:
        scaled = list(grads)
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    steps = [torch.tensor(float(step), device=masters[0].device)] * len(masters)
    fused(
        masters, scaled, exp_avgs, exp_avg_sqs, [], steps, lr=float(lr), beta1=float(beta1), beta2=float(beta2),
        weight_decay=float(weight_decay), eps=float(eps), amsgrad=False, maximize=False,
    )  # fmt: skip
    if outs:
        torch._foreach_copy_(outs, masters)


# ------------------------------------------------------------------------------ the entry point
def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend ``backend`` means for tensors on ``device`` (building the CUDA op for "auto");
    warns once when "auto" falls back from the CUDA kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"multi_tensor_adam_step: backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if backend != "auto":
        return backend
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and _CUDA_OP.value() is not None:
        return "cuda"
    from lightning_zero.ops.triton_adam import triton_unavailable_reason

    triton_reason = triton_unavailable_reason(device)
    chosen = "triton" if triton_reason is None else "torch"
    what = "the Triton kernel" if chosen == "triton" else "torch's fused AdamW plus separate scale and copy passes"
    _CUDA_OP.warn_once(
        f"lightning_zero.ops: the fused CUDA Adam is unavailable for {device} tensors; using {what}"
        + ("" if triton_reason is None else f" (Triton: {triton_reason})")
        + ".",
        FusedAdamFallbackWarning,
        stacklevel=5,
    )
    return chosen


def _wrong_device(backend: str, device: torch.device) -> str | None:
    if backend == "cuda" and device.type != "cuda":
        return f"backend='cuda' needs CUDA tensors, got {device} tensors"
    if backend in ("host", "cpu") and device.type != "cpu":
        return f"backend={backend!r} runs on CPU tensors, got {device} tensors"
    return None


def _missing_here(backend: str, device: torch.device) -> str | None:
    """Why this machine cannot run ``backend`` (building the op if it needs one), or None."""
    if backend == "cuda" and _CUDA_OP.value() is None:
        return f"backend='cuda' is unavailable: {_CUDA_OP.unavailable_reason()}"
    if backend == "host" and _HOST_OP.value() is None:
        return f"backend='host' is unavailable: {_HOST_OP.unavailable_reason()}"
    if backend == "triton":
        from lightning_zero.ops.triton_adam import triton_unavailable_reason

        reason = triton_unavailable_reason(device)
        if reason is not None:
            return f"backend='triton' is unavailable: {reason}"
    return None


def backend_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot step tensors on ``device`` here (building the op if it needs one),
    or None when it can."""
    return _wrong_device(backend, device) or _missing_here(backend, device)


def _check_backend_can_run(backend: str, device: torch.device) -> None:
    wrong = _wrong_device(backend, device)
    if wrong is not None:
        raise ValueError(f"multi_tensor_adam_step: {wrong}")
    missing = _missing_here(backend, device)
    if missing is not None:
        raise RuntimeError(f"multi_tensor_adam_step: {missing}")


def _check_list(name: str, tensors: Sequence[Any], count: int | None) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"multi_tensor_adam_step: {name} must be a list of tensors, got {type(tensors).__name__}")
    if count is not None and len(tensors) != count:
        raise ValueError(f"multi_tensor_adam_step: {name} has {len(tensors)} tensors, masters has {count}")


def _check_tensor(
    name: str, tensor: Any, dtypes: tuple[torch.dtype, ...], device: torch.device, numel: int | None
) -> None:
    check_tensor("multi_tensor_adam_step", name, tensor, dtypes, numel, device)


def _check_scalar(name: str, tensor: Tensor | None, device: torch.device) -> None:
    if tensor is None:
        return
    if not isinstance(tensor, Tensor) or tensor.numel() != 1 or tensor.dtype != torch.float32:
        raise ValueError(f"multi_tensor_adam_step: {name} must be a one-element float32 tensor, got {tensor!r}")
    if tensor.device != device:
        raise ValueError(f"multi_tensor_adam_step: {name} is on {tensor.device}; the tensors are on {device}")


@torch.no_grad()
def multi_tensor_adam_step(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float | Tensor = 1.0,
    found_inf: Tensor | None = None,
    low_precision_outs: Sequence[Tensor | None] | None = None,
    backend: str = "auto",
) -> str:
    """One Adam(W) step over lists of flat fp32 shards on one device, in place; returns the backend
    that ran (see [Note: backends of the fused Adam op]).

    Args:
        masters, exp_avgs, exp_avg_sqs: fp32, contiguous; the weights and Adam's moments.
        grads: fp32, bf16 or fp16 (per tensor), as large as their masters; read only.
        step: the step number after the increment (1 on the first step), the same for every
            tensor of the call (bias correction).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw_mode: True: decoupled decay (AdamW); False: L2 added to the gradient (Adam).
        grad_scale: multiplies every gradient first (the combined unscale x clip factor): a
            float, or a one-element fp32 tensor on the tensors' device, read by the kernel.
        found_inf: a one-element fp32 tensor on the device; nonzero skips the step, every tensor
            left as it was, decided in the kernel (the fallbacks read it on the host).
        low_precision_outs: per master, a bf16/fp16 tensor that receives the updated master
            rounded to nearest even, or None for no copy.
        backend: ``"auto"`` or one of :data:`BACKENDS`.

    Raises:
        ValueError / TypeError: a list or tensor does not fit the contract (named in the message).
        RuntimeError: an explicitly requested backend cannot run here (and why).
    """
    count = len(masters)
    _check_list("masters", masters, None)
    for name, tensors in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        _check_list(name, tensors, count)
    outs: list[Tensor | None] = [None] * count if low_precision_outs is None else list(low_precision_outs)
    _check_list("low_precision_outs", outs, count)
    if int(step) != step or step < 1:
        raise ValueError(
            f"multi_tensor_adam_step: step={step!r}; it is the step number after the increment, an integer >= 1"
        )
    if backend not in BACKENDS:
        raise ValueError(f"multi_tensor_adam_step: backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if count == 0:
        return backend if backend != "auto" else "none"
    first = masters[0]
    if not isinstance(first, Tensor):
        raise TypeError(f"multi_tensor_adam_step: masters[0] must be a Tensor, got {type(first).__name__}")
    device = first.device
    for index in range(count):
        master = masters[index]
        _check_tensor(f"masters[{index}]", master, (torch.float32,), device, None)
        numel = master.numel()
        _check_tensor(f"grads[{index}]", grads[index], _GRAD_DTYPES, device, numel)
        _check_tensor(f"exp_avgs[{index}]", exp_avgs[index], (torch.float32,), device, numel)
        _check_tensor(f"exp_avg_sqs[{index}]", exp_avg_sqs[index], (torch.float32,), device, numel)
        if outs[index] is not None:
            _check_tensor(f"low_precision_outs[{index}]", outs[index], _LOW_PRECISION, device, numel)
    scale_tensor = grad_scale if isinstance(grad_scale, Tensor) else None
    _check_scalar("grad_scale", scale_tensor, device)
    _check_scalar("found_inf", found_inf, device)
    chosen = resolve_backend(backend, device)
    _check_backend_can_run(chosen, device)
    # The kernels are compiled per (grad dtype, out dtype): one call per combination present.
    groups: dict[tuple[torch.dtype, torch.dtype | None], list[int]] = {}
    for index in range(count):
        out = outs[index]
        groups.setdefault((grads[index].dtype, None if out is None else out.dtype), []).append(index)
    # [Note: eager calls skip the op's dispatch]
    # Through torch.ops the custom op's Python layers (autograd, ADInplaceOrView, redispatch) cost
    # about 0.4 ms a call on the CPU: more than the C++ kernel takes for a bucket of the demo GPT.
    # In plain eager mode (plain tensors, no torch.compile, no dispatch or function mode active:
    # FlopCounterMode, fake tensors, make_fx, memory trackers still see the op) the implementation
    # is called directly, and the version counters of what it wrote are bumped as the op's
    # ADInplaceOrView layer bumps them (autograd still sees the writes).
    direct = (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and all(type(t) in _PLAIN_TENSORS for ts in (masters, grads, exp_avgs, exp_avg_sqs) for t in ts)
        and all(t is None or type(t) in _PLAIN_TENSORS for t in outs)
    )
    for (_, out_dtype), members in groups.items():
        written = [masters[i] for i in members], [exp_avgs[i] for i in members], [exp_avg_sqs[i] for i in members]
        low = [outs[i] for i in members] if out_dtype is not None else []
        args = (
            [grads[i] for i in members], *written, low,
            scale_tensor, found_inf, int(step), float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), bool(adamw_mode), 1.0 if scale_tensor is not None else float(grad_scale), chosen,
        )  # fmt: skip
        if direct:
            _fused_adam_impl(*args)  # type: ignore[arg-type]
            for tensors in (*written, low):
                for tensor in tensors:
                    increment_version(tensor)  # type: ignore[arg-type]
        else:
            torch.ops.lightning_zero.fused_adam_(*args)
    return chosen
