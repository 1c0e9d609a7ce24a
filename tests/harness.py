"""Runs a function on N gloo ranks on the CPU, the way torchrun would start them.

Starting ranks costs seconds, so a test module spawns one group and runs many sub-cases inside
it. Each rank sees the environment torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*),
so a Lightning ``Trainer`` inside the worker treats the processes as launched externally and
does not relaunch the script.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "NODE_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world_size),
    }


@contextmanager
def launched_environment() -> Iterator[None]:
    """Restores torchrun's variables around a Trainer: Lightning's teardown deletes WORLD_SIZE."""
    saved = {key: os.environ[key] for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK") if key in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# [Note: ranks forked from a preloaded server]
# A spawned rank imports torch, Lightning and this package afresh, about 2.5 s of a 2-rank group's
# start on this project's 2-core machine, paid by every test module's group. The ranks are forked
# instead from multiprocessing's fork server with those modules preloaded (one server per pytest
# process; it starts no threads, so forking it is safe), as a spawned rank would be but already
# imported. A fork inherits the server's environment and working directory, not the test's, so each
# rank takes the test's own (os.environ, cwd) as a spawned one would.
PRELOADED = ["torch", "torch.distributed", "lightning.pytorch", "lightning_zero"]


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, queue: Any,
    environment: dict[str, str], cwd: str,
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(1)  # N ranks share 2 cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(*args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank's traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` spawned ranks; returns each rank's result in rank order."""
    context = _context()  # see [Note: ranks forked from a preloaded server]
    queue = context.SimpleQueue()
    port = free_port()
    environment, cwd = dict(os.environ), os.getcwd()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, backend, fn, args, queue, environment, cwd),
                        daemon=True)
        for rank in range(world_size)
    ]
    pidfds = []  # to kill a rank by pid safely once the fork server is gone (below): no reused pid
    for process in processes:
        process.start()
        with suppress(OSError):
            pidfds.append((process, os.pidfd_open(process.pid)))
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = _get(queue, processes)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks may now wait forever on a collective
    finally:
        for process in processes:
            process.join(timeout=5 if failures else 60)
            if process.is_alive():
                process.kill()
        for process, pidfd in pidfds:
            if process.exitcode == 255 and failures:
                # What multiprocessing reports for every rank once the fork server itself is gone
                # (killed from outside): it can no longer tell whether the rank lives, so kill()
                # would do nothing, and a rank left waiting in a collective spins on as an orphan.
                with suppress(OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
    if failures:
        raise RuntimeError("a rank failed:\n" + "\n".join(failures))
    return [results[rank] for rank in range(world_size)]


def _get(queue: Any, processes: list[Any]) -> tuple[int, bool, Any]:
    import time

    deadline = time.monotonic() + RANK_TIMEOUT_S
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        dead = [p for p in processes if p.exitcode not in (None, 0)]
        if dead:
            return (processes.index(dead[0]), False, f"process exited with code {dead[0].exitcode}")
        time.sleep(0.05)
    return (-1, False, f"no result within {RANK_TIMEOUT_S} s (a hang in a collective?)")


@contextmanager
def recording_fused_backends() -> Iterator[list[str]]:
    """Records the backend of every fused device Adam step (``ops.multi_tensor_adam_step``)
    taken inside it, in this process."""
    from lightning_zero.ops import fused_adam

    ran: list[str] = []
    original = fused_adam.multi_tensor_adam_step

    def recording(*args: Any, **kwargs: Any) -> str:
        ran.append(original(*args, **kwargs))
        return ran[-1]

    fused_adam.multi_tensor_adam_step = recording  # type: ignore[assignment]
    try:
        yield ran
    finally:
        fused_adam.multi_tensor_adam_step = original  # type: ignore[assignment]
