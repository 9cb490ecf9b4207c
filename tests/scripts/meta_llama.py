"""examples/llama.py built the way TorchTitan builds a model larger than one device: under `torch.device("meta")`, with
TorchTitan's `init_weights(buffer_device=...)` (the RoPE tables recomputed, every weight drawn in place), as tests
launch it.

Environment knobs (tests only):
  BUILD            init_module (default): under `self.init_module()` (the meta device on stack=parallel); meta: under
                   `torch.device("meta")` on any stack; eager: the same model on the CPU; bare: on meta, a model class
                   without init_weights whose root owns the RoPE buffers (what the runner must refuse)
  USER_OPTIMIZER   the program builds its AdamW in __init__, over the parameters as built
  KILL_AT_STEP     SIGKILL this very process when `global_step` reaches this value (every rank at the same step)
  INITIAL_WEIGHTS  rank 0 writes the whole model's weights and buffers there once the runner is built (before any step)
  PEAK_RSS         each rank writes how far its resident memory rose above its start (bytes: the peak from the start
                   of the program to the model built, sharded and materialised; /proc/self/status), "{rank}" replaced
  LOAD_RSS         each rank writes how far its resident memory rose from its shards materialised to the model's
                   sharding done (bytes: the peak reset there; with --pretrained, the load into the shards)
  BUILT_RSS        each rank writes how far its resident memory rose from the model sharded (the peak reset there) to
                   the runner built: the state-dict round-trip check, the loaders and the restore
  EXPORT_RSS       each rank writes how far its resident memory rose during the final export (bytes: the peak from the
                   export's start, when the peak is reset, over the resident memory then), "{rank}" replaced
  SETUP_ONLY       build the runner, write the above and stop (no training)
  HF_ADAPTER       the runner maps Hugging Face weights through examples/llama_hf.py's `LlamaStateDictAdapter`
  EXPORT_AGAIN     after training, the runner exports hf again into this directory through `ConcatNormsAdapter` (the
                   same, with each block's two norms concatenated into one tensor), measured as EXPORT_RSS is into
                   EXPORT_AGAIN_RSS
  HF_CONFIG        the runner gives a plain Hugging Face config (`hf_config()`), so `ckpt.export_format` may hold hf
  FUSED_STATE      the state dict holds each attention's fused `wqkv` as the model does: its hooks that split it into
                   whole `wq` / `wk` / `wv` (gathering it) and fuse them back are removed
"""

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import llama  # noqa: E402  (examples/llama.py)
from llama_hf import LlamaStateDictAdapter  # noqa: E402  (examples/llama_hf.py)

from tests.runs import reset_peak, write_rise  # noqa: E402


class Config(llama.Config):
    def __init__(self):
        super().__init__()
        self.steps = 10
        self.ckpt.interval = 5
        self.log.interval = 5
        self.dataloader.batch_size = 4
        self.model.dim = 16
        self.model.heads = 2
        self.model.hidden = 32
        self.model.seq_len = 8
        self.model.vocab = 32
        self.data.tokens = 700


