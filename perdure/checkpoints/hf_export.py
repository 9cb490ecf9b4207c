"""A Hugging Face model directory (`save_pretrained`'s layout), written tensor by tensor and published atomically.

    config.json                          the model's config (`PretrainedConfig.save_pretrained`, or a plain dict)
    generation_config.json               for a model that generates, as `save_pretrained` writes it
    model.safetensors                    the weights: one file, or when they pass `max_shard_bytes`
    model-00001-of-0000N.safetensors     several, named as `save_pretrained` names them,
    model.safetensors.index.json         with the index that maps each tensor to its file

The directory is made in a staging sibling (`.tmp-<name>-<pid>-<random>`, `commit.make_staging_dir`), every file is
fsynced, and only then is it renamed into place: a reader sees the previous export or the new one, never a mix. A
previous export is moved aside first and removed after the rename.

Tensors arrive one at a time (`HFShardWriter.add`) in the order the shard plan was made from, so a sharded model's
export holds at most one shard file's tensors in memory, never the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.commit import fsync_dir, make_staging_dir
from perdure.errors import ConfigError, PerdureError
from perdure.safe_io import temporary_name

MAX_SHARD_BYTES = 50 * 10**9  # transformers' `save_pretrained` default (max_shard_size="50GB")
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def tensor_bytes(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, str]:
    """The file each tensor goes to, in order: consecutive tensors fill a file up to `max_shard_bytes` (a larger tensor
    gets one of its own). One file is `model.safetensors`; several are `model-0000i-of-0000N.safetensors`."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes:
        if groups[-1] and filled + size > max_shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    if len(groups) == 1:
        return dict.fromkeys(groups[0], WEIGHTS_NAME)
    return {
        name: f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        for index, group in enumerate(groups, 1)
        for name in group
    }


