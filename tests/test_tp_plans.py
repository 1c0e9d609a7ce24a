"""Tensor-parallel plans (lightning_zero/parallel/plans.py) on 2 gloo ranks against a single-process reference.

One 2-rank group runs every parity sub-case (demo GPT, Hugging Face GPT-2, Llama: loss, every
gradient, the weights after one SGD step) plus the checks that need a real mesh; the checks that
raise before any mesh use run in this process with a stand-in mesh.
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel

from harness import run_on_ranks
from lightning_zero.parallel.plans import (
    FusedQKV,
    TensorParallelPlanError,
    _convert_gpt2_block,
    apply_plan,
    hf_gpt2_state_dict_to_hf,
    parallelize_gpt,
    parallelize_hf_gpt2,
    parallelize_llama,
)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "gpt")
sys.path.insert(0, EXAMPLES)
from model import GPT  # noqa: E402  (examples/gpt/model.py, as tests/test_precision.py imports it)

WORLD = 2
VOCAB = 64
# fp32 throughout. The tensor-parallel model sums the same products in another order (each rank's
# partial matmul, then an all-reduce), so it is not bitwise equal to the reference; 1e-5 is far
# above that rounding (~1e-7 relative here) and far below any real mistake (a wrong head or a
# missed all-reduce moves the loss by ~1e-3 even at this small init, most gradient entries by far more).
TOL = {"rtol": 1e-5, "atol": 1e-5}
SHARD0, SHARD1, REPLICATE = str(Shard(0)), str(Shard(1)), str(Replicate())


# ---------------------------------------------------------------------------------------------
# models (built the same on every rank: fixed seed)
# ---------------------------------------------------------------------------------------------


def _demo_gpt(n_head: int = 4, n_embd: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=n_head, n_embd=n_embd, dropout=0.0)


def _gpt2_config(**overrides: Any) -> Any:
    from transformers import GPT2Config

    settings: dict[str, Any] = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    settings.update(overrides)
    return GPT2Config(**settings)


def _hf_gpt2(**overrides: Any) -> nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(_gpt2_config(**overrides))


def _llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32)
    settings.update(overrides)
    return LlamaConfig(**settings)


def _hf_llama(**overrides: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config(**overrides))


def _demo_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _hf_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    return model(input_ids=tokens, labels=tokens).loss


# Which parameters each plan splits, and how; every other parameter must stay a plain tensor.
EXPECTED_PLACEMENTS: dict[str, list[tuple[str, str]]] = {
    "gpt": [
        (r"blocks\.\d+\.attn\.qkv\.(weight|bias)", SHARD0),
        (r"blocks\.\d+\.attn\.proj\.weight", SHARD1),
        (r"blocks\.\d+\.attn\.proj\.bias", REPLICATE),
        (r"blocks\.\d+\.mlp\.fc\.(weight|bias)", SHARD0),
        (r"blocks\.\d+\.mlp\.proj\.weight", SHARD1),
        (r"blocks\.\d+\.mlp\.proj\.bias", REPLICATE),
    ],
    "gpt2": [
        (r"transformer\.h\.\d+\.attn\.c_attn\.[qkv]\.(weight|bias)", SHARD0),
        (r"transformer\.h\.\d+\.(attn|mlp)\.c_proj\.weight", SHARD1),
        (r"transformer\.h\.\d+\.(attn|mlp)\.c_proj\.bias", REPLICATE),
        (r"transformer\.h\.\d+\.mlp\.c_fc\.(weight|bias)", SHARD0),
    ],
    "llama": [
        (r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.weight", SHARD0),
        (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", SHARD1),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", SHARD0),
        (r"model\.layers\.\d+\.mlp\.down_proj\.weight", SHARD1),
    ],
}


# ---------------------------------------------------------------------------------------------
# what each rank runs
# ---------------------------------------------------------------------------------------------


def _full(tensor: Tensor) -> Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _identity(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return tensors


def _parity(build: Any, parallelize: Any, loss_of: Any, to_reference_names: Any, tp_mesh: Any) -> dict[str, Any]:
    """Reference and tensor-parallel copy: loss, full gradients and full weights after one SGD step."""
    reference = build()
    model = parallelize(copy.deepcopy(reference), tp_mesh)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    result: dict[str, Any] = {}
    for tag, net in (("ref_", reference), ("", model)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        loss = loss_of(net, tokens)
        loss.backward()
        result[f"{tag}loss"] = loss.item()
        result[f"{tag}grads"] = {name: _full(p.grad) for name, p in net.named_parameters() if p.grad is not None}
        optimizer.step()
        result[f"{tag}weights"] = {name: _full(value) for name, value in net.state_dict().items()}
    result["grads"] = to_reference_names(result["grads"])
    result["weights"] = to_reference_names(result["weights"])
    result["placements"] = {
        name: str(p.placements[0]) if isinstance(p, DTensor) else None for name, p in model.named_parameters()
    }
    result["model"] = model  # for the follow-up sub-cases on this rank; dropped before returning
    result["tokens"] = tokens
    return result


def _error(fn: Any, *args: Any) -> str | None:
    try:
        fn(*args)
    except TensorParallelPlanError as error:
        return str(error)
    return None


def _tp_cases() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2LMHeadModel

    tp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tensor",))["tensor"]
    out: dict[str, Any] = {}
    out["gpt"] = _parity(_demo_gpt, parallelize_gpt, _demo_loss, _identity, tp_mesh)
    out["gpt2"] = _parity(_hf_gpt2, parallelize_hf_gpt2, _hf_loss, hf_gpt2_state_dict_to_hf, tp_mesh)
    out["llama"] = _parity(_hf_llama, parallelize_llama, _hf_loss, _identity, tp_mesh)

    # GPT-2 back to Hugging Face: the gathered, converted state dict loads strictly into a fresh model
    # and computes the stepped tensor-parallel model's loss.
    gpt2 = out["gpt2"]
    fresh = GPT2LMHeadModel(_gpt2_config())
    missing, unexpected = fresh.load_state_dict(gpt2["weights"], strict=True)
    with torch.no_grad():
        out["gpt2_reload"] = {
            "missing": list(missing), "unexpected": list(unexpected),
            "fresh_loss": _hf_loss(fresh, gpt2["tokens"]).item(),
            "tp_loss": _hf_loss(gpt2["model"], gpt2["tokens"]).item(),
        }
    out["gpt2_dtensor_state_dict"] = _error(hf_gpt2_state_dict_to_hf, gpt2["model"].state_dict())
    # Lightning calls configure_model at every fit/validate/test: a second call on the same mesh
    # changes nothing; a model split only in part is refused.
    for case, fn in (("gpt2", parallelize_hf_gpt2), ("gpt", parallelize_gpt), ("llama", parallelize_llama)):
        model = out[case]["model"]
        before = {name: p for name, p in model.named_parameters()}
        out[f"{case}_twice"] = {"error": _error(fn, model, tp_mesh),
                                "unchanged": all(p is before[name] for name, p in model.named_parameters())}
    partial = _demo_gpt()
    parallelize_module(partial.blocks[0], tp_mesh, {"attn.qkv": ColwiseParallel()})
    out["gpt_partial"] = _error(parallelize_gpt, partial, tp_mesh)

    # apply_plan takes parallelize_module's patterns: '*' matches one name segment.
    block = _demo_gpt().blocks[0]
    apply_plan(block, tp_mesh, {"mlp.f*": ColwiseParallel(), "mlp.p*": RowwiseParallel()})
    out["pattern"] = {name: str(p.placements[0]) if isinstance(p, DTensor) else None
                      for name, p in block.named_parameters()}

    # A real mesh, a bad head count: refused before anything changes.
    bad = _demo_gpt(n_head=3, n_embd=24)
    out["gpt_bad_heads"] = {
        "error": _error(parallelize_gpt, bad, tp_mesh),
        "dtensors": any(isinstance(p, DTensor) for p in bad.parameters()),
        "n_head": bad.blocks[0].attn.n_head,
    }

    # The meta device: the surgery and the plan run without values, each rank holds its local shapes.
    with torch.device("meta"):
        meta = GPT2LMHeadModel(_gpt2_config())
    parallelize_hf_gpt2(meta, tp_mesh)
    out["gpt2_meta"] = {
        name: (p.is_meta, str(p.placements[0]) if isinstance(p, DTensor) else None,
               tuple((p.to_local() if isinstance(p, DTensor) else p).shape))
        for name, p in meta.named_parameters()
    }
    for case in ("gpt", "gpt2", "llama"):
        del out[case]["model"]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_tp_cases, WORLD)


# ---------------------------------------------------------------------------------------------
# parity on 2 ranks
# ---------------------------------------------------------------------------------------------

CASES = ("gpt", "gpt2", "llama")


@pytest.mark.parametrize("case", CASES)
def test_loss_matches_the_single_process_model(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in ranks:
        result = rank[case]
        assert math.isfinite(result["loss"])
        assert result["loss"] == pytest.approx(result["ref_loss"], **{"rel": TOL["rtol"], "abs": TOL["atol"]})


@pytest.mark.parametrize("case", CASES)
def test_every_gradient_matches_the_reference_gradient(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in ranks:
        result = rank[case]
        assert set(result["grads"]) == set(result["ref_grads"])
        for name, reference in result["ref_grads"].items():
            assert reference.abs().max() > 0, f"{name}: the reference gradient is zero, the comparison proves nothing"
            torch.testing.assert_close(result["grads"][name], reference, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_one_sgd_step_leaves_the_same_full_weights(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in ranks:
        result = rank[case]
        assert set(result["weights"]) == set(result["ref_weights"])
        for name, reference in result["ref_weights"].items():
            torch.testing.assert_close(result["weights"][name], reference, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_only_the_block_linears_are_split(ranks: list[dict[str, Any]], case: str) -> None:
    placements = ranks[0][case]["placements"]
    sharded = 0
    for name, placement in placements.items():
        expected = next((want for pattern, want in EXPECTED_PLACEMENTS[case] if re.fullmatch(pattern, name)), None)
        assert placement == expected, f"{name}: placement {placement}, expected {expected}"
        sharded += placement is not None
    assert sharded >= 4 * 2  # at least four split linears in each of the two blocks
    assert placements == ranks[1][case]["placements"]


def test_gpt2_state_dict_converts_back_and_loads_into_hugging_face(ranks: list[dict[str, Any]]) -> None:
    reload = ranks[0]["gpt2_reload"]
    assert reload["missing"] == [] and reload["unexpected"] == []
    assert reload["fresh_loss"] == pytest.approx(reload["tp_loss"], rel=TOL["rtol"], abs=TOL["atol"])


def test_gpt2_conversion_refuses_dtensors(ranks: list[dict[str, Any]]) -> None:
    message = ranks[0]["gpt2_dtensor_state_dict"]
    assert message is not None and "DTensor" in message and "full_tensor" in message


@pytest.mark.parametrize("case", CASES)
def test_parallelizing_twice_on_the_same_mesh_changes_nothing(ranks: list[dict[str, Any]], case: str) -> None:
    result = ranks[0][f"{case}_twice"]
    assert result["error"] is None and result["unchanged"]


def test_a_model_split_in_part_is_refused(ranks: list[dict[str, Any]]) -> None:
    message = ranks[0]["gpt_partial"]
    assert message is not None and "already" in message and "once" in message


def test_apply_plan_takes_patterns(ranks: list[dict[str, Any]]) -> None:
    placements = ranks[0]["pattern"]
    assert placements["mlp.fc.weight"] == SHARD0 and placements["mlp.proj.weight"] == SHARD1
    assert placements["attn.qkv.weight"] is None and placements["ln_1.weight"] is None


def test_bad_head_count_on_a_real_mesh_changes_nothing(ranks: list[dict[str, Any]]) -> None:
    bad = ranks[0]["gpt_bad_heads"]
    assert bad["error"] is not None and "n_head=3" in bad["error"] and "tp_mesh.size()=2" in bad["error"]
    assert not bad["dtensors"] and bad["n_head"] == 3


def test_gpt2_on_the_meta_device(ranks: list[dict[str, Any]]) -> None:
    params = ranks[0]["gpt2_meta"]
    assert all(is_meta for is_meta, _, _ in params.values())
    c = 32
    assert params["transformer.h.0.attn.c_attn.q.weight"] == (True, SHARD0, (c // WORLD, c))
    assert params["transformer.h.0.attn.c_attn.v.bias"] == (True, SHARD0, (c // WORLD,))
    assert params["transformer.h.1.attn.c_proj.weight"] == (True, SHARD1, (c, c // WORLD))
    assert params["transformer.h.1.mlp.c_fc.weight"] == (True, SHARD0, (4 * c // WORLD, c))
    assert params["transformer.h.1.mlp.c_proj.weight"] == (True, SHARD1, (c, 4 * c // WORLD))
    assert params["transformer.wte.weight"] == (True, None, (VOCAB, c))


# ---------------------------------------------------------------------------------------------
# single process: checks that run before any mesh use (a stand-in mesh), conversions, the demo
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeMesh:
    """What the plans read before any DTensor work: ``ndim`` and ``size()``; nothing else is touched."""

    tp: int
    ndim: int = 1
    mesh_dim_names: tuple[str, ...] = ("tensor",)

    def size(self) -> int:
        return self.tp


def _has_dtensors(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def test_apply_plan_names_the_missing_key_and_close_names() -> None:
    block = _demo_gpt().blocks[0]
    with pytest.raises(TensorParallelPlanError) as error:
        apply_plan(block, FakeMesh(2), {"attn.qkv": ColwiseParallel(), "attn.qvk": ColwiseParallel()})
    message = str(error.value)
    assert "'attn.qvk'" in message and "attn.qkv" in message and "named_modules" in message
    assert not _has_dtensors(block)


def test_apply_plan_needs_a_1d_mesh() -> None:
    with pytest.raises(TensorParallelPlanError, match=r"ndim=2.*device_mesh\['tensor'\]"):
        apply_plan(_demo_gpt().blocks[0], FakeMesh(2, ndim=2), {"attn.qkv": ColwiseParallel()})


def test_apply_plan_refuses_colwise_on_a_non_linear_and_a_non_style() -> None:
    block = _demo_gpt().blocks[0]
    with pytest.raises(TensorParallelPlanError, match=r"'ln_1' is a LayerNorm"):
        apply_plan(block, FakeMesh(2), {"ln_1": ColwiseParallel()})
    with pytest.raises(TensorParallelPlanError, match=r"plan\['attn.qkv'\]='colwise' is a str"):
        apply_plan(block, FakeMesh(2), {"attn.qkv": "colwise"})  # type: ignore[dict-item]


def test_apply_plan_refuses_a_pattern_that_matches_nothing() -> None:
    with pytest.raises(TensorParallelPlanError, match=r"plan key 'mlp\.f\*x' names no submodule"):
        apply_plan(_demo_gpt().blocks[0], FakeMesh(2), {"mlp.f*x": ColwiseParallel()})


@pytest.mark.parametrize(
    ("build", "parallelize", "needle"),
    [
        (lambda: _demo_gpt(n_head=3, n_embd=24), parallelize_gpt, "blocks.0.attn n_head=3"),
        (lambda: _hf_gpt2(n_head=3, n_embd=24), parallelize_hf_gpt2, "transformer.h.0.attn.num_heads=3"),
        (lambda: _hf_llama(num_attention_heads=3, num_key_value_heads=3, hidden_size=24), parallelize_llama,
         "num_attention_heads=3"),
    ],
    ids=["gpt", "gpt2", "llama"],
)
def test_head_count_not_divisible_is_refused_before_any_change(build: Any, parallelize: Any, needle: str) -> None:
    model = build()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(TensorParallelPlanError) as error:
        parallelize(model, FakeMesh(2))
    assert needle in str(error.value) and "tp_mesh.size()=2" in str(error.value)
    after = dict(model.named_parameters())
    assert set(after) == set(before) and not _has_dtensors(model)
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_llama_kv_heads_and_width_not_divisible() -> None:
    with pytest.raises(TensorParallelPlanError, match=r"num_key_value_heads=2 .*tp_mesh.size\(\)=4.*whole KV heads"):
        parallelize_llama(_hf_llama(num_attention_heads=4, num_key_value_heads=2), FakeMesh(4))
    with pytest.raises(TensorParallelPlanError, match=r"intermediate_size=66 .*multiple of 4"):
        parallelize_llama(_hf_llama(num_key_value_heads=4, intermediate_size=66), FakeMesh(4))


def test_gpt2_mlp_width_not_divisible_leaves_conv1d_in_place() -> None:
    model = _hf_gpt2(n_inner=30)
    with pytest.raises(TensorParallelPlanError, match=r"mlp.c_fc width \(GPT2Config.n_inner\)=30"):
        parallelize_hf_gpt2(model, FakeMesh(4))
    attn = model.transformer.h[0].attn
    assert type(attn.c_attn).__name__ == "Conv1D" and attn.split_size == 32 and attn.num_heads == 4


@pytest.mark.parametrize(
    ("parallelize", "model", "needle"),
    [
        (parallelize_gpt, nn.Sequential(nn.Linear(4, 4)), "'blocks'"),
        (parallelize_hf_gpt2, "llama", "'transformer.h' or 'h'"),
        (parallelize_llama, "gpt2", "'model.layers' or 'layers'"),
        (parallelize_hf_gpt2, "gpt", "'transformer.h' or 'h'"),
    ],
    ids=["gpt<-sequential", "gpt2<-llama", "llama<-gpt2", "gpt2<-demo"],
)
def test_wrong_model_structure_names_what_was_expected(parallelize: Any, model: Any, needle: str) -> None:
    built = {"llama": _hf_llama, "gpt2": _hf_gpt2, "gpt": _demo_gpt}[model]() if isinstance(model, str) else model
    with pytest.raises(TensorParallelPlanError) as error:
        parallelize(built, FakeMesh(2))
    assert needle in str(error.value) and type(built).__name__ in str(error.value)


def test_gpt_refuses_an_attention_without_head_dim() -> None:
    # The old [q | k | v] CausalSelfAttention had no head_dim; splitting it by rows would mix heads.
    model = _demo_gpt()
    del model.blocks[1].attn.head_dim
    with pytest.raises(TensorParallelPlanError, match=r"blocks\.1\.attn .*head_dim"):
        parallelize_gpt(model, FakeMesh(2))
    assert model.blocks[0].attn.n_head == 4  # block 0 was checked, not changed


def test_gpt2_surgery_at_tp1_is_exact_and_converts_back() -> None:
    reference, model = _hf_gpt2(), _hf_gpt2()
    for block in model.transformer.h:
        _convert_gpt2_block(block, tp=1)
    assert isinstance(model.transformer.h[0].attn.c_attn, FusedQKV)
    assert isinstance(model.transformer.h[1].mlp.c_proj, nn.Linear)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-6, atol=1e-6)
    converted = hf_gpt2_state_dict_to_hf(model.state_dict())
    expected = reference.state_dict()
    assert list(converted) == list(expected)  # same keys, same order
    for name, value in expected.items():
        assert torch.equal(converted[name], value), name
        assert converted[name].is_contiguous(), name  # e.g. for safetensors


def test_gpt2_conversion_passes_an_unconverted_state_dict_through() -> None:
    state_dict = _hf_gpt2().state_dict()
    converted = hf_gpt2_state_dict_to_hf(state_dict)
    assert list(converted) == list(state_dict)
    assert all(converted[name] is value for name, value in state_dict.items())


def test_gpt2_conversion_names_a_missing_part() -> None:
    model = _hf_gpt2()
    _convert_gpt2_block(model.transformer.h[0], tp=1)
    state_dict = {k: v for k, v in model.state_dict().items() if k != "transformer.h.0.attn.c_attn.v.weight"}
    with pytest.raises(TensorParallelPlanError, match=r"'transformer.h.0.attn.c_attn.v.weight' is missing"):
        hf_gpt2_state_dict_to_hf(state_dict)


def test_demo_attention_is_laid_out_head_by_head() -> None:
    """The demo's qkv rows are [head 0: q, k, v | head 1: ...]: recompute attention from that reading."""
    torch.manual_seed(0)
    attn = _demo_gpt().blocks[0].attn
    heads, head_dim = 4, 8
    x = torch.randn(2, 5, heads * head_dim)
    weight = attn.qkv.weight.view(heads, 3, head_dim, -1)
    bias = attn.qkv.bias.view(heads, 3, head_dim)
    outputs = []
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    for h in range(heads):
        q, k, v = (x @ weight[h, i].T + bias[h, i] for i in range(3))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(~mask, float("-inf"))
        outputs.append(scores.softmax(-1) @ v)
    expected = attn.proj(torch.cat(outputs, dim=-1))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


def test_demo_gpt_still_trains() -> None:
    model = _demo_gpt()
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    assert model(tokens).shape == (4, 16, VOCAB)
    optimizer = torch.optim.AdamW(model.param_groups(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = _demo_loss(model, tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
