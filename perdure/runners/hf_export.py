"""The `hf` export: `<run dir>/hf/` (and `hf-ema/` with EMA), a directory `transformers.AutoModel*.from_pretrained`
loads, written at the end of training when `ckpt.export_format` includes `hf`.

How the weights get there depends on where they live (the bytes and the directory's layout: checkpoints/hf_export.py),
so each stack writes its own through its override point `write_hf_weights` (checkpointing.py, parallel_runner.py,
deepspeed_runner.py), with the functions here; this module imports no stack:

    one process, DDP         the main process holds the full weights: a `transformers.PreTrainedModel` writes them
                             through its own `save_pretrained(state_dict=...)`; any other model through its adapter's
                             `to_hf` and the config `hf_config()` returns
    parallel (FSDP2, TP, PP) every rank writes its own shards through torch DCP's `HuggingFaceStorageWriter`; rank 0
                             then consolidates them into the final files one tensor at a time. No rank gathers the
                             model (the adapter's `to_hf` gets the state dict of DTensors, as TorchTitan's do). A
                             model whose state-dict hooks make tensors (a fused weight saved split, whole), without
                             an adapter and a pipeline, is streamed instead (`module_source`, as `model.safetensors`):
                             each DTensor gathered alone, what hooks make one hooked module at a time, rank 0
                             appending each tensor to its file (`HFShardWriter`); with a key-wise adapter too (below)
    DeepSpeed (ZeRO 1-3)     tensor by tensor (`zero3_export.zero3_source`, as `model.pth`): every rank gathers one
                             fp32 parameter (`deepspeed.utils.safe_get_full_fp32_param`), or one hooked module's state
                             dict made through its hooks from its parameters gathered whole, rank 0 appends each tensor
                             to the shard file it belongs to: at most one whole parameter (or one hooked module's
                             state dict) in memory. With an adapter, the same, through `to_hf` one key at a time
                             when the adapter maps each key on its own (below)

A state-dict adapter's `to_hf` maps a whole state dict: it may rename, permute, split, but also concatenate keys, so it
cannot blindly be called key by key. `probe_adapter` finds out, on tensors on the meta device (no memory): `to_hf` of
the whole state dict gives the reference names, shapes and dtypes, `to_hf` of each key alone that key's. When every
key alone maps, their outputs are disjoint and together are the reference exactly (names, shapes, dtypes; no output
the same tensor as another, which the whole path would leave out), the adapter is key-wise (TorchTitan's Llama3
adapter: renames, and permutes the rows of `q_proj` / `k_proj`) and `stream_adapted` streams: each tensor (or one
hooked module's state dict) made whole, mapped alone through `to_hf` on the main process and its outputs appended to
their files, in the reference's order (the same files, tensor for tensor, as the whole path writes). Otherwise (an
adapter that concatenates keys, or whose `to_hf` fails on meta tensors or on one key alone) the export takes the whole
path as before, and says so in one line of the log: on DeepSpeed rank 0 then holds the whole model; on the parallel
stack every rank holds what the hooks make for the whole model.

Each checkpoint of such a run also holds `hf.json` (the config, generation config, which keys are tied, and the
adapter's class), so `perdure ckpt export CKPT OUT --format hf` writes the same directory without the program.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from perdure.checkpoints.hf_export import (
    HFShardWriter,
    TensorSpec,
    check_hf_config,
    is_hf_model,
    plan_shards,
    publish,
    staging_dir,
    tensor_bytes,
    write_config,
    write_state_dict,
)
from perdure.checkpoints.state_pieces import made_by_hooks, own_tensors, state_pieces
from perdure.distributed.collectives import all_gather_object, barrier, broadcast_object, is_distributed
from perdure.errors import ConfigError
from perdure.runners.compile import plain_name, uncompiled
from perdure.runners.export import EXPORT_DTYPES, StreamSource, cast_weights

if TYPE_CHECKING:
    from perdure.checkpoints.hf_adapter import StateDictAdapter
    from perdure.runners.fields import RunnerFields

HF_DIR, HF_EMA_DIR = "hf", "hf-ema"
SHARDED_DIR = "sharded"  # where HuggingFaceStorageWriter puts each rank's files before consolidating them


def hf_requested(runner: RunnerFields) -> bool:
    formats = runner.config.ckpt.export_format
    return "hf" in ([formats] if isinstance(formats, str) else formats)


def check_hf_export(runner: RunnerFields) -> None:
    """Before anything is written: a model that is not a `transformers.PreTrainedModel` can be exported as `hf` only
    with the config its program gives (`hf_config()`)."""
    if not hf_requested(runner) or is_hf_model(uncompiled(runner.model)):
        return
    name = type(runner).__name__
    config = runner.hf_config()
    if config is None:
        raise ConfigError(
            "ckpt.export_format",
            runner.config.ckpt.export_format,
            f"{type(uncompiled(runner.model)).__name__} is not a transformers PreTrainedModel, so the hf export needs "
            f"its Hugging Face config: override {name}.hf_config() (and {name}.state_dict_adapter() when its "
            "parameter names are not the Hugging Face model's), or leave hf out",
        )
    check_hf_config(config, f"{name}.hf_config()")


def hf_metadata(runner: RunnerFields) -> str:
    """`hf.json` of each checkpoint: what `perdure ckpt export --format hf` needs besides the weights."""
    model = uncompiled(runner.unwrap_model())
    config, generation = _configs(runner)
    adapter = runner.state_dict_adapter()
    tied = tied_keys(model)
    return json.dumps(
        {
            "config": config if isinstance(config, dict) else config.to_diff_dict(),
            "generation_config": generation.to_diff_dict() if generation is not None else None,
            "tied": tied,
            "adapter": None if adapter is None else _class_name(type(adapter)),
        },
        indent=2,
        sort_keys=True,
        default=str,
    )


def _class_name(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "__main__" else f"{kind.__module__}.{kind.__qualname__}"


def tied_keys(model: torch.nn.Module) -> list[str]:
    """The names under which a tensor the model holds under an earlier name appears again (an output layer tied to
    the embedding): an export leaves them out as `save_pretrained` does, and `from_pretrained` ties them again."""
    seen: set[int] = set()
    tied = []
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in seen:
            tied.append(plain_name(name))
        seen.add(id(tensor))
    return tied


def _configs(runner: RunnerFields) -> tuple[Any, Any]:
    """(config, generation config or None): the model's own for a PreTrainedModel (naming its class in
    `architectures`, as `save_pretrained` does), else `hf_config()`'s."""
    model = uncompiled(runner.unwrap_model())
    if is_hf_model(model):
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        return config, model.generation_config if model.can_generate() else None
    return runner.hf_config(), None


