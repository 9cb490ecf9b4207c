"""A Hugging Face causal LM (transformers' LlamaForCausalLM, a tiny config, random init) on padded dict batches.

    pip install -e '.[hf]'                                                           # transformers
    python examples/hf_causal_lm.py                                                  # one process
    torchrun --nproc_per_node 2 examples/hf_causal_lm.py                             # DDP
    torchrun --nproc_per_node 2 examples/hf_causal_lm.py --stack deepspeed --deepspeed.zero_stage 3

Nothing is downloaded: the model is built from a config. Batches are what the model takes (`input_ids`,
`attention_mask`, `labels`), padded per batch by the runner's `self.collate_fns`; the loss is token-weighted
(`loss.normalize=tokens`) as Hugging Face Trainer makes it. For a pretrained model, build it with `from_pretrained`
in `__init__` instead (perdure then saves and resumes it like any module). See docs/quickstart.md and
docs/deepspeed.md.
"""

from __future__ import annotations

from typing import Any

import torch
from padded_lm import IGNORE, Sequences, pad_batch, summed_loss  # examples/padded_lm.py: data, padding, the loss
from transformers import LlamaConfig, LlamaForCausalLM

from perdure import Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 40
        self.seed = 7
        self.accum_steps = 2
        self.loss.normalize = "tokens"
        self.optim.lr = 3e-3
        self.dataloader.batch_size = 4
        self.ckpt.interval = 20
        self.log.interval = 10
        self.model.vocab = 32
        self.model.dim = 32
        self.model.layers = 2
        self.model.heads = 4
        self.data.sequences = 256
        self.data.min_length = 4
        self.data.max_length = 24


class HFRunner(Runner):
    model: LlamaForCausalLM  # narrower than the base's `nn.Module`

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        m = config.model
        model_config = LlamaConfig(
            vocab_size=m.vocab,
            hidden_size=m.dim,
            intermediate_size=2 * m.dim,
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.heads,
            max_position_embeddings=config.data.max_length,
            pad_token_id=0,
        )
        self.model = LlamaForCausalLM(model_config)
        data = config.data
        for split, count, seed in (("train", data.sequences, 0), ("val", max(data.sequences // 8, 8), 1)):
            self.datasets[split] = Sequences(count, m.vocab, data.min_length, data.max_length, seed)
            self.collate_fns[split] = pad_batch  # {"input_ids", "attention_mask", "labels"}, padded per batch

    def train_step(self, batch: Any) -> torch.Tensor:
        batch = self.to_device(batch)
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss, _ = summed_loss(logits, batch["labels"])
        return loss  # a sum: loss.normalize=tokens divides it by the window's target tokens on all ranks

    def loss_tokens(self, batch: Any) -> torch.Tensor:
        labels: torch.Tensor = batch["labels"]
        return (labels[:, 1:] != IGNORE).sum()

    def evaluate_step(self, batch: Any) -> dict[str, torch.Tensor]:
        batch = self.to_device(batch)
        return {"loss": self.model(**batch).loss}  # the model's own loss: the mean over the batch's target tokens


if __name__ == "__main__":
    HFRunner(Config().parse()).train()