class MetaLlama(llama.Llama):
    """TorchTitan's convention: the constructor only declares the tensors; `init_weights` gives them their values."""

    def __init__(self, vocab, dim, layers, heads, hidden, seq_len, theta):
        super().__init__(vocab, dim, layers, heads, hidden, seq_len, theta)
        self.rope = (dim // heads, seq_len, theta)

    def init_weights(self, buffer_device=None):
        with torch.device(buffer_device or self.rope_cos.device):
            self.rope_cos, self.rope_sin = llama.rope_tables(*self.rope)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()


class BareLlama(llama.Llama):
    """No init_weights, and the root module (no reset_parameters) owns the RoPE buffers."""


class TestRunner(llama.LlamaRunner):
    def __init__(self, config):
        super(llama.LlamaRunner, self).__init__(config)  # LlamaRunner's own builds its model eagerly: not called
        m = config.model
        build = os.environ.get("BUILD", "init_module")
        if build == "eager":
            self.model = MetaLlama(m.vocab, m.dim, m.layers, m.heads, m.hidden, m.seq_len, m.rope_theta)
        else:
            with torch.device("meta") if build in ("meta", "bare") else self.init_module():
                model_class = BareLlama if build == "bare" else MetaLlama
                self.model = model_class(m.vocab, m.dim, m.layers, m.heads, m.hidden, m.seq_len, m.rope_theta)
        if os.environ.get("FUSED_STATE"):
            for module in self.model.modules():
                if isinstance(module, llama.Attention):
                    module._state_dict_hooks.clear()
                    module._load_state_dict_pre_hooks.clear()
        if os.environ.get("USER_OPTIMIZER"):  # over the parameters as built (on meta): the runner must keep them
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.optim.lr)
        self.criterion = llama.cross_entropy
        self.datasets["train"] = llama.TokenWindows(config.data.tokens, m.vocab, m.seq_len, seed=0)
        self.datasets["val"] = llama.TokenWindows(config.data.tokens // 8, m.vocab, m.seq_len, seed=1)

    concat_norms = False  # EXPORT_AGAIN's export: through ConcatNormsAdapter

    def state_dict_adapter(self):
        if not os.environ.get("HF_ADAPTER"):
            return None
        return (ConcatNormsAdapter if self.concat_norms else LlamaStateDictAdapter)(self.config.model.heads)

    def hf_config(self):
        return {"model_type": "perdure-test-llama"} if os.environ.get("HF_CONFIG") else None

    def materialise_model(self, parts):
        super().materialise_model(parts)
        if os.environ.get("LOAD_RSS"):  # what follows: --pretrained read into the shards
            self.load_start = reset_peak()

    def distribute_model(self):
        super().distribute_model()
        if os.environ.get("LOAD_RSS"):
            write_rise(os.environ["LOAD_RSS"], self.rank, self.load_start)
        if os.environ.get("BUILT_RSS"):  # after PEAK_RSS: the peak from here on
            self.built_start = reset_peak()
        if os.environ.get("PEAK_RSS"):  # the model is built, sharded and (on meta) materialised now
            write_rise(os.environ["PEAK_RSS"], self.rank, START_RSS)

    def write_final_exports(self):
        if not os.environ.get("EXPORT_RSS"):
            return super().write_final_exports()
        start = reset_peak()  # the peak from here on
        super().write_final_exports()
        write_rise(os.environ["EXPORT_RSS"], self.rank, start)

    def forward_backward(self, window):
        if self.state.global_step == int(os.environ.get("KILL_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward_backward(window)


class ConcatNormsAdapter(LlamaStateDictAdapter):
    """`LlamaStateDictAdapter`, and each block's two norms concatenated into one tensor (`model.layers.N.norms`): an
    adapter that maps two keys into one, so the export cannot map each key alone. Export only."""

    def to_hf(self, state_dict):
        out = super().to_hf(state_dict)
        for key in [key for key in out if key.endswith(".input_layernorm.weight")]:
            block = key.removesuffix(".input_layernorm.weight")
            if f"{block}.post_attention_layernorm.weight" in out:  # alone, each is passed on renamed
                norms = out.pop(key), out.pop(f"{block}.post_attention_layernorm.weight")
                out[f"{block}.norms"] = torch.cat(norms)
        return out


def full_weights(model):
    """The state dict (gathered) and the buffers, non-persistent ones (RoPE) included."""
    tensors = {**model.state_dict(), **dict(model.named_buffers())}
    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in tensors.items()}


if __name__ == "__main__":
    if os.environ.get("PEAK_RSS"):
        START_RSS = reset_peak()  # the peak from here on (tests/runs.py)
    runner = TestRunner(Config().parse())
    if os.environ.get("BUILT_RSS"):
        write_rise(os.environ["BUILT_RSS"], runner.rank, runner.built_start)
    if os.environ.get("INITIAL_WEIGHTS"):
        weights = full_weights(runner.model)
        if runner.rank == 0:
            torch.save({key: value.cpu() for key, value in weights.items()}, os.environ["INITIAL_WEIGHTS"])
    if not os.environ.get("SETUP_ONLY"):
        runner.train()
    if os.environ.get("EXPORT_AGAIN"):
        runner.concat_norms = True
        start = reset_peak()
        runner.export_hf(os.environ["EXPORT_AGAIN"])
        write_rise(os.environ["EXPORT_AGAIN_RSS"], runner.rank, start)
