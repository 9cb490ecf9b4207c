"""Evaluation and scoring: the part of the runner that measures, keeps every result and tracks the best score."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping

import torch

from perdure.data.batch import batch_length
from perdure.distributed.collectives import sum_over_ranks


class EvaluationMixin:
    """Evaluation loops, results history, best score and early stopping. Part of `BaseRunner` (one concept per
    file); it uses the runner's `config`, `state`, `model`, `dataloaders`, `autocast` and `evaluate_step`."""

    def _eval_splits(self) -> list[str]:
        return [split for split in self.dataloaders if split != "train"]

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
        """
        model = self.model
        was_training = model.training
        model.eval()
        totals: dict[str, float] = {}
        count = 0
        loader = self.dataloaders[split]
        limit = None if steps is None else steps * loader.batch_size
        batches = loader.iter_epoch(0, limit=limit)
        if loader.is_iterable and steps is not None:
            batches = itertools.islice(batches, steps)
        with torch.inference_mode():
            for batch in batches:
                with self.autocast():
                    metrics = self.evaluate_step(batch)
                weight = batch_length(batch)
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0.0) + float(value) * weight
                count += weight
        model.train(was_training)
        return self.reduce_metrics(totals, count)

    def reduce_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        """Turn weighted sums into means, after summing `totals` and `count` over every rank (each evaluates its own
        share of the split, uneven shares included)."""
        names = list(totals)  # evaluate_step's order, the same on every rank
        *sums, count = sum_over_ranks([totals[name] for name in names] + [float(count)])
        return {name: total / max(count, 1) for name, total in zip(names, sums)}

    def infer(self, split: str) -> torch.Tensor:
        """Concatenated `infer_step` outputs over a whole split, in order."""
        model = self.model
        was_training = model.training
        model.eval()
        outputs = []
        with torch.inference_mode():
            for batch in self.dataloaders[split].iter_epoch(0):
                with self.autocast():
                    outputs.append(self.infer_step(batch))
        model.train(was_training)
        return torch.cat(outputs)

    def _evaluate_and_score(self) -> None:
        started = time.perf_counter()
        results = self.evaluate()
        self.meter.exclude(time.perf_counter() - started)  # not training time: kept out of step_time
        self.state.results[str(self.state.global_step)] = results
        for split, metrics in results.items():
            self.log_metrics(split, metrics)
        self._update_score(results)

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
