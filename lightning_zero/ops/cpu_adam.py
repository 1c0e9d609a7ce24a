"""One-pass Adam(W) on the CPU: :func:`fused_adam_step` over a flat shard, and :class:`CPUAdam`.

The kernel is ``csrc/cpu_adam.cpp``. In one pass over memory it reads the gradient (fp32, bf16
or fp16) and multiplies it by ``grad_scale`` (the engine's combined unscale x clip
coefficient), updates ``exp_avg``, ``exp_avg_sq`` and the fp32 master, and writes the bf16 or
fp16 copy the device will receive: 28 bytes per element with a bf16 gradient and a bf16 copy,
where torch's fused AdamW plus the separate upcast, unscale and copy passes move 48.

[Note: building on first use]
Importing this module builds nothing and loads nothing. The first :func:`fused_adam_step`,
:class:`CPUAdam` step or :func:`cpu_adam_available` call compiles the source with
``torch.utils.cpp_extension.load`` (ninja, about 10 s on two cores) into torch's extensions
cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``), or into
``$LIGHTNING_ZERO_BUILD_DIR`` when that is set; later processes load the cached library in
milliseconds. One process at a time builds or loads it per build directory, so ranks that start
together build once, and a build killed half-way does not stall the next one (see [Note: the
build lock] in _build.py). The flags are picked per instruction set that torch detects on this CPU (AVX-512,
AVX2 or none) rather than ``-march=native``, and the ISA is part of the extension's name, so a
cache shared between different machines never hands one a library it cannot run.

[Note: the fallback]
Where the op cannot be built (no C++ compiler, no ninja, no source, a compile error) or is
disabled, the same call runs torch's fused CPU AdamW (``torch._fused_adamw_`` /
``torch._fused_adam_``) with the separate passes around it, and warns once with the reason
and the fix (:class:`CPUAdamFallbackWarning`). Same numbers to about 1e-7 relative, more
memory traffic. To force it: ``LIGHTNING_ZERO_DISABLE_CPP_OPS=1`` in the environment, or
``lightning_zero.ops.cpu_adam._force_fallback(True)`` in a test.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero.ops import _build
from lightning_zero.ops._build import LazyExtension, check_toolchain, load_extension, source_path
from lightning_zero.ops._checks import check_tensor

__all__ = ["CPUAdam", "CPUAdamFallbackWarning", "cpu_adam_available", "fused_adam_step"]

DISABLE_ENV = _build.DISABLE_ENV  # named here too, where the notes above document them
BUILD_DIR_ENV = _build.BUILD_DIR_ENV
EXTENSION_NAME = "lightning_zero_cpu_adam"
_SOURCE = "cpu_adam.cpp"
_HEADER = "adam_constants.h"  # shared with the CUDA kernel

# Codes of the lane widths compiled into csrc/cpu_adam.cpp (kIsa* there).
_ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
_ISA_NAMES = {code: name for name, code in _ISA_CODES.items()}
# Per-ISA flags instead of -march=native: the library must run on any CPU that torch says has
# this ISA, not only on the one that built it (see [Note: building on first use]).
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
# -O3 without -ffast-math: sqrt and division stay IEEE. -ffp-contract=off: the kernel says
# where it wants an fma, the compiler must not add others (see [Note: one math, three widths]).
_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUAdamFallbackWarning(UserWarning):
    """The one-pass C++ Adam is not in use; torch's fused AdamW and separate passes are."""


