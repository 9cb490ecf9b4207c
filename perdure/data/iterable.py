"""Iterable (streaming) datasets: which ones can resume, and torchdata node pipelines as datasets.

An `IterableDataset` resumes exactly when it implements `state_dict()` / `load_state_dict()`: torchdata's
StatefulDataLoader asks it for its state with every checkpoint (each rank for its own stream, saved in the rank's
file) and gives it back before the resumed run's first `iter()`. Its `__iter__` must then continue from that state,
and start the next pass when a pass is over. A stream without state cannot say where it was: a resume restarts it
from its beginning (its first samples are seen again), and perdure says so when the runner is built.

With worker processes, each epoch's workers start from the stream as the main process holds it, which never read a
sample: a pass counter the stream keeps itself stays at 0 there, so a stream that reshuffles per pass would read the
same order every epoch. A stream with `set_epoch(epoch)` is told the epoch before each `iter()`, in the main process
(whose copy the workers get), with or without workers.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import Dataset, IterableDataset

from perdure.checkpoints.base import Stateful

logger = logging.getLogger("perdure")


def is_stateful(dataset: Any) -> bool:
    """Whether `dataset` can report and take back its position (`state_dict` and `load_state_dict` methods)."""
    return isinstance(dataset, Stateful)


@runtime_checkable
class EpochAware(Protocol):
    """A stream told which epoch begins (`set_epoch`, the convention of torch's DistributedSampler and of Hugging Face
    streaming datasets), before each epoch's `iter()`."""

    def set_epoch(self, epoch: int) -> None: ...


def is_node(dataset: Any) -> bool:
    """Whether `dataset` is a torchdata.nodes pipeline (without importing torchdata.nodes when nothing uses it)."""
    try:
        from torchdata.nodes import BaseNode
    except ImportError:  # pragma: no cover - torchdata is a dependency
        return False
    return isinstance(dataset, BaseNode)


class NodeDataset(IterableDataset):
    """A torchdata.nodes pipeline (a `BaseNode` yielding samples) as a resumable IterableDataset: its position is the
    pipeline's `state_dict`, and each pass over it is one epoch. The runner wraps a node assigned to
    `self.datasets[...]` in one; perdure batches its samples with `dataloader.batch_size`."""

    def __init__(self, node: Any) -> None:
        from torchdata.nodes import Loader

        self.loader = Loader(node)

    def __iter__(self) -> Any:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def as_dataset(dataset: Any) -> Dataset:
    """`dataset`, or a node pipeline wrapped in a `NodeDataset`."""
    return NodeDataset(dataset) if is_node(dataset) else dataset


def warn_if_unresumable(split: str, dataset: Any) -> None:
    """The training stream cannot be resumed where it was: say so once, with the fix."""
    if split != "train" or not isinstance(dataset, IterableDataset) or is_stateful(dataset):
        return
    logger.warning(
        "the 'train' dataset %s is an IterableDataset without state_dict() / load_state_dict(): perdure cannot save "
        "its position, so a resumed run restarts its stream from the beginning (samples seen before the checkpoint "
        "are seen again). Implement state_dict() returning the stream's position and load_state_dict() continuing "
        "from it (docs/datasets.md), or use a map-style dataset",
        type(dataset).__name__,
    )
