"""Evaluation and scoring: the runner's evaluation override points, and the `Evaluator` it owns, which measures,
keeps every result and tracks the best score.

    EvaluationHooks   the override points, on the runner (`BaseRunner` inherits them): `evaluate`, `eval_batches`,
                      `evaluate_steps`, `evaluation_context`, `evaluates_in_lockstep`, `reduce_metrics`, `infer`
                      (`evaluate_step` and `infer_step` are with the other user override points, in runners/base.py)
    Evaluator         the loops and the score: built by `BaseRunner.__post_init__` with what it reads, passed
                      explicitly (config, state, loaders, world size, preemption handler, telemetry, throughput
                      meter, logger), and the runner as the `EvaluationHooks` it calls back; nothing else of the
                      runner. The training loop calls `evaluate_and_score` (`BaseRunner._evaluate_and_score`).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from perdure.data.loader import ResumableLoader
from perdure.distributed.collectives import all_gather_object, max_each_over_ranks, max_over_ranks, sum_over_ranks
from perdure.errors import PerdureError
from perdure.runners.fields import RunnerFields
from perdure.runners.rng import RNGState

if TYPE_CHECKING:
    from perdure.config import RunnerConfig
    from perdure.resilience.signals import PreemptionHandler
    from perdure.runners.state import RunnerState
    from perdure.runners.telemetry import RunTelemetry
    from perdure.runners.throughput import ThroughputMeter

_NO_BATCH = object()  # an iterator's end, as `next(iterator, _NO_BATCH)` says it


class EvaluationStopped(Exception):
    """A preemption signal stopped a training evaluation before batch `batch` of `split` (on every rank alike).

    `signal`: the signal the ranks agreed on while reading an iterable split batch by batch; 0 when the runner's
    `stop_requested` agreed it (and recorded it already)."""

    def __init__(self, split: str, batch: int, signal: int = 0) -> None:
        super().__init__(f"evaluation stopped before batch {batch} of {split!r} by a preemption signal")
        self.split = split
        self.batch = batch
        self.signal = signal


class EvaluationHooks(RunnerFields):
    """The evaluation override points, with their defaults: `BaseRunner` inherits them, user runners and the stacks
    override them on the runner (as a LightningModule inherits its hook classes). They hold no state; the loops are
    the `Evaluator`'s (`self.evaluator`, built by `BaseRunner.__post_init__`), which calls them back."""

    evaluator: Evaluator  # built by `BaseRunner.__post_init__`

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
        splits = splits or self.evaluator.splits()
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
        the same batch, see `Evaluator._batches_checked_for_stop`): it raises `EvaluationStopped`, and the loop saves
        the step. The loops are the Evaluator's (runners/evaluation.py).
        """
        return self.evaluator.evaluate_steps(split, steps)

    def reduce_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        """Turn weighted sums into means, after summing `totals` and `count` over every rank (each evaluates its own
        share of the split, uneven shares included)."""
        names = list(totals)  # evaluate_step's order, the same on every rank
        *sums, samples = sum_over_ranks([totals[name] for name in names] + [float(count)])
        return {name: total / max(samples, 1) for name, total in zip(names, sums)}

    def infer(self, split: str) -> torch.Tensor:
        """Concatenated `infer_step` outputs over a whole split, in order (the Evaluator's loop)."""
        return self.evaluator.infer(split)


class Evaluator:
    """Evaluation loops, results history, best score and early stopping, and an evaluation a preemption signal
    stops. Owned by the runner (`runner.evaluator`); see the module docstring for what it is built with."""

    def __init__(
        self,
        hooks: EvaluationHooks,
        *,
        config: RunnerConfig,
        state: RunnerState,
        dataloaders: Mapping[str, ResumableLoader],
        world_size: int,
        preemption: PreemptionHandler,
        telemetry: RunTelemetry,
        meter: ThroughputMeter,
        logger: logging.Logger,
    ) -> None:
        self.hooks = hooks
        self.config = config
        self.state = state  # results, best score, patience, `evaluation_pending`: written by `evaluate_and_score`
        self.dataloaders = dataloaders  # the runner's, filled by `build_dataloaders` after the Evaluator is built
        self.world_size = world_size
        self.preemption = preemption
        self.telemetry = telemetry  # a heartbeat per batch; an evaluation's time is counted as blocked
        self.meter = meter  # an evaluation's time is kept out of the train log lines' step_time
        self.logger = logger
        self.stops_on_signal = False  # set while the training loop evaluates (`evaluate_and_score`)

    def splits(self) -> list[str]:
        """The splits an evaluation reads by default: every split but train."""
        return [split for split in self.dataloaders if split != "train"]

    def evaluate_steps(self, split: str, steps: int | None) -> dict[str, float]:
        """`runner.evaluate_steps` (documented there): average `evaluate_step` over the first `steps` batches."""
        hooks = self.hooks
        loader = self.dataloaders[split]
        lockstep = hooks.evaluates_in_lockstep()
        if lockstep and not loader.is_iterable:
            steps = self._batches_every_rank_reads(loader, steps)
        model = hooks.model
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
            checked = self._batches_checked_for_stop(loader, limit) if self.stops_on_signal else 0
        try:
            with hooks.evaluation_context():
                for index, batch in enumerate(batches):
                    if index < checked and hooks.stop_requested():
                        raise EvaluationStopped(split, index)
                    with hooks.autocast():
                        metrics = hooks.evaluate_step(batch)
                    weight = loader.take_samples(1)
                    for name, value in metrics.items():
                        totals[name] = totals.get(name, 0.0) + float(value) * weight
                    count += weight
                    self.telemetry.alive()
        finally:
            model.train(was_training)
        return hooks.reduce_metrics(totals, count)

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
            received = (self.preemption.received or 0) if self.stops_on_signal else 0
            signum, any_has, any_lacks = max_each_over_ranks([received, int(has_batch), int(not has_batch)])
            if signum:
                raise EvaluationStopped(split, index, signal=signum)
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

    def infer(self, split: str) -> torch.Tensor:
        """`runner.infer` (documented there): concatenated `infer_step` outputs over a whole split, in order."""
        hooks = self.hooks
        loader = self.dataloaders[split]
        if hooks.evaluates_in_lockstep():
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
        model = hooks.model
        was_training = model.training
        model.eval()
        outputs = []
        with hooks.evaluation_context():
            for batch in loader.iter_epoch(0):
                with hooks.autocast():
                    outputs.append(hooks.infer_step(batch))
        model.train(was_training)
        return torch.cat(outputs)

    def evaluate_and_score(self) -> bool:
        """The training loop's evaluation of every split (`runner.evaluate()`): its results are kept, logged and
        scored; returns whether the score improved.

        A preemption signal stops it (see `runner.evaluate_steps`): nothing of it is kept, the random generators go
        back to where they stood before it (so the one run again later draws what this one would have), the state
        records that this position's evaluation is still to run (`evaluation_pending`: the next attempt runs it
        first), and `EvaluationStopped` is raised; the runner then saves this position and exits.
        """
        started = time.perf_counter()
        generators = RNGState().state_dict()
        self.stops_on_signal = True
        try:
            results = self.hooks.evaluate()
        except EvaluationStopped as stopped:
            RNGState().load_state_dict(generators)
            self.state.evaluation_pending = True
            self.logger.warning(
                "evaluation of step %d stopped at batch %d of %r: the next attempt runs it again before training on",
                self.state.global_step,
                stopped.batch,
                stopped.split,
            )
            raise
        finally:
            self.stops_on_signal = False
            self.meter.exclude(time.perf_counter() - started)  # not training time: kept out of step_time
            self.telemetry.goodput.blocked("evaluation", time.perf_counter() - started)
        self.state.evaluation_pending = False
        self.state.results[str(self.state.global_step)] = results
        for split, metrics in results.items():
            self.hooks.log_metrics(split, metrics)
        return self._update_score(results)

    def _update_score(self, results: Mapping[str, Mapping[str, float]]) -> bool:
        """Track the best score and early stopping; True when `results` improved the score."""
        score_config = self.config.score
        score = results.get(score_config.split, {}).get(score_config.metric)
        if score is None:
            return False
        best = self.state.best_score
        improved = best is None or (score < best if score_config.mode == "min" else score > best)
        if improved:
            self.state.best_score = float(score)
            self.state.best_step = self.state.global_step
            self.state.patience_count = 0
            return True
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
        return False


def _batches_known(loader: ResumableLoader) -> int | None:
    """The batches this rank reads of a whole epoch of `loader`, or None for a stream without a length."""
    if not loader.is_iterable:
        return loader.batch_count()
    try:
        return len(loader)
    except TypeError:
        return None
