"""A Llama-style decoder written the TorchTitan way, trained by perdure's parallel stack through its override points.

    torchrun --nproc_per_node 4 examples/llama.py --parallel.axes.tensor 2 --parallel.loss_parallel true
    torchrun --nproc_per_node 2 examples/llama.py --parallel.axes.pipeline 2
    python examples/llama.py                                       # one process: the same model, unsplit

The model code knows nothing of perdure: RMSNorm, rotary embeddings (RoPE), a SwiGLU feed-forward, attention with one
fused QKV projection whose state-dict hooks save it as separate `wq` / `wk` / `wv` weights (the layout checkpoints of
Llama models use), and the functions TorchTitan's `parallelize_llama` is made of: `apply_tp` (its own tensor-parallel
plan with `parallelize_module`, optionally leaving the logits sharded for loss parallelism), `apply_ac` (torch's
`checkpoint_wrapper` on each block) and `apply_compile` (`torch.compile` per block). The runner calls them from
`parallelize_model`, `apply_activation_checkpointing` and `apply_compile`, with the mesh perdure builds, whose
dimensions are named as TorchTitan names them (`mesh["tp"]`); FSDP2, the pipeline schedule and DCP checkpoints are
perdure's. See docs/parallel.md.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from perdure import ConfigError, Runner, RunnerConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from perdure.distributed.topology import Topology


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.stack = "parallel"
        self.steps = 100
        self.seed = 42
        self.ckpt.interval = 50
        self.optim.lr = 3e-3
        self.dataloader.batch_size = 8
        self.dataloader.drop_last = True  # every batch splits into equal pipeline microbatches
        self.log.interval = 20
        self.model.dim = 32
        self.model.layers = 2
        self.model.heads = 4
        self.model.hidden = 64  # SwiGLU width
        self.model.seq_len = 16
        self.model.vocab = 64
        self.model.rope_theta = 10000.0
        self.data.tokens = 16384

    def check_user_keys(self) -> None:
        if self.model.dim % (2 * self.model.heads):
            raise ConfigError("model.dim", self.model.dim, f"use a multiple of 2 x model.heads ({self.model.heads})")


# ---- the model ------------------------------------------------------------------------------------------------------


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq_len, head_dim / 2)."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, length, heads, head_dim) by the position's angles."""
    even, odd = torch.unflatten(x.float(), -1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with one fused QKV projection. Its rows are grouped by head (q, k, v of head 0, then of
    head 1, ...), so a column-wise tensor-parallel shard holds whole heads. Checkpoints see separate `wq`, `wk`, `wv`
    weights (the usual layout): a state-dict post-hook splits the fused weight, a load pre-hook fuses them back."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        # torch declares neither method's parameters (mypy --strict: "call to untyped function")
        self.register_state_dict_post_hook(split_qkv)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(fuse_qkv)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # Under tensor parallelism this rank holds some of the heads: their count follows the local width.
        q, k, v = self.wqkv(x).view(batch, length, -1, 3, self.head_dim).unbind(3)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, length, -1))
        return projected


