"""csrc/fused_adam.cu compiles with nvcc against this torch's headers, without a GPU.

The CPU torch wheel ships ATen's headers and nvcc compiles (``-c``) but nothing links or runs, so
this is how CI catches a syntax or API error in the CUDA kernel. The flags are those
``torch.utils.cpp_extension`` passes when it builds the kernel on a GPU machine
(lightning_zero/ops/fused_adam.py), for two architectures: one below sm_80 and one above, since
c10's bf16/fp16 conversions take different device paths there. ptxas must report no spills: the
kernel is memory bound and a spill would add local-memory traffic to every element.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [shutil.which("nvcc"), *([str(Path(cuda_home) / "bin" / "nvcc")] if cuda_home else []),
                  "/usr/local/cuda/bin/nvcc"]  # fmt: skip
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("nvcc is not installed: the CUDA source cannot be compile-checked here")


def test_fused_adam_cu_compiles_with_nvcc(tmp_path: Path) -> None:
    from torch.utils import cpp_extension

    nvcc = _nvcc()
    include = Path(torch.__file__).parent / "include"
    command = [
        nvcc, "-c", str(REPO_ROOT / "csrc" / "fused_adam.cu"), "-o", str(tmp_path / "fused_adam.o"),
        "-std=c++20", "-O3", "--fmad=false", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        *cpp_extension.COMMON_NVCC_FLAGS,
        "-gencode", "arch=compute_75,code=sm_75", "-gencode", "arch=compute_90,code=sm_90",
        "--threads", "2",  # the two architectures' device passes side by side (38 s -> 32 s here)
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert (tmp_path / "fused_adam.o").stat().st_size > 0
    # 9 kernels (3 gradient dtypes x 3 copy dtypes) per architecture, none spilling.
    reports = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)
    assert len(reports) >= 18, output[-3000:]
    assert all(stores == "0" and loads == "0" for stores, loads in reports), output[-3000:]
