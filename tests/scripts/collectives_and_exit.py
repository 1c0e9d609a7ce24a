"""One of 2 gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment): every form of the
engine's collectives on temporary tensors, each waited for, then the process exits at once (see
[Note: tensors outlive the gloo worker] in lightning_zero/zero/comm.py). ``--unheld`` issues them
without the holder, to see the abort the holder prevents. ``--objects`` instead ends with torch's
object collectives, whose tensors nothing holds (the exit grace covers them)."""

import contextlib
import sys

import torch
import torch.distributed as dist

from lightning_zero.zero.comm import CollectiveForms, Collectives

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if "--objects" in sys.argv:
        import lightning_zero  # noqa: F401  - what every user script imports, with its exit handler

        for step in range(30):
            every: list[object] = [None, None]
            dist.all_gather_object(every, {"rank": dist.get_rank(), "step": step, "padding": "x" * 100_000})
            chosen = [dist.get_rank() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(chosen, 0)
        sys.exit(0)
    if "--unheld" in sys.argv:
        Collectives.holding = lambda self, *tensors: contextlib.nullcontext()  # type: ignore[method-assign]
    every_form = [CollectiveForms.native(), CollectiveForms(0, 0), CollectiveForms(exchange_between_two_ranks=True)]
    collectives = [Collectives(forms=forms) for forms in every_form]
    n = 1 << 14
    for _ in range(2):
        for comm in collectives:
            comm.agree([1, 2])
            comm.all_reduce(torch.ones(4))
            comm.reduce_scatter(torch.empty(n), torch.randn(2 * n)).wait()
            comm.all_gather(torch.empty(2 * n), torch.randn(n)).wait()
    # The last ones in a burst, and nothing after the last wait: the interpreter exits while
    # gloo's workers may still hold their tensors.
    handles = [collectives[-1].all_gather(torch.empty(2 * n), torch.randn(n)) for _ in range(64)]
    for handle in handles:
        handle.wait()
    del handles, handle