# ------------------------------------------------------------------------------ the extension
def _target_isa() -> str:
    """The widest lane type worth compiling for here, from torch's own CPU detection.

    torch checks the OS saves the wide registers and honours ``ATEN_CPU_CAPABILITY``, so
    ``ATEN_CPU_CAPABILITY=avx2`` also builds (and names) an AVX2 library.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "scalar"  # -O3 still vectorises the scalar lane for NEON / SVE
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return "avx512"
    if capability == "AVX2":
        return "avx2"
    return "scalar"


def _build_and_load() -> int:
    """Compile (or find in the cache) and load the library; returns its compiled ISA code."""
    source = source_path(_SOURCE)
    source_path(_HEADER)  # a copy without the header fails here, naming it
    check_toolchain()
    isa = _target_isa()
    load_extension(
        f"{EXTENSION_NAME}_{isa}", [source],
        extra_cflags=[*_CFLAGS, *_ISA_FLAGS[isa]], extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    return int(torch.ops.lightning_zero.cpu_adam_isa())


_OP: LazyExtension[int] = LazyExtension(
    _build_and_load, label="C++ op", force_hook="lightning_zero.ops.cpu_adam._force_fallback"
)
_FALLBACK_MESSAGE = (
    "lightning_zero.ops: one-pass C++ Adam unavailable, using torch's fused CPU AdamW plus separate "
    "upcast, unscale and low-precision copy passes (same numbers, more memory traffic)."
)


def _force_fallback(enabled: bool = True) -> None:
    """Route every call through the fallback (for tests); resets the warn-once flag."""
    _OP.force_fallback(enabled)


def cpu_adam_available() -> bool:
    """Whether the one-pass C++ op is in use; builds it (or loads it from cache) on first call."""
    return _OP.value() is not None


def _kernel_isa() -> str | None:
    """``"avx512"``, ``"avx2"`` or ``"scalar"``: the widest lanes compiled in; None if not in use."""
    code = _OP.value()
    return None if code is None else _ISA_NAMES[code]


# ------------------------------------------------------------------------------ the step
def _check_tensor(name: str, tensor: Tensor, dtypes: tuple[torch.dtype, ...], numel: int | None) -> None:
    check_tensor("fused_adam_step", name, tensor, dtypes, numel, "cpu")


def _check_step_args(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    low_precision_out: Tensor | None,
    step: int,
) -> None:
    _check_tensor("master", master, (torch.float32,), None)
    numel = master.numel()
    _check_tensor("grad", grad, _GRAD_DTYPES, numel)
    _check_tensor("exp_avg", exp_avg, (torch.float32,), numel)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), numel)
    if low_precision_out is not None:
        _check_tensor("low_precision_out", low_precision_out, _LOW_PRECISION, numel)
    if int(step) != step or step < 1:
        raise ValueError(
            f"fused_adam_step: step={step!r}; it is the step number after the increment, "
            "an integer >= 1 (1 on the first step)"
        )


class _Fp32Scratch(threading.local):
    """Per calling thread, the fp32 buffer the fallback upcasts gradients into. Allocating it
    every step would cost more than the step's passes (fresh pages fault on first touch); it
    keeps the size of the largest gradient seen, which is what a torch user's fp32 gradient
    buffer costs too."""

    buffer: Tensor | None = None

    def get(self, numel: int) -> Tensor:
        if self.buffer is None or self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.float32)
        return self.buffer[:numel]


_SCRATCH = _Fp32Scratch()


def _cpp_adam_step(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    grad_scale: float,
    low_precision_out: Tensor | None,
    isa: str,
) -> None:
    """The C++ op with a chosen lane width (tests check every compiled one); no validation."""
    torch.ops.lightning_zero.cpu_adam_step(
        master, grad, exp_avg, exp_avg_sq, low_precision_out,
        int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        bool(adamw_mode), float(grad_scale), _ISA_CODES[isa],
    )  # fmt: skip


def _fallback_adam_step(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    grad_scale: float,
    low_precision_out: Tensor | None,
) -> None:
    """torch's fused CPU Adam(W) with the upcast, unscale and copy as separate passes."""
    # torch's kernel wants the param's dtype for the gradient, and its own grad_scale divides
    # and writes the result back into the gradient: scale an fp32 copy ourselves instead, so
    # the caller's gradient is never modified.
    g = grad
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        g = _SCRATCH.get(grad.numel())  # [n], like grad
        if grad.dtype == torch.float32:
            torch.mul(grad, grad_scale, out=g)
        else:
            g.copy_(grad)
            if grad_scale != 1.0:
                g.mul_(grad_scale)
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    fused(
        [master], [g], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))],
        lr=float(lr), beta1=float(beta1), beta2=float(beta2), weight_decay=float(weight_decay),
        eps=float(eps), amsgrad=False, maximize=False,
    )  # fmt: skip
    if low_precision_out is not None:
        low_precision_out.copy_(master)