def export_hf(runner: RunnerFields, target: Path | None = None) -> Path | None:
    """Write the `hf` export of the model (`target`, default `<run dir>/hf`) and of its EMA weights (`hf-ema` beside
    it). Called on every rank (a sharded model is written collectively); returns the model's directory on the main
    process, None on the others."""
    target = Path(target) if target is not None else runner.run_dir.path / HF_DIR
    config, generation = _configs(runner)
    jobs = [(target, False)]
    if runner.ema is not None:
        jobs.append((target.with_name(target.name + "-ema") if target.name != HF_DIR else target.parent / HF_EMA_DIR,
                     True))  # fmt: skip
    for directory, ema in jobs:
        shared = broadcast_object(str(staging_dir(directory)) if runner.is_main_process else None)
        assert shared is not None  # every rank receives the main process's
        staging = Path(shared)
        try:
            runner.write_hf_weights(staging, ema)
            if runner.is_main_process:
                if not (staging / "config.json").exists():
                    write_config(staging, config, generation)
                publish(staging, directory)
        except BaseException:
            if runner.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)  # the previous export, if any, is still in place
            raise
        if is_distributed():
            barrier()
    if runner.is_main_process:
        runner.logger.info("wrote the Hugging Face export %s%s", target, " and its EMA weights" if runner.ema else "")
        return target
    return None


def export_dtype(runner: RunnerFields) -> torch.dtype | None:
    """The dtype `ckpt.export_dtype` names (floating tensors are cast to it), None to keep each tensor's own."""
    return EXPORT_DTYPES[runner.config.ckpt.export_dtype] if runner.config.ckpt.export_dtype else None


def write_whole_weights(
    runner: RunnerFields,
    staging: Path,
    weights: dict[str, Any],
    adapter: StateDictAdapter | None,
    *,
    save_pretrained: bool = True,
) -> None:
    """On the main process: write the whole `weights` (the model's state-dict layout) into `staging`, mapped by
    `adapter.to_hf` (or with the tied keys left out), cast to `ckpt.export_dtype`: through the model's own
    `save_pretrained` for a `PreTrainedModel` without an adapter (when `save_pretrained`: not for a module that holds
    only its partition), else as sharded safetensors (`write_state_dict`)."""
    weights = adapter.to_hf(weights) if adapter is not None else untied(weights, runner)
    weights = cast_weights(weights, runner.config.ckpt.export_dtype)
    model = uncompiled(runner.unwrap_model())
    if is_hf_model(model) and adapter is None and save_pretrained:
        model.save_pretrained(str(staging), state_dict=weights)
    else:
        write_state_dict(staging, distinct(weights))


