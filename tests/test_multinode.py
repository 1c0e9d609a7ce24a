"""The multi-node case: hybrid ZeRO-3 on 2 "nodes" x 2 processes, launched by two torchrun agents.

Two ``torchrun --nnodes 2 --node-rank {0,1}`` agents on one machine rendezvous over loopback
(static rendezvous: node 0's agent hosts the store at ``--master-port``), so every rank sees
what it would on a real cluster: RANK, LOCAL_RANK, GROUP_RANK (the node) and WORLD_SIZE from
torchrun, and a Lightning ``Trainer(devices=2, num_nodes=2)`` that must take them as they are
(``TorchElasticEnvironment``) instead of relaunching. ``shard_size=2`` shards within each node
and replicates across the two, all-reducing gradients between the replicas.

The reference is one torchrun node of 4 processes with plain ZeRO-3 over all 4 ranks. Both
layouts have 4 data-parallel ranks with a batch of 2 each, and Lightning's DistributedSampler
(seed 0, num_replicas 4) deals rank r the same samples in both, so each rank's loss at each step
must be the same number, and so must the final weights: everything is fp32 and only the order
of the gradient reductions differs (reduce-scatter within a node, then all-reduce across nodes,
versus one reduce-scatter over 4 ranks), i.e. differences of a few float32 ulps.

Each launch starts 4 ranks (seconds each on 2 cores), so the module launches each layout once
and the tests read its results.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "multinode_train.py"
NODES, PROCS_PER_NODE = 2, 2
WORLD = NODES * PROCS_PER_NODE
STEPS = 4
PER_RANK_BATCH = 2  # both layouts have 4 data-parallel ranks: a global batch of 8
LAUNCH_TIMEOUT_S = 300.0  # a hard limit per launch; a healthy one takes well under a minute
# Losses and weights: fp32, the same samples per rank, only the reduction order differs. Measured
# differences are ~5e-7 for the losses and ~2e-6 for the weights after 4 AdamW steps.
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-5
# The key biases have a gradient that is exactly zero in exact arithmetic (see
# _key_bias_mask), so Adam's update on them is rounding noise divided by sqrt(v) + eps, and no
# two reduction orders agree on it. After 4 steps they are ~3e-5 away from their initial 0 in
# either run; a parameter with a real gradient moves ~lr = 1e-2 per step.
KEY_BIAS_NOISE_BOUND = 1e-3

# Variables a surrounding launcher may have set: the agents must start from a clean slate.
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"  # 4 ranks share 2 cores
    env["PYTHONUNBUFFERED"] = "1"  # so a killed run still shows how far it got
    return env


def _torchrun(nnodes: int, nproc: int, node_rank: int, port: int, out: Path, shard_size: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(SCRIPT), "--out", str(out), "--shard-size", shard_size, "--steps", str(STEPS),
            "--batch-size", str(PER_RANK_BATCH)]


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM first: the torchrun agent forwards it to its workers (which run in sessions of
    their own, so killing the agent's process group would orphan them); SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _launch(commands: list[list[str]], logs: list[Path], timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
    """Runs the agents concurrently; fails with every agent's output as soon as one fails (the
    others would wait for it at the next collective until the deadline) or the deadline passes."""
    processes: list[subprocess.Popen[bytes]] = []
    handles = [log.open("wb") for log in logs]
    try:
        for command, handle in zip(commands, handles):
            # Output to files, not pipes: a pipe nobody reads while the others run could fill and block.
            processes.append(subprocess.Popen(command, cwd=ROOT, env=_environment(), stdout=handle,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        failure = None
        while failure is None and any(p.poll() is None for p in processes):
            failed = [i for i, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed:
                failure = f"agent {failed[0]} exited with {processes[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s"
            else:
                time.sleep(0.2)
        if failure is None and any(p.returncode != 0 for p in processes):
            failure = f"exit codes {[p.returncode for p in processes]}"
    finally:
        for process in processes:
            _stop(process)
        for handle in handles:
            handle.close()
    if failure is not None:
        outputs = "\n".join(f"----- {' '.join(c[3:])}\n{log.read_text(errors='replace')[-10000:]}"
                            for c, log in zip(commands, logs))
        pytest.fail(f"torchrun launch failed: {failure}\n{outputs}", pytrace=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("multinode")
    two_nodes, one_node = tmp / "two_nodes.pt", tmp / "one_node.pt"
    port = _free_port()
    _launch([_torchrun(NODES, PROCS_PER_NODE, node, port, two_nodes, "2") for node in range(NODES)],
            [tmp / f"node{node}.log" for node in range(NODES)])
    _launch([_torchrun(1, WORLD, 0, _free_port(), one_node, "none")], [tmp / "one_node.log"])
    return {"two_nodes": torch.load(two_nodes), "one_node": torch.load(one_node)}


def _key_bias_mask(name: str, value: torch.Tensor, n_head: int = 4) -> torch.Tensor:
    """True at the entries of a key bias: ``qkv.bias`` is laid out (head, q/k/v, head_dim) (see
    [Note: per-head qkv layout] in examples/gpt/model.py). Adding a constant b to every key adds
    q . b to all of one query's attention scores alike, which softmax ignores, so the loss does
    not depend on the key bias at all."""
    mask = torch.zeros_like(value, dtype=torch.bool)
    if name.endswith("attn.qkv.bias"):
        mask.view(n_head, 3, -1)[:, 1, :] = True
    return mask


def test_two_nodes_place_ranks_and_shard_within_a_node(runs: dict[str, dict[str, Any]]) -> None:
    """torchrun's placement reaches Lightning unchanged, the mesh is 2 shards x 2 replicas, and
    every shard group lies on one node (its gathers and reduce-scatters never cross nodes)."""
    run = runs["two_nodes"]
    assert run["dims"] == {"world": 4, "data": 4, "tensor": 1, "shard": 2, "replicas": 2}
    ranks = run["ranks"]
    assert [r["dist_rank"] for r in ranks] == list(range(WORLD))
    node_of = {}
    for rank, record in enumerate(ranks):
        env, seen = record["env"], record["lightning"]
        # torchrun numbers ranks node by node; Lightning must read the same placement, not relaunch or renumber.
        assert env["RANK"] == rank and env["GROUP_RANK"] == rank // PROCS_PER_NODE
        assert env["LOCAL_RANK"] == rank % PROCS_PER_NODE and env["LOCAL_WORLD_SIZE"] == PROCS_PER_NODE
        assert seen == {"global_rank": rank, "local_rank": env["LOCAL_RANK"], "node_rank": env["GROUP_RANK"],
                        "world_size": WORLD, "num_nodes": NODES}
        node_of[rank] = env["GROUP_RANK"]
    for rank, record in enumerate(ranks):
        group = record["shard_group"]
        assert rank in group and len(group) == 2
        assert {node_of[r] for r in group} == {node_of[rank]}, f"rank {rank}'s shard group {group} spans nodes"
    # the reference really is plain ZeRO-3 over the whole world
    assert runs["one_node"]["dims"] is None
    assert all(r["shard_group"] == list(range(WORLD)) for r in runs["one_node"]["ranks"])


def test_two_nodes_train_like_one_node(runs: dict[str, dict[str, Any]]) -> None:
    """Per rank and step, the same samples and the same loss; after fit, the same whole weights."""
    two, one = runs["two_nodes"], runs["one_node"]
    for rank, (mine, ref) in enumerate(zip(two["ranks"], one["ranks"])):
        # the premise of comparing per rank: the sampler dealt this rank the same samples in both layouts
        assert mine["batches"] == ref["batches"], f"rank {rank} saw other samples"
        assert len(mine["losses"]) == STEPS
        assert mine["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL, rel=0), f"rank {rank}"
    # the losses moved: the comparison is of a model that trained
    assert one["ranks"][0]["losses"][0] != one["ranks"][0]["losses"][-1]

    weights, expected = two["state_dict"], one["state_dict"]
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        reference = expected[name]
        assert value.shape == reference.shape, name
        noise = _key_bias_mask(name, value)
        torch.testing.assert_close(value[~noise], reference[~noise], atol=WEIGHT_ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        if noise.any():
            for run_values in (value[noise], reference[noise]):
                assert run_values.abs().max().item() < KEY_BIAS_NOISE_BOUND, f"{name}: a key bias left zero"
