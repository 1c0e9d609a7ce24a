"""Exporting a sharded checkpoint as a Hugging Face model directory (see [Note: Hugging Face
export] in lightning_zero/checkpoint/hf.py): a GPT-2 trained at ZeRO-3 on 2 gloo ranks inside a
LightningModule loads with ``from_pretrained`` and equals the trained model, weight for weight and
in its logits. The reference for the shard split is huggingface_hub's own.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from harness import launched_environment, run_on_ranks
from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, consolidate_hf, sharded
from lightning_zero.checkpoint.hf import plan_shards, shard_names
from lightning_zero.cli import main

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 64, 8
SHARD_BYTES = 10_000  # below the MLP weights (32 x 128 x 4 = 16384 bytes): they get shards of their own


def _config() -> Any:
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


class HFWrapper(pl.LightningModule):
    """A LightningModule holding the Hugging Face model as an attribute: its keys are model.*"""

    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.GPT2LMHeadModel(_config())

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def predict_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0]).logits

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _tokens(samples: int, seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))


def _train(directory: str) -> dict[str, Any]:
    """ZeRO-3 (every parameter sharded) for 4 steps; the sharded checkpoint, the config, and the
    trained model's weights and logits as the reference."""
    pl.seed_everything(0)
    module = HFWrapper()
    with launched_environment():
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(config=ZeroConfig(stage=3, min_unit_numel=1)),
                             max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False)
        trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(_tokens(16, 0)), batch_size=4))
        trainer.save_checkpoint(os.path.join(directory, "gpt2.ckpt"))
        with trainer.strategy.gathered_params(writeback=False):
            state = {key: value.detach().clone() for key, value in module.model.state_dict().items()}
        # every rank predicts on the same batch (no distributed sampler)
        logits = trainer.predict(module, dataloaders=DataLoader(TensorDataset(_tokens(3, 1)), batch_size=3))
    if trainer.is_global_zero:
        module.model.config.save_pretrained(os.path.join(directory, "config"))
    return {"state": state, "logits": logits[0]}


@pytest.fixture(scope="module")
def trained() -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        ranks = run_on_ranks(_train, 2, directory)
        yield {"directory": Path(directory), "ckpt": Path(directory) / "gpt2.ckpt", "config": Path(directory) / "config",
               **ranks[0]}


def _weights_of(directory: Path) -> tuple[dict[str, Tensor], dict[str, dict[str, str]]]:
    from safetensors import safe_open

    tensors: dict[str, Tensor] = {}
    metadata: dict[str, dict[str, str]] = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            metadata[path.name] = handle.metadata()
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors, metadata


