"""The offloaded optimizer step on the CPU: lightning_zero's one-pass Adam against the alternatives.

    python benchmarks/cpu_adam.py                              # 50M and 100M, 1 and 2 threads, about 1 min
    python benchmarks/cpu_adam.py --sizes 20e6 --threads 1 --repeats 3 --skip-deepspeed

"The step" is everything between "the bf16 gradient shard is in CPU memory and the combined
unscale x clip coefficient is known" and "the updated fp32 master, moments and the bf16 copy for
the device are in CPU memory" (the coefficient's gradient norm is computed before it, the same
way for every contender, and is not timed). Contenders, all AdamW with weight decay:

- ours: ``lightning_zero.ops.fused_adam_step`` with a bf16 gradient, ``grad_scale`` and a bf16
  ``low_precision_out``: one pass, 28 bytes per element (grad 2, master/m/v 12 read + 12
  written, copy 2).
- (a) torch: what a user of torch alone runs: upcast the bf16 gradient into an fp32 buffer
  (``copy_``), multiply it by the coefficient (``mul_``; unscale and clip folded into one pass,
  the kindest version), ``torch.optim.AdamW(fused=True).step()`` and the bf16 copy (``copy_``):
  6 + 8 + 28 + 6 = 48 bytes per element in four passes.
- (b) deepspeed: ``DeepSpeedCPUAdam`` (JIT-built on first use) on an fp32 gradient, after
  DeepSpeed's own unscale-and-clip pass over it (``mul_``), plus its fp16 copy: 8 + 28 + 6 = 42
  bytes per element in three passes. DeepSpeed's ZeRO-Offload upcasts the gradient on the
  device before copying it to the CPU, so the upcast is not timed: the fp32 gradient is
  refilled from the bf16 one before each repeat, outside the timing (which also keeps repeated
  unscaling from drifting into denormals). The installed DeepSpeed has no fused fp16 copy (its
  old ``adam_update_copy`` is gone), so the copy is a separate ``copy_``, as its engine does.
- (c) the bound: the step's bytes divided by a measured bandwidth, two ways, each in this run:
  the STREAM triad ``a = b + s * c`` (fp32, counted as STREAM counts it: 12 bytes per element),
  and a probe with exactly the step's five streams and no Adam math (``cpu_adam_stream_probe``
  in csrc/cpu_adam.cpp). The triad's write-only stream pays a read-for-ownership STREAM does not
  count, so on most machines it reports less bandwidth than a read-modify-write pass gets; the
  goal is judged against the stricter (faster) of the two.

Each contender runs ``--repeats`` times per configuration, round-robin so drift hits all alike,
after one warm-up; the best time counts (STREAM's convention). Threads are set with
``torch.set_num_threads``, which every contender's OpenMP / ATen pool follows.
This is a measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from lightning_zero.ops import cpu_adam, fused_adam_step

BYTES_PER_ELEMENT = 28  # bf16 grad 2 + fp32 master/m/v read and written 24 + bf16 copy 2
TRIAD_BYTES_PER_ELEMENT = 12  # STREAM's count for a fp32 triad: read b, read c, write a
GOALS = {"vs torch": 1.5, "vs deepspeed": 1.2, "of bound": 0.85}
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.01
COEFFICIENT = 0.5  # combined unscale x clip; any value works, this one keeps the numbers tame


# ----------------------------------------------------------------------------- buffers
@dataclass
class Shard:
    """One rank's offloaded shard, [n] each. Every contender steps the same master and gradient
    buffers (torch and DeepSpeed keep their own moments); no contender's time depends on the
    values it finds there."""

    n: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad_bf16: torch.Tensor
    grad_fp32: torch.Tensor  # torch's and DeepSpeed's fp32 gradient buffer
    copy_bf16: torch.Tensor
    copy_fp16: torch.Tensor

    @classmethod
    def allocate(cls, n: int) -> Shard:
        generator = torch.Generator().manual_seed(0)
        master = torch.randn(n, generator=generator)
        grad = torch.randn(n, generator=generator)
        return cls(
            n=n, master=master, exp_avg=torch.zeros(n), exp_avg_sq=torch.full((n,), 1e-4),
            grad_bf16=grad.to(torch.bfloat16), grad_fp32=grad,
            copy_bf16=torch.zeros(n, dtype=torch.bfloat16),
            copy_fp16=torch.zeros(n, dtype=torch.float16),
        )  # fmt: skip


@dataclass
class Contender:
    name: str
    run: Callable[[], None]
    setup: Callable[[], None] = lambda: None  # untimed, before each repeat
    times: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.times)


# ----------------------------------------------------------------------------- contenders
def ours(shard: Shard) -> Contender:
    state = {"step": 0}

    def run() -> None:
        state["step"] += 1
        fused_adam_step(
            shard.master, shard.grad_bf16, shard.exp_avg, shard.exp_avg_sq, step=state["step"],
            lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WEIGHT_DECAY,
            grad_scale=COEFFICIENT, low_precision_out=shard.copy_bf16,
        )  # fmt: skip

    return Contender("ours", run)


def torch_baseline(shard: Shard) -> Contender:
    param = torch.nn.Parameter(shard.master, requires_grad=True)  # shares the master's storage
    param.grad = shard.grad_fp32
    optimizer = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    def run() -> None:
        shard.grad_fp32.copy_(shard.grad_bf16)  # upcast
        shard.grad_fp32.mul_(COEFFICIENT)  # unscale x clip, one pass for both
        optimizer.step()
        shard.copy_bf16.copy_(shard.master)  # the copy for the device

    return Contender("(a) torch", run)


def deepspeed_baseline(shard: Shard) -> tuple[Contender | None, str]:
    """DeepSpeedCPUAdam, or None and why not."""
    try:
        with _quiet():
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
            param = torch.nn.Parameter(shard.master, requires_grad=True)
            param.grad = shard.grad_fp32
            start = time.perf_counter()
            optimizer = DeepSpeedCPUAdam(
                [param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True
            )
            load_s = time.perf_counter() - start
    except ImportError as error:
        return None, f"deepspeed not installed ({error}); DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"
    except Exception as error:  # noqa: BLE001 - the JIT build of its CPU Adam op failed: say so
        cause = f" (caused by {type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
        return None, f"[red]DeepSpeedCPUAdam failed to build or load: {type(error).__name__}: {error}{cause}[/]"

    def setup() -> None:
        shard.grad_fp32.copy_(shard.grad_bf16)  # done on the device in ZeRO-Offload: untimed

    def run() -> None:
        shard.grad_fp32.mul_(COEFFICIENT)  # its unscale_and_clip_grads pass
        optimizer.step()
        shard.copy_fp16.copy_(shard.master)  # its fp16 copy, a separate pass

    note = f"deepspeed {deepspeed.__version__}, DeepSpeedCPUAdam built/loaded in {load_s:.1f} s"
    return Contender("(b) deepspeed", run, setup), note


def triad(shard: Shard) -> Contender:
    # a = b + s * c over three fp32 arrays of the shard's size (the moments and master are
    # reused as scratch; the step contenders do not care what values they start from).
    a, b, c = torch.empty(shard.n), shard.exp_avg_sq, shard.grad_fp32

    def run() -> None:
        torch.add(b, c, alpha=3.0, out=a)

    return Contender("triad", run)


def probe(shard: Shard) -> Contender | None:
    def run() -> None:
        cpu_adam._stream_probe(shard.master, shard.grad_bf16, shard.exp_avg, shard.exp_avg_sq, shard.copy_bf16)

    return Contender("probe", run) if cpu_adam.cpu_adam_available() else None


@contextlib.contextmanager
def _quiet():
    """DeepSpeed prints its accelerator and build chatter on import; keep the table readable."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


