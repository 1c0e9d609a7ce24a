"""The wheel carries the kernel sources, and an installed copy builds its ops from them.

csrc/ lives at the top of the repository; pyproject.toml maps it into the package as
lightning_zero/ops/csrc, where lightning_zero/ops/_build.py looks in an installed copy. Before
that mapping a non-editable install had no sources and silently took the fallback. This test
builds the wheel, installs it (no dependencies: torch comes from the test's own environment,
through --system-site-packages and a .pth line) into a fresh virtual environment, and from a directory outside
the checkout builds the C++ CPU Adam and the host build of the CUDA kernel from the installed
sources into an empty build directory, and runs both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import venv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = {"adam_constants.h", "cpu_adam.cpp", "fused_adam.cu", "fused_adam.cuh", "fused_adam_host.cpp", "multi_tensor_apply.cuh"}


def test_every_package_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(path.parent.relative_to(REPO_ROOT).parts) for path in (REPO_ROOT / "lightning_zero").rglob("__init__.py")
    }
    assert found - listed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"
    assert "lightning_zero.ops.csrc" in listed
    assert KERNEL_SOURCES <= {path.name for path in (REPO_ROOT / "csrc").iterdir()}


def test_the_wheel_ships_the_kernel_sources_and_builds_from_them(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheel"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
         str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheel_dir.glob("lightning_zero-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"lightning_zero/ops/csrc/{name}" for name in KERNEL_SOURCES} <= names

    environment = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(environment)
    # Run from a virtual environment, --system-site-packages reaches the base interpreter's
    # packages and not this one's torch: a .pth line puts this interpreter's site-packages after the
    # new environment's own (a path line: the .pth files there, an editable install's, stay unread).
    (site_packages,) = environment.glob("lib/python*/site-packages")
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site_packages / "test_environment.pth").write_text("".join(f"{path}\n" for path in ours))
    python = environment / "bin" / "python"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if installed.returncode != 0 and "no such option: --python" in installed.stderr:
        pytest.skip("this pip cannot install into another environment (pip >= 22.3 can)")
    assert installed.returncode == 0, installed.stderr[-3000:]

    script = textwrap.dedent(
        """
        import json, sys
        import torch
        import lightning_zero
        from lightning_zero.ops import _build, cpu_adam, fused_adam
        from lightning_zero.ops._reference import reference_adam_step

        n = 1000
        master, exp_avg, exp_avg_sq = torch.randn(n), torch.zeros(n), torch.zeros(n)
        grad = torch.randn(n).bfloat16()
        expected = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
        hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        reference_adam_step(*expected[:1], grad, *expected[1:], **hyper)
        results = {}
        for backend in ("cpu", "host"):
            tensors = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
            ran = fused_adam.multi_tensor_adam_step([tensors[0]], [grad], [tensors[1]], [tensors[2]],
                                                    backend=backend, **hyper)
            results[backend] = ran == backend and all(torch.equal(a, b) for a, b in zip(tensors, expected))
        print(json.dumps({
            "package": lightning_zero.__file__,
            "sources": [str(_build.source_path(name)) for name in ("cpu_adam.cpp", "fused_adam.cu")],
            "cpu_op": cpu_adam.cpu_adam_available(),
            "host_op": fused_adam._HOST_OP.loaded,
            "results": results,
        }))
        """
    )
    build_dir = tmp_path / "build"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "LIGHTNING_ZERO_DISABLE_CPP_OPS")}
    env["LIGHTNING_ZERO_BUILD_DIR"] = str(build_dir)
    run = subprocess.run(
        [str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    site = str(environment)
    assert report["package"].startswith(site), report["package"]
    assert all(source.startswith(site) for source in report["sources"]), report["sources"]
    assert report["cpu_op"] and report["host_op"], report
    assert report["results"] == {"cpu": True, "host": True}
    # Built here, from the installed sources, not found in a cache.
    assert any(build_dir.rglob("*.so"))
