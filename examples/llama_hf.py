"""examples/llama.py's TorchTitan-style Llama, published as a Hugging Face `LlamaForCausalLM` through a state-dict
adapter (`perdure.StateDictAdapter`: `to_hf` / `from_hf`, the shape of TorchTitan's `Llama3StateDictAdapter`).

    pip install -e '.[hf]'                                                  # transformers
    python examples/llama_hf.py --ckpt.export_format pth,hf                 # writes <run dir>/hf/
    torchrun --nproc_per_node 2 examples/llama_hf.py --ckpt.export_format hf   # FSDP2: written shard by shard

    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('RUN/hf')"

The model keeps its own names (`layers.0.attention.wq.weight`, ...); the adapter renames them to Hugging Face's
(`model.layers.0.self_attn.q_proj.weight`, ...) and permutes the rows of the query and key projections: this model
rotates adjacent channel pairs (Meta's RoPE), Hugging Face's Llama rotates the two halves of each head. `hf_config()`
gives the `LlamaConfig` of the same shapes. See docs/checkpoints.md, "Hugging Face formats".
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from llama import Config, LlamaRunner  # examples/llama.py

if TYPE_CHECKING:
    from transformers import LlamaConfig

# The model's names -> Hugging Face Llama's, `{}` the block's index.
NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}
ROTATED = ("q_proj", "k_proj")  # rows permuted between the two RoPE layouts


def _rename(key: str, table: dict[str, str]) -> str:
    block = re.search(r"layers\.(\d+)\.", key)
    pattern = key.replace(f"layers.{block.group(1)}.", "layers.{}.", 1) if block else key
    if pattern not in table:
        raise KeyError(f"no Hugging Face name for {key!r}")
    return table[pattern].format(block.group(1)) if block else table[pattern]


class LlamaStateDictAdapter:
    """examples/llama.py's state dict <-> Hugging Face `LlamaForCausalLM`'s."""

    def __init__(self, heads: int) -> None:
        self.heads = heads

    def _permute(self, weight: torch.Tensor, to_hf: bool) -> torch.Tensor:
        rows, columns = weight.shape
        pairs = (self.heads, rows // self.heads // 2, 2) if to_hf else (self.heads, 2, rows // self.heads // 2)
        return weight.reshape(*pairs, columns).transpose(1, 2).reshape(rows, columns)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in state_dict.items():
            name = _rename(key, NAMES)
            out[name] = self._permute(value, to_hf=True) if name.split(".")[-2] in ROTATED else value
        return out

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inverse = {hf: ours for ours, hf in NAMES.items()}
        out = {}
        for key, value in hf_state_dict.items():
            out[_rename(key, inverse)] = self._permute(value, to_hf=False) if key.split(".")[-2] in ROTATED else value
        return out


class HFLlamaRunner(LlamaRunner):
    def state_dict_adapter(self) -> LlamaStateDictAdapter:
        return LlamaStateDictAdapter(self.config.model.heads)

    def hf_config(self) -> LlamaConfig:
        from transformers import LlamaConfig

        m = self.config.model
        return LlamaConfig(
            vocab_size=m.vocab,
            hidden_size=m.dim,
            intermediate_size=m.hidden,
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.heads,
            max_position_embeddings=m.seq_len,
            rope_parameters={"rope_theta": m.rope_theta, "rope_type": "default"},
            rms_norm_eps=torch.finfo(torch.float32).eps,  # nn.RMSNorm's default eps
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )


if __name__ == "__main__":
    HFLlamaRunner(Config().parse()).train()