class HFShardWriter:
    """Writes tensors into the safetensors files of a plan (`plan_shards`), one file as soon as its last tensor
    arrives; `finish()` writes the index when there are several files. Tensors are copied to the CPU, made contiguous,
    and cloned when two names share storage (safetensors refuses shared tensors)."""

    def __init__(self, directory: Path, plan: dict[str, str], metadata: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.plan = plan
        self.metadata = {"format": "pt", **(metadata or {})}
        self._remaining: dict[str, int] = {}
        for file in plan.values():
            self._remaining[file] = self._remaining.get(file, 0) + 1
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._sizes: dict[str, int] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        file = self.plan.get(name)
        if file is None or name in self._pending.get(file, {}):
            raise PerdureError(f"hf export: tensor {name!r} is not in the shard plan, or came twice")
        tensor = tensor.detach().to("cpu").contiguous()
        pending = self._pending.setdefault(file, {})
        if any(tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr() for other in pending.values()):
            tensor = tensor.clone()
        pending[name] = tensor
        self._sizes[name] = tensor_bytes(tensor.shape, tensor.dtype)
        self._remaining[file] -= 1
        if self._remaining[file] == 0:
            self._write(file, self._pending.pop(file))

    def _write(self, file: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(self.directory / file), metadata=self.metadata)

    def finish(self) -> None:
        """Every planned tensor has been added: write the index (several files). PerdureError names missing ones."""
        missing = [name for name in self.plan if name not in self._sizes]
        if missing:
            raise PerdureError(f"hf export: {len(missing)} planned tensors never came: {', '.join(missing[:5])}")
        if len(set(self.plan.values())) > 1:
            index = {"metadata": {"total_size": sum(self._sizes.values())}, "weight_map": dict(self.plan)}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_state_dict(directory: Path, weights: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """A full state dict (already in the Hugging Face layout) as the safetensors files of `directory`."""
    plan = plan_shards([(name, tensor_bytes(t.shape, t.dtype)) for name, t in weights.items()], max_shard_bytes)
    writer = HFShardWriter(directory, plan)
    for name, tensor in weights.items():
        writer.add(name, tensor)
    writer.finish()


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a `transformers.PreTrainedModel`, without importing transformers when nothing else has."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_hf_config(config: Any, where: str) -> None:
    """A config `hf_config()` may return: a `transformers.PretrainedConfig`, or a JSON-able dict with `model_type`."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        return
    if not isinstance(config, dict):
        raise ConfigError(
            "ckpt.export_format",
            "hf",
            f"{where} returned a {type(config).__name__}; return a transformers.PretrainedConfig or a dict "
            "(the content of config.json)",
        )
    try:
        json.dumps(config)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            "ckpt.export_format", "hf", f"{where} returned a dict that is not JSON ({error}); use plain values"
        ) from None
    if not isinstance(config.get("model_type"), str):
        raise ConfigError(
            "ckpt.export_format",
            "hf",
            f"{where} returned a dict without a 'model_type' (e.g. 'llama'): AutoModel*.from_pretrained needs it to "
            "find the model class",
        )


def write_config(directory: Path, config: Any, generation_config: Any = None) -> None:
    """`config.json` (and `generation_config.json` when given) as `save_pretrained` writes them."""
    if isinstance(config, dict):
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        config.save_pretrained(str(directory))
    if generation_config is not None:
        generation_config.save_pretrained(str(directory))


def staging_dir(target: Path) -> Path:
    """A fresh staging directory beside `target` (in its parent), for `publish`."""
    return make_staging_dir(target.parent, target.name)


def publish(staging: Path, target: Path) -> Path:
    """fsync every file of `staging` and the directory itself, then rename it to `target`; a previous `target` (a
    directory perdure wrote, or anything else: never followed if a symlink) is moved aside and removed after."""
    for path in staging.iterdir():
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(staging)
    old = None
    if os.path.lexists(target):
        old = temporary_name(target)
        os.rename(target, old)
    os.rename(staging, target)
    fsync_dir(target.parent)
    if old is not None:
        if old.is_symlink() or not old.is_dir():
            old.unlink()
        else:
            shutil.rmtree(old)
    return target


HF_META = "hf.json"  # in each checkpoint of a run whose `ckpt.export_format` has hf: what the CLI export needs
MAX_HF_META_BYTES = 4 << 20


def read_hf_meta(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's `hf.json` (written by the training program), read as a file from someone else: bounded, a
    mapping of the expected types. CheckpointError when absent or malformed."""
    from perdure.errors import CheckpointError
    from perdure.safe_io import read_json

    path = checkpoint / HF_META
    if not path.exists():
        raise CheckpointError(
            f"{checkpoint} holds no {HF_META}: it was not trained with hf in ckpt.export_format, so perdure does not "
            "know its Hugging Face config. Export it from its program instead: "
            "YourRunner.from_checkpoint(CKPT).export_hf(OUT)"
        )
    try:
        meta = read_json(path, limit=MAX_HF_META_BYTES, max_depth=64)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    ok = isinstance(meta, dict) and isinstance(meta.get("config"), dict)
    ok = ok and isinstance(meta.get("generation_config"), (dict, type(None)))
    ok = ok and isinstance(meta.get("tied"), list) and all(isinstance(key, str) for key in meta["tied"])
    ok = ok and isinstance(meta.get("adapter"), (str, type(None))) and isinstance(meta["config"].get("model_type"), str)
    if not ok:
        raise CheckpointError(f"{path} is malformed: it is not the hf.json perdure writes")
    return meta


def write_hf_dir(target: Path, weights: dict[str, torch.Tensor], meta: dict[str, Any], source: str) -> Path:
    """`perdure ckpt export --format hf`: `target` from full weights in the model's own names and a checkpoint's
    `hf.json` (config, generation config, tied keys), published atomically like the end-of-training export."""
    if meta["adapter"] is not None:
        from perdure.safe_io import safe_name

        raise PerdureError(
            f"the model of {source} maps its names to Hugging Face's with an adapter ({safe_name(meta['adapter'])}, "
            "its runner's state_dict_adapter()), which only its program can run: export it there with "
            "YourRunner.from_checkpoint(CKPT).export_hf(OUT)"
        )
    tied = set(meta["tied"])
    weights = {key: value for key, value in weights.items() if key not in tied}
    staging = staging_dir(target)
    try:
        write_state_dict(staging, weights)
        (staging / CONFIG_NAME).write_text(json.dumps(meta["config"], indent=2, sort_keys=True) + "\n")
        if meta["generation_config"] is not None:
            text = json.dumps(meta["generation_config"], indent=2, sort_keys=True) + "\n"
            (staging / "generation_config.json").write_text(text)
        return publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
