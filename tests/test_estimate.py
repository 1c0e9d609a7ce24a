"""The memory estimator against measurement (model_state_bytes after training steps), its
activation probe, its errors and the `lightning-zero estimate` command."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from harness import launched_environment, run_on_ranks
from models import TinyGPT, loader, token_data

from lightning_zero import CPUOffloadPolicy, ZeroConfig, ZeroStrategy, estimate_memory
from lightning_zero.cli import main
from lightning_zero.offload import CPUOffloadPolicy
from lightning_zero.profiling import measure_activations

TOLERANCE = 0.05  # relative, per category: padding to a multiple of the ranks and Adam's step scalars
WIDTH = 128


def cases() -> list[tuple[int, str, str, bool]]:
    """(stage, precision, offload, frozen): frozen freezes the embedding and the block, as a fine-tuning would."""
    out = []
    for stage in (1, 2, 3):
        for precision in ("32-true", "bf16-mixed"):
            for offload in ("none", "optimizer", "params"):
                if offload != "params" or stage == 3:
                    out.append((stage, precision, offload, False))
    out += [(1, "bf16-mixed", "none", True), (2, "32-true", "optimizer", True), (3, "bf16-mixed", "none", True),
            (3, "32-true", "params", True), (3, "bf16-mixed", "optimizer", True)]
    return out


def tiny_gpt(frozen: bool) -> TinyGPT:
    module = TinyGPT(width=WIDTH)
    if frozen:
        module.embed.requires_grad_(False)
        module.block.requires_grad_(False)
    return module


def config_of(stage: int, offload: str) -> ZeroConfig:
    policy = CPUOffloadPolicy() if offload != "none" else None
    return ZeroConfig(stage=stage, offload_optimizer=policy, offload_params=policy if offload == "params" else None)


def _measure() -> list[tuple[int, str, str, bool, tuple[int, int, int]]]:
    out = []
    for stage, precision, offload, frozen in cases():
        torch.manual_seed(0)
        module = tiny_gpt(frozen)
        strategy = ZeroStrategy(config=config_of(stage, offload))
        measured: dict[str, Any] = {}

        class AfterStep(pl.Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                measured["bytes"] = trainer.strategy.model_state_bytes()

        with launched_environment():
            trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=2,
                                 precision=precision, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[AfterStep()])
            trainer.fit(module, train_dataloaders=loader())
        state = measured["bytes"]
        out.append((stage, precision, offload, frozen, (state.params, state.grads, state.optimizer_states)))
    return out


@pytest.fixture(scope="module")
def measured() -> dict[int, list[tuple[int, str, str, bool, tuple[int, int, int]]]]:
    return {world: run_on_ranks(_measure, world)[0] for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_estimate_matches_measurement(measured: dict[int, Any], world: int) -> None:
    """Stages 1-3 x {fp32, bf16-mixed} x {no offload, optimizer, parameters}, and a model with
    frozen parts: each category of the estimate within 5% of what the rank holds after optimizer
    steps."""
    errors = []
    for stage, precision, offload, frozen, got in measured[world]:
        estimate = estimate_memory(tiny_gpt(frozen), world, config_of(stage, offload), precision, device_type="cpu")
        device, host = estimate.device, estimate.host
        expected = (device.params + host.params, device.grads + host.grads,
                    device.optimizer_states + host.optimizer_states)
        for name, value, want in zip(("params", "grads", "optimizer"), got, expected):
            error = abs(value - want) / value
            errors.append(error)
            assert error <= TOLERANCE, (world, stage, precision, offload, frozen, name, value, want)
        assert sum(got) == pytest.approx(estimate.model_states, rel=TOLERANCE)
    print(f"world {world}: largest relative error {max(errors):.2e}")


def test_offload_moves_state_to_the_host() -> None:
    model = TinyGPT(width=WIDTH)
    on_device = estimate_memory(model, 4, config_of(3, "none"), "bf16-mixed")
    offloaded = estimate_memory(model, 4, config_of(3, "params"), "bf16-mixed")
    assert on_device.host.model_states == 0
    assert offloaded.device.params == offloaded.device.optimizer_states == offloaded.device.grads == 0
    assert offloaded.model_states == on_device.model_states
    half = estimate_memory(model, 4, ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(ratio=0.5)))
    assert half.host.optimizer_states == pytest.approx(half.device.optimizer_states, rel=1e-6)
    # fp32 at stage 3 on a GPU with the optimizer offloaded: the host master is a copy of the shard
    fp32 = estimate_memory(model, 4, config_of(3, "optimizer"), "32-true", device_type="cuda")
    same = estimate_memory(model, 4, config_of(3, "none"), "32-true", device_type="cuda")
    assert fp32.model_states - same.model_states == pytest.approx(4 * sum(p.numel() for p in model.parameters()) / 4,
                                                                  abs=8)


def test_formulas_for_a_parameter_count() -> None:
    """[Note: memory of one rank]: 1e9 parameters, bf16, Adam, 8 ranks."""
    psi, n = 10**9, 8
    stage1 = estimate_memory(psi, n, ZeroConfig(stage=1), "bf16-mixed")
    assert (stage1.device.params, stage1.device.grads, stage1.device.optimizer_states) == (
        2 * psi, 4 * psi + 4 * psi // n, 12 * psi // n)
    stage3 = estimate_memory(psi, n, ZeroConfig(stage=3), "bf16-mixed")
    assert (stage3.device.params, stage3.device.grads, stage3.device.optimizer_states) == (
        2 * psi // n, 4 * psi // n, 12 * psi // n)
    assert stage3.device.activations is None and any("activations unknown" in note for note in stage3.notes)
    # Stages 1/2 on CUDA: the fused device Adam's bf16 staging chunk (P Ψ/N), none without it; on the
    # CPU it writes into the parameters' own chunk (no staging), offloaded or not.
    for device_type, staging in (("cuda", 2 * psi // n), ("cpu", 0)):
        fused = estimate_memory(psi, n, ZeroConfig(stage=2), "bf16-mixed", device_type=device_type)
        own_step = estimate_memory(psi, n, ZeroConfig(stage=2, fused_adam="off"), "bf16-mixed", device_type=device_type)
        assert fused.device.comm_buffers - own_step.device.comm_buffers == staging, device_type
    offload = ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy())
    assert estimate_memory(psi, n, offload, "bf16-mixed").host.comm_buffers == 2 * psi // n
    assert estimate_memory(psi, n, offload, "bf16-mixed", device_type="cpu").host.comm_buffers == 0
    assert estimate_memory(psi, n, ZeroConfig(stage=2), "32-true").device.comm_buffers == estimate_memory(
        psi, n, ZeroConfig(stage=2, fused_adam="off"), "32-true").device.comm_buffers


def test_activations_are_measured_from_one_micro_batch() -> None:
    torch.manual_seed(0)
    model = TinyGPT(width=WIDTH)
    tokens, targets = token_data(16).tensors
    small = measure_activations(model, (tokens[:4], targets[:4]))
    large = measure_activations(model, (tokens[:8], targets[:8]))
    assert small > 0 and 1.8 < large / small < 2.2
    estimate = estimate_memory(model, 2, ZeroConfig(stage=2), sample_batch=(tokens[:4], targets[:4]))
    assert estimate.device.activations == small
    # bf16-true runs the module in bf16: the fp32 probe counts each floating activation at 2 bytes
    assert 0.45 < measure_activations(model, (tokens[:4], targets[:4]), "bf16-true") / small < 0.55  # ints stay
    assert not any(p.grad is not None for p in model.parameters())  # the probe runs no backward


def test_bad_input_is_refused_with_the_fix() -> None:
    model = TinyGPT(width=8)
    with pytest.raises(ValueError, match=r"precision='fp8'\) is not supported"):
        estimate_memory(model, 2, precision="fp8")
    with pytest.raises(ValueError, match="world_size=0"):
        estimate_memory(model, 0)
    with pytest.raises(ValueError, match="model=-5"):
        estimate_memory(-5, 2)
    with pytest.raises(ValueError, match="optimizer_moments=-1"):
        estimate_memory(model, 2, optimizer_moments=-1)
    with pytest.raises(ValueError, match="reduce_bucket_size=-1 must be a positive"):
        ZeroConfig(reduce_bucket_size=-1)
    with pytest.raises(ValueError, match="offload_params needs stage 3"):
        ZeroConfig(stage=2, offload_optimizer=CPUOffloadPolicy(), offload_params=CPUOffloadPolicy())
    with pytest.raises(ValueError, match="needs the model itself"):
        estimate_memory(1000, 2, sample_batch=torch.zeros(1))
    # A module whose layers configure_model() builds has none yet: a message, not an estimate of 0 bytes.
    with pytest.raises(ValueError, match=r"has no parameters \(yet\).*configure_model\(\)"):
        estimate_memory(torch.nn.Module(), 2)
    with pytest.raises(ValueError, match="frozen_params=5.*is for a parameter count"):
        estimate_memory(model, 2, frozen_params=5)
    with pytest.raises(ValueError, match="frozen_params=-1"):
        estimate_memory(1000, 2, frozen_params=-1)


def test_frozen_parameters_are_held_not_trained() -> None:
    """[Note: memory of one rank]: frozen elements cost their parameter bytes (and at stage 3 the
    unit's master), never a master gradient or moments; a module and its counts agree; Lightning's
    short precision flags are the long ones."""
    psi, frozen, n = 10**6, 4 * 10**6, 4
    for stage in (1, 2):
        with_frozen = estimate_memory(psi, n, ZeroConfig(stage=stage), "bf16-mixed", frozen_params=frozen)
        alone = estimate_memory(psi, n, ZeroConfig(stage=stage), "bf16-mixed")
        assert with_frozen.device.params - alone.device.params == 2 * frozen
        assert (with_frozen.device.grads, with_frozen.device.optimizer_states) == (
            alone.device.grads, alone.device.optimizer_states)
    # Counted frozen parameters sit in units of their own: a master each, no master gradient.
    stage3 = estimate_memory(psi, n, ZeroConfig(stage=3), "bf16-mixed", frozen_params=frozen)
    assert (stage3.device.params, stage3.device.grads, stage3.device.optimizer_states) == (
        2 * (psi + frozen) // n, 4 * psi // n, 4 * (psi + frozen) // n + 8 * psi // n)
    assert stage3.frozen_params == frozen and stage3.num_params == psi
    module = tiny_gpt(frozen=True)
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    held = sum(p.numel() for p in module.parameters()) - trained
    from_module = estimate_memory(module, n, ZeroConfig(stage=1), "bf16")
    from_counts = estimate_memory(trained, n, ZeroConfig(stage=1), "bf16-mixed", frozen_params=held)
    assert (from_module.num_params, from_module.frozen_params, from_module.precision) == (trained, held, "bf16-mixed")
    assert from_module.model_states == from_counts.model_states
    # Stage 3, one unit per block: neither the frozen block (a unit of its own) nor the frozen
    # embedding (in the root unit, beside the trained norm and head) has a master gradient.
    blocks = ZeroConfig(stage=3, unit_modules=("TransformerEncoderLayer",), param_persistence_threshold=0)
    assert estimate_memory(module, n, blocks, "bf16").device.grads == 4 * -(-trained // n)
    assert not any("trainable" in note for note in from_module.notes)
    # trained= (what an engine holds gradients for) decides instead of requires_grad, which is left alone.
    whole = tiny_gpt(frozen=False)
    named_trained = {p for p in whole.parameters() if p not in set(whole.embed.parameters()) | set(whole.block.parameters())}
    by_argument = estimate_memory(whole, n, blocks, "bf16", trained=named_trained)
    assert by_argument == estimate_memory(module, n, blocks, "bf16")
    assert all(p.requires_grad for p in whole.parameters())
    with pytest.raises(ValueError, match=r"trained=...\) names parameters of a module; with a count \(1000\)"):
        estimate_memory(1000, 2, trained=set())
    # [Note: masters of frozen pieces]: frozen weights built in bf16 keep no fp32 master at stage 3 under bf16.
    in_bf16 = tiny_gpt(frozen=True)
    for param in in_bf16.parameters():
        if not param.requires_grad:
            param.data = param.data.bfloat16()
    for precision in ("bf16-mixed", "bf16-true"):
        fp32_base, bf16_base = (estimate_memory(m, n, blocks, precision) for m in (module, in_bf16))
        assert fp32_base.device.optimizer_states - bf16_base.device.optimizer_states == 4 * -(-held // n)
        assert (bf16_base.device.params, bf16_base.device.grads) == (fp32_base.device.params, fp32_base.device.grads)
    assert estimate_memory(in_bf16, n, blocks, "16-mixed") == estimate_memory(module, n, blocks, "16-mixed")
    # Per piece: a frozen norm kept in fp32 beside that bf16 base (as Hugging Face's
    # _keep_in_fp32_modules keeps them) has a master of its own, and the base still none.
    norm_in_fp32 = copy.deepcopy(in_bf16)
    norm_in_fp32.block.norm1.float()
    kept = sum(p.numel() for p in norm_in_fp32.block.norm1.parameters())
    with_norm, bf16_base = (estimate_memory(m, n, blocks, "bf16-mixed") for m in (norm_in_fp32, in_bf16))
    assert with_norm.device.optimizer_states - bf16_base.device.optimizer_states == 4 * (
        -(-(trained + kept) // n) - -(-trained // n))
    # At 32-true every parameter is held in its own dtype: an offloaded master (on the host, the
    # shard on the GPU) is the trained pieces' alone, as if nothing were frozen.
    offloaded = ZeroConfig(stage=3, unit_modules=("TransformerEncoderLayer",), param_persistence_threshold=0,
                           offload_optimizer=CPUOffloadPolicy())
    with_base, without = (estimate_memory(m, n, offloaded, "32-true") for m in (module, trained))
    assert with_base.host.optimizer_states == without.host.optimizer_states > 0
    module.requires_grad_(False)
    assert any("no trainable parameters" in note for note in estimate_memory(module, n).notes)


def test_estimate_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "7e9", "--world-sizes", "8", "64", "--offload", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 trainable parameters" in out and "GiB" in out
    assert out.count("│     8 │") == 3 and out.count("│    64 │") == 3
    assert main(["estimate", "models:TinyGPT", "--world-sizes", "2", "--stages", "3"]) == 0
    assert "MiB" in capsys.readouterr().out
    assert main(["estimate", "models:Nothing"]) == 2
    assert "cannot import 'Nothing' from 'models'" in capsys.readouterr().err
    assert main(["estimate", "-3"]) == 2
    for bad in ("inf", "1e400", "7.9"):
        assert main(["estimate", bad]) == 2
        assert "neither a whole parameter count" in capsys.readouterr().err


def test_estimate_command_takes_a_hugging_face_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user with a config.json (or its directory) estimates without writing a factory; nothing is
    allocated (the model is built on the meta device) and tied weights count once."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0,
                        eos_token_id=0)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        expected = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["estimate", model, "--world-sizes", "2", "--stages", "3"]) == 0
        assert f"{expected:,} trainable parameters" in capsys.readouterr().out
    assert main(["estimate", str(tmp_path / "missing.json")]) == 2
    assert "missing.json': no such file" in capsys.readouterr().err
    (tmp_path / "unknown.json").write_text('{"model_type": "no_such_architecture"}')
    assert main(["estimate", str(tmp_path / "unknown.json")]) == 2
    assert "cannot read a Hugging Face config from" in capsys.readouterr().err
