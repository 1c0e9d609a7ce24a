"""Ready-made tensor-parallel plans for the demo GPT, Hugging Face GPT-2 and Llama-style models.

Call one inside ``configure_model`` with the 1-D tensor-parallel sub-mesh::

    def configure_model(self) -> None:
        parallelize_llama(self.model, self.device_mesh["tensor"])

[Note: tensor-parallel plans]
Only the transformer blocks are split, Megatron-style, with ``torch.distributed.tensor.parallel``:
the first matmul of each sublayer is ``ColwiseParallel`` (weight ``Shard(0)``: each rank computes
some of the output features: whole attention heads, or a slice of the MLP width) and the second
is ``RowwiseParallel`` (weight ``Shard(1)``: each rank multiplies its slice of the features, and
the partial sums are all-reduced into the replicated output). Both styles keep their default
layouts, ``Replicate`` in and out with ``use_local_output=True``, so:

- between the two matmuls the model's own code (head views, attention, activation) sees plain
  local tensors of this rank's heads or features. That is why each plan adjusts the attention
  code "locally" (head views with ``-1``, split sizes, head-count attributes) and why head
  counts and MLP widths must divide by the tensor size;
- at the block boundary every tensor is plain and replicated, so embeddings, norms, residuals,
  rotary embeddings, the final norm and the head stay ordinary replicated parameters. Their
  gradients agree on every rank because each ``ColwiseParallel`` input's backward all-reduces
  the partial input gradients of its rank's features into the full one.

Per block that is one all-reduce per sublayer in the forward and one in the backward.
``SequenceParallel`` (norms and dropouts on sequence shards) would save activation memory but
hands DTensors to the code between blocks, which Hugging Face models do not expect; it is left
out on purpose. ``parallelize_module`` distributes every weight from tensor rank 0
(``src_data_rank=0``), so the ranks agree even when they built different initial weights; on
the meta device nothing is sent. Apply a plan before creating the optimizer: the parameters
are replaced by new (DTensor) ones.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

__all__ = [
    "FusedQKV",
    "TensorParallelPlanError",
    "apply_plan",
    "hf_gpt2_state_dict_to_hf",
    "parallelize_gpt",
    "parallelize_hf_gpt2",
    "parallelize_llama",
]

_SUGGESTIONS = 3  # close names shown when a plan key is missing
_LISTED_NAMES = 8  # names shown when none is close


class TensorParallelPlanError(ValueError):
    """A plan, mesh or model that a tensor-parallel plan cannot be applied to; raised before any
    parameter is touched, and naming the value and the fix."""


# ---------------------------------------------------------------------------------------------
# apply_plan: validate, then parallelize_module
# ---------------------------------------------------------------------------------------------


def apply_plan(module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Checks ``tp_mesh`` and ``plan`` against ``module``, then ``parallelize_module(module, tp_mesh, plan)``.

    Every key of ``plan`` must name a submodule of ``module`` (a dotted name relative to it, as
    ``module.named_modules()`` spells it; ``*`` patterns match one name segment each, as in
    ``parallelize_module``), every value must be a ``ParallelStyle``, and a ``ColwiseParallel`` or
    ``RowwiseParallel`` must land on ``nn.Linear`` or ``nn.Embedding`` modules. All of that is checked
    before any DTensor work, so a bad plan leaves the module untouched. Returns ``module``.
    """
    _tp_size(tp_mesh, "apply_plan")
    _check_plan(module, plan, "apply_plan")
    parallelize_module(module, tp_mesh, plan)
    return module


def _tp_size(tp_mesh: DeviceMesh, caller: str) -> int:
    ndim = getattr(tp_mesh, "ndim", None)
    if ndim != 1:
        names = getattr(tp_mesh, "mesh_dim_names", None)
        raise TensorParallelPlanError(
            f"{caller}: tp_mesh={tp_mesh!r} has ndim={ndim!r} (dims {names!r}); a tensor-parallel plan needs the 1-D"
            " tensor-parallel sub-mesh: pass device_mesh['tensor'] (e.g. self.device_mesh['tensor'] in"
            " configure_model), not the whole mesh."
        )
    return int(tp_mesh.size())


