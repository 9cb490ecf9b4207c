"""A small classifier on stack=deepspeed whose model is built under `self.init_module()` (ZeRO-3: partitioned as it
is built, `deepspeed.zero.Init`), as tests launch it. The config and data are tests/scripts/resumable.py's.

Environment knobs (tests only):
  BUILD         partitioned (default): under `self.init_module()`; eager: built whole on every rank
  LOSS_LOG      append one JSON line per micro-batch: position and the loss as an exact float hex ("{rank}" replaced)
  KILL_AT_STEP  SIGKILL this very process when `global_step` reaches this value (every rank at the same step)
  NORM          a BatchNorm1d after the first layer (its running statistics are buffers)
  INITIAL_WEIGHTS  rank 0 writes {"weights": the module's whole parameters and buffers, "master": the engine's fp32
                   master weights (stack=deepspeed)} there once the runner is built, gathered one at a time
  PEAK_RSS      each rank writes how far its resident memory rose above the program's start once the runner is built
                (bytes: VmHWM of /proc/self/status), "{rank}" replaced
  SETUP_ONLY    build the runner, write the above and stop (no training)
  EXPORT_RSS, CHECKPOINT_RSS  each rank writes how far its resident memory rose during the final export / during its
                last checkpoint save (bytes: the peak from the phase's start, when the peak is reset, over the resident
                memory then), "{rank}" replaced
  LOAD_RSS      each rank writes how far its resident memory rose while `--pretrained` was loaded into its
                partitions, before the engine is built (bytes: the peak from the load's start over the resident memory
                then; stack=deepspeed with ZeRO-3), "{rank}" replaced
  SPLIT_STATE   each hidden Linear(width, width) saves its weight as two new tensors, `weight_top` and `weight_bottom`
                (its rows split in half, cloned), in a state-dict post-hook, and a load pre-hook joins them back: what
                a hook makes, as a fused QKV saved split
  RENAME_STATE  the Linear(width, width) after the hidden ones saves its weight under another name, `kernel`: the
                parameter itself, renamed by a state-dict post-hook (a load pre-hook names it back), a hook that makes
                no tensor (as a Hugging Face style renaming)
  HF_CONFIG     the runner gives a plain Hugging Face config (`hf_config()`), so `ckpt.export_format` may hold hf
  ADAPTER       keywise: the runner's `state_dict_adapter()` is `KeywiseAdapter` (renames every key, permutes the rows
                of each square weight as TorchTitan's Llama3 adapter permutes q/k, splits the first weight in two);
                concat: `ConcatAdapter` (the same, and the last layer's weight and bias concatenated into one tensor)
  --depth N     N more Linear(width, width) + ReLU after the first ReLU (resumable.py's key; default 0: none)

Each rank prints how many parameter values it holds once the model is built.
"""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from resumable import Config, Synthetic  # noqa: E402  (tests/scripts/resumable.py)

from perdure import Runner  # noqa: E402
from tests.runs import reset_peak, write_rise  # noqa: E402


class ZeroInitRunner(Runner):
    def __init__(self, config):
        super().__init__(config)
        partitioned = os.environ.get("BUILD", "partitioned") == "partitioned"
        with self.init_module() if partitioned else contextlib.nullcontext():
            width = config.width
            norm = [nn.BatchNorm1d(width)] if os.environ.get("NORM") else []
            hidden = [layer for _ in range(config.depth) for layer in (nn.Linear(width, width), nn.ReLU())]
            self.model = nn.Sequential(
                nn.Linear(16, width), *norm, nn.ReLU(), *hidden, nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2)
            )
        if os.environ.get("SPLIT_STATE"):
            for layer in hidden:
                if isinstance(layer, nn.Linear):
                    layer.register_state_dict_post_hook(split_weight)
                    layer.register_load_state_dict_pre_hook(join_weight)
        if os.environ.get("RENAME_STATE"):
            self.model[-3].register_state_dict_post_hook(rename_weight)
            self.model[-3].register_load_state_dict_pre_hook(name_weight_back)
        held = sum(parameter.numel() for parameter in self.model.parameters())
        print(f"rank {self.rank} holds {held} parameter values once the model is built", flush=True)
        self.criterion = nn.CrossEntropyLoss()
        self.datasets["train"] = Synthetic(config.dataset_size, seed=1)
        self.loss_log = os.environ.get("LOSS_LOG", "").replace("{rank}", str(self.rank))
        self.kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
        self._position, self._micro = None, 0

    def hf_config(self):
        return {"model_type": "perdure-test-mlp"} if os.environ.get("HF_CONFIG") else None

    def state_dict_adapter(self):
        adapters = {"keywise": KeywiseAdapter, "concat": ConcatAdapter}
        return adapters[os.environ["ADAPTER"]]() if os.environ.get("ADAPTER") else None

    def save_checkpoint(self, reason):
        return self._measured("CHECKPOINT_RSS", lambda: super(ZeroInitRunner, self).save_checkpoint(reason), True)

    def write_final_exports(self):
        return self._measured("EXPORT_RSS", lambda: super(ZeroInitRunner, self).write_final_exports(), False)

    def _load_pretrained_slices(self, slices, path):
        # DeepSpeedRunner's ZeRO-3 --pretrained load alone: the engine built after it allocates its own state
        return self._measured(
            "LOAD_RSS", lambda: super(ZeroInitRunner, self)._load_pretrained_slices(slices, path), False
        )

    def _measured(self, knob, phase, saved):
        """`phase()`; with the knob set, how far this rank's resident memory rose during it, written to its file (with
        `saved`, only when it returned a checkpoint: a call that found the step saved already writes nothing)."""
        if not os.environ.get(knob):
            return phase()
        start = reset_peak()  # the peak from here on
        result = phase()
        if result is not None or not saved:
            write_rise(os.environ[knob], self.rank, start)
        return result

    def train_step(self, batch):
        if self.state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().train_step(batch)
        position = (self.state.epoch, self.state.global_step)
        self._micro = self._micro + 1 if position == self._position else 0
        self._position = position
        if self.loss_log:
            with open(self.loss_log, "a") as log:
                record = {"epoch": position[0], "step": position[1], "micro": self._micro, "loss": loss.item().hex()}
                log.write(json.dumps(record) + "\n")
        return loss


