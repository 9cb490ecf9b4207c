"""Data setup: the part of the runner that builds its dataloaders and tells the step budget they span."""

from __future__ import annotations

import math
from typing import Any

from perdure.data.iterable import warn_if_unresumable
from perdure.data.loader import ResumableLoader
from perdure.errors import PerdureError
from perdure.runners.fields import RunnerFields


class DataSetupMixin(RunnerFields):
    """One ResumableLoader per split, and the scheduler's step budget. Part of `BaseRunner` (one concept per file); it
    uses the runner's `config`, `datasets`, `dataloaders` and the stack's `data_shard` / `data_parallel_rank`."""

    def build_dataloaders(self) -> None:
        """One ResumableLoader per dataset the user assigned; per-split options from `dataloader.<split>.*`, and the
        split's `collate_fns` entry (torch's default collation without one)."""
        if "train" not in self.datasets:
            raise PerdureError(f"{type(self).__name__}.__init__ must assign self.datasets['train']")
        for split, collate in self.collate_fns.items():
            if split not in self.datasets:
                known = ", ".join(repr(name) for name in self.datasets)
                raise PerdureError(
                    f"self.collate_fns[{split!r}]: no dataset is named {split!r}; the splits are {known}"
                )
            if not callable(collate):
                raise PerdureError(
                    f"self.collate_fns[{split!r}]: a {type(collate).__name__} is not callable; give a function that "
                    "makes a batch of a list of samples"
                )
        shard, shards = self.data_shard()
        for split, dataset in self.datasets.items():
            if split in self.dataloaders:
                continue
            options = self.config.loader_options(split)
            # Training batches are sharded over every data-parallel process; evaluation over this job's data shards.
            rank, world_size = self.data_parallel_rank() if split == "train" else (shard, shards)
            self.dataloaders[split] = ResumableLoader(
                dataset,
                batch_size=options["batch_size"],
                shuffle=bool(options["shuffle"]) and split == "train",
                num_workers=options["num_workers"],
                drop_last=bool(options["drop_last"]) and split == "train",
                pin_memory=bool(options["pin_memory"]),
                seed=self.config.seed,
                rank=rank,
                world_size=world_size,
                pad=split == "train",  # evaluation shares are uneven rather than padded with repeats
                collate_fn=self.collate_fns.get(split),
            )
            warn_if_unresumable(split, dataset)

    def total_steps_hint(self) -> int:
        """The step budget a scheduler should span (epoch mode: epochs times optimizer steps per epoch)."""
        if self.config.training_mode() == "steps":
            steps = self.config.steps
            assert steps is not None  # steps mode: `config.steps` is the budget
            return steps
        dataset: Any = self.datasets.get("train")
        readers = self.data_parallel_rank()[1]
        batches = math.ceil(len(dataset) / (self.config.loader_options("train")["batch_size"] * readers))
        return self.config.epochs * math.ceil(batches / self.config.accum_steps)