# ----------------------------------------------------------------------------- measurement
def measure(contenders: list[Contender], repeats: int) -> None:
    for contender in contenders:  # warm-up: page faults, lazy state, caches
        contender.setup()
        contender.run()
    for _ in range(repeats):
        for contender in contenders:
            contender.setup()
            start = time.perf_counter()
            contender.run()
            contender.times.append(time.perf_counter() - start)


@dataclass
class Row:
    n: int
    threads: int
    ours: float
    torch: float
    deepspeed: float | None
    triad_bound: float
    probe_bound: float | None

    @property
    def strict_bound(self) -> float:
        """The shorter of the two bound times: the one from the higher measured bandwidth."""
        return min(self.triad_bound, self.probe_bound or self.triad_bound)


def run_config(shard: Shard, threads: int, repeats: int, with_deepspeed: bool) -> tuple[Row, str]:
    torch.set_num_threads(threads)
    ds, ds_note = deepspeed_baseline(shard) if with_deepspeed else (None, "skipped (--skip-deepspeed)")
    step_contenders = [ours(shard), torch_baseline(shard)] + ([ds] if ds else [])
    bound_contenders = [triad(shard)] + [c for c in [probe(shard)] if c]
    measure(step_contenders, repeats)
    measure(bound_contenders, repeats)
    by_name = {c.name: c.best for c in step_contenders + bound_contenders}
    triad_bandwidth = TRIAD_BYTES_PER_ELEMENT * shard.n / by_name["triad"]
    row = Row(
        n=shard.n, threads=threads, ours=by_name["ours"], torch=by_name["(a) torch"],
        deepspeed=by_name.get("(b) deepspeed"),
        triad_bound=BYTES_PER_ELEMENT * shard.n / triad_bandwidth,
        probe_bound=by_name.get("probe"),
    )  # fmt: skip
    return row, ds_note


