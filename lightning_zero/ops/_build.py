"""Lazily built extensions: where their sources are, and one object per extension that builds it
on first use, remembers why it could not, and warns once.

Shared by the C++ CPU Adam (cpu_adam.py) and the CUDA Adam (fused_adam.py); see [Note: building
on first use] in cpu_adam.py. Nothing here imports ``torch.utils.cpp_extension`` at import time:
it pulls in setuptools, which ``import lightning_zero`` must not.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Generic, TypeVar

try:
    import fcntl
except ImportError:  # Windows: no flock; builds fall back to the age rule for torch's lock file
    fcntl = None  # type: ignore[assignment]

DISABLE_ENV = "LIGHTNING_ZERO_DISABLE_CPP_OPS"  # disables every compiled op (C++ and CUDA)
BUILD_DIR_ENV = "LIGHTNING_ZERO_BUILD_DIR"
VERBOSE_ENV = "LIGHTNING_ZERO_BUILD_VERBOSE"
BUILD_TIMEOUT_ENV = "LIGHTNING_ZERO_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 1800.0  # a CUDA build on a slow machine takes minutes, never half an hour
BUILDER_LOCK = "lightning_zero.build.lock"  # ours, beside torch's `lock`; kept, never removed
TORCH_LOCK = "lock"  # torch.utils.file_baton.FileBaton's file, which cpp_extension.load makes

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


def build_timeout() -> float:
    """Seconds a process waits for another one's build of the same extension
    (``$LIGHTNING_ZERO_BUILD_TIMEOUT``, default 1800)."""
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={raw!r} is not a positive number of seconds. Unset it or set e.g. 1800")
    return seconds


# [Note: the build lock]
# cpp_extension.load guards a build with a `lock` file (torch's FileBaton): the process that
# creates it builds and deletes it; every other process polls until the file is gone, with no
# timeout. A builder killed mid-build (Ctrl-C twice, SIGKILL, a job's time limit) leaves the
# file behind and every later load of that extension waits forever. So each of our loads first
# holds an flock on a file of our own in the same directory: the kernel drops an flock when its
# process dies, so while we hold it no live lightning_zero process of this host is inside load()
# for this directory, and a `lock` file found then, made by a process of this host (our file
# names the last holder), was left by a dead one. We delete it with a warning. One made by another
# host (a shared cache on a file system whose locks may be per node) counts as left behind once
# older than the timeout.
# Waiting for a live builder is bounded (build_timeout()) and ends in an error naming the file
# and the holder, which the caller turns into the fallback: never a hang. Without flock
# (Windows, or a file system without locks) a `lock` older than the timeout counts as left behind.
@contextlib.contextmanager
def builder_lock(directory: Path, name: str, timeout: float | None = None) -> Iterator[None]:
    """Holds this process's turn to build or load ``name`` in ``directory`` (see [Note: the
    build lock]); raises TimeoutError after ``timeout`` seconds (default :func:`build_timeout`)."""
    timeout = build_timeout() if timeout is None else timeout
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / BUILDER_LOCK
    with open(path, "a+") as handle:
        if fcntl is None or not _flock(handle, path, name, timeout):
            # No flock (Windows) or a file system without locks (some network and FUSE mounts).
            remove_left_lock(directory / TORCH_LOCK, name, older_than=timeout)
            yield
            return
        try:
            handle.seek(0)
            last = handle.read().strip()  # the last holder: "pid N on HOST"
            here = socket.gethostname()
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {here}\n")
            handle.flush()
            # Some network file systems lock per node only (NFS with local_lock, Lustre localflock):
            # there the lock proves nothing about another host's builder, which only age retires.
            same_host = last.endswith(f" on {here}")
            remove_left_lock(directory / TORCH_LOCK, name, older_than=0.0 if same_host else timeout)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _flock(handle: IO[str], path: Path, name: str, timeout: float) -> bool:
    """Takes an exclusive flock on ``handle`` within ``timeout`` seconds (TimeoutError naming the
    holder otherwise); False where the file system does not support locks."""
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            waited = time.monotonic() - start
            if waited >= timeout:
                handle.seek(0)
                holder = handle.read().strip() or "a process that wrote no id"
                raise TimeoutError(
                    f"waited {waited:.0f} s for another process to build or load {name} in {path.parent} "
                    f"(it holds {path}: {holder}). Let it finish, raise {BUILD_TIMEOUT_ENV} (seconds, "
                    f"now {timeout:g}), or point {BUILD_DIR_ENV} at another directory"
                ) from None
            time.sleep(min(0.1, max(timeout - waited, 0.0)))
        except OSError as error:
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise


def remove_left_lock(path: Path, name: str, older_than: float = 0.0) -> None:
    """Deletes torch's build lock ``path`` left by a dead builder (older than ``older_than`` s)."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return
    if age < older_than:
        return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    warnings.warn(
        f"removed {path}, a build lock {age:.0f} s old left by a process that stopped while building {name} "
        "(torch's loader would have waited on it forever). Building again",
        RuntimeWarning,
        stacklevel=2,
    )


def load_extension(
    name: str,
    sources: list[Path],
    *,
    extra_cflags: list[str] | None = None,
    extra_cuda_cflags: list[str] | None = None,
    extra_ldflags: list[str] | None = None,
) -> None:
    """``cpp_extension.load`` of TORCH_LIBRARY ops (no pybind11), into our build directory or torch's
    cache, one process at a time per directory (see [Note: the build lock]): ranks that start
    together build once, and a build lock left by a killed builder does not stop the next one."""
    from torch.utils import cpp_extension

    directory = build_directory(name) or cpp_extension._get_build_directory(name, verbose=False)
    with builder_lock(Path(directory), name):
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=extra_cflags,
            extra_cuda_cflags=extra_cuda_cflags,
            extra_ldflags=extra_ldflags,
            extra_include_paths=sorted({str(source.parent) for source in sources}),
            build_directory=directory,
            is_python_module=False,  # TORCH_LIBRARY ops, no pybind11: builds in a third of the time
            verbose=env_flag(VERBOSE_ENV),
        )