def untied(state: dict[str, Any], runner: RunnerFields) -> dict[str, Any]:
    tied = set(tied_keys(uncompiled(runner.unwrap_model())))
    return {key: value for key, value in state.items() if key not in tied}


def distinct(state: dict[str, Any], *, every_rank: bool = False) -> dict[str, Any]:
    """The state dict without a key whose tensor is the same memory as an earlier key's (tied weights: the embedding
    and the output layer), as `save_pretrained` leaves them out; `from_pretrained` ties them again. A sharded model's
    state dict wraps each key's shard in a DTensor of its own, so the memory is compared, and what one rank finds tied
    is left out by all (`every_rank`: a collective; the ranks must save the same keys)."""
    seen: set[tuple[Any, ...]] = set()
    tied = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.numel() == 0:
            continue
        memory = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride())
        if memory in seen:
            tied.add(key)
        seen.add(memory)
    for found in all_gather_object(sorted(tied)) if every_rank else []:
        tied.update(found)
    return {key: value for key, value in state.items() if key not in tied}


def hooks_make_tensors(parts: list[torch.nn.Module]) -> bool:
    """Whether a state-dict hook of `parts` makes tensors the model does not hold (`checkpoints/state_pieces.py`):
    each hooked module's state dict made once, one at a time (every rank calls this: a hook may gather)."""
    owned = set().union(*(own_tensors(part) for part in parts))
    for part in parts:
        for piece in state_pieces(part):
            if piece.hooked and made_by_hooks(piece, piece.state(keep_vars=True), owned):
                return True
    return False


def stream_weights(
    runner: RunnerFields, source: StreamSource, tied: set[str], staging: Path, dtype: torch.dtype | None
) -> None:
    """Every rank takes each tensor of `source` in turn (`whole`: a collective), `tied` keys left out as
    `save_pretrained` does; the main process appends each to the safetensors file it belongs to (`HFShardWriter`),
    cast to `dtype` if floating. The main process holds one whole tensor at a time, or one hooked module's state
    dict (`source` makes them so), never the model."""
    specs: list[TensorSpec] = []
    for name, (kind, shape) in source.shapes.items():
        if name not in tied:
            specs.append((name, shape, dtype if dtype is not None and kind.is_floating_point else kind))
    writer = HFShardWriter(staging, specs) if runner.is_main_process else None
    for name, _, written in specs:
        tensor = source.whole(name)
        if writer is not None:
            writer.add(name, tensor.detach().to("cpu", written))
        del tensor
    if writer is not None:
        writer.finish()


def write_with_dcp(state: dict[str, Any], staging: Path, dtype: torch.dtype | None) -> None:
    """Every rank writes its shards of `state` (DTensors, or plain tensors DCP writes once) with DCP's Hugging Face
    storage writer; rank 0 consolidates them into `save_pretrained`'s files, one full tensor at a time, then the
    per-rank files are removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if dtype is not None:
        state = {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state.items()
        }
    local = {key: tensor_bytes(value.shape, value.dtype) for key, value in state.items()}
    sizes: dict[str, int] = {}
    for part in all_gather_object(local) if is_distributed() else [local]:
        for key, size in part.items():
            sizes.setdefault(key, size)
    files = plan_shards(sorted(sizes.items()))
    names = sorted(set(files.values()))
    index = {key: names.index(file) + 1 for key, file in files.items()}
    writer = HuggingFaceStorageWriter(
        path=str(staging), fqn_to_index_mapping=index, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    if not is_distributed() or torch.distributed.get_rank() == 0:
        shutil.rmtree(staging / SHARDED_DIR)


# What an adapter's `to_hf` may raise on tensors on the meta device or on one key alone (a name it looks up, a tensor
# it reads the values of, a shape it does not expect): the export then takes the whole path, where a real error shows.
ADAPTER_PROBE_ERRORS = (LookupError, RuntimeError, NotImplementedError, ValueError, TypeError)


@dataclass(frozen=True)
class KeywisePlan:
    """A key-wise adapter's export: the model's keys in the order they are streamed (those that map to nothing left
    out), and each one's outputs in the Hugging Face layout (name, shape, dtype `to_hf` gives), in the order written."""

    order: tuple[str, ...]
    outputs: dict[str, tuple[TensorSpec, ...]]