def split_weight(module, state_dict, prefix, local_metadata):
    top, bottom = state_dict.pop(f"{prefix}weight").chunk(2)
    state_dict[f"{prefix}weight_top"], state_dict[f"{prefix}weight_bottom"] = top.clone(), bottom.clone()


def join_weight(module, state_dict, prefix, *args):
    halves = [f"{prefix}weight_top", f"{prefix}weight_bottom"]
    if all(key in state_dict for key in halves):
        state_dict[f"{prefix}weight"] = torch.cat([state_dict.pop(key) for key in halves])


def rename_weight(module, state_dict, prefix, local_metadata):
    state_dict[f"{prefix}kernel"] = state_dict.pop(f"{prefix}weight")


def name_weight_back(module, state_dict, prefix, *args):
    if f"{prefix}kernel" in state_dict:
        state_dict[f"{prefix}weight"] = state_dict.pop(f"{prefix}kernel")


class KeywiseAdapter:
    """Maps each key on its own: `N.weight` -> `mlp.N.kernel`, a square weight's rows permuted within two heads (each
    head's adjacent pairs of rows to its two halves, as TorchTitan's Llama3 adapter permutes q and k), the first
    layer's weight split into `mlp.0.gate` and `mlp.0.up` (its halves)."""

    def to_hf(self, state_dict):
        out = {}
        for key, value in state_dict.items():
            index, kind = key.split(".")
            if key == "0.weight":
                out["mlp.0.gate"], out["mlp.0.up"] = value.chunk(2)
            elif kind == "weight" and value.shape[0] == value.shape[1]:
                rows, columns = value.shape
                out[f"mlp.{index}.kernel"] = (
                    value.reshape(2, rows // 4, 2, columns).transpose(1, 2).reshape(rows, columns)
                )
            else:
                out[f"mlp.{index}.{'kernel' if kind == 'weight' else kind}"] = value
        return out

    def from_hf(self, hf_state_dict):
        out = {}
        for key, value in hf_state_dict.items():
            _, index, kind = key.split(".")
            if kind == "gate":
                out["0.weight"] = torch.cat([value, hf_state_dict["mlp.0.up"]])
            elif kind == "up":
                continue
            elif kind == "kernel" and value.shape[0] == value.shape[1]:
                rows, columns = value.shape
                out[f"{index}.weight"] = value.reshape(2, 2, rows // 4, columns).transpose(1, 2).reshape(rows, columns)
            else:
                out[f"{index}.{'weight' if kind == 'kernel' else kind}"] = value
        return out


class ConcatAdapter(KeywiseAdapter):
    """`KeywiseAdapter`, and the last layer's weight and bias concatenated into one tensor, `mlp.head` (its bias a
    last column): two keys map to one, so the export takes the whole path."""

    def to_hf(self, state_dict):
        out = super().to_hf(state_dict)
        last = max(int(key.split(".")[0]) for key in state_dict)
        if f"mlp.{last}.kernel" in out and f"mlp.{last}.bias" in out:  # alone, each is passed on as it is
            weight, bias = out.pop(f"mlp.{last}.kernel"), out.pop(f"mlp.{last}.bias")
            out["mlp.head"] = torch.cat([weight, bias[:, None]], dim=1)
        return out


def initial_weights(runner):
    """The module's whole parameters and buffers, and (stack=deepspeed) the engine's fp32 master weights: each
    partitioned parameter gathered alone (collectives: every rank calls this); kept by rank 0."""
    module, weights, master = runner.unwrap_model(), {}, {}
    for name, parameter in module.named_parameters():
        if runner.config.stack in ("deepspeed", "ds"):
            import deepspeed
            from deepspeed.utils import safe_get_full_fp32_param

            with deepspeed.zero.GatheredParameters([parameter]):
                weights[name] = parameter.detach().clone()
            master[name] = safe_get_full_fp32_param(parameter).detach().clone()
        else:
            weights[name] = parameter.detach().clone()
    weights.update((name, buffer.detach().clone()) for name, buffer in module.named_buffers())
    return {"weights": weights, "master": master}


if __name__ == "__main__":
    if os.environ.get("PEAK_RSS"):
        START_RSS = reset_peak()  # the peak from here on (tests/runs.py)
    runner = ZeroInitRunner(Config().parse())
    if os.environ.get("PEAK_RSS"):
        write_rise(os.environ["PEAK_RSS"], runner.rank, START_RSS)
    if os.environ.get("INITIAL_WEIGHTS"):
        initial = initial_weights(runner)
        if runner.rank == 0:
            torch.save(initial, os.environ["INITIAL_WEIGHTS"])
    if not os.environ.get("SETUP_ONLY"):
        runner.train()
