"""A build of a compiled op never waits forever (see [Note: the build lock] in ops/_build.py).

torch's cpp_extension.load guards a build with a `lock` file and waits on it with no timeout; a
builder killed mid-build used to leave it behind and every later load hung. These tests drive
torch's own FileBaton through a stand-in for cpp_extension.load (the same acquire-or-wait
protocol as cpp_extension._jit_compile), so nothing is compiled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_zero.ops import _build

REPO_ROOT = Path(__file__).resolve().parents[1]
NAME = "lightning_zero_lock_test"

# A process that loads NAME through load_extension, with cpp_extension.load replaced by torch's
# acquire-or-wait protocol; with `hang` the builder stops forever after taking the lock.
_LOADER = textwrap.dedent(
    """
    import os, sys, time, warnings
    from pathlib import Path
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton
    from lightning_zero.ops import _build

    hang = sys.argv[1] == "hang"

    def load(*, name, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            if not Path(build_directory, "built").exists():  # ninja: nothing to do when up to date
                print("building", flush=True)
                if hang:
                    time.sleep(3600)
                Path(build_directory, "built").write_text(name)
            baton.release()
        else:
            baton.wait()

    cpp_extension.load = load
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _build.load_extension(sys.argv[2], [])
    print("loaded", *[str(w.message) for w in record], sep="\\n", flush=True)
    """
)


def _loader(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, _build.BUILD_DIR_ENV: str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-c", _LOADER, mode, NAME],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(process: subprocess.Popen[str], timeout: float = 60) -> tuple[str, str]:
    """Output of a loader that must end by itself; killed (and the test failed) if it hangs."""
    try:
        return process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_a_lock_left_by_a_killed_builder_is_removed_and_the_next_build_goes_on(tmp_path: Path) -> None:
    killed = _loader(tmp_path, "hang")
    try:
        assert killed.stdout is not None and killed.stdout.readline().strip() == "building"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=30)
    torch_lock = tmp_path / NAME / _build.TORCH_LOCK
    assert torch_lock.exists(), "the killed builder should leave torch's lock behind (the bug's setup)"

    # Without the builder lock this process waits on torch_lock forever (timeout -> test failure).
    loader = _loader(tmp_path, "build")
    out, err = _finish(loader)
    assert loader.returncode == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["building", "loaded"]
    assert "removed" in lines[2] and str(torch_lock) in lines[2] and NAME in lines[2]
    assert (tmp_path / NAME / "built").read_text() == NAME
    assert not torch_lock.exists()


def test_ranks_that_start_together_build_once_and_warn_nothing(tmp_path: Path) -> None:
    loaders = [_loader(tmp_path, "build") for _ in range(3)]
    outputs = [_finish(loader) for loader in loaders]
    assert all(loader.returncode == 0 for loader in loaders), [err for _, err in outputs]
    assert sorted(out.splitlines() for out, _ in outputs) == [["building", "loaded"]] + [["loaded"]] * 2


def _hold(path: Path) -> object:
    """Holds the builder lock from another open file, as a live builder in another process would."""
    import fcntl

    handle = open(path, "a+")  # noqa: SIM115 - closed by the caller
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
    handle.write("pid 4242 on buildhost\n")
    handle.flush()
    return handle


@pytest.mark.skipif(_build.fcntl is None, reason="no flock on this platform")
def test_waiting_on_a_live_builder_ends_in_an_error_naming_the_lock_and_its_holder(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    holder = _hold(tmp_path / _build.BUILDER_LOCK)
    (tmp_path / _build.TORCH_LOCK).touch()  # the live builder's own lock: must survive
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as raised, _build.builder_lock(tmp_path, NAME, timeout=0.3):
            pytest.fail("entered while another process holds the lock")
        assert 0.3 <= time.monotonic() - start < 5
    finally:
        holder.close()
    message = str(raised.value)
    assert str(tmp_path / _build.BUILDER_LOCK) in message and "pid 4242 on buildhost" in message
    assert _build.BUILD_TIMEOUT_ENV in message and NAME in message
    assert (tmp_path / _build.TORCH_LOCK).exists()


@pytest.mark.skipif(_build.fcntl is None, reason="no flock on this platform")
def test_a_builder_that_finishes_in_time_is_waited_for(tmp_path: Path) -> None:
    holder = _hold(tmp_path / _build.BUILDER_LOCK)
    threading.Timer(0.3, holder.close).start()  # closing the file drops the flock
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        start = time.monotonic()
        with _build.builder_lock(tmp_path, NAME, timeout=30):
            waited = time.monotonic() - start
    assert 0.25 <= waited < 10
    assert f"pid {os.getpid()}" in (tmp_path / _build.BUILDER_LOCK).read_text()


@pytest.mark.skipif(_build.fcntl is None, reason="no flock on this platform")
def test_a_build_that_times_out_falls_back_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_build.BUILD_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(_build.BUILD_TIMEOUT_ENV, "0.2")
    monkeypatch.delenv(_build.DISABLE_ENV, raising=False)
    (tmp_path / NAME).mkdir()
    holder = _hold(tmp_path / NAME / _build.BUILDER_LOCK)
    try:
        extension = _build.LazyExtension(lambda: _build.load_extension(NAME, []), label="test op", force_hook="none")
        assert extension.value() is None
    finally:
        holder.close()
    reason = extension.unavailable_reason()
    assert "building the test op failed" in reason and "TimeoutError" in reason
    assert str(tmp_path / NAME / _build.BUILDER_LOCK) in reason


def _only_an_old_lock_is_removed(directory: Path, before_each: Callable[[], object] = lambda: None) -> None:
    """The age rule: a torch lock younger than the timeout (60 s here) may be a live build and is
    kept, without a warning; one of 120 s is removed, with one. ``before_each`` runs before each
    builder_lock (to name the last holder again)."""
    torch_lock = directory / _build.TORCH_LOCK
    torch_lock.touch()
    before_each()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _build.builder_lock(directory, NAME, timeout=60):
            assert torch_lock.exists()
    old = time.time() - 120
    os.utime(torch_lock, (old, old))
    before_each()
    with pytest.warns(RuntimeWarning, match="removed .*lock.* 1[12][0-9] s old"), _build.builder_lock(
        directory, NAME, timeout=60
    ):
        assert not torch_lock.exists()


def test_without_flock_only_a_lock_older_than_the_timeout_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_build, "fcntl", None)
    _only_an_old_lock_is_removed(tmp_path)


@pytest.mark.skipif(_build.fcntl is None, reason="no flock on this platform")
def test_a_lock_made_on_another_host_is_left_to_its_age(tmp_path: Path) -> None:
    """A shared cache whose locks may be per node: another host's build lock is removed only once
    older than the timeout; this host's (its builder dead, as the flock proves) at once."""
    builder_lock = tmp_path / _build.BUILDER_LOCK
    _only_an_old_lock_is_removed(tmp_path, lambda: builder_lock.write_text("pid 4242 on some-other-host\n"))
    assert builder_lock.read_text().startswith(f"pid {os.getpid()} on ")
    # The last holder is now this process, on this host: a lock left now is a dead builder's.
    torch_lock = tmp_path / _build.TORCH_LOCK
    torch_lock.touch()
    with pytest.warns(RuntimeWarning, match="removed"), _build.builder_lock(tmp_path, NAME, timeout=60):
        assert not torch_lock.exists()


@pytest.mark.skipif(_build.fcntl is None, reason="no flock on this platform")
def test_a_file_system_without_locks_falls_back_to_the_age_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    _only_an_old_lock_is_removed(tmp_path)


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_build_timeout_names_the_variable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_build.BUILD_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{_build.BUILD_TIMEOUT_ENV}='{value}' is not a positive number"):
        _build.build_timeout()