def _matches(name: str, key: str) -> bool:
    """``parallelize_module``'s rule: the key's dotted atoms match the name's atoms one by one."""
    name_atoms, key_atoms = name.split("."), key.split(".")
    return len(name_atoms) == len(key_atoms) and all(
        fnmatch.fnmatchcase(atom, pattern) for atom, pattern in zip(name_atoms, key_atoms)
    )


def _check_plan(module: nn.Module, plan: Mapping[str, ParallelStyle], caller: str) -> None:
    if not isinstance(plan, Mapping):
        raise TensorParallelPlanError(
            f"{caller}: plan={plan!r} is a {type(plan).__name__}; pass a dict from submodule name to ParallelStyle,"
            " e.g. {'mlp.fc': ColwiseParallel(), 'mlp.proj': RowwiseParallel()}."
        )
    modules = {name: sub for name, sub in module.named_modules() if name}
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TensorParallelPlanError(
                f"{caller}: plan[{key!r}]={style!r} is a {type(style).__name__}, not a ParallelStyle; use"
                " ColwiseParallel(), RowwiseParallel(), SequenceParallel() or PrepareModuleInput(...)."
            )
        targets = [sub for name, sub in modules.items() if _matches(name, key)]
        if not targets:
            raise TensorParallelPlanError(_missing_key_message(caller, key, module, list(modules)))
        if isinstance(style, ColwiseParallel | RowwiseParallel):
            for target in targets:
                if not isinstance(target, nn.Linear | nn.Embedding):
                    raise TensorParallelPlanError(
                        f"{caller}: plan[{key!r}] is {type(style).__name__}, but {key!r} is a {type(target).__name__};"
                        " torch's ColwiseParallel/RowwiseParallel split only nn.Linear and nn.Embedding. Replace the"
                        " module by an equivalent nn.Linear first (as parallelize_hf_gpt2 does with GPT-2's Conv1D)"
                        " or point the key at a Linear submodule."
                    )


def _missing_key_message(caller: str, key: str, module: nn.Module, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=_SUGGESTIONS, cutoff=0.6)
    if close:
        hint = f"close names: {close}"
    else:
        hint = f"its submodules include {names[:_LISTED_NAMES]}" if names else "it has no submodules"
    return (
        f"{caller}: plan key {key!r} names no submodule of {type(module).__name__} ({hint}). Plan keys are dotted"
        " names relative to the module the plan is applied to, as module.named_modules() prints them; fix the key"
        " or apply the plan to the module that holds it."
    )


# ---------------------------------------------------------------------------------------------
# shared checks
# ---------------------------------------------------------------------------------------------


def _find_blocks(model: nn.Module, paths: tuple[str, ...], caller: str, expected: str) -> tuple[str, nn.ModuleList]:
    """The first of the dotted ``paths`` that leads to a ModuleList of blocks."""
    for path in paths:
        found: object = model
        for attr in path.split("."):
            found = getattr(found, attr, None)
            if found is None:
                break
        if isinstance(found, nn.ModuleList):
            return path, found
    raise TensorParallelPlanError(
        f"{caller}: {type(model).__name__} has no block list at {' or '.join(repr(p) for p in paths)}; it expects"
        f" {expected}. Pass that model itself (e.g. self.model inside a LightningModule), or build a plan for your"
        " model and call apply_plan on each block."
    )


def _already_split(blocks: nn.ModuleList, tp_mesh: DeviceMesh, plan: Callable[[], dict[str, ParallelStyle]]) -> bool:
    """Whether every block's planned modules already hold DTensor weights on ``tp_mesh``: the plan
    ran before (Lightning calls configure_model at every fit/validate/test), so it is not run again."""
    for block in blocks:
        for key in plan():
            weight = getattr(block.get_submodule(key), "weight", None) if _has_submodule(block, key) else None
            if not isinstance(weight, DTensor):
                return False
            if weight.device_mesh.mesh.flatten().tolist() != tp_mesh.mesh.flatten().tolist():
                return False
    return True


def _has_submodule(module: nn.Module, key: str) -> bool:
    try:
        module.get_submodule(key)
    except AttributeError:
        return False
    return True


def _check_not_parallel(blocks: nn.ModuleList, path: str, caller: str) -> None:
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if isinstance(param, DTensor):
                raise TensorParallelPlanError(
                    f"{caller}: {path}.{index}.{name} is already a DTensor: the model has been parallelized before."
                    f" Call {caller} once per model, on plain parameters."
                )