@torch.no_grad()
def fused_adam_step(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float | Tensor = 1.0,
    low_precision_out: Tensor | None = None,
) -> None:
    """One Adam(W) step over a flat fp32 shard, in one pass over memory; all updates in place.

    Args:
        master: fp32, contiguous, CPU ``[n]``; the weights, updated in place.
        grad: ``[n]``, fp32, bf16 or fp16, contiguous, CPU; read only.
        exp_avg, exp_avg_sq: fp32 ``[n]``; Adam's moments, updated in place.
        step: the step number after the increment, 1 on the first step (bias correction).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw_mode: True: decoupled decay ``master *= 1 - lr * weight_decay`` (AdamW);
            False: ``weight_decay * master`` is added to the gradient (Adam's L2).
        grad_scale: multiplies the gradient before anything else: the combined loss-unscale x
            clip coefficient, so neither needs its own pass. A float or a 0-dim tensor.
        low_precision_out: bf16 or fp16 ``[n]``; receives the updated master rounded to
            nearest even (bit-equal to ``master.to(low_precision_out.dtype)``).

    Semantics are ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` with
    ``weight_decay`` (``adamw_mode=False``); ground truth is
    :func:`lightning_zero.ops._reference.reference_adam_step`. Runs the C++ op, built on the
    first call, or the warned-once fallback (see the module's notes).

    Raises:
        ValueError: a tensor has the wrong device, dtype, layout or size, or ``step < 1``.
        TypeError: a tensor argument is not a Tensor.
    """
    _check_step_args(master, grad, exp_avg, exp_avg_sq, low_precision_out, step)
    hyper: dict[str, Any] = {
        "step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
        "weight_decay": weight_decay, "adamw_mode": adamw_mode,
        "grad_scale": float(grad_scale),  # a 0-dim tensor is read once here
        "low_precision_out": low_precision_out,
    }  # fmt: skip
    isa = _OP.value()
    if isa is not None:
        _cpp_adam_step(master, grad, exp_avg, exp_avg_sq, isa=_ISA_NAMES[isa], **hyper)
    else:
        _OP.warn_once(_FALLBACK_MESSAGE, CPUAdamFallbackWarning)
        _fallback_adam_step(master, grad, exp_avg, exp_avg_sq, **hyper)


def fused_adam_steps(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    outs: Sequence[Tensor | None],
    **hyper: Any,
) -> None:
    """:func:`fused_adam_step` (its keywords in ``hyper``, ``grad_scale`` a float) over lists the
    caller has checked (``multi_tensor_adam_step`` does) or built (the engine's flat fp32 CPU chunks,
    ``offload.step.cpu_adam_steps``), empty tensors skipped. The C++ op checks
    devices, dtypes and sizes itself; the Python checks per tensor are what this leaves out (a
    third of the step's host time for a bucket of small pieces). Without the op, the checked
    fallback of :func:`fused_adam_step`."""
    code = _OP.value()
    for master, grad, exp_avg, exp_avg_sq, out in zip(masters, grads, exp_avgs, exp_avg_sqs, outs):
        if not master.numel():
            continue
        if code is None:
            fused_adam_step(master, grad, exp_avg, exp_avg_sq, low_precision_out=out, **hyper)
        else:
            _cpp_adam_step(master, grad, exp_avg, exp_avg_sq, low_precision_out=out, isa=_ISA_NAMES[code], **hyper)


def _stream_probe(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, out: Tensor) -> bool:
    """The step's memory traffic with no Adam math (benchmark bound); False without the op."""
    if _OP.value() is None:
        return False
    torch.ops.lightning_zero.cpu_adam_stream_probe(master, grad, exp_avg, exp_avg_sq, out)
    return True


# ------------------------------------------------------------------------------ the optimizer
def _check_hyperparameters(where: str, group: dict[str, Any]) -> None:
    lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not float(lr) >= 0.0:
        raise ValueError(f"{where}: lr={lr!r}; it must be >= 0")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"{where}: betas={betas!r}; it must be two floats in [0, 1)")
    if not float(eps) >= 0.0:
        raise ValueError(f"{where}: eps={eps!r}; it must be >= 0")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"{where}: weight_decay={weight_decay!r}; it must be >= 0")
    # Keys a torch.optim.Adam/AdamW state dict may bring along; CPUAdam has none of them.
    for unsupported in ("amsgrad", "maximize"):
        if group.get(unsupported, False):
            raise ValueError(f"{where}: {unsupported}=True is not supported by CPUAdam; use torch.optim.AdamW")


