"""The `ft.*` config keys (TorchFT replica groups) and their validation.

    ft.enabled              train as one replica group of a fault-tolerant job (default false)
    ft.replica_id           this group's id, 0 .. ft.group_size - 1 (not part of the run's identity)
    ft.group_size           the number of replica groups of the job (the data is sharded over all of them)
    ft.min_replica_size     steps commit only while at least this many groups take part (default 1)
    ft.lighthouse           the lighthouse address, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE)
    ft.timeout              seconds a cross-group collective, a commit vote or a heal may take (default 60)
    ft.quorum_timeout       seconds a quorum may take to form before the group stops with an error (default 60)
    ft.heartbeat_interval   seconds between the group's heartbeats to the lighthouse (default 0.1)

`WORLD_SIZE` (torchrun's `--nproc_per_node`) is the number of ranks inside one group. Every key is checked by
`check_ft` (called from `RunnerConfig.check`), before anything is written.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from typing import Any

from perdure.config_checks import SectionKey, register_section
from perdure.config_text import is_int, is_number
from perdure.errors import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
FT_EXTRA_HINT = "torchft is not installed: pip install 'perdure[ft]'"
_ADDRESS = re.compile(r"^https?://[^\s/:]+(:\d{1,5})?/?$|^https?://\[[0-9a-fA-F:.]+\](:\d{1,5})?/?$")

# Why a stack cannot train as a replica group (yet): FT must own the gradient all-reduce across groups and gate the
# optimizer step on the groups' vote.
UNSUPPORTED_STACKS = {
    "deepspeed": (
        "DeepSpeed's engine owns the gradient all-reduce and the optimizer step, which FT must gate on the groups' "
        "vote; FT does not support it. Use stack=torch (one process or DDP inside each group)"
    ),
}


MODEL_PARALLEL_AXES = ("tensor", "pipeline", "context", "expert")


def lighthouse_address(value: Any) -> str | None:
    """`ft.lighthouse`, or `$TORCHFT_LIGHTHOUSE` when the key is unset."""
    return value if value else os.environ.get(LIGHTHOUSE_ENV) or None


def check_ft(get: Callable[[str], Any]) -> None:
    """Validate the `ft.*` keys (`get` reads a dotted key). Raises ConfigError naming the key, the value, the fix."""
    enabled = get("ft.enabled")
    if not isinstance(enabled, bool):
        raise ConfigError("ft.enabled", enabled, "use true or false")
    if not enabled:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("ft.enabled", True, f"{FT_EXTRA_HINT}, or set --ft.enabled false")
    stack = get("stack")
    if stack in UNSUPPORTED_STACKS:
        raise ConfigError("stack", stack, UNSUPPORTED_STACKS[stack])
    if stack == "parallel":
        for axis in MODEL_PARALLEL_AXES:
            size = get(f"parallel.axes.{axis}")
            if size != 1:
                raise ConfigError(
                    f"parallel.axes.{axis}",
                    size,
                    "FT trains the parallel stack as HSDP across replica groups (FSDP inside each group, the groups "
                    "its replicate dimension): the cross-group gradient average and the groups' vote own the "
                    f"reduction and the optimizer step, which {axis} parallelism splits. Set it to 1, or ft.enabled "
                    "false",
                )
    if get("ckpt.backend") == "deepspeed":
        raise ConfigError("ckpt.backend", "deepspeed", "FT trains with the torch stack; use auto, file or dcp")
    group_size = get("ft.group_size")
    if not is_int(group_size) or group_size < 1:
        raise ConfigError("ft.group_size", group_size, "use the number of replica groups of the job, an integer >= 1")
    replica_id = get("ft.replica_id")
    if not is_int(replica_id) or not 0 <= replica_id < group_size:
        fix = f"use this group's id, an integer from 0 to ft.group_size - 1 = {group_size - 1}"
        raise ConfigError("ft.replica_id", replica_id, fix)
    minimum = get("ft.min_replica_size")
    if not is_int(minimum) or not 1 <= minimum <= group_size:
        fix = f"use an integer from 1 to ft.group_size = {group_size} (1: one live group keeps training)"
        raise ConfigError("ft.min_replica_size", minimum, fix)
    address = lighthouse_address(get("ft.lighthouse"))
    if address is None:
        raise ConfigError(
            "ft.lighthouse",
            None,
            f"give the lighthouse address, --ft.lighthouse http://HOST:PORT (or set ${LIGHTHOUSE_ENV}); start one "
            "with `perdure ft lighthouse`",
        )
    if not isinstance(address, str) or not _ADDRESS.match(address):
        key = "ft.lighthouse" if get("ft.lighthouse") else LIGHTHOUSE_ENV
        raise ConfigError(key, address, "use an address like http://HOST:PORT (what `perdure ft lighthouse` prints)")
    for key in ("ft.timeout", "ft.quorum_timeout", "ft.heartbeat_interval"):
        value = get(key)
        if not is_number(value) or value <= 0:
            raise ConfigError(key, value, "use a number of seconds > 0")
    if get("ft.heartbeat_interval") >= get("ft.timeout"):
        raise ConfigError(
            "ft.heartbeat_interval", get("ft.heartbeat_interval"), "use a number of seconds below ft.timeout"
        )


# TorchFT replica groups (docs/fault-tolerance.md); this section is no part of the run's config identity.
SECTION = (
    SectionKey("enabled", False, "train as one replica group of a fault-tolerant job"),
    SectionKey("replica_id", 0, "this group's id, from 0 to ft.group_size - 1"),
    SectionKey("group_size", 1, "replica groups of the job: the training data is sharded over all of them"),
    SectionKey("min_replica_size", 1, "a step commits only when at least this many groups take part"),
    SectionKey("lighthouse", None, "the lighthouse address http://HOST:PORT; None: $TORCHFT_LIGHTHOUSE"),
    SectionKey("timeout", 60.0, "seconds a cross-group all-reduce, the commit vote or a heal may take"),
    SectionKey("quorum_timeout", 60.0, "seconds a quorum may take before the group stops with an error"),
    SectionKey("heartbeat_interval", 0.1, "seconds between the group's heartbeats to the lighthouse"),
)
# No part of the run's config identity (workspace/identity.py): every group of a job shares one run directory, so
# `ft.replica_id` cannot be identity; the lighthouse, timeouts and `min_replica_size` decide when steps commit, not
# what a step computes; `ft.enabled` and `ft.group_size` are topology, like the world size (a run continues on another
# number of groups as it does on another number of ranks, with a topology note).
register_section("ft", SECTION, lambda config, get: check_ft(get), not_identity=("ft",))
