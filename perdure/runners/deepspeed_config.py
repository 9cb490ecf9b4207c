"""The DeepSpeed engine's config: perdure's keys, merged over the user's raw DeepSpeed settings.

The runner owns the settings that its own keys decide (`OWNED`): micro batch, accumulation, global batch, clipping,
ZeRO stage and offload, precision. Everything else in `deepspeed.config` (a dict, or a JSON / YAML file read with
perdure's bounded readers) is handed to DeepSpeed as it is. A raw setting that says something else than the runner's
key is a `ConfigError` naming both, raised by `RunnerConfig.check()`, so before anything is written; `"auto"` (as in
Hugging Face-style DeepSpeed files) always means "perdure's value". The optimizer and scheduler are the runner's
(`self.optimizer` / `self.scheduler`, or `optim.*` / `sched.*`): a raw `optimizer` or `scheduler` section is refused.

Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from perdure.config_checks import SectionKey, register_section, register_stack
from perdure.errors import ConfigError

ZERO_STAGES = (0, 1, 2, 3)
# Quiet unless the user's raw settings ask otherwise: perdure logs progress itself.
DEFAULTS: dict[str, Any] = {
    "steps_per_print": 2**31 - 1,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,  # the user's own torch optimizer, handed to ZeRO
    # ... also with ZeRO-Offload (DeepSpeed would insist on its DeepSpeedCPUAdam, a compiled op: assign
    # `self.optimizer = DeepSpeedCPUAdam(...)` in the runner for it)
    "zero_force_ds_cpu_optimizer": False,
}
_MISSING = object()


def _owned(config: Any, world_size: int) -> dict[str, tuple[str, Any, Any]]:
    """Raw dotted setting -> (the perdure key that decides it, that key's value, the raw value it implies)."""
    micro = config.loader_options("train")["batch_size"]
    accum, precision, ds = config.accum_steps, config.precision, config.deepspeed
    owned: dict[str, tuple[str, Any, Any]] = {
        "train_micro_batch_size_per_gpu": ("dataloader.batch_size", micro, micro),
        "gradient_accumulation_steps": ("accum_steps", accum, accum),
        "train_batch_size": (
            f"dataloader.batch_size x accum_steps x world size ({micro} x {accum} x {world_size})",
            micro * accum * world_size,
            micro * accum * world_size,
        ),
        "gradient_clipping": ("max_grad_norm", config.max_grad_norm, float(config.max_grad_norm or 0.0)),
        "zero_optimization.stage": ("deepspeed.zero_stage", ds.zero_stage, ds.zero_stage),
        "zero_optimization.offload_optimizer.device": (
            "deepspeed.offload_optimizer",
            ds.offload_optimizer,
            "cpu" if ds.offload_optimizer else "none",
        ),
        "zero_optimization.offload_param.device": (
            "deepspeed.offload_param",
            ds.offload_param,
            "cpu" if ds.offload_param else "none",
        ),
        "bf16.enabled": ("precision", precision, precision == "bf16"),
        "fp16.enabled": ("precision", precision, precision == "fp16"),
    }
    if precision == "bf16":  # DeepSpeed's skip of a non-finite bf16 step
        owned["bf16.check_grad_overflow"] = ("skip_nonfinite_grad", config.skip_nonfinite_grad,
                                             bool(config.skip_nonfinite_grad))  # fmt: skip
    return owned


def raw_settings(config: Any) -> dict[str, Any]:
    """`deepspeed.config` as a plain dict: {} for None, a mapping as is, a path read as JSON / YAML (bounded)."""
    from perdure.config import plain_dict, read_config_file

    value = config.lookup("deepspeed.config")
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return plain_dict(value)
    if isinstance(value, (str, os.PathLike)):
        data = read_config_file(value, key="deepspeed.config")
        if not isinstance(data, Mapping):
            raise ConfigError("deepspeed.config", str(value), "the file must hold a mapping of DeepSpeed settings")
        return plain_dict(data)
    raise ConfigError("deepspeed.config", value, "use a mapping of DeepSpeed settings or the path of a JSON/YAML file")


def engine_config(config: Any, world_size: int) -> dict[str, Any]:
    """The config dict `deepspeed.initialize` gets: the raw settings with the runner's settings merged over them.

    Raises ConfigError for a raw setting that contradicts a runner key, or a raw optimizer / scheduler section.
    """
    raw = raw_settings(config)
    for section, keys in (("optimizer", "optim.*"), ("scheduler", "sched.*")):
        if section in raw:
            raise ConfigError(
                f"deepspeed.config {section}",
                raw[section],
                f"the runner builds the {section} (self.{section} in your runner, or {keys}): remove the '{section}' "
                f"section from the DeepSpeed config and set {keys} instead",
            )
    if _get(raw, "checkpoint.load_universal") not in (_MISSING, False):
        raise ConfigError(
            "deepspeed.config checkpoint.load_universal",
            _get(raw, "checkpoint.load_universal"),
            "perdure converts a checkpoint to DeepSpeed's universal format and loads it that way by itself when the "
            "world size changes: remove the setting",
        )
    merged = {**DEFAULTS, **raw}
    for dotted, (key, value, implied) in _owned(config, world_size).items():
        theirs = _get(raw, dotted)
        if theirs is not _MISSING and theirs != "auto" and not _same(theirs, implied):
            raise ConfigError(
                "deepspeed.config",
                f"{dotted}={theirs!r}",
                f"contradicts {key}={value!r} (which sets {dotted}={implied!r}): perdure sets {dotted} from {key}; "
                f'remove it from the DeepSpeed config, set it to "auto", or change {key}',
            )
        _put(merged, dotted, implied)
    return merged


def check_deepspeed_section(config: Any, get: Callable[[str], Any]) -> None:
    """`stack=deepspeed`: every `deepspeed.*` key (`check_engine_config`); any other stack: no DeepSpeed checkpoints."""
    if get("stack") in ("deepspeed", "ds"):
        from perdure.distributed.process_group import launched_world_size

        check_engine_config(config, launched_world_size())
    elif get("ckpt.backend") == "deepspeed":
        raise ConfigError("ckpt.backend", "deepspeed", "the DeepSpeed engine's checkpoints need stack=deepspeed; use "
                          "auto, file or dcp")  # fmt: skip


# stack=deepspeed (docs/deepspeed.md); this section is no part of other stacks' config identity.
SECTION = (
    SectionKey("zero_stage", 2, "0 (plain data parallel), 1, 2 or 3"),
    SectionKey("offload_optimizer", False, "ZeRO-Offload of optimizer states to the CPU"),
    SectionKey("offload_param", False, "ZeRO-3 parameter offload to the CPU"),
    SectionKey("config", None, "raw DeepSpeed settings: a dict, or a JSON / YAML file"),
)
register_stack("deepspeed", "perdure.runners.deepspeed_runner:DeepSpeedRunner", aliases=("ds",))
register_section("deepspeed", SECTION, check_deepspeed_section, stack="deepspeed")


def check_engine_config(config: Any, world_size: int) -> None:
    """Every `deepspeed.*` key and the keys the stack cannot honour; called by `RunnerConfig.check()`."""
    ds = config.deepspeed
    stage = ds.zero_stage
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ConfigError("deepspeed.zero_stage", stage, "use 0, 1, 2 or 3 (ZeRO stage)")
    for key in ("offload_optimizer", "offload_param"):
        if not isinstance(ds[key], bool):
            raise ConfigError(f"deepspeed.{key}", ds[key], "use true or false")
    if ds.offload_optimizer and stage == 0:
        raise ConfigError("deepspeed.offload_optimizer", True, "optimizer offload needs ZeRO: set deepspeed.zero_stage")
    if ds.offload_param and stage != 3:
        fix = f"parameter offload needs ZeRO-3 (deepspeed.zero_stage is {stage})"
        raise ConfigError("deepspeed.offload_param", True, fix)
    backend = config.ckpt.backend
    if backend not in ("auto", "deepspeed"):
        raise ConfigError(
            "ckpt.backend", backend, "stack=deepspeed saves through the engine: use auto or deepspeed (the engine's "
            "own checkpoints, committed like every other backend)"
        )  # fmt: skip
    if config.ckpt.async_mode != "disabled":
        raise ConfigError(
            "ckpt.async_mode", config.ckpt.async_mode, "stack=deepspeed saves synchronously (engine.save_checkpoint is "
            "collective and reads live engine state): use disabled"
        )  # fmt: skip
    engine_config(config, world_size)


def _get(mapping: Mapping[str, Any], dotted: str) -> Any:
    node: Any = mapping
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _put(mapping: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    node = mapping
    for section in sections:
        child = node.get(section)
        node[section] = child = dict(child) if isinstance(child, Mapping) else {}
        node = child
    node[leaf] = value


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return theirs is ours
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        return float(theirs) == float(ours)
    return theirs == ours
