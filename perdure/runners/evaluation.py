"""Evaluation and scoring: the part of the runner that measures, keeps every result and tracks the best score."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from perdure.data.loader import ResumableLoader
from perdure.distributed.collectives import all_gather_object, max_each_over_ranks, max_over_ranks, sum_over_ranks
from perdure.errors import PerdureError
from perdure.resilience.hang_watch import watched_phase
from perdure.runners.fields import RunnerFields
from perdure.runners.rng import RNGState

_NO_BATCH = object()  # an iterator's end, as `next(iterator, _NO_BATCH)` says it


class EvaluationStopped(Exception):
    """A preemption signal stopped a training evaluation before batch `batch` of `split` (on every rank alike)."""

    def __init__(self, split: str, batch: int) -> None:
        super().__init__(f"evaluation stopped before batch {batch} of {split!r} by a preemption signal")
        self.split = split
        self.batch = batch


class EvaluationMixin(RunnerFields):
    """Evaluation loops, results history, best score and early stopping, and an evaluation a preemption signal stops.
    Part of `BaseRunner` (one concept per file); it uses the runner's `config`, `state`, `model`, `dataloaders`,
    `autocast`, `evaluate_step`, `stop_requested`, `checkpoints` and `_stop_for_preemption`."""

    _evaluation_stops_on_signal = False  # set while the training loop evaluates (`_evaluate_and_score`)

    def _eval_splits(self) -> list[str]:
        return [split for split in self.dataloaders if split != "train"]

    def evaluation_context(self) -> AbstractContextManager:
        """Override point: the autograd mode `evaluate_steps` and `infer` run the model in; default `torch.no_grad()`.

        Called at every evaluation, which may come before the first training step (a resumed run first evaluates the
        step a signal stopped its evaluation in; `evaluate()` before `train()`). Not `torch.inference_mode()`: what a
        model makes at its first forward and training then uses (FSDP2's all-gather buffers, ZeRO-3's gathered
        parameters, a rotary-embedding cache) would be inference tensors, which training cannot use. Must not
        change any state.
        """
        return torch.no_grad()

    def evaluates_in_lockstep(self) -> bool:
        """Override point: whether every forward of an evaluation is a collective (FSDP2, tensor or pipeline
        parallelism, ZeRO-3), so that every data rank must run as many. Then each data rank evaluates the first N
        batches of its share, N the fewest any data rank holds: the split's last batches beyond (fewer samples than
        there are data ranks) are left out, and `infer` refuses a split the data ranks do not divide evenly.

        Default False: each rank evaluates its whole share, uneven or not. Called at every evaluation and `infer`;
        must return the same on every rank.
        """
        return False

    def evaluate(self, splits: list[str] | None = None) -> dict[str, dict[str, float]]:
        """Evaluate each split (default: every split but train) on its first `eval_batches(split)` batches."""
        splits = splits or self._eval_splits()
        return {split: self.evaluate_steps(split, self.eval_batches(split)) for split in splits}

    def eval_batches(self, split: str) -> int | None:
        """Override point: how many batches of `split` (from its start, in order) each evaluation reads; None: all.

        Default: `eval.steps`; batches of the split's batch size, counted for all ranks together on a map-style split
        (see `evaluate_steps`). Called at every evaluation. Must return the same number at every evaluation of a run,
        whatever its budget, so that every evaluation (and the best score) measures the same samples.
        """
        return self.config.eval.steps

    def evaluate_steps(self, split: str, steps: int | None = None) -> dict[str, float]:
        """Average `evaluate_step` over the first `steps` batches of `split` (all of them when None).

        For a map-style split the batches are counted for all ranks together: the first `steps x batch_size`
        samples, each rank reading its share, so the samples evaluated do not depend on the number of ranks. An
        iterable split reads `steps` batches on each rank.

        An evaluation the training loop runs stops at the next batch once a preemption signal arrives (every rank at
        the same batch, see `_batches_checked_for_stop`): it raises `EvaluationStopped`, and the loop saves the step.
        """
        loader = self.dataloaders[split]
        lockstep = self.evaluates_in_lockstep()
        if lockstep and not loader.is_iterable:
            steps = self._batches_every_rank_reads(loader, steps)
        model = self.model
        was_training = model.training
        model.eval()
        totals: dict[str, float] = {}
        count = 0
        limit = None if steps is None else steps * loader.batch_size
        batches = loader.iter_epoch(0, limit=limit)
        if loader.is_iterable and steps is not None:
            batches = itertools.islice(batches, steps)
        if loader.is_iterable and self.world_size > 1:
            batches, checked = self._agreed_batches(batches, split, lockstep), 0
        else:
            checked = self._batches_checked_for_stop(loader, limit) if self._evaluation_stops_on_signal else 0
        try:
            with self.evaluation_context():
                for index, batch in enumerate(batches):
                    if index < checked and self.stop_requested():
                        raise EvaluationStopped(split, index)
                    with self.autocast():
                        metrics = self.evaluate_step(batch)
                    weight = loader.take_samples(1)
                    for name, value in metrics.items():
                        totals[name] = totals.get(name, 0.0) + float(value) * weight
                    count += weight
                    self.telemetry.alive()
        finally:
            model.train(was_training)
        return self.reduce_metrics(totals, count)

    def _batches_every_rank_reads(self, loader: ResumableLoader, steps: int | None) -> int | None:
        """`steps` for `evaluate_steps` on a map-style split (all ranks together) such that every data rank reads the
        same number of batches: the fewest any data rank holds of the bounded split."""
        counts = all_gather_object(loader.batch_count(None if steps is None else steps * loader.batch_size))
        if len(set(counts)) == 1:
            return steps
        return min(counts) * loader.world_size  # the first `min` batches of each data rank's share

    def _agreed_batches(self, batches: Iterable[Any], split: str, lockstep: bool) -> Iterator[Any]:
        """An iterable split on several ranks, where how many batches each rank's stream holds is not known ahead:
        before each batch the ranks agree (one collective) whether any of them was signalled to stop (in the loop's
        evaluations), whether any still has a batch and whether any has run out. In lockstep, all stop once one ran out;
        otherwise they go on while one has a batch, and a rank that ran out only takes part in the agreement."""
        batches = iter(batches)
        for index in itertools.count():
            batch = next(batches, _NO_BATCH)
            has_batch = batch is not _NO_BATCH
            received = (self.preemption.received or 0) if self._evaluation_stops_on_signal else 0
            signum, any_has, any_lacks = max_each_over_ranks([received, int(has_batch), int(not has_batch)])
            if signum:
                self.stop_signal = signum
                raise EvaluationStopped(split, index)
            if not any_has or (lockstep and any_lacks):
                return
            if has_batch:
                yield batch

    def _batches_checked_for_stop(self, loader: ResumableLoader, limit: int | None) -> int:
        """Before how many of this evaluation's batches a preemption signal is looked for: all of them on one process;
        with several ranks, as many as every rank reads (each look agrees the signal over all ranks, so every rank
        must take it, and a stack may run each forward collectively). An uneven share's last batch is not looked
        before (an iterable split's batches are agreed one by one instead, see `_agreed_batches`)."""
        if self.world_size == 1:
            return sys.maxsize
        return -max_over_ranks(-loader.batch_count(limit))

    def reduce_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        """Turn weighted sums into means, after summing `totals` and `count` over every rank (each evaluates its own
        share of the split, uneven shares included)."""
        names = list(totals)  # evaluate_step's order, the same on every rank
        *sums, samples = sum_over_ranks([totals[name] for name in names] + [float(count)])
        return {name: total / max(samples, 1) for name, total in zip(names, sums)}

    def infer(self, split: str) -> torch.Tensor:
        """Concatenated `infer_step` outputs over a whole split, in order."""
        loader = self.dataloaders[split]
        if self.evaluates_in_lockstep():
            counts = all_gather_object(_batches_known(loader))
            if None in counts:
                raise PerdureError(
                    f"infer({split!r}): the split is a stream without a length, which this stack cannot check to be "
                    "even across data ranks (it runs every forward on every data rank together); infer on one "
                    "process from the exported model.pth"
                )
            if len(set(counts)) > 1:
                raise PerdureError(
                    f"infer({split!r}): the data ranks hold {counts} batches of the split, but this stack runs every "
                    "forward on every data rank together; use a split the data ranks divide evenly, or infer on one "
                    "process from the exported model.pth"
                )
        model = self.model
        was_training = model.training
        model.eval()
        outputs = []
        with self.evaluation_context():
            for batch in loader.iter_epoch(0):
                with self.autocast():
                    outputs.append(self.infer_step(batch))
        model.train(was_training)
        return torch.cat(outputs)

    @watched_phase("evaluation")  # not a step: dist.step_timeout does not count it
    def _evaluate_and_score(self) -> bool:
        """The training loop's evaluation of every split: its results are kept, logged and scored; returns True.

        A preemption signal stops it (see `evaluate_steps`): nothing of it is kept, the random generators go back to
        where they stood before it (so the one run again later draws what this one would have), the state records
        that this position's evaluation is still to run (`evaluation_pending`: the next attempt runs it first), and
        it returns False; the caller then saves this position and exits.
        """
        started = time.perf_counter()
        generators = RNGState().state_dict()
        self._evaluation_stops_on_signal = True
        try:
            results = self.evaluate()
        except EvaluationStopped as stopped:
            RNGState().load_state_dict(generators)
            self.state.evaluation_pending = True
            self.logger.warning(
                "evaluation of step %d stopped at batch %d of %r: the next attempt runs it again before training on",
                self.state.global_step,
                stopped.batch,
                stopped.split,
            )
            return False
        finally:
            self._evaluation_stops_on_signal = False
            self.meter.exclude(time.perf_counter() - started)  # not training time: kept out of step_time
            self.telemetry.goodput.blocked("evaluation", time.perf_counter() - started)
        self.state.evaluation_pending = False
        self.state.results[str(self.state.global_step)] = results
        for split, metrics in results.items():
            self.log_metrics(split, metrics)
        self._update_score(results)
        return True

    def _evaluate_pending(self) -> None:
        """The attempt starts from a position whose evaluation a preemption signal stopped: run it now, as the
        uninterrupted run did right after that step. The position is saved already (a position is never saved twice),
        so an improved score points `best` at that checkpoint."""
        if not self._eval_splits():  # this attempt has no evaluation splits: nothing to run
            self.state.evaluation_pending = False
            return
        self.logger.info("evaluating step %d, which the last attempt was stopped in", self.state.global_step)
        self.is_best = False
        if not self._evaluate_and_score():
            self._stop_for_preemption()
        if self.is_best and self.config.ckpt.enabled:
            self.checkpoints.point_best(self._position_name())

    def _update_score(self, results: Mapping[str, Mapping[str, float]]) -> None:
        score_config = self.config.score
        score = results.get(score_config.split, {}).get(score_config.metric)
        if score is None:
            return
        best = self.state.best_score
        improved = best is None or (score < best if score_config.mode == "min" else score > best)
        if improved:
            self.state.best_score = float(score)
            self.state.best_step = self.state.global_step
            self.state.patience_count = 0
            self.is_best = True
            return
        self.state.patience_count += 1
        if score_config.patience and self.state.patience_count >= score_config.patience:
            self.state.early_stopped = True
            self.logger.info(
                "early stop at step %d: %s/%s did not improve for %d evaluations (best %.6g at step %d)",
                self.state.global_step,
                score_config.split,
                score_config.metric,
                self.state.patience_count,
                self.state.best_score,
                self.state.best_step,
            )


def _batches_known(loader: ResumableLoader) -> int | None:
    """The batches this rank reads of a whole epoch of `loader`, or None for a stream without a length."""
    if not loader.is_iterable:
        return loader.batch_count()
    try:
        return len(loader)
    except TypeError:
        return None
