"""What one rank holds right now, per category: model state split by device, gathered stage-3
units, the activations autograd saved, the allocator's (CUDA) or the process's (CPU) totals.
Plain PyTorch; the ZeroMemoryProfiler callback calls these at the phases of sampled steps."""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.zero.accounting import model_state_bytes

PHASES = ("forward", "backward", "step")  # after forward (before backward), backward, after the optimizer step


@dataclass(frozen=True)
class MemorySample:
    """One rank's memory at one phase of one step, in bytes (None: not measurable here)."""

    step: int
    rank: int
    phase: str
    params_device: int
    params_host: int
    params_gathered: int  # stage 3: units gathered whole right now (also counted in params_device)
    grads_device: int
    grads_host: int
    grads_buffers: int  # of the gradients: the local bucket/unit buffers not yet reduced into shards
    optimizer_device: int
    optimizer_host: int
    activations: int | None  # saved for backward by this step's forward (forward phase)
    other: int | None  # CUDA: what the allocator holds beyond model state and activations
    allocated: int | None  # CUDA: torch.cuda.memory_allocated
    peak_allocated: int | None  # CUDA: the peak since the previous phase
    reserved: int | None  # CUDA: torch.cuda.memory_reserved
    alloc_retries: int | None  # CUDA: num_alloc_retries (the allocator freed its cache to fit)
    rss: int  # the process's resident memory
    peak_rss: int  # its high-water mark

    @property
    def params(self) -> int:
        return self.params_device + self.params_host

    @property
    def grads(self) -> int:
        return self.grads_device + self.grads_host

    @property
    def optimizer_states(self) -> int:
        return self.optimizer_device + self.optimizer_host

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def sample_memory(step: int, rank: int, phase: str, module: nn.Module, optimizers: Sequence[Optimizer],
                  device: torch.device, engine: Any = None, activations: int | None = None,
                  peak_allocated: int | None = None) -> MemorySample:
    """This rank's :class:`MemorySample` now. Model state comes from
    :func:`~lightning_zero.zero.accounting.model_state_bytes`, split between ``device`` (where
    training runs) and the host (the rest)."""
    on_device = model_state_bytes(module, optimizers, where=lambda t: t.device == device)
    on_host = model_state_bytes(module, optimizers, where=lambda t: t.device != device)
    gathered = sum(unit.full.untyped_storage().nbytes() for unit in getattr(engine, "units", ()))
    cuda = device.type == "cuda" and torch.cuda.is_available()
    stats = torch.cuda.memory_stats(device) if cuda else {}
    rss, peak = process_memory()
    allocated = stats.get("allocated_bytes.all.current") if cuda else None
    other = None
    if allocated is not None:
        other = allocated - on_device.params - on_device.grads - on_device.optimizer_states - (activations or 0)
    return MemorySample(
        step=step, rank=rank, phase=phase,
        params_device=on_device.params, params_host=on_host.params, params_gathered=gathered,
        grads_device=on_device.grads, grads_host=on_host.grads, grads_buffers=gradient_buffer_bytes(engine),
        optimizer_device=on_device.optimizer_states, optimizer_host=on_host.optimizer_states,
        activations=activations, other=other,
        allocated=allocated,
        peak_allocated=peak_allocated,
        reserved=stats.get("reserved_bytes.all.current") if cuda else None,
        alloc_retries=stats.get("num_alloc_retries") if cuda else None,
        rss=rss, peak_rss=peak,
    )


def gradient_buffer_bytes(engine: Any) -> int:
    """Bytes of the engine's local gradient buffers allocated now: each bucket's (stages 1/2; kept
    at stage 1) or unit's (stage 3) gradient before it is reduced into this rank's shard."""
    reductions = [bucket.reduction for layout in getattr(engine, "layouts", ()) for bucket in layout.buckets]
    reductions += [unit.reduction for unit in getattr(engine, "units", ())]
    return sum(r.grad.untyped_storage().nbytes() for r in reductions if r.grad is not None)


def process_memory() -> tuple[int, int]:
    """(resident bytes now, the high-water mark) of this process. Both from /proc/self/status on
    Linux: the kernel updates the mark getrusage reports (ru_maxrss) only now and then, so beside
    the current size from statm it read lower than the size it should bound."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS:", "VmHWM:")))
        rss, peak = (int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))  # kB
        return rss, max(peak, rss)
    except (OSError, ValueError, KeyError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
        return peak, peak


def host_memory_available(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of host memory this process may still allocate without swapping or being killed:
    MemAvailable of /proc/meminfo (free memory and the page cache that can be reclaimed), or less
    where a memory cgroup (a container's or a SLURM job's limit) leaves less; None where unknown."""
    available = None
    try:
        with open(proc / "meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    headroom = cgroup_memory_headroom(proc, cgroup_root)
    if headroom is None:
        return available
    return headroom if available is None else min(available, headroom)


def cgroup_memory_headroom(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What the tightest memory limit among this process's cgroup and its parents leaves (limit
    minus usage, the reclaimable inactive page cache not counted as used); None without a limit.
    cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    tightest = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, files = cgroup_root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = cgroup_root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # this cgroup, then each parent: a limit may sit higher up
            headroom = _cgroup_headroom(base.joinpath(*parts[:depth]), *files)
            if headroom is not None:
                tightest = headroom if tightest is None else min(tightest, headroom)
    return tightest


def _cgroup_headroom(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 2**60:  # no limit (v1 writes a huge number)
            return None
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for stat in (directory / "memory.stat").read_text().splitlines():
            key, _, value = stat.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit_text) - (usage - inactive))


class SavedActivations:
    """Counts what autograd saves for backward between :meth:`start` and :meth:`stop` (each
    storage once; parameters, and stage-3 units gathered whole, excluded): the activations a
    step's forward keeps. ``dtype_bytes`` counts floating tensors at that element size instead
    (a probe in fp32 of a run in bf16-true)."""

    def __init__(self, module: nn.Module, engine: Any = None, dtype_bytes: int | None = None) -> None:
        self._parameters = {storage_key(p) for p in module.parameters() if p.numel()}
        self._units = list(getattr(engine, "units", ()))
        self._dtype_bytes = dtype_bytes
        self._seen: set[int | None] = set()
        self.bytes = 0
        self._hooks: Any = None

    def _pack(self, tensor: Tensor) -> Tensor:
        key = storage_key(tensor)
        if key is None or key in self._seen or key in self._parameters or isinstance(tensor, nn.Parameter):
            return tensor
        # A gathered unit's storage exists only while it is gathered: looked up now.
        if any(storage_key(unit.full) == key for unit in self._units):
            return tensor
        self._seen.add(key)
        size = _local(tensor).untyped_storage().nbytes()
        if self._dtype_bytes is not None and tensor.is_floating_point():
            size = size // tensor.element_size() * self._dtype_bytes
        self.bytes += size
        return tensor

    def start(self) -> None:
        self.stop()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def stop(self) -> int:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        return self.bytes


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local part (what this rank stores); the tensor itself otherwise."""
    return getattr(tensor, "_local_tensor", tensor)


def storage_key(tensor: Tensor) -> int | None:
    """The address of the storage ``tensor`` lives in; None where it has none to read (a nested or
    fake tensor)."""
    try:
        storage = _local(tensor).untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


__all__ = ["MemorySample", "PHASES", "SavedActivations", "gradient_buffer_bytes", "process_memory", "sample_memory",
           "storage_key"]