def test_sharded_export_loads_with_from_pretrained_and_equals_the_trained_model(trained: dict[str, Any], tmp_path: Path) -> None:
    out = consolidate_hf(trained["ckpt"], tmp_path / "gpt2", max_shard_size=SHARD_BYTES, hf_config=trained["config"],
                         progress=False)
    reference: dict[str, Tensor] = trained["state"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = sorted(path.name for path in out.glob("model*.safetensors"))
    count = len(names)
    assert count > 2 and names == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(path.name for path in out.iterdir()) == sorted(["config.json", "model.safetensors.index.json", *names])
    tensors, metadata = _weights_of(out)
    # one copy of the tied weight, under the name GPT-2's _tied_weights_keys points to
    assert set(tensors) == set(reference) - {"lm_head.weight"}
    assert index == {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": index["weight_map"]}
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(names)
    assert all(value == {"format": "pt"} for value in metadata.values())
    for name in names:  # bounded, unless one tensor alone is larger than the bound
        keys = [key for key, file in index["weight_map"].items() if file == name]
        size = sum(tensors[key].numel() * tensors[key].element_size() for key in keys)
        assert size <= SHARD_BYTES or len(keys) == 1, (name, keys, size)
    assert any(len([k for k, f in index["weight_map"].items() if f == n]) == 1 and
               tensors[[k for k, f in index["weight_map"].items() if f == n][0]].nbytes > SHARD_BYTES for n in names)

    model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    for key, value in reference.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied again
    pl.seed_everything(0)
    initial = HFWrapper().model.state_dict()  # what the ranks started from: training changed every weight
    assert all(not torch.equal(initial[key], value) for key, value in reference.items() if key.endswith("weight"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_tokens(3, 1)).logits
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-5)


def test_bf16_export_fits_one_file_by_default_as_save_pretrained_writes_it(trained: dict[str, Any], tmp_path: Path) -> None:
    out = consolidate_hf(trained["ckpt"], tmp_path / "gpt2-bf16", dtype="bf16", hf_config=trained["config"] / "config.json",
                         progress=False)
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors, _ = _weights_of(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    model = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.bfloat16)
    loaded = model.state_dict()
    for key, value in trained["state"].items():
        assert torch.equal(loaded[key], value.bfloat16()), key


def test_console_command_writes_overwrites_and_refuses_a_non_empty_directory(trained: dict[str, Any], tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero.cli", "consolidate", str(trained["ckpt"]), str(out), "--format", "hf",
         "--max-shard-size", "30KB", "--hf-config", str(trained["config"]), "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    shards = sorted(path.name for path in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and f"wrote {out} ({len(shards)} safetensors file(s)" in result.stdout
    (out / "tokenizer.json").write_text("{}")  # the user's own file: kept by --overwrite

    assert main(["consolidate", str(trained["ckpt"]), str(out), "--format", "hf", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert f"{out} exists and is not empty" in error and "--overwrite" in error and "Traceback" not in error

    assert main(["consolidate", str(trained["ckpt"]), str(out), "--format", "hf", "--no-progress", "--overwrite",
                 "--strip-prefix", "model."]) == 0
    # one file now: the earlier shards and index are gone, the config and the tokenizer stay
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, trained["state"]["transformer.h.1.mlp.c_fc.weight"])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--max-shard-size", "12 parsecs"], "--max-shard-size='12 parsecs' is not a number of bytes"),
        (["--max-shard-size", "0"], "--max-shard-size='0' must be a positive number of bytes"),
        (["--strip-prefix", "encoder."], "strip_prefix='encoder.': no key of"),
        (["--hf-config", "nowhere.json"], "hf_config: nowhere.json does not exist"),
    ],
)
def test_console_command_reports_bad_options_without_a_traceback(trained: dict[str, Any], tmp_path: Path, arguments: list[str],
                                                                  message: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad"
    assert main(["consolidate", str(trained["ckpt"]), str(out), "--format", "hf", "--no-progress", *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert not out.exists()  # nothing was created


def test_hf_options_without_format_hf_and_a_file_name_with_it_are_refused(trained: dict[str, Any], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["consolidate", str(trained["ckpt"]), str(tmp_path / "x.pt"), "--max-shard-size", "1GB"]) == 2
    assert "--max-shard-size only apply to --format hf" in capsys.readouterr().err
    assert main(["consolidate", str(trained["ckpt"]), str(tmp_path / "x.safetensors"), "--format", "hf"]) == 2
    assert "--format hf writes a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        consolidate_hf(trained["ckpt"], tmp_path / "file")
    with pytest.raises(ValueError, match="max_shard_size='2 GBs' is not a number of bytes"):
        consolidate_hf(trained["ckpt"], tmp_path / "y", max_shard_size="2 GBs")
    with pytest.raises(ValueError, match="max_shard_size=True is not a number of bytes"):
        consolidate_hf(trained["ckpt"], tmp_path / "y", max_shard_size=True)
    with pytest.raises(ValueError, match="consolidate_hf\\(dtype='int8'\\) is not one of"):
        consolidate_hf(trained["ckpt"], tmp_path / "y", dtype="int8")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ no ranks needed
def _checkpoint(path: Path, tensors: dict[str, Tensor], aliases: dict[str, str], lightning: dict[str, Any]) -> Path:
    """A tiny but real sharded checkpoint (single process) with ``aliases`` tied to saved keys."""
    keys = list(tensors) + list(aliases)
    meta = sharded.CheckpointMeta(world_size=1, stage=2, model_keys=keys, aliases=aliases, param_dtypes={},
                                  lightning=lightning)
    sharded.save_sharded(path, {"model": dict(tensors), sharded.META_KEY: meta.to_entry()})
    return path


def _exported_keys(directory: Path) -> dict[str, Tensor]:
    return _weights_of(directory)[0]


def test_the_prefix_is_detected_only_for_checkpoints_a_trainer_wrote(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weight, bias = torch.randn(3, 2), torch.randn(3)
    # a bare module whose keys all share one attribute (as CLIPTextModel's text_model.*): kept
    bare = _checkpoint(tmp_path / "bare.ckpt", {"text_model.weight": weight, "text_model.bias": bias}, {}, {})
    assert set(_exported_keys(consolidate_hf(bare, tmp_path / "bare", progress=False))) == {"text_model.weight",
                                                                                           "text_model.bias"}
    # a LightningModule's: the attribute holding the model is stripped; strip_prefix="" keeps it
    lightning = {"pytorch-lightning_version": "2.6.6", "global_step": 1}
    wrapped = _checkpoint(tmp_path / "wrapped.ckpt", {"model.linear.weight": weight, "model.linear.bias": bias}, {},
                          lightning)
    assert set(_exported_keys(consolidate_hf(wrapped, tmp_path / "auto", progress=False))) == {"linear.weight", "linear.bias"}
    kept = consolidate_hf(wrapped, tmp_path / "kept", strip_prefix="", progress=False)
    assert set(_exported_keys(kept)) == {"model.linear.weight", "model.linear.bias"}
    # two attributes: nothing is detected; an explicit prefix (without its dot) selects one and says what it left out
    two = _checkpoint(tmp_path / "two.ckpt", {"model.linear.weight": weight, "loss.scale": bias}, {}, lightning)
    assert set(_exported_keys(consolidate_hf(two, tmp_path / "two", progress=False))) == {"model.linear.weight", "loss.scale"}
    with caplog.at_level(logging.WARNING):
        chosen = consolidate_hf(two, tmp_path / "chosen", strip_prefix="model", progress=False)
    assert set(_exported_keys(chosen)) == {"linear.weight"}
    assert "not under 'model.' and are left out of the export: ['loss.scale']" in caplog.text
    assert "has no config.json, which from_pretrained needs" in caplog.text


def test_a_compiled_model_is_exported_under_the_keys_of_the_model_it_compiled(tmp_path: Path) -> None:
    """`self.model = torch.compile(self.model)` (or a compiled block) saves `_orig_mod.` in the
    keys; the export leaves it out, as from_pretrained needs."""
    weight, bias = torch.randn(3, 2), torch.randn(3)
    lightning = {"pytorch-lightning_version": "2.6.6", "global_step": 1}
    compiled = _checkpoint(tmp_path / "compiled.ckpt", {"model._orig_mod.linear.weight": weight,
                                                        "model._orig_mod.h.0._orig_mod.bias": bias}, {}, lightning)
    exported = _exported_keys(consolidate_hf(compiled, tmp_path / "compiled", progress=False))
    assert set(exported) == {"linear.weight", "h.0.bias"} and torch.equal(exported["linear.weight"], weight)
    explicit = consolidate_hf(compiled, tmp_path / "explicit", strip_prefix="model._orig_mod.", progress=False)
    assert set(_exported_keys(explicit)) == {"linear.weight", "h.0.bias"}


def test_peft_adapter_layers_are_refused_with_the_ways_to_export_them(tmp_path: Path) -> None:
    """A LoRA model as peft wraps it saves ``base_layer.weight`` beside ``lora_A.default.weight``,
    names no base model has: from_pretrained would initialize every adapted layer at random."""
    lightning = {"pytorch-lightning_version": "2.6.6", "global_step": 1}
    prefix = "model.base_model.model.transformer.h.0.attn.c_attn."
    ckpt = _checkpoint(tmp_path / "peft.ckpt", {prefix + "base_layer.weight": torch.randn(4, 4),
                                                prefix + "lora_A.default.weight": torch.randn(2, 4),
                                                prefix + "lora_B.default.weight": torch.randn(4, 2)}, {}, lightning)
    for strip_prefix in (None, "model.base_model.model."):
        with pytest.raises(CheckpointError) as refused:
            consolidate_hf(ckpt, tmp_path / "out", strip_prefix=strip_prefix, progress=False)
        message = str(refused.value)
        assert "holds peft adapter layers (" in message and "c_attn.base_layer.weight'" in message
        assert "c_attn.lora_A.default.weight'" in message and "merge_and_unload()" in message
    assert not (tmp_path / "out").exists()


def test_a_module_of_ones_own_named_base_layer_exports(tmp_path: Path) -> None:
    """``base_layer`` with no peft adapter beside it is the user's own name: exported as it is."""
    weight = torch.randn(4, 4)
    ckpt = _checkpoint(tmp_path / "own.ckpt", {"model.encoder.base_layer.weight": weight,
                                               "model.head.weight": torch.randn(2, 4)}, {}, {})
    exported = _exported_keys(consolidate_hf(ckpt, tmp_path / "out", strip_prefix="model.", progress=False))
    assert set(exported) == {"encoder.base_layer.weight", "head.weight"}
    assert torch.equal(exported["encoder.base_layer.weight"], weight)


def test_a_tied_weight_is_written_once_unless_what_it_is_tied_to_is_left_out(tmp_path: Path) -> None:
    embed, norm = torch.randn(5, 4), torch.randn(4)
    ckpt = _checkpoint(tmp_path / "tied.ckpt", {"model.embed.weight": embed, "model.norm.weight": norm},
                       {"model.head.weight": "model.embed.weight"}, {})
    once = _exported_keys(consolidate_hf(ckpt, tmp_path / "once", strip_prefix="model.", progress=False))
    assert set(once) == {"embed.weight", "norm.weight"} and torch.equal(once["embed.weight"], embed)
    # the export of model.head alone still holds the head's weight (read from the key it is tied to)
    outside = _checkpoint(tmp_path / "outside.ckpt", {"embed.weight": embed, "model.norm.weight": norm},
                          {"model.head.weight": "embed.weight"}, {})
    alone = _exported_keys(consolidate_hf(outside, tmp_path / "alone", strip_prefix="model.", progress=False))
    assert set(alone) == {"head.weight", "norm.weight"} and torch.equal(alone["head.weight"], embed)


def test_a_failed_export_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _checkpoint(tmp_path / "c.ckpt", {f"w{i}": torch.randn(100) for i in range(4)}, {}, {})
    import safetensors.torch

    calls: list[str] = []

    def fail_second(tensors: dict[str, Tensor], filename: str, metadata: dict[str, str]) -> None:
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        real(tensors, filename, metadata=metadata)

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", fail_second)
    with pytest.raises(OSError, match="disk full"):
        consolidate_hf(ckpt, tmp_path / "out", max_shard_size=400, progress=False)
    assert len(calls) == 2 and not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="disk full"):
        calls.clear()
        consolidate_hf(ckpt, tmp_path / "kept", max_shard_size=400, progress=False)
    assert list((tmp_path / "kept").iterdir()) == []  # no temporary shard left behind


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        consolidate_hf(tmp_path / "empty", tmp_path / "out", progress=False)


@pytest.mark.parametrize("limit", [1, 10, 12, 25, 1000])
def test_the_shard_split_is_huggingface_hubs(limit: int) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    sizes = [("a", 6), ("b", 6), ("c", 20), ("d", 3), ("e", 4), ("f", 10), ("g", 1)]
    state = {name: torch.zeros(size, dtype=torch.uint8) for name, size in sizes}
    expected = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    shards = plan_shards(sizes, limit)
    assert dict(zip(shard_names(len(shards)), shards)) == expected.filename_to_tensors


def test_a_bare_hugging_face_model_is_exported_under_its_own_keys(tmp_path: Path) -> None:
    """A model trained bare (no LightningModule): keys as saved, loaded by from_pretrained."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    state = model.state_dict()
    tensors = {k: v.detach() for k, v in state.items() if k != "lm_head.weight"}
    ckpt = _checkpoint(tmp_path / "bare.ckpt", tensors, {"lm_head.weight": "transformer.wte.weight"}, {})
    out = consolidate_hf(ckpt, tmp_path / "out", hf_config=_saved_config(model, tmp_path), progress=False)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def _saved_config(model: nn.Module, directory: Path) -> Path:
    model.config.save_pretrained(directory / "config")  # type: ignore[operator]
    return directory / "config"