def _mapped_specs(mapped: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | str:
    """The name, shape and dtype of each output of `to_hf`, or why it cannot be streamed (not a tensor, or the same
    memory as an earlier output: `distinct` leaves such a one out of the whole path)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    seen: set[tuple[Any, ...]] = set()
    for name, value in mapped.items():
        if not isinstance(value, torch.Tensor):
            return f"it returns a {type(value).__name__} for {name!r}"
        root = value._base if value._base is not None else value
        memory = (id(root), value.storage_offset(), tuple(value.shape), value.stride())
        if value.numel() and memory in seen:
            return f"it returns {name!r} as the same tensor as another key"
        seen.add(memory)
        specs[name] = (tuple(value.shape), value.dtype)
    return specs


def probe_adapter(
    adapter: StateDictAdapter, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> KeywisePlan | str:
    """Whether `adapter.to_hf` maps each key of a state dict of these dtypes and shapes on its own (module docstring):
    its `KeywisePlan`, or why not. Only tensors on the meta device: nothing is allocated."""
    meta = {name: torch.empty(shape, dtype=kind, device="meta") for name, (kind, shape) in shapes.items()}
    try:
        reference = _mapped_specs(adapter.to_hf(dict(meta)))
    except ADAPTER_PROBE_ERRORS as error:
        return f"its to_hf fails on tensors on the meta device ({type(error).__name__}: {error})"
    if isinstance(reference, str):
        return reference
    position = {name: index for index, name in enumerate(reference)}
    outputs: dict[str, tuple[TensorSpec, ...]] = {}
    made: set[str] = set()
    for name, tensor in meta.items():
        try:
            alone = _mapped_specs(adapter.to_hf({name: tensor}))
        except ADAPTER_PROBE_ERRORS as error:
            return f"its to_hf fails on {name!r} alone ({type(error).__name__}: {error})"
        if isinstance(alone, str):
            return alone
        for output, spec in alone.items():
            if output in made:
                return f"{output!r} comes from more than one key alone"
            if output not in reference:
                return f"{name!r} alone maps to {output!r}, which the whole state dict does not hold"
            if reference[output] != spec:
                return f"{name!r} alone maps to {output!r} as {spec}, the whole state dict as {reference[output]}"
            made.add(output)
        ordered = sorted(alone, key=lambda output: position[output])
        outputs[name] = tuple((output, *alone[output]) for output in ordered)
    if made != set(reference):
        return f"{sorted(set(reference) - made)[:3]} come only from several keys together"
    order = sorted((name for name in meta if outputs[name]), key=lambda name: position[outputs[name][0][0]])
    return KeywisePlan(tuple(order), outputs)


def stream_adapted(
    runner: RunnerFields,
    source: StreamSource,
    tied: set[str],
    staging: Path,
    dtype: torch.dtype | None,
    adapter: StateDictAdapter,
    whole: str,
) -> bool:
    """With a key-wise `adapter` (`probe_adapter`, on the main process, its answer given to every rank): stream
    `source` as `stream_weights` does, `tied` keys left out, each tensor mapped alone through `to_hf` on the main
    process and its outputs appended to their files; True. Otherwise log why the export takes the whole path (what it
    then holds: `whole`) and return False, having done nothing else. A collective: every rank calls it."""
    shapes = {name: value for name, value in source.shapes.items() if name not in tied}
    plan = probe_adapter(adapter, shapes) if runner.is_main_process else None
    if isinstance(plan, str):
        runner.logger.warning(
            "hf export: %s; %s.to_hf maps keys together (%s): an adapter whose to_hf maps each key alone (renames, "
            "permutes, splits) is streamed one tensor at a time",
            whole,
            type(adapter).__name__,
            plan,
        )
    order = broadcast_object(list(plan.order) if isinstance(plan, KeywisePlan) else None)
    if order is None:
        return False
    writer = None
    if isinstance(plan, KeywisePlan):
        specs = [
            (output, shape, dtype if dtype is not None and kind.is_floating_point else kind)
            for name in plan.order
            for output, shape, kind in plan.outputs[name]
        ]
        writer = HFShardWriter(staging, specs)
    try:
        for name in order:
            tensor = source.whole(name)  # a collective: every rank takes every name
            if writer is not None and isinstance(plan, KeywisePlan):
                mapped = adapter.to_hf({name: tensor.detach().cpu()})
                for output, _, _ in plan.outputs[name]:
                    value = mapped[output]
                    target = dtype if dtype is not None and value.is_floating_point() else value.dtype
                    writer.add(output, value.detach().to("cpu", target))
                del mapped
            del tensor
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    if writer is not None:
        writer.finish()
    return True
