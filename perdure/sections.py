"""The config sections of perdure's own layers: importing their modules registers each one's check
(`config_checks.register_section_check`), which `RunnerConfig.check()` runs, and the `deepspeed`, `ft` and `parallel`
sections' keys, defaults, help and validation (`config_checks.register_section`), which `RunnerConfig.__init__` sets.
`perdure/__init__.py` imports this first, so every program that imports any part of perdure (`from perdure.config
import RunnerConfig` included) has them; `perdure/config.py` itself imports none of these layers. The parallel and
DeepSpeed stacks register themselves here too (`config_checks.register_stack`), in this import order: the order
`--stack`'s choices are listed in (torch, parallel, deepspeed, ds)."""

from perdure.checkpoints import auto_interval, mirror
from perdure.distributed import topology
from perdure.ft import config as ft_config
from perdure.runners import deepspeed_config

__all__ = ["auto_interval", "deepspeed_config", "ft_config", "mirror", "topology"]
