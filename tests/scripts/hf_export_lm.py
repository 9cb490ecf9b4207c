"""examples/hf_causal_lm.py with the output layer tied to the embedding (`tie_word_embeddings`), as the hf export tests
launch it: tiny, a few steps.

Environment knobs (tests only):
  GATHER_LOG   write to this file (rank in `{rank}`) how many DTensors the hf export gathered whole
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_causal_lm  # noqa: E402  (examples/hf_causal_lm.py)
from transformers import LlamaForCausalLM  # noqa: E402


class Config(hf_causal_lm.Config):
    def __init__(self):
        super().__init__()
        self.steps = 4
        self.accum_steps = 1
        self.ckpt.interval = 2
        self.log.interval = 2
        self.model.dim = 16
        self.model.heads = 2
        self.data.sequences = 32


class TiedRunner(hf_causal_lm.HFRunner):
    def __init__(self, config):
        super().__init__(config)
        model_config = self.model.config
        model_config.tie_word_embeddings = True
        self.model = LlamaForCausalLM(model_config)
        assert self.model.lm_head.weight is self.model.model.embed_tokens.weight

    def export_hf(self, target=None):
        log = os.environ.get("GATHER_LOG", "").replace("{rank}", str(self.rank))
        if not log:
            return super().export_hf(target)
        from torch.distributed.tensor import DTensor

        gathered = []
        full_tensor = DTensor.full_tensor

        def counting(tensor, *args, **kwargs):
            gathered.append(tuple(tensor.shape))
            return full_tensor(tensor, *args, **kwargs)

        DTensor.full_tensor = counting
        try:
            return super().export_hf(target)
        finally:
            DTensor.full_tensor = full_tensor
            Path(log).write_text(f"{len(gathered)}\n")


if __name__ == "__main__":
    TiedRunner(Config().parse()).train()
