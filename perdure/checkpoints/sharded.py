"""Checkpoints of the parallel stack: DCP on the one commit protocol, sharded state under the whole model's names.

    ShardedModel, ShardedOptimizer   Stateful views of this rank's model parts (pipeline stages) and their optimizer
                                     in DCP's form: tensors keyed by the whole model's parameter names (FQNs), each
                                     rank holding its shards (DTensors), so DCP reshards them onto any topology
    ParallelCheckpointManager        the DCP manager, with the topology recorded in every manifest and rank-local
                                     state (RNGs, data position) read from the rank that played this rank's part

The model goes through its own `state_dict()` / `load_state_dict()` per part (`module_state.py`: its hooks apply); the
optimizer through `get_optimizer_state_dict` / `set_optimizer_state_dict` with `flatten_optimizer_state_dict` (keys
`state.<fqn>.<name>` and `param_groups.<fqn>.<option>`: they do not depend on how parameters are grouped into parts or
ranks). The EMA's shadows are DTensors sharded like the parameters, keyed by the same names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from perdure.checkpoints.commit import read_manifest
from perdure.checkpoints.dcp import DCPCheckpointManager
from perdure.checkpoints.module_state import load_module_state_dict, module_state_dict
from perdure.distributed.topology import Topology

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class ShardedModel:
    """This rank's model parts as one Stateful: the union of their state dicts (their names never overlap)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(module_state_dict(part))
        return merged

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for part in self.parts:
            own = module_state_dict(part).keys()
            load_module_state_dict(part, {key: value for key, value in state.items() if key in own})


class ShardedOptimizer:
    """One optimizer over this rank's model parts, in DCP's flattened, FQN-keyed form.

    Several parts (stages of one rank) are handed to DCP's helpers as an `nn.ModuleList`, whose names carry the
    part's index (`1.layers.3.fc.weight`); the index is taken off for the checkpoint and put back for loading.
    """

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        # name -> index of the part holding it; empty with one part (no index in the names then)
        self.index = {name: i for i, part in enumerate(parts) for name, _ in part.named_parameters()}
        if len(parts) == 1:
            self.index = {}

    def state_dict(self) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.module, self.optimizer, options=FLAT)
        return {self._plain(key): value for key, value in state.items()} if self.index else state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.index:
            state = {self._indexed(key): value for key, value in state.items()}
        set_optimizer_state_dict(self.module, self.optimizer, dict(state), options=FLAT)

    def _plain(self, key: str) -> str:
        kind, rest = key.split(".", 1)  # state.<index>.<fqn>.<name>
        return f"{kind}.{rest.split('.', 1)[1]}"

    def _indexed(self, key: str) -> str:
        kind, rest = key.split(".", 1)  # state.<fqn>.<name>: names and options have no dot
        fqn = rest.rsplit(".", 1)[0]
        return f"{kind}.{self.index[fqn]}.{rest}" if fqn in self.index else key


class ParallelCheckpointManager(DCPCheckpointManager):
    """DCP with the topology (`identity["topology"]`, set by the runner) recorded in every manifest.

    Rank-local state after a change of topology: a rank continues the RNGs and iterable-data position of the rank
    that held the same data rank and pipeline stage (position 0 of the model-parallel axes); one with no such rank
    before (more data ranks or stages now) starts its streams afresh (`Topology.local_source`). A checkpoint without
    a topology (written by the torch stack) counts its ranks as data ranks.
    """

    def local_source(self, path: Path) -> int | None:
        now = Topology.from_manifest(self.identity.get("topology"))
        if now is None:
            return self.rank
        manifest = read_manifest(path)
        before = Topology.from_manifest(manifest.get("topology"))
        if before is None:
            world_size = manifest.get("world_size")
            if type(world_size) is not int or world_size < 1:
                return None
            before = Topology(shard=world_size)
        return now.local_source(self.rank, before)
