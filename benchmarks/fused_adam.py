"""The device optimizer step: the fused multi-tensor Adam against torch's fused AdamW with the
separate passes, and against a plain copy of the same bytes.

    python benchmarks/fused_adam.py                       # CUDA when present, else the CPU
    python benchmarks/fused_adam.py --numel 16e6 --tensors 64 --repeats 10 --device cpu

"The step" starts when the bf16 gradient shards are on the device and the combined unscale x
clip coefficient is known (the gradient norm is computed before it, the same way for every
contender, and is not timed), and ends when the fp32 masters, the moments and the bf16 copies
the all-gather sends are updated. The shard is ``--tensors`` tensors of mixed sizes (a few large
matrices, many small vectors, as one rank's pieces of a transformer are). Contenders:

- ours (``cuda`` / ``triton`` on a GPU, ``cpu`` on the CPU): ``ops.multi_tensor_adam_step``
  with a bf16 gradient, a device-tensor scale and bf16 copies: one pass, 28 bytes per element
  (grad 2, master/m/v 12 read + 12 written, copy 2).
- torch, separate passes: what a user of torch alone runs: the upcast of the bf16 gradient into
  fp32 buffers, the unscale pass, the clip pass (each ``_foreach_mul_``),
  ``torch.optim.AdamW(fused=True).step()`` and the cast-and-copy to bf16: 6 + 8 + 8 + 28 + 6 = 56
  bytes per element in five passes.
- torch, one scale pass: the same with unscale and clip folded into one multiply (the kindest
  version; our own fallback): 48 bytes per element.
- copy: a device-to-device copy of 14 bytes per element, which moves the step's 28 bytes: the
  bandwidth bound.

Each contender runs ``--repeats`` times, round-robin after one warm-up; the median counts. GB/s
is the step's 28 bytes per element over the time, for every contender, so the ratios compare
times. This is a measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from lightning_zero.ops import fused_adam

BYTES_PER_ELEMENT = 28
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.01
LOSS_SCALE, CLIP = 1024.0, 0.5
GOALS = {"vs torch passes": 1.3, "of copy": 0.8}


def shard_sizes(numel: int, tensors: int) -> list[int]:
    """``tensors`` sizes summing to about ``numel``: a quarter of them large (95% of the
    elements), the rest small vectors of a few thousand elements."""
    large = max(1, tensors // 4)
    small = tensors - large
    small_size = 4096 + 17
    each = max(1, (numel - small * small_size) // large)
    return [each + 3 * i for i in range(large)] + [small_size + i for i in range(small)]


@dataclass
class Shard:
    masters: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    outs: list[torch.Tensor]
    fp32_grads: list[torch.Tensor]  # the torch contenders' upcast buffers, allocated once

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.masters)


def make_shard(sizes: list[int], device: torch.device) -> Shard:
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(n: int, scale: float) -> torch.Tensor:
        return (torch.randn(n, generator=generator) * scale).to(device)

    return Shard(
        masters=[randn(n, 1.0) for n in sizes],
        grads=[randn(n, 1e-3 * LOSS_SCALE).to(torch.bfloat16) for n in sizes],
        exp_avgs=[torch.zeros(n, device=device) for n in sizes],
        exp_avg_sqs=[torch.zeros(n, device=device) for n in sizes],
        outs=[torch.empty(n, dtype=torch.bfloat16, device=device) for n in sizes],
        fp32_grads=[torch.empty(n, device=device) for n in sizes],
    )


def ours(shard: Shard, backend: str) -> Callable[[int], None]:
    scale = torch.tensor([CLIP / LOSS_SCALE], device=shard.masters[0].device)

    def run(step: int) -> None:
        fused_adam.multi_tensor_adam_step(
            shard.masters, shard.grads, shard.exp_avgs, shard.exp_avg_sqs, step=step, lr=LR, beta1=BETA1,
            beta2=BETA2, eps=EPS, weight_decay=WEIGHT_DECAY, grad_scale=scale, low_precision_outs=shard.outs,
            backend=backend,
        )  # fmt: skip

    return run


def torch_passes(shard: Shard, fold_scales: bool) -> Callable[[int], None]:
    params = [torch.nn.Parameter(m) for m in shard.masters]
    for param, grad in zip(params, shard.fp32_grads):
        param.grad = grad
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    device = shard.masters[0].device
    inverse_scale = torch.tensor(1.0 / LOSS_SCALE, device=device)
    clip = torch.tensor(CLIP, device=device)
    combined = torch.tensor(CLIP / LOSS_SCALE, device=device)

    def run(step: int) -> None:
        torch._foreach_copy_(shard.fp32_grads, shard.grads)  # the upcast
        if fold_scales:
            torch._foreach_mul_(shard.fp32_grads, combined)
        else:
            torch._foreach_mul_(shard.fp32_grads, inverse_scale)  # the unscale
            torch._foreach_mul_(shard.fp32_grads, clip)  # the clip
        optimizer.step()
        torch._foreach_copy_(shard.outs, [p.detach() for p in params])  # the cast-and-copy

    return run


def device_copy(numel: int, device: torch.device) -> Callable[[int], None]:
    source = torch.empty(numel * BYTES_PER_ELEMENT // 2, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)

    def run(step: int) -> None:
        target.copy_(source)

    return run


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(contenders: dict[str, Callable[[int], None]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds per call of each contender, run round-robin after a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for name, run in contenders.items():
        run(1)
    _synchronize(device)
    for repeat in range(repeats):
        for name, run in contenders.items():
            _synchronize(device)
            start = time.perf_counter()
            run(repeat + 2)
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def run_benchmark(device: torch.device, numel: int, tensors: int, repeats: int) -> list[dict[str, object]]:
    """One row per contender: name, ms, GB/s, fraction of the copy's bandwidth, speedup vs torch's passes."""
    sizes = shard_sizes(numel, tensors)
    contenders: dict[str, Callable[[int], None]] = {}
    notes: dict[str, str] = {}
    backends = ["cuda", "triton"] if device.type == "cuda" else ["cpu"]
    for backend in backends:
        reason = fused_adam.backend_unavailable_reason(backend, device)
        if reason is not None:
            notes[f"ours ({backend})"] = reason
            continue
        contenders[f"ours ({backend})"] = ours(make_shard(sizes, device), backend)
    contenders["torch, separate passes"] = torch_passes(make_shard(sizes, device), fold_scales=False)
    contenders["torch, one scale pass"] = torch_passes(make_shard(sizes, device), fold_scales=True)
    contenders["copy of the same bytes"] = device_copy(sum(sizes), device)
    seconds = measure(contenders, device, repeats)
    total = sum(sizes)
    copy_rate = BYTES_PER_ELEMENT * total / seconds["copy of the same bytes"]
    baseline = seconds["torch, separate passes"]
    rows: list[dict[str, object]] = []
    for name, value in seconds.items():
        rate = BYTES_PER_ELEMENT * total / value
        rows.append({"contender": name, "ms": value * 1e3, "GB/s": rate / 1e9, "of copy": rate / copy_rate,
                     "vs torch passes": baseline / value})  # fmt: skip
    for name, note in notes.items():
        rows.append({"contender": name, "ms": None, "GB/s": None, "of copy": None, "vs torch passes": None, "note": note})
    return rows


def print_rows(rows: list[dict[str, object]], title: str, console: Console | None = None) -> None:
    table = Table(title=title)
    for column in ("contender", "ms", "GB/s", "of copy", "vs torch passes"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for row in rows:
        if row["ms"] is None:
            table.add_row(str(row["contender"]), "-", "-", "-", f"unavailable: {row.get('note', '')}"[:60])
            continue
        table.add_row(str(row["contender"]), f"{row['ms']:.3f}", f"{row['GB/s']:.1f}", f"{row['of copy']:.0%}",
                      f"{row['vs torch passes']:.2f}x")  # fmt: skip
    (console or Console()).print(table)
    goals = ", ".join(f"{key} >= {value}" for key, value in GOALS.items())
    (console or Console()).print(f"Goals for ours: {goals}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=float, default=None, help="elements in the shard (64e6 on CUDA, 8e6 on CPU)")
    parser.add_argument("--tensors", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per contender (20 on CUDA, 5 on CPU)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    numel = int(args.numel or (64e6 if device.type == "cuda" else 8e6))
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    rows = run_benchmark(device, numel, args.tensors, repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print_rows(rows, f"Adam step over {numel / 1e6:.0f}M elements in {args.tensors} tensors on {name} "
                     f"(bf16 grads and copies, fp32 masters; {BYTES_PER_ELEMENT} B/element)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
