"""Building the torchft Manager of one process, and averaging gradients across the replica groups through it.

Every process of a group has a Manager; the group's rank 0 also runs the ManagerServer that talks to the lighthouse.
Each step: `start_quorum()` (synchronous here: a group that joins behind heals from a live peer *before* its forward
pass, so it takes part in the step), the gradients are averaged across the participating groups with
`manager.allreduce` (not torchft's DistributedDataParallel, whose comm hook crashes the survivor when a peer dies
inside the all-reduce), then `should_commit()` is the groups' vote that gates the optimizer step.

A healing group receives the peer's state over HTTP. torchft's own transport unpickles it with
`weights_only=False`; `RestrictedHTTPTransport` reads it with torch's allow-list (tensors and plain data), as every
file perdure reads.
"""

from __future__ import annotations

import logging
import os
import pickle
import urllib.request
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from perdure.checkpoints.snapshot import is_dtensor, local_part
from perdure.errors import PerdureError
from perdure.ft.ports import host_port, manager_server_on, own_address, rebind_transport, store_on
from perdure.private_api import flatten_dense_tensors, streaming_load, tree_map, unflatten_dense_tensors

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# torch warns once that tensors loaded from a byte stream view read-only memory; the transport copies them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module="torch.distributed._serialization")


class _DropWarning(logging.Filter):
    """torchft warns at every quorum change that it cannot reset NCCL's flight recorder: meaningless on gloo."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


logging.getLogger("torchft.manager").addFilter(_DropWarning())

BUCKET_BYTES = 25 << 20  # gradients travel in buckets of at most this many bytes, in parameter order


class HealRefusedError(PerdureError):
    """The state a peer sent to heal this group holds something beyond tensors and plain data."""


class QuorumError(PerdureError):
    """The group could not join a quorum (the lighthouse is unreachable, or too few groups within the timeout)."""


def _transport_class() -> type:
    from torchft.checkpointing import HTTPTransport

    class RestrictedHTTPTransport(HTTPTransport):
        """torchft's HTTP checkpoint transport whose receiving side only unpickles tensors and plain data, and whose
        server listens on the group's address `ip` only, advertised as `host` (see ports.py)."""

        def __init__(self, timeout: timedelta, *, host: str, ip: str) -> None:
            self._advertised = host
            super().__init__(timeout=timeout, num_chunks=0)
            rebind_transport(self, ip)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            address = f"{metadata}{step}/full"
            if not address.startswith(("http://", "https://")):  # the peer names it: never a file:// or other URL
                raise HealRefusedError(f"a peer offered its state at {address!r}, which is not an http(s) address")
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response:
                try:
                    state = streaming_load(response, weights_only=True)
                except pickle.UnpicklingError as error:  # torch's allow-list refused a global; the message names it
                    raise HealRefusedError(
                        f"the state the peer at {address} sent to heal this group holds more than tensors and plain "
                        f"data, which perdure never unpickles ({str(error).splitlines()[0]}); every object in "
                        "checkpoint_states() must have a state_dict of tensors and plain data"
                    ) from None
            # The tensors view the received bytes, which are read-only: own copies, so that the optimizer's state
            # can be updated in place.
            return tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, state)

        def address(self) -> str:
            """The address a healing peer downloads from: the group's own (see `ports.rebind_transport`)."""
            return f"http://{host_port(self._advertised, self._server.socket.getsockname()[1])}/checkpoint/"

    return RestrictedHTTPTransport


@dataclass(frozen=True)
class ManagerSettings:
    """What one process needs to build its Manager (from the `ft.*` keys and the group's launch)."""

    replica_id: int
    group_rank: int
    group_world_size: int
    lighthouse: str
    min_replica_size: int
    timeout_s: float
    quorum_timeout_s: float
    heartbeat_interval_s: float
    backend: str  # "gloo" or "nccl": the process group across the groups


def torchft_replica_id(replica_id: int) -> str:
    """The replica id the lighthouse sees. Zero-padded, so that torchft's ordering of a quorum (by replica id, as
    text) is the numeric order: the lowest replica id is rank 0 of every quorum."""
    return f"perdure_{replica_id:05d}"