# ----------------------------------------------------------------------------- report
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _gbs(n: int, seconds: float | None) -> str:
    return "-" if seconds is None else f"{BYTES_PER_ELEMENT * n / seconds / 1e9:.1f}"


def _ratio(value: float | None, goal: float, percent: bool = False) -> str:
    if value is None:
        return "-"
    text = f"{value:.0%}" if percent else f"{value:.2f}x"
    return f"[green]{text}[/]" if value >= goal else f"[red]{text}[/]"


def report(console: Console, rows: list[Row], notes: list[str]) -> None:
    table = Table(title="Offloaded AdamW step on the CPU: ms, best of repeats (GB/s = 28 B/element / time)")
    for column in ("params", "threads", "ours ms", "ours GB/s", "(a) torch ms", "(b) deepspeed ms",
                   "(c) triad ms", "(c) probe ms", "(a) / ours", "(b) / ours", "(c) / ours"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row.n / 1e6:.0f}M", str(row.threads), _ms(row.ours), _gbs(row.n, row.ours),
            _ms(row.torch), _ms(row.deepspeed), _ms(row.triad_bound), _ms(row.probe_bound),
            _ratio(row.torch / row.ours, GOALS["vs torch"]),
            _ratio(None if row.deepspeed is None else row.deepspeed / row.ours, GOALS["vs deepspeed"]),
            _ratio(row.strict_bound / row.ours, GOALS["of bound"], percent=True),
        )  # fmt: skip
    console.print(table)

    goals = Table(title="Goals (worst configuration counts)")
    for column in ("goal", "target", "worst", "met"):
        goals.add_column(column, justify="right")
    worst_torch = min(r.torch / r.ours for r in rows)
    ds_ratios = [r.deepspeed / r.ours for r in rows if r.deepspeed is not None]
    worst_bound = min(r.strict_bound / r.ours for r in rows)
    worst_triad = min(r.triad_bound / r.ours for r in rows)
    entries = [
        ("faster than (a) torch", f">= {GOALS['vs torch']}x", worst_torch, GOALS["vs torch"], False),
        ("faster than (b) deepspeed", f">= {GOALS['vs deepspeed']}x",
         min(ds_ratios) if ds_ratios else None, GOALS["vs deepspeed"], False),
        ("of (c) bound, stricter of triad/probe", f">= {GOALS['of bound']:.0%}", worst_bound,
         GOALS["of bound"], True),
        ("of (c) bound, triad only", f">= {GOALS['of bound']:.0%}", worst_triad, GOALS["of bound"], True),
    ]  # fmt: skip
    for name, target, value, goal, percent in entries:
        met = "-" if value is None else ("[green]yes[/]" if value >= goal else "[red]no[/]")
        goals.add_row(name, target, _ratio(value, goal, percent), met)
    console.print(goals)
    for note in notes:
        console.print(f"- {note}")


def describe_machine() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} logical CPUs, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[50e6, 100e6], help="elements per shard")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=10, help="best of this many, per contender")
    parser.add_argument("--skip-deepspeed", action="store_true")
    args = parser.parse_args()

    console = Console(width=None if Console().is_terminal else 150)
    start = time.perf_counter()
    available = cpu_adam.cpu_adam_available()
    notes = [describe_machine()]
    if available:
        notes.append(
            f"lightning_zero C++ op: {cpu_adam._kernel_isa()} lanes, built or loaded from cache in "
            f"{cpu_adam._OP.build_seconds:.2f} s"
        )
    else:
        reason = cpu_adam._OP.unavailable_reason()
        notes.append(f"[red]lightning_zero C++ op unavailable, 'ours' is the fallback: {reason}[/]")

    rows: list[Row] = []
    for size in args.sizes:
        shard = Shard.allocate(int(size))
        for threads in args.threads:
            row, ds_note = run_config(shard, threads, args.repeats, not args.skip_deepspeed)
            rows.append(row)
            if threads == args.threads[0] and size == args.sizes[0]:
                notes.append(ds_note)
            console.print(f"  measured {row.n / 1e6:.0f}M params x {threads} thread(s)")
        del shard
    notes.append(f"total {time.perf_counter() - start:.0f} s")
    report(console, rows, notes)


if __name__ == "__main__":
    main()
