"""Everything that needs a GPU, in one run that prints one table (benchmarks/gpu_check.sh runs it).

    bash benchmarks/gpu_check.sh [--out DIR]     # under 8 minutes on one GPU

1. builds the CUDA fused Adam (ninja, cached afterwards) and reports how long it took;
2. parity: the CUDA and Triton kernels against the CPU-run reference (ops/_reference.py), bit for
   bit, with fp32, bf16 and fp16 gradients and copies, a device-tensor scale, a set found_inf
   flag (nothing written) and an inf in a gradient; and the CUDA kernel against
   ``torch.optim.AdamW(fused=True)`` over 20 steps (relative error);
3. bandwidth: benchmarks/fused_adam.py on a 64M-element shard (GB/s, share of a device copy of
   the same bytes, speedup over torch's fused AdamW with separate passes);
4. ``pytest tests/gpu`` (every stage at world size 1 on CUDA, offload, the autotuner; the 2-GPU
   NCCL parity tests skip on one GPU);
5. the demo GPT for 20 steps with zero3_offload (pinned copies, the C++ CPU Adam) and with zero3
   (the fused CUDA Adam in the engine).

Each part is guarded: one that fails is reported with its error and the rest still run. With
``--out DIR`` the table also goes to DIR/gpu_check.json and DIR/gpu_check.txt.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The package, this directory (fused_adam.py's benchmark) and the checks tests/gpu asserts.
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "benchmarks"), str(REPO_ROOT / "tests" / "gpu")]

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ROWS: list[dict[str, str]] = []


def record(check: str, ok: bool | None | str, figures: str) -> None:
    """``ok``: True / False for a check, None for one that could not run, or a label ("info")."""
    result = ok if isinstance(ok, str) else {True: "ok", False: "FAILED", None: "skipped"}[ok]
    ROWS.append({"check": check, "result": result, "figures": figures})
    print(f"[{ROWS[-1]['result']}] {check}: {figures}", flush=True)


def guarded(check: str, part: Callable[[], None]) -> None:
    try:
        part()
    except Exception as error:  # noqa: BLE001 - a failed part is reported, the others still run
        record(check, False, f"{type(error).__name__}: {error}"[:300])
        traceback.print_exc()


# ------------------------------------------------------------------------------ parts
def environment() -> None:
    triton = "absent"
    try:
        import triton as triton_module

        triton = triton_module.__version__
    except Exception:  # noqa: BLE001
        pass
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton}"
    if not torch.cuda.is_available():
        record("environment", None, f"no CUDA device: the GPU checks do not run; {versions}")
        return
    record("environment", True, f"{torch.cuda.get_device_name()}; {versions}")


def build() -> None:
    from lightning_zero.ops import fused_adam

    start = time.perf_counter()
    available = fused_adam.cuda_adam_available()
    seconds = time.perf_counter() - start
    detail = "" if available else f": {fused_adam._CUDA_OP.unavailable_reason()}"
    record("build the CUDA op (ninja; cached after the first run)", available, f"{seconds:.1f} s{detail}")


def parity(backend: str, device: torch.device) -> None:
    from fused_adam_checks import DTYPES, differing_from_reference

    counts = {label: differing_from_reference(backend, device, label) for label in DTYPES}
    record(f"{backend} kernel vs CPU reference, bit for bit (3 steps + skipped ones, scale, inf)",
           not any(counts.values()), "differing elements: " + ", ".join(f"{k} {v}" for k, v in counts.items()))  # fmt: skip


def versus_torch(backend: str, device: torch.device) -> None:
    from fused_adam_checks import relative_error_vs_torch_fused

    error = relative_error_vs_torch_fused(backend, device)
    record(f"{backend} kernel vs torch.optim.AdamW(fused=True), 20 steps", error < 1e-5, f"max relative error {error:.2e}")


def bandwidth(device: torch.device, numel: int) -> None:
    from fused_adam import GOALS, run_benchmark

    rows = run_benchmark(device, numel, 96, 20)
    for row in rows:
        if row["ms"] is None:
            record(f"bandwidth: {row['contender']}", None, str(row.get("note", "")))
            continue
        ok: bool | str = "info"
        if str(row["contender"]).startswith("ours"):
            # A goal, not a test: missing it is reported, not failed.
            meets = row["vs torch passes"] >= GOALS["vs torch passes"] and row["of copy"] >= GOALS["of copy"]  # type: ignore[operator]
            ok = "meets goal" if meets else "below goal"
        record(f"bandwidth: {row['contender']} ({numel / 1e6:.0f}M elements, 96 tensors)", ok,
               f"{row['ms']:.3f} ms, {row['GB/s']:.0f} GB/s, {row['of copy']:.0%} of copy, "
               f"{row['vs torch passes']:.2f}x torch's separate passes")  # fmt: skip


def gpu_tests() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    summary = next((line for line in reversed(result.stdout.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error)", line)), result.stdout[-200:])  # fmt: skip
    failures = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    record("pytest tests/gpu", result.returncode == 0, summary.strip() + ("; " + "; ".join(failures) if failures else ""))
    if result.returncode != 0:
        print(result.stdout[-8000:], result.stderr[-3000:], sep="\n")


def demo(strategy: str, accelerator: str) -> None:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "examples/gpt/train.py", "fit", "--config", "examples/gpt/configs/zero3_offload_gpu.yaml",
         f"--trainer.strategy={strategy}", f"--trainer.accelerator={accelerator}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    train = re.search(r"train loss \(first -> last[^│]*│\s*([0-9.]+ -> [0-9.]+)", result.stdout)
    val = re.search(r"val loss \(last[^│]*│\s*([0-9.]+)", result.stdout)
    figures = ", ".join(part for part in (train and f"train loss {train.group(1)}", val and f"val loss {val.group(1)}")
                        if part) or result.stdout[-200:]  # fmt: skip
    record(f"demo GPT, {strategy}, 20 steps, bf16-mixed", result.returncode == 0, f"{seconds:.0f} s, {figures}")
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-6000:], sep="\n")


# ------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write gpu_check.json and gpu_check.txt here")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run every part on the CPU instead (the host build and interpreted Triton in place of "
                             "the GPU kernels), to check this script before a GPU is at hand")  # fmt: skip
    args = parser.parse_args()
    start = time.perf_counter()
    guarded("environment", environment)
    if args.cpu_rehearsal:
        os.environ["TRITON_INTERPRET"] = "1"
        device, kernels, numel, accelerator = torch.device("cpu"), ("host", "triton"), int(4e6), "cpu"
    elif torch.cuda.is_available():
        device, kernels, numel, accelerator = torch.device("cuda"), ("cuda", "triton"), int(64e6), "gpu"
        guarded("build the CUDA op", build)
    if args.cpu_rehearsal or torch.cuda.is_available():
        for kernel in kernels:
            guarded(f"{kernel} parity", lambda kernel=kernel: parity(kernel, device))  # type: ignore[misc]
        guarded("vs torch fused AdamW", lambda: versus_torch("cpu" if args.cpu_rehearsal else "cuda", device))
        guarded("bandwidth", lambda: bandwidth(device, numel))
        guarded("pytest tests/gpu", gpu_tests)
        for strategy in ("zero3_offload", "zero3"):
            guarded(f"demo {strategy}", lambda strategy=strategy: demo(strategy, accelerator))  # type: ignore[misc]
    table = Table(title=f"lightning_zero GPU check ({time.perf_counter() - start:.0f} s)")
    for column in ("check", "result", "figures"):
        table.add_column(column, overflow="fold")
    for row in ROWS:
        table.add_row(row["check"], row["result"], row["figures"])
    Console(width=160).print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(ROWS, indent=2))
        text = io.StringIO()
        Console(file=text, width=160).print(table)
        (out / "gpu_check.txt").write_text(text.getvalue())
    if not torch.cuda.is_available() and not args.cpu_rehearsal:
        sys.exit(2)
    sys.exit(0 if all(row["result"] != "FAILED" for row in ROWS) else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
