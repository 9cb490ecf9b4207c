"""The config sections of perdure's own layers: importing their modules registers each one's check
(`config_checks.register_section_check`), which `RunnerConfig.check()` runs. `perdure/__init__.py` imports this, so
every program that imports any part of perdure has them; `perdure/config.py` itself imports none of these layers."""

from perdure.checkpoints import auto_interval, mirror
from perdure.distributed import topology
from perdure.ft import config as ft_config
from perdure.runners import deepspeed_config

__all__ = ["auto_interval", "deepspeed_config", "ft_config", "mirror", "topology"]