def build_manager(
    settings: ManagerSettings,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
) -> tuple[Any, Any]:
    """(manager, store): a torchft Manager for this process, and the TCPStore it uses (kept alive by the caller).

    A group of several ranks uses its own process group's store (MASTER_ADDR / MASTER_PORT, as torchrun sets them);
    a group of one process starts a store of its own, advertised under MASTER_ADDR or the host name, which the other
    groups reach when this group is the quorum's primary. The group's ports listen on that address only (ports.py).
    """
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=settings.timeout_s)
    host, ip = own_address(os.environ.get("MASTER_ADDR"))  # this rank's ports listen there only (ports.py)
    if settings.group_world_size > 1:
        store_host, port, store = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    else:
        store = store_on(ip, host, timeout)  # (the TCPStore, its listening socket): kept alive together
        store_host, port = host, store[0].port
    group = ProcessGroupNCCL(timeout=timeout) if settings.backend == "nccl" else ProcessGroupGloo(timeout=timeout)
    transport = _transport_class()(timeout, host=host, ip=ip)
    try:
        with manager_server_on(ip):
            manager = Manager(
                pg=group,
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                min_replica_size=settings.min_replica_size,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
                connect_timeout=timeout,
                rank=settings.group_rank,
                world_size=settings.group_world_size,
                store_addr=store_host,
                store_port=port,
                lighthouse_addr=settings.lighthouse,
                replica_id=torchft_replica_id(settings.replica_id),
                hostname=host,  # advertised to the lighthouse and the other groups: the address it listens on
                heartbeat_interval=timedelta(seconds=settings.heartbeat_interval_s),
                checkpoint_transport=transport,
                init_sync=True,
            )
    except Exception as error:
        raise QuorumError(
            f"replica group {settings.replica_id} could not reach the lighthouse at {settings.lighthouse} "
            f"({type(error).__name__}: {error}); is it running (`perdure ft lighthouse --bind HOST:PORT`), and is "
            "ft.lighthouse / $TORCHFT_LIGHTHOUSE its address?"
        ) from None
    return manager, store


class GradientAverager:
    """Averages every trainable parameter's gradient across the participating groups, in buckets of a fixed layout
    (parameter order, `BUCKET_BYTES`), so the reduction is the same at every step and after every restart.

    A parameter without a gradient takes part with zeros (another group may have one), and gets the average. A
    sharded parameter (FSDP2 inside the group: HSDP whose replicate dimension is the replica groups) takes part with
    this rank's shard of its gradient, which rank `r` of every group holds alike.
    """

    def __init__(self, parameters: Iterable[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for parameter in parameters:
            if not parameter.requires_grad:
                continue
            shard = local_part(parameter)
            nbytes = shard.numel() * shard.element_size()
            same_kind = not current or (current[0].dtype, local_part(current[0]).device) == (shard.dtype, shard.device)
            if current and (size + nbytes > bucket_bytes or not same_kind):
                self.buckets.append(current)
                current, size = [], 0
            current.append(parameter)
            size += nbytes
        if current:
            self.buckets.append(current)

    def average(self, manager: Any) -> None:
        """All-reduce (average) the gradients through `manager`. Errors are the manager's to report: a failed
        all-reduce makes `should_commit()` return False, and the gradients are then dropped."""
        flats, works, grads = [], [], []
        for bucket in self.buckets:
            grads.append(
                [local_part(p.grad) if p.grad is not None else torch.zeros_like(local_part(p)) for p in bucket]
            )
            flat = flatten_dense_tensors(grads[-1])
            flats.append(flat)
            works.append(manager.allreduce(flat))
        for work in works:
            work.wait()
        for bucket, flat, shapes in zip(self.buckets, flats, grads):
            for parameter, averaged in zip(bucket, unflatten_dense_tensors(flat, shapes)):
                if parameter.grad is not None:
                    local_part(parameter.grad).copy_(averaged)
                elif is_dtensor(parameter):
                    parameter.grad = _shaped_like(parameter, averaged)
                else:
                    parameter.grad = averaged


def _shaped_like(template: DTensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` as a DTensor with `template`'s mesh, placements and global shape (this rank's part of it)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        shard.to(local_part(template).device),
        template.device_mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
        run_check=False,
    )


def local_shards(tree: Any) -> Any:
    """A state tree as a healing peer receives it: copies of the tensors (taken now: the coming step changes the live
    ones while the peer may still be downloading), each DTensor as this rank's shard (the allow-listed transport
    carries plain tensors; rank `r` of the peer holds the same shards)."""
    if isinstance(tree, torch.Tensor):
        return local_part(tree).detach().clone()
    if isinstance(tree, dict):
        return {key: local_shards(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        values = [local_shards(value) for value in tree]
        return values if isinstance(tree, list) else tuple(values)
    return tree


def sharded_like(template: Any, received: Any) -> Any:
    """The inverse of `local_shards` against this rank's own state tree: a received shard whose counterpart in
    `template` is a DTensor becomes a DTensor of the same layout; everything else is taken as received."""
    if is_dtensor(template) and isinstance(received, torch.Tensor):
        mine = local_part(template)
        if received.shape != mine.shape or received.dtype != mine.dtype:
            raise HealRefusedError(
                f"a peer sent a shard of {list(received.shape)} {received.dtype} where this rank holds "
                f"{list(mine.shape)} {mine.dtype}: every replica group must shard the model alike (the same number of "
                "ranks and parallel.axes)"
            )
        return _shaped_like(template, received)
    if isinstance(template, dict) and isinstance(received, dict):
        return {key: sharded_like(template.get(key), value) for key, value in received.items()}
    if isinstance(template, (list, tuple)) and isinstance(received, (list, tuple)) and len(template) == len(received):
        values = [sharded_like(mine, theirs) for mine, theirs in zip(template, received)]
        return values if isinstance(received, list) else tuple(values)
    return received
