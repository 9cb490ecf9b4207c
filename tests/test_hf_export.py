"""`ckpt.export_format: [hf]`: `<run dir>/hf/` (and `hf-ema/`) that transformers' `from_pretrained` loads with the
weights of `model.pth`, on every stack, for a transformers model and for a model of its own with a state-dict adapter;
`perdure ckpt export --format hf` writes the same directory from a checkpoint.

Launches: one DeepSpeed ZeRO-3 run and one FSDP2 run on 2 ranks (tests/scripts/hf_export_lm.py, a tied
LlamaForCausalLM); the adapter model (examples/llama_hf.py) trains in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perdure import ConfigError, PerdureError
from perdure.checkpoints.hf_export import HFShardWriter, publish, staging_dir, write_state_dict
from perdure.cli import main as cli
from tests.runs import assert_all_ok, run_dir, run_ranks
from tests.scripts.resumable import ResumableRunner, make_config

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
from safetensors.torch import load_file  # noqa: E402  (transformers depends on it)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN = ("--steps", "4", "--ckpt.interval", "2", "--ema.enabled", "true", "--dist.timeout", "60")


def loaded(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict of the model `AutoModelForCausalLM.from_pretrained(directory)` builds, and it is tied when the
    export's config says so."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    return model.state_dict()


def assert_equal(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(weights) == sorted(reference)
    unequal = [key for key in reference if not torch.equal(weights[key], reference[key])]
    assert not unequal, unequal


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def perdure(capsys, *argv: object) -> tuple[int, str]:
    code = cli.main(["ckpt", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.timeout(300)
def test_a_tied_transformers_model_on_deepspeed_zero3_exports_what_from_pretrained_loads(tmp_path, capsys):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    args = ("--stack", "deepspeed", "--deepspeed.zero_stage", "3", "--ckpt.export_format", "pth,hf", *RUN)
    assert_all_ok(run_ranks(2, "hf_export_lm.py", tmp_path, *args, timeout=240, DS_ACCELERATOR="cpu"))
    run = run_dir(tmp_path)
    assert_equal(loaded(run / "hf"), torch.load(run / "model.pth", weights_only=True))
    assert_equal(loaded(run / "hf-ema"), torch.load(run / "model-ema.pth", weights_only=True))
    assert "lm_head.weight" not in safetensors_of(run / "hf")  # tied: left out, as save_pretrained does
    assert json.loads((run / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (run / "hf" / "generation_config.json").is_file()

    # The CLI writes the same directory from the last checkpoint (its weights and the hf.json stored with them).
    for source, flags in (("hf", ()), ("hf-ema", ("--ema",))):
        out = tmp_path / "cli" / source
        code, said = perdure(capsys, "export", run / "checkpoints" / "latest", out, "--format", "hf", *flags)
        assert code == 0, said
        assert "(Hugging Face, llama)" in said
        assert_equal(safetensors_of(out), safetensors_of(run / source))
        for name in ("config.json", "generation_config.json"):
            assert json.loads((out / name).read_text()) == json.loads((run / source / name).read_text())
    code, said = perdure(capsys, "export", run / "checkpoints" / "latest", tmp_path / "cli" / "hf", "--format", "hf")
    assert code == 2 and "exists; pass --force" in said
    code, said = perdure(capsys, "export", run / "model.pth", tmp_path / "x", "--format", "hf")
    assert code == 2 and "--format hf needs a checkpoint" in said


@pytest.mark.timeout(300)
def test_fsdp2_ranks_write_their_own_shards_and_the_export_equals_model_pth(tmp_path):
    args = ("--stack", "parallel", "--ckpt.export_format", "pth,hf", *RUN)
    gathers = tmp_path / "gathers-{rank}"
    assert_all_ok(run_ranks(2, "hf_export_lm.py", tmp_path / "runs", *args, timeout=240, GATHER_LOG=gathers))
    run = run_dir(tmp_path / "runs")
    assert_equal(loaded(run / "hf"), torch.load(run / "model.pth", weights_only=True))
    assert_equal(loaded(run / "hf-ema"), torch.load(run / "model-ema.pth", weights_only=True))
    # No rank gathered a DTensor whole: each wrote its shards, rank 0 consolidated them file by file.
    assert [(tmp_path / f"gathers-{rank}").read_text() for rank in (0, 1)] == ["0\n", "0\n"]
    assert sorted(path.name for path in (run / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


@pytest.mark.timeout(120)
def test_a_model_of_its_own_is_published_as_hugging_face_llama_through_its_adapter(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import llama
    from llama_hf import HFLlamaRunner, LlamaStateDictAdapter

    config = llama.Config()
    settings = {"stack": "torch", "steps": 4, "ckpt.interval": 2, "data.tokens": 1000, "model.vocab": 32}
    settings.update({"ckpt.export_format": ["pth", "hf"], "workspace.root": str(tmp_path / "runs")})
    for key, value in {**settings, "workspace.code_id": "tests"}.items():
        config[key] = value
    HFLlamaRunner(config).train()
    run = run_dir(tmp_path / "runs")
    ours = torch.load(run / "model.pth", weights_only=True)
    adapter = LlamaStateDictAdapter(config.model.heads)
    assert_equal(loaded(run / "hf"), adapter.to_hf(ours))
    assert_equal(adapter.from_hf(adapter.to_hf(ours)), ours)

    # The Hugging Face model computes what the model of its own computes: the adapter's permutation is right.
    m = config.model
    model = llama.Llama(m.vocab, m.dim, m.layers, m.heads, m.hidden, m.seq_len, m.rope_theta)
    model.load_state_dict(ours)
    published = transformers.AutoModelForCausalLM.from_pretrained(run / "hf")
    tokens = torch.randint(0, m.vocab, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(published(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)

    # Only the program can run the adapter: the CLI says so and how; from_checkpoint + export_hf does it.
    code, said = perdure(capsys, "export", run, tmp_path / "cli", "--format", "hf")
    assert code == 2 and "LlamaStateDictAdapter" in said and "export_hf(OUT)" in said
    assert not (tmp_path / "cli").exists()
    rebuilt = HFLlamaRunner.from_checkpoint(run / "checkpoints" / "latest", config_class=llama.Config)
    rebuilt.export_hf(tmp_path / "again")
    assert_equal(safetensors_of(tmp_path / "again"), safetensors_of(run / "hf"))

    # An export that fails leaves the previous one in place and no staging directory behind.
    class Failing(LlamaStateDictAdapter):
        def to_hf(self, state_dict):
            raise KeyError("no Hugging Face name for 'extra.weight'")

    monkeypatch.setattr(rebuilt, "state_dict_adapter", lambda: Failing(m.heads))
    with pytest.raises(KeyError, match="extra.weight"):
        rebuilt.export_hf(tmp_path / "again")
    rebuilt.close()
    assert_equal(safetensors_of(tmp_path / "again"), safetensors_of(run / "hf"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["again", "runs"]


class NoHFConfig(ResumableRunner):
    pass


class BadHFConfig(ResumableRunner):
    def hf_config(self):
        return {"hidden_size": 8}


@pytest.mark.parametrize(
    ("runner", "message"),
    [
        (NoHFConfig, "is not a transformers PreTrainedModel, so the hf export needs its Hugging Face config: override "
                     "NoHFConfig.hf_config()"),
        (BadHFConfig, "BadHFConfig.hf_config() returned a dict without a 'model_type'"),
    ],
)  # fmt: skip
def test_a_model_without_a_hugging_face_config_is_refused_before_training(tmp_path, runner, message):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError) as error:
        runner(make_config(root, steps=2, **{"ckpt.export_format": ["pth", "hf"]}))
    assert "ckpt.export_format" in str(error.value) and message in str(error.value)
    assert not list(root.glob("*/*/checkpoints/ckpt-*"))


def test_weights_past_the_shard_size_go_to_several_files_with_an_index(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    state = model.state_dict()
    target = tmp_path / "hf"
    target.mkdir()
    (target / "stale.safetensors").write_bytes(b"from an earlier export")
    staging = staging_dir(target)
    write_state_dict(staging, state, max_shard_bytes=1024)
    config.save_pretrained(staging)
    publish(staging, target)
    files = sorted(path.name for path in target.iterdir())
    assert "stale.safetensors" not in files and "model.safetensors.index.json" in files
    assert len([name for name in files if name.startswith("model-0")]) > 2
    assert not [path for path in tmp_path.iterdir() if path.name != "hf"]  # no staging or old directory left
    assert_equal(transformers.LlamaForCausalLM.from_pretrained(target).state_dict(), state)

    mixed = {"half": torch.randn(3, 5).bfloat16(), "steps": torch.arange(7), "flag": torch.tensor([True, False])}
    (tmp_path / "mixed").mkdir()
    write_state_dict(tmp_path / "mixed", mixed)
    assert_equal(load_file(tmp_path / "mixed" / "model.safetensors"), mixed)
    with pytest.raises(PerdureError, match="'b' came where 'a' was expected"):
        HFShardWriter(tmp_path, [("a", (2,), torch.float32), ("b", (2,), torch.float32)]).add("b", torch.zeros(2))
    with pytest.raises(PerdureError, match="never came"):
        HFShardWriter(tmp_path, [("a", (2,), torch.float32), ("b", (2,), torch.float32)]).finish()


def test_the_probe_tells_an_adapter_that_maps_each_key_alone_from_one_that_maps_keys_together():
    """`probe_adapter` (on tensors on the meta device): a renaming, permuting, splitting adapter streams, in the
    order `to_hf` of the whole state dict gives; one that concatenates, needs another key, or gives one tensor twice
    takes the whole path, with the reason."""
    from perdure.runners.hf_export import KeywisePlan, probe_adapter

    shapes = {"b.weight": (torch.float32, (4, 2)), "a.weight": (torch.float32, (4, 2)), "a.bias": (torch.float32, (4,))}

    class Split:
        def to_hf(self, state):
            out = {}
            for key, value in sorted(state.items()):  # a.bias, a.weight, b.weight
                if key == "a.weight":
                    out["a.top"], out["a.bottom"] = value.chunk(2)
                else:
                    out[f"hf.{key}"] = value.flip(0)
            return out

    class Concat:
        def to_hf(self, state):
            out = dict(state)
            if "a.weight" in out and "b.weight" in out:
                out["ab"] = torch.cat([out.pop("a.weight"), out.pop("b.weight")])
            return out

    class Needs:
        def to_hf(self, state):
            return {key: value * state["a.bias"].sum() for key, value in state.items()}

    class Twice:
        def to_hf(self, state):
            return {**state, **({"tied": state["b.weight"]} if "b.weight" in state else {})}

    plan = probe_adapter(Split(), shapes)
    assert isinstance(plan, KeywisePlan)
    assert plan.order == ("a.bias", "a.weight", "b.weight")
    assert plan.outputs["a.weight"] == (("a.top", (2, 2), torch.float32), ("a.bottom", (2, 2), torch.float32))
    assert "alone maps to 'b.weight', which the whole state dict does not hold" in str(probe_adapter(Concat(), shapes))
    assert "fails on 'b.weight' alone (KeyError" in str(probe_adapter(Needs(), shapes))
    assert "returns 'tied' as the same tensor as another key" in str(probe_adapter(Twice(), shapes))
