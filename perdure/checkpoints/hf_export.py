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
import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import torch

from perdure.atomic import fsync_dir, temporary_sibling
from perdure.checkpoints.commit import make_staging_dir
from perdure.errors import ConfigError, PerdureError

MAX_SHARD_BYTES = 5 * 10**9  # "5GB": transformers 4's `save_pretrained` default, the Hub's usual shard size
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


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]  # name, full shape, dtype as written


class HFShardWriter:
    """Writes tensors, as they arrive in the order of `specs`, straight into the safetensors files of
    `plan_shards`: each file's header is written from the specs before its first tensor, then each tensor's bytes are
    appended, so no more than the tensor being added is ever held. `finish()` writes the index (several files)."""

    def __init__(
        self,
        directory: Path,
        specs: list[TensorSpec],
        max_shard_bytes: int = MAX_SHARD_BYTES,
        metadata: dict[str, str] | None = None,
    ) -> None:
        for name, _, dtype in specs:
            if dtype not in SAFETENSORS_DTYPES:
                raise PerdureError(f"hf export: {name!r} is a {dtype} tensor, which safetensors does not hold")
        self.directory = directory
        self.specs = specs
        self.plan = plan_shards([(name, tensor_bytes(shape, dtype)) for name, shape, dtype in specs], max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._next = 0
        self._file: BinaryIO | None = None
        self._file_name: str | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.specs) or self.specs[self._next][0] != name:
            expected = self.specs[self._next][0] if self._next < len(self.specs) else "none"
            raise PerdureError(f"hf export: tensor {name!r} came where {expected!r} was expected")
        _, shape, dtype = self.specs[self._next]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise PerdureError(
                f"hf export: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, planned as {shape} {dtype}"
            )
        if self._file_name != self.plan[name]:
            self.close()
            self._open(self.plan[name])
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        assert self._file is not None  # `_open` opened it; only `close` (after the last tensor) clears it
        # numpy's stubs give ndarray `__buffer__` only from Python 3.12 (python_version is 3.10): it is a buffer.
        self._file.write(memoryview(data.numpy()))  # type: ignore[arg-type]
        self._next += 1

    def _open(self, file: str) -> None:
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for name, shape, dtype in self.specs:
            if self.plan[name] == file:
                size = tensor_bytes(shape, dtype)
                header[name] = {
                    "dtype": SAFETENSORS_DTYPES[dtype],
                    "shape": list(shape),
                    "data_offsets": [offset, offset + size],
                }
                offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(self.directory / file, "xb")  # noqa: SIM115  (closed by _close)
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._file_name = file

    def close(self) -> None:
        """Close the file being written (`finish` does; after a failure, the caller)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """Every planned tensor has been added: close the last file and write the index (several files)."""
        self.close()
        if self._next < len(self.specs):
            missing = [name for name, _, _ in self.specs[self._next :]]
            raise PerdureError(f"hf export: {len(missing)} planned tensors never came: {', '.join(missing[:5])}")
        if len(set(self.plan.values())) > 1:
            total = sum(tensor_bytes(shape, dtype) for _, shape, dtype in self.specs)
            index = {"metadata": {"total_size": total}, "weight_map": dict(self.plan)}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_state_dict(directory: Path, weights: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """A full state dict (already in the Hugging Face layout) as the safetensors files of `directory`."""
    writer = HFShardWriter(directory, [(k, tuple(t.shape), t.dtype) for k, t in weights.items()], max_shard_bytes)
    try:
        for name, tensor in weights.items():
            writer.add(name, tensor)
    except BaseException:
        writer.close()
        raise
    writer.finish()


def is_hf_model(model: torch.nn.Module) -> TypeGuard[Any]:
    """Whether `model` is a `transformers.PreTrainedModel`, without importing transformers when nothing else has (an
    optional dependency: a type checker reads such a model as Any)."""
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
        old = temporary_sibling(target)
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