def _check_params(where: str, params: Iterable[Tensor]) -> None:
    for index, param in enumerate(params):
        if param.device.type != "cpu" or param.dtype != torch.float32:
            raise ValueError(
                f"{where}: parameter {index} is {param.dtype} on {param.device}; CPUAdam updates "
                "fp32 CPU tensors in place. For bf16/fp16 weights keep an fp32 master copy and "
                "call lightning_zero.ops.fused_adam_step(master, grad, ..., "
                "low_precision_out=weights)"
            )


def _flat(tensor: Tensor) -> Tensor:
    return tensor.view(-1)  # [numel]; callers ensure contiguity


def _step_param(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, **hyper: Any) -> None:
    """One parameter of any shape: a flat view when it is contiguous, else a round trip."""
    targets = (param, exp_avg, exp_avg_sq)
    grad = grad.contiguous()
    if all(t.is_contiguous() for t in targets):
        fused_adam_step(*(_flat(t) for t in (param, grad, exp_avg, exp_avg_sq)), **hyper)
        return
    # Rare (a transposed parameter, say): step contiguous copies, then write them back.
    copies = [t.contiguous() for t in targets]
    fused_adam_step(_flat(copies[0]), _flat(grad), _flat(copies[1]), _flat(copies[2]), **hyper)
    for target, copy in zip(targets, copies):
        if copy is not target:
            target.copy_(copy)


class CPUAdam(torch.optim.Optimizer):
    """Adam(W) for fp32 CPU parameters, one pass over memory per parameter (the C++ op).

    ``CPUAdam(params, lr, betas, eps, weight_decay, adamw_mode=True)`` equals
    ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)``; ``adamw_mode=False`` equals
    ``torch.optim.Adam(params, lr, betas, eps, weight_decay)`` (L2 added to the gradient).

    Parameters must be fp32 on the CPU, of any shape; gradients may be fp32, bf16 or fp16.
    (Low-precision weights: keep an fp32 master and call :func:`fused_adam_step` with
    ``low_precision_out``, which is what lightning_zero's offload engine does.)

    State is torch's: per parameter ``step`` (a float32 scalar tensor), ``exp_avg`` and
    ``exp_avg_sq``; each param group stores ``adamw_mode`` under torch's key
    ``decoupled_weight_decay``. So a ``CPUAdam.state_dict()`` loads into ``torch.optim.AdamW``
    (or ``Adam``) and a torch state dict loads into ``CPUAdam``, each way continuing the same
    run; a torch state dict with ``amsgrad`` or ``maximize`` set is refused with a ValueError.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw_mode: bool = True,
    ) -> None:
        defaults = {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "decoupled_weight_decay": adamw_mode,
        }  # fmt: skip
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"CPUAdam param group {len(self.param_groups) - 1}"
        _check_hyperparameters(where, group)
        _check_params(where, group["params"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Checked before loading, so a refused state dict leaves this optimizer as it was.
        for index, group in enumerate(state_dict["param_groups"]):
            _check_hyperparameters(f"CPUAdam.load_state_dict param group {index}", group)
        # Loading replaces each group with the saved one; a state dict from a torch that
        # predates decoupled_weight_decay keeps this optimizer's mode rather than guessing.
        modes = [group["decoupled_weight_decay"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mode in zip(self.param_groups, modes):
            group.setdefault("decoupled_weight_decay", mode)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = {
                "lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                "adamw_mode": bool(group["decoupled_weight_decay"]),
            }  # fmt: skip
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("CPUAdam does not support sparse gradients")
                state = self.state[param]
                if not state:
                    self._init_state(state, param)
                state["step"] += 1
                _step_param(
                    param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                    step=int(state["step"].item()), **hyper,
                )  # fmt: skip
        return loss

    @staticmethod
    def _init_state(state: dict[str, Any], param: Tensor) -> None:
        # Exactly torch.optim.AdamW's keys, dtypes and layout, for state-dict compatibility.
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
