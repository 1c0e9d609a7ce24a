"""Lazily built extensions: where their sources are, and one object per extension that builds it
on first use, remembers why it could not, and warns once.

Shared by the C++ CPU Adam (cpu_adam.py) and the CUDA Adam (fused_adam.py); see [Note: building
on first use] in cpu_adam.py. Nothing here imports ``torch.utils.cpp_extension`` at import time:
it pulls in setuptools, which ``import lightning_zero`` must not.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

DISABLE_ENV = "LIGHTNING_ZERO_DISABLE_CPP_OPS"  # disables every compiled op (C++ and CUDA)
BUILD_DIR_ENV = "LIGHTNING_ZERO_BUILD_DIR"
VERBOSE_ENV = "LIGHTNING_ZERO_BUILD_VERBOSE"

T = TypeVar("T")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def source_path(name: str) -> Path:
    """``csrc/<name>`` of the checkout this package runs from, or the copy shipped in the wheel
    (package data ``lightning_zero/ops/csrc``, mapped from the top-level ``csrc/`` by
    pyproject.toml)."""
    here = Path(__file__).resolve().parent
    candidates = (here.parents[1] / "csrc" / name, here / "csrc" / name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the kernel source is not at {candidates[0]} (a source checkout) nor at {candidates[1]} "
        "(package data). Reinstall lightning_zero (`pip install lightning-zero`, or `pip install -e .` "
        "from a checkout)"
    )


def check_toolchain() -> None:
    """A C++ compiler and ninja, which ``cpp_extension.load`` needs; raises naming what is missing."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"no C++ compiler: `{compiler}` (from $CXX, default c++) is not on PATH. Install one "
            "(e.g. `apt-get install g++`) or point CXX at it"
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not available. `pip install ninja`")


def build_directory(name: str) -> str | None:
    """``$LIGHTNING_ZERO_BUILD_DIR/<name>`` when that is set (created), else None: torch's cache."""
    root = os.environ.get(BUILD_DIR_ENV)
    if not root:
        return None
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    return str(directory)


def short(error: BaseException, limit: int = 1500) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= limit else text[:limit] + " [...]"


class LazyExtension(Generic[T]):
    """Owns one lazily built extension: tried or not, loaded or why not, warned or not.

    ``build()`` compiles (or loads from cache) and returns what the callers need of it (the CPU
    op's ISA code, say); any exception it raises means "use the fallback", with its text kept
    as the reason. ``label`` names the extension in messages (``"C++ op"``).
    """

    def __init__(self, build: Callable[[], T], *, label: str, force_hook: str) -> None:
        self._build = build
        self.label = label
        self._force_hook = force_hook  # the function tests call to force the fallback
        self._lock = threading.Lock()
        self._tried = False
        self._value: T | None = None
        self._failure: str | None = None
        self._forced = False
        self._warned = False
        self.build_seconds: float | None = None  # build or cache load, for the first call

    @property
    def loaded(self) -> bool:
        """Whether the library is in this process; never triggers the build."""
        return self._value is not None

    def disabled_reason(self) -> str | None:
        if self._forced:
            return f"it was forced by {self._force_hook}(True)"
        if env_flag(DISABLE_ENV):
            return f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} is set. Unset it to use the {self.label}"
        return None

    def value(self) -> T | None:
        """What ``build`` returned, building on first use; None means: use the fallback."""
        if self.disabled_reason() is not None:
            return None
        if not self._tried:
            self._try_build()
        return self._value

    def _try_build(self) -> None:
        with self._lock:
            if self._tried:
                return
            start = time.perf_counter()
            try:
                self._value = self._build()
            except Exception as error:  # noqa: BLE001 - any failure means: fall back, and say why
                self._failure = (
                    f"building the {self.label} failed ({short(error)}). Fix the toolchain, or set "
                    f"{DISABLE_ENV}=1 to use the fallback without trying"
                )
            self.build_seconds = time.perf_counter() - start
            self._tried = True

    def unavailable_reason(self) -> str:
        return self.disabled_reason() or self._failure or f"the {self.label} is not loaded"

    def warn_once(self, message: str, category: type[Warning], stacklevel: int = 4) -> None:
        """Warns ``message`` + the reason, the first time only."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"{message} Reason: {self.unavailable_reason()}.", category, stacklevel=stacklevel)

    def force_fallback(self, enabled: bool) -> None:
        self._forced = enabled
        self._warned = False


def load_extension(
    name: str,
    sources: list[Path],
    *,
    extra_cflags: list[str] | None = None,
    extra_cuda_cflags: list[str] | None = None,
    extra_ldflags: list[str] | None = None,
) -> None:
    """``cpp_extension.load`` of TORCH_LIBRARY ops (no pybind11), into our build directory or torch's
    cache; torch's file lock makes ranks that start together build once."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name,
        sources=[str(source) for source in sources],
        extra_cflags=extra_cflags,
        extra_cuda_cflags=extra_cuda_cflags,
        extra_ldflags=extra_ldflags,
        extra_include_paths=sorted({str(source.parent) for source in sources}),
        build_directory=build_directory(name),
        is_python_module=False,  # TORCH_LIBRARY ops, no pybind11: builds in a third of the time
        verbose=env_flag(VERBOSE_ENV),
    )