def _check_divisible(caller: str, what: str, value: int, tp: int, fix: str) -> None:
    if value % tp != 0:
        raise TensorParallelPlanError(
            f"{caller}: {what}={value} is not divisible by the tensor-parallel size tp_mesh.size()={tp}: {fix}"
        )


def _apply_per_block(blocks: nn.ModuleList, tp_mesh: DeviceMesh, plan: Callable[[], dict[str, ParallelStyle]]) -> None:
    for block in blocks:
        apply_plan(block, tp_mesh, plan())


# ---------------------------------------------------------------------------------------------
# demo GPT (examples/gpt/model.py)
# ---------------------------------------------------------------------------------------------


def _gpt_block_plan() -> dict[str, ParallelStyle]:
    return {
        "attn.qkv": ColwiseParallel(),  # whole heads per rank: [Note: per-head qkv layout] in the demo
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }


def parallelize_gpt(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Splits every block of the demo GPT (``examples/gpt/model.py``) over ``tp_mesh``.

    ``attn.qkv`` and ``mlp.fc`` are column-parallel, ``attn.proj`` and ``mlp.proj`` row-parallel;
    the embeddings, ``ln_f`` and the (tied) ``lm_head`` stay replicated (see [Note:
    tensor-parallel plans]). The demo's fused ``qkv`` is laid out head by head, so each rank's rows
    are whole heads with their q, k and v ([Note: per-head qkv layout] in the demo's model.py).
    Each attention's ``n_head`` becomes its local head count. Returns ``model``.
    """
    caller = "parallelize_gpt"
    tp = _tp_size(tp_mesh, caller)
    path, blocks = _find_blocks(
        model, ("blocks",), caller, "the demo GPT of examples/gpt/model.py (a `blocks` ModuleList)"
    )
    if _already_split(blocks, tp_mesh, _gpt_block_plan):
        return model
    _check_not_parallel(blocks, path, caller)
    heads_per_block: list[int] = []
    for index, block in enumerate(blocks):
        where = f"{path}.{index}"
        _check_plan(block, _gpt_block_plan(), f"{caller} ({where})")
        attn = block.attn
        head_dim = getattr(attn, "head_dim", None)
        if not isinstance(head_dim, int):
            raise TensorParallelPlanError(
                f"{caller}: {where}.attn ({type(attn).__name__}) has no integer head_dim (got {head_dim!r}): it is not"
                " the per-head CausalSelfAttention of examples/gpt/model.py, whose fused qkv rows are grouped by"
                " head. Splitting a [q | k | v] layout by rows would mix heads; update the model file."
            )
        heads = attn.qkv.out_features // (3 * head_dim)
        _check_divisible(
            caller, f"{where}.attn n_head", heads, tp,
            f"choose GPTConfig.n_head as a multiple of {tp}, or a tensor-parallel size that divides {heads}.",
        )
        _check_divisible(caller, f"{where}.mlp.fc out_features (MLP width)", block.mlp.fc.out_features, tp,
                         f"make the MLP width a multiple of {tp}.")
        heads_per_block.append(heads)
    for block, heads in zip(blocks, heads_per_block):
        block.attn.n_head = heads // tp  # informational: the demo's forward reads it off qkv's output
    _apply_per_block(blocks, tp_mesh, _gpt_block_plan)
    return model


# ---------------------------------------------------------------------------------------------
# Hugging Face GPT-2
# ---------------------------------------------------------------------------------------------

# [Note: tensor-parallel GPT-2]
# GPT-2's projections are ``transformers.pytorch_utils.Conv1D``: a Linear whose weight is stored
# transposed, ``[in, out]``, with the bias always present. torch's ColwiseParallel/RowwiseParallel
# split only ``nn.Linear``, and ``c_attn`` fuses q | k | v along its output as three blocks of C
# features: contiguous row sharding would give rank 0 all of q and half of k. So before the plan,
# in every block:
#
# - ``attn.c_attn`` becomes a ``FusedQKV`` holding three ``nn.Linear(C, C)`` children ``q``, ``k``,
#   ``v`` (weights: the transposed column blocks of the Conv1D weight; biases: its slices) whose
#   forward returns ``cat([q(x), k(x), v(x)], -1)``. Each child is column-parallel, so a rank's
#   output is ``[its q heads | its k heads | its v heads]``, and ``attn.split_size = C // tp``
#   makes GPT-2's own ``.split(split_size, dim=2)`` cut it there; its head views use ``-1``.
#   ``attn.num_heads`` becomes the local head count (GPT-2's forward does not read it).
# - ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` become the equivalent ``nn.Linear`` (weight
#   transposed, same output). ``c_fc`` is column-parallel, both ``c_proj`` are row-parallel.
#
# At tp=1 the converted model computes what the original does (the same products, a Linear's
# ``x @ W.T + b`` instead of ``addmm(b, x, W)``). The Linears are built with ``skip_init`` on the
# Conv1D weight's device and dtype and take its values under no_grad (nothing to copy on the meta
# device, where a model built with ``torch.device("meta")`` is converted too), keep its
# ``requires_grad``, and consume no random numbers.
#
# What changes is the state dict: ``attn.c_attn.weight`` [C, 3C] becomes ``attn.c_attn.{q,k,v}.weight``
# [C, C] each (and the biases likewise), and the other three weights are transposed.
# ``hf_gpt2_state_dict_to_hf`` maps a whole-tensor state dict of a converted model back to GPT-2's
# own keys and layouts, so ``GPT2LMHeadModel.load_state_dict`` and ``from_pretrained`` tooling
# read it. Cross-attention blocks (``add_cross_attention``) are not supported.

_GPT2_TRANSPOSED = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GPT2_QKV = ("q", "k", "v")
_GPT2_CONVERTED = re.compile(r"^(?P<prefix>(?:.*\.)?)attn\.c_attn\.q\.weight$")


class FusedQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three Linears, so each can be column-parallel (see [Note:
    tensor-parallel GPT-2]): ``forward(x) = cat([q(x), k(x), v(x)], dim=-1)``."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.q = q
        self.k = k
        self.v = v

    @classmethod
    def from_conv1d(cls, conv: nn.Module) -> FusedQKV:
        """Splits a ``Conv1D(3C, C)`` (weight [C, 3C], q | k | v along the output) into three Linears."""
        width = conv.weight.shape[1] // 3
        parts = [
            _linear(conv.weight[:, i * width:(i + 1) * width], _slice(conv.bias, i, width), conv.weight.requires_grad)
            for i in range(3)
        ]
        return cls(*parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def _slice(bias: Tensor | None, index: int, width: int) -> Tensor | None:
    return None if bias is None else bias[index * width:(index + 1) * width]


def _linear(conv_weight: Tensor, bias: Tensor | None, requires_grad: bool) -> nn.Linear:
    """The nn.Linear computing ``x @ conv_weight + bias`` (``conv_weight`` is [in, out], Conv1D's layout)."""
    in_features, out_features = conv_weight.shape
    linear = torch.nn.utils.skip_init(
        nn.Linear, in_features, out_features, bias=bias is not None, device=conv_weight.device, dtype=conv_weight.dtype
    )
    if not conv_weight.is_meta:
        with torch.no_grad():
            linear.weight.copy_(conv_weight.t())
            if bias is not None:
                linear.bias.copy_(bias)
    for param in linear.parameters():
        param.requires_grad_(requires_grad)
    return linear


def _linear_from_conv1d(conv: nn.Module) -> nn.Linear:
    return _linear(conv.weight, conv.bias, conv.weight.requires_grad)


def _gpt2_block_plan() -> dict[str, ParallelStyle]:
    return {
        "attn.c_attn.q": ColwiseParallel(),
        "attn.c_attn.k": ColwiseParallel(),
        "attn.c_attn.v": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }


def _is_conv1d(module: object) -> bool:
    # By name, so that this module does not import transformers (an optional dependency).
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), Tensor)


def _check_gpt2_block(block: nn.Module, where: str, tp: int, caller: str) -> None:
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if isinstance(getattr(attn, "c_attn", None), FusedQKV):
        raise TensorParallelPlanError(
            f"{caller}: {where}.attn.c_attn is already a FusedQKV: the model has been parallelized before. Call"
            f" {caller} once per model."
        )
    convs = {name: getattr(owner, attr, None) for name, owner, attr in (
        ("attn.c_attn", attn, "c_attn"), ("attn.c_proj", attn, "c_proj"), ("mlp.c_fc", mlp, "c_fc"),
        ("mlp.c_proj", mlp, "c_proj"))}
    for name, conv in convs.items():
        if not _is_conv1d(conv):
            raise TensorParallelPlanError(
                f"{caller}: {where}.{name} is {type(conv).__name__}, not transformers' Conv1D: {caller} expects the"
                " blocks of a transformers GPT2LMHeadModel / GPT2Model. Use the plan of your architecture"
                " (parallelize_llama, parallelize_gpt) or apply_plan with your own plan."
            )
    if getattr(attn, "is_cross_attention", False) or hasattr(block, "crossattention"):
        raise TensorParallelPlanError(
            f"{caller}: {where} has cross-attention (GPT2Config.add_cross_attention=True), which {caller} does not"
            " split; build the model without it or write a plan that also covers crossattention.q_attn."
        )
    heads, width = int(attn.num_heads), int(attn.embed_dim)
    if tuple(convs["attn.c_attn"].weight.shape) != (width, 3 * width):
        raise TensorParallelPlanError(
            f"{caller}: {where}.attn.c_attn.weight has shape {tuple(convs['attn.c_attn'].weight.shape)}, expected"
            f" ({width}, {3 * width}) for GPT-2's fused q | k | v; only unmodified GPT-2 attention is supported."
        )
    _check_divisible(caller, f"{where}.attn.num_heads", heads, tp,
                     f"choose GPT2Config.n_head as a multiple of {tp}, or a tensor-parallel size that divides {heads}.")
    _check_divisible(caller, f"{where}.mlp.c_fc width (GPT2Config.n_inner)", convs["mlp.c_fc"].weight.shape[1], tp,
                     f"make n_inner a multiple of {tp}.")


def _convert_gpt2_block(block: nn.Module, tp: int) -> None:
    """The module surgery of [Note: tensor-parallel GPT-2] on one block; no DTensor yet."""
    attn, mlp = block.attn, block.mlp
    attn.c_attn = FusedQKV.from_conv1d(attn.c_attn)
    attn.c_proj = _linear_from_conv1d(attn.c_proj)
    mlp.c_fc = _linear_from_conv1d(mlp.c_fc)
    mlp.c_proj = _linear_from_conv1d(mlp.c_proj)
    attn.split_size = attn.embed_dim // tp
    attn.num_heads = attn.num_heads // tp


def parallelize_hf_gpt2(model: nn.Module, tp_mesh: DeviceMesh | None) -> nn.Module:
    """Splits every block of a transformers ``GPT2LMHeadModel`` or ``GPT2Model`` over ``tp_mesh``.

    The blocks' Conv1D projections are first replaced by equivalent Linears, ``c_attn`` by a
    :class:`FusedQKV` (see [Note: tensor-parallel GPT-2], which also says how the state-dict keys
    change and how :func:`hf_gpt2_state_dict_to_hf` maps them back); then q, k, v and ``mlp.c_fc``
    are column-parallel and both ``c_proj`` row-parallel. ``wte``, ``wpe``, the norms and
    ``lm_head`` stay replicated. ``tp_mesh=None`` converts the blocks and splits nothing, for a run
    without tensor parallelism (``self.device_mesh`` is None under plain ZeRO) that resumes a
    checkpoint of a split one: its state dict has the same keys. Returns ``model``.
    """
    caller = "parallelize_hf_gpt2"
    tp = 1 if tp_mesh is None else _tp_size(tp_mesh, caller)
    path, blocks = _find_blocks(
        model, ("transformer.h", "h"), caller, "a transformers GPT2LMHeadModel (`transformer.h`) or GPT2Model (`h`)"
    )
    if tp_mesh is None:
        if all(isinstance(getattr(getattr(block, "attn", None), "c_attn", None), FusedQKV) for block in blocks):
            return model  # converted by an earlier call (Lightning calls configure_model at every fit/test)
    elif _already_split(blocks, tp_mesh, _gpt2_block_plan):
        return model
    _check_not_parallel(blocks, path, caller)
    for index, block in enumerate(blocks):
        _check_gpt2_block(block, f"{path}.{index}", tp, caller)
    for block in blocks:
        _convert_gpt2_block(block, tp)
    if tp_mesh is not None:
        _apply_per_block(blocks, tp_mesh, _gpt2_block_plan)
    return model


def hf_gpt2_state_dict_to_hf(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Maps a whole-tensor state dict of a model converted by :func:`parallelize_hf_gpt2` back to
    GPT-2's own keys and layouts (see [Note: tensor-parallel GPT-2]).

    In every converted block (one with an ``attn.c_attn.q.weight`` key, under any prefix, e.g. a
    LightningModule's ``model.``), ``attn.c_attn.{q,k,v}.{weight,bias}`` are fused back into
    ``attn.c_attn.weight`` [C, 3C] and ``attn.c_attn.bias`` [3C], and the Linear weights of
    ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` are transposed back to Conv1D's [in, out].
    Every other key passes through, so a state dict of an unconverted model comes back unchanged.
    The values must be whole tensors: gather DTensors first, e.g.
    ``{k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}``
    on every rank, or ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``.
    """
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            raise TensorParallelPlanError(
                f"hf_gpt2_state_dict_to_hf: state_dict[{key!r}] is a DTensor ({value.placements}); it maps whole"
                " tensors. Gather first, on every rank: {k: v.full_tensor() if isinstance(v, DTensor) else v ...},"
                " or torch.distributed.checkpoint.state_dict.get_model_state_dict(model,"
                " options=StateDictOptions(full_state_dict=True))."
            )
    return _gpt2_to_hf(state_dict, gpt2_converted_prefixes(state_dict))


def gpt2_converted_prefixes(keys: Iterable[str]) -> set[str]:
    """The prefixes of the blocks :func:`parallelize_hf_gpt2` converted, found among ``keys``."""
    return {match["prefix"] for key in keys if (match := _GPT2_CONVERTED.match(key))}


def hf_gpt2_key_plan(shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, list[str], tuple[int, ...]]]:
    """For a converted model's state-dict keys (and their whole shapes), in order: each of GPT-2's
    own keys, the converted keys its tensor is made of, and its shape; what
    :func:`hf_gpt2_state_dict_to_hf` computes, planned before any tensor is read (an export that
    streams the checkpoint keeps each of these groups together). Unconverted keys map to themselves."""
    prefixes = gpt2_converted_prefixes(shapes)
    plan: list[tuple[str, list[str], tuple[int, ...]]] = []
    for key, shape in shapes.items():
        prefix, rest = _split_converted(key, prefixes)
        if prefix is None:
            plan.append((key, [key], shape))
        elif rest in _GPT2_TRANSPOSED:
            plan.append((key, [key], tuple(reversed(shape))))
        elif (fused := _fused_qkv_key(rest)) is not None:
            kind, part = fused
            if part != "q":
                continue
            parts = [f"{prefix}attn.c_attn.{name}.{kind}" for name in _GPT2_QKV]
            missing = [name for name in parts if name not in shapes]
            if missing:
                raise TensorParallelPlanError(
                    f"{missing[0]!r} is missing while {parts[0]!r} is present; GPT-2's fused attn.c_attn needs all of"
                    " q, k and v of every converted block.")
            # Linear weights are [out, in]; Conv1D's fused weight is [in, 3 * out].
            out = sum(shapes[name][0] for name in parts)
            plan.append((f"{prefix}attn.c_attn.{kind}", parts, (shape[1], out) if kind == "weight" else (out,)))
        else:
            plan.append((key, [key], shape))
    return plan


def _gpt2_to_hf(state_dict: Mapping[str, Tensor], prefixes: set[str]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        prefix, rest = _split_converted(key, prefixes)
        if prefix is None:
            out[key] = value
        elif rest in _GPT2_TRANSPOSED:
            out[key] = value.t().contiguous()
        elif (fused := _fused_qkv_key(rest)) is not None:
            kind, part = fused
            if part == "q":  # emitted once, where q stood
                out[f"{prefix}attn.c_attn.{kind}"] = _fuse_qkv(state_dict, prefix, kind)
        else:
            out[key] = value
    return out


def _split_converted(key: str, prefixes: set[str]) -> tuple[str | None, str]:
    for prefix in prefixes:
        if key.startswith(prefix):
            return prefix, key[len(prefix):]
    return None, key


def _fused_qkv_key(rest: str) -> tuple[str, str] | None:
    """('weight' | 'bias', 'q' | 'k' | 'v') for 'attn.c_attn.<part>.<kind>', else None."""
    match = re.fullmatch(r"attn\.c_attn\.([qkv])\.(weight|bias)", rest)
    return None if match is None else (match[2], match[1])


def _fuse_qkv(state_dict: Mapping[str, Tensor], prefix: str, kind: str) -> Tensor:
    parts: list[Tensor] = []
    for part in _GPT2_QKV:
        key = f"{prefix}attn.c_attn.{part}.{kind}"
        if key not in state_dict:
            raise TensorParallelPlanError(
                f"hf_gpt2_state_dict_to_hf: {key!r} is missing while {prefix}attn.c_attn.q.{kind} is present; pass"
                " the whole state dict of the converted model (all of q, k and v of every block)."
            )
        parts.append(state_dict[key])
    # Linear weights are [out, in]; Conv1D's fused weight is [in, 3 * out] with q | k | v along out.
    return torch.cat([p.t() for p in parts], dim=1) if kind == "weight" else torch.cat(parts, dim=0)


# ---------------------------------------------------------------------------------------------
# Llama (and the models that share its module names: Mistral, Qwen2, ...)
# ---------------------------------------------------------------------------------------------


def _llama_block_plan() -> dict[str, ParallelStyle]:
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _llama_sizes(model: nn.Module, caller: str) -> tuple[int, int, int]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None)
    if not all(isinstance(v, int) for v in (heads, kv_heads, intermediate)):
        raise TensorParallelPlanError(
            f"{caller}: {type(model).__name__}.config gives num_attention_heads={heads!r},"
            f" num_key_value_heads={kv_heads!r}, intermediate_size={intermediate!r}; it expects a transformers"
            " LlamaForCausalLM / LlamaModel (or a Llama-style model: Mistral, Qwen2) whose config has all three."
        )
    return heads, kv_heads, intermediate


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Splits every decoder layer of a transformers ``LlamaForCausalLM`` / ``LlamaModel`` (or a model with
    Llama's module names: Mistral, Qwen2) over ``tp_mesh``.

    ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` are column-parallel,
    ``o_proj`` and ``down_proj`` row-parallel; ``embed_tokens``, the norms, the rotary embedding and
    ``lm_head`` stay replicated (see [Note: tensor-parallel plans]). Each rank holds
    ``num_attention_heads / tp`` query heads and ``num_key_value_heads / tp`` KV heads, so
    ``num_key_value_groups`` (their ratio) stays right; transformers 5.x views heads with ``-1``,
    and an attention module that carries ``num_heads`` / ``num_key_value_heads`` attributes (older
    versions, some Llama-style models) gets them divided by ``tp``. Returns ``model``.
    """
    caller = "parallelize_llama"
    tp = _tp_size(tp_mesh, caller)
    path, layers = _find_blocks(
        model, ("model.layers", "layers"), caller,
        "a transformers LlamaForCausalLM (`model.layers`) or LlamaModel (`layers`), or a Llama-style model",
    )
    if _already_split(layers, tp_mesh, _llama_block_plan):
        return model
    _check_not_parallel(layers, path, caller)
    heads, kv_heads, intermediate = _llama_sizes(model, caller)
    _check_divisible(
        caller, "num_attention_heads", heads, tp,
        f"choose num_attention_heads as a multiple of {tp}, or a tensor-parallel size that divides {heads}.",
    )
    _check_divisible(caller, "num_key_value_heads", kv_heads, tp,
                     f"each rank needs whole KV heads: choose num_key_value_heads as a multiple of {tp}, or a"
                     f" tensor-parallel size that divides {kv_heads}.")
    _check_divisible(caller, "intermediate_size", intermediate, tp, f"make intermediate_size a multiple of {tp}.")
    for index, layer in enumerate(layers):
        _check_plan(layer, _llama_block_plan(), f"{caller} ({path}.{index})")
    for layer in layers:
        for attr in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(layer.self_attn, attr, None), int):
                setattr(layer.self_attn, attr, getattr(layer.self_attn, attr) // tp)
    _apply_per_block(layers, tp_mesh, _llama_block_plan)
    return model