def split_qkv(module: Attention, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
    """State-dict post-hook: `wqkv.weight` becomes `wq.weight`, `wk.weight`, `wv.weight` (each whole: a sharded
    weight is gathered first, so the split does not depend on how it is sharded)."""
    from torch.distributed.tensor import DTensor

    fused = state_dict.pop(prefix + "wqkv.weight")
    if isinstance(fused, DTensor):
        fused = fused.full_tensor()
    per_head = fused.view(module.heads, 3, module.head_dim, -1)
    for index, name in enumerate(("wq", "wk", "wv")):
        state_dict[f"{prefix}{name}.weight"] = per_head[:, index].reshape(module.heads * module.head_dim, -1).clone()


def fuse_qkv(module: Attention, state_dict: dict[str, Any], prefix: str, *args: object) -> None:
    """Load-state-dict pre-hook: `wq.weight`, `wk.weight`, `wv.weight` become `wqkv.weight`, laid out (and sharded)
    as the module's own weight is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = [f"{prefix}{name}.weight" for name in ("wq", "wk", "wv")]
    if not all(name in state_dict for name in names):
        return  # load_state_dict reports the missing keys
    parts = [state_dict.pop(name) for name in names]
    parts = [part.full_tensor() if isinstance(part, DTensor) else part for part in parts]
    fused = torch.stack([part.view(module.heads, module.head_dim, -1) for part in parts], 1).flatten(0, 2)
    weight = module.wqkv.weight
    if isinstance(weight, DTensor):
        fused = distribute_tensor(fused.to(weight.device), weight.device_mesh, weight.placements)
    state_dict[prefix + "wqkv.weight"] = fused


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Llama(nn.Module):
    """Embedding, blocks in a ModuleDict (named by index: a pipeline stage keeps their names), norm, output."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int, seq_len: int, theta: float) -> None:
        super().__init__()
        # None on the pipeline stages that do not hold them (`pipeline_stage`)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(index): TransformerBlock(dim, heads, hidden) for index in range(layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(dim)
        self.output: nn.Linear | None = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(dim // heads, seq_len, theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # recomputed, never saved
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of these parts: the first embeds the tokens, the last makes the logits.
        h: torch.Tensor = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.output is not None and self.norm is not None:
            h = self.output(self.norm(h))
        return h

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """A copy holding this stage's blocks (under their own names), the embedding on the first stage and the norm
        and output on the last (as TorchTitan's pipeline split does)."""
        names = list(self.layers)
        if num_stages > len(names):
            raise ConfigError("parallel.axes.pipeline", num_stages, f"use at most model.layers ({len(names)}) stages")
        per_stage = math.ceil(len(names) / num_stages)
        mine = names[stage_index * per_stage : (stage_index + 1) * per_stage]
        stage = copy.deepcopy(self)
        for name in names:
            if name not in mine:
                del stage.layers[name]
        if stage_index > 0:
            stage.tok_embeddings = None
        if stage_index < num_stages - 1:
            stage.norm = stage.output = None
        return stage


# ---- how it is parallelised: TorchTitan's functions, with a DeviceMesh whose dimensions have TorchTitan's names ----


def apply_tp(model: Llama, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The tensor-parallel plan: embedding by rows, output by columns (left sharded over the vocabulary when
    `loss_parallel`), norms replicated; per block the fused QKV and w1 / w3 by columns, wo and w2 by rows."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # A ModuleDict's values are typed nn.Module; a block may be wrapped (checkpoint_wrapper forwards attributes).
    heads = cast(TransformerBlock, model.layers[next(iter(model.layers))]).attention.heads
    if heads % tp_mesh.size():
        raise ConfigError("parallel.axes.tensor", tp_mesh.size(), f"use a divisor of model.heads ({heads})")
    root_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    parallelize_module(model, tp_mesh, root_plan)
    block_plan: dict[str, ParallelStyle] = {
        "attention.wqkv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def apply_ac(model: Llama) -> None:
    """Activation checkpointing of every block with torch's `checkpoint_wrapper` (the wrapper replaces the block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in model.layers.named_children():
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=True))


def apply_compile(model: Llama, backend: str) -> None:
    """`torch.compile` of every block (the compiled module replaces the block)."""
    for name, block in model.layers.named_children():
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        assert isinstance(compiled, nn.Module)  # typed as a callable; a module compiles to an OptimizedModule
        model.layers.register_module(name, compiled)


# ---- data, loss and the runner ------------------------------------------------------------------------------------


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `seq_len + 1` tokens of a stream drawn from a fixed random bigram table (the same for every split;
    `seed` draws the stream): inputs and targets."""

    def __init__(self, count: int, vocab: int, seq_len: int, seed: int) -> None:
        table = (torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)) * 3).softmax(-1)
        generator = torch.Generator().manual_seed(seed)
        tokens = [0]
        for _ in range(count - 1):
            tokens.append(int(torch.multinomial(table[tokens[-1]], 1, generator=generator)))
        self.tokens, self.seq_len = torch.tensor(tokens), seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; on logits sharded over the vocabulary it runs under loss parallelism."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LlamaRunner(Runner):
    topology: Topology  # the parallel stack's; it alone calls the override points below

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        m = config.model
        self.model = Llama(m.vocab, m.dim, m.layers, m.heads, m.hidden, m.seq_len, m.rope_theta)
        self.criterion = cross_entropy
        count = config.data.tokens
        self.datasets["train"] = TokenWindows(count, m.vocab, m.seq_len, seed=0)
        self.datasets["val"] = TokenWindows(count // 8, m.vocab, m.seq_len, seed=1)

    # The parallel stack's override points, each calling the model's own function (stack=parallel only).

    def parallelize_model(self, model: nn.Module, mesh: DeviceMesh) -> None:
        assert isinstance(model, Llama)  # the model built in __init__, or a pipeline stage of it
        if self.topology.tensor > 1:
            apply_tp(model, mesh["tp"], loss_parallel=self.config.parallel.loss_parallel)

    def apply_activation_checkpointing(self, model: nn.Module) -> None:
        assert isinstance(model, Llama)
        if self.config.parallel.activation_checkpointing:
            apply_ac(model)

    def apply_compile(self, model: nn.Module) -> None:
        assert isinstance(model, Llama)
        if self.config.compile.enabled:
            apply_compile(model, self.config.compile.backend)


if __name__ == "__main__":
    LlamaRunner(Config().parse()).train()
