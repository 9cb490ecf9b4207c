"""Reading weights in Hugging Face formats through the one read entry (`perdure.checkpoints.read`):
`save_pretrained` directories (one file, sharded with an index, `pytorch_model.bin`), a single safetensors file and
perdure's own `model.safetensors`, for `--pretrained`, `from_pretrained` and `perdure ckpt export`; a TorchTitan-style
Llama starts from Hugging Face Llama weights through its adapter; hostile safetensors headers and indexes are
refused before the safetensors library reads anything. Everything runs in this process."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from perdure import CheckpointError, PerdureError, WeightsMisfitError
from perdure.checkpoints.hf_read import check_safetensors_header, is_hf_source
from perdure.checkpoints.read import read_weights
from perdure.cli import main as cli
from tests.runs import run_dir
from tests.scripts.resumable import ResumableRunner, make_config

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def assert_equal(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(weights) == sorted(reference)
    unequal = [key for key in reference if not torch.equal(weights[key], reference[key])]
    assert not unequal, unequal


def perdure(capsys, *argv: object) -> tuple[int, str]:
    code = cli.main(["ckpt", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err


def tiny_llama(**overrides) -> transformers.LlamaForCausalLM:
    """The model examples/hf_causal_lm.py builds from its config below (vocab 32, dim 16, 2 layers, 2 heads)."""
    torch.manual_seed(3)
    settings = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    settings.update(num_key_value_heads=2, max_position_embeddings=24, pad_token_id=0, **overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))


def saved(model: torch.nn.Module, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.mark.timeout(120)
def test_save_pretrained_directories_and_files_read_equal_and_start_a_run(tmp_path, monkeypatch, capsys):
    model = tiny_llama()
    state = model.state_dict()
    single = saved(model, tmp_path / "single")
    sharded = saved(model, tmp_path / "sharded", max_shard_size=4000)
    assert len(list(sharded.glob("model-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    legacy = tmp_path / "legacy"  # a save_pretrained directory of the pickle era: allow-listed torch.load only
    legacy.mkdir()
    torch.save(state, legacy / "pytorch_model.bin")
    (legacy / "config.json").write_text((single / "config.json").read_text())
    sources = (single, single / "model.safetensors", sharded, legacy)
    for source in sources:
        assert_equal(read_weights(source), state)
        assert is_hf_source(source)

    # --pretrained / from_pretrained of each starts a run with exactly those weights.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import hf_causal_lm

    for number, source in enumerate(sources):
        config = hf_causal_lm.Config()
        settings = {
            "workspace.root": str(tmp_path / "runs"),
            "workspace.code_id": "tests",
            "workspace.id": f"ft{number}",
        }
        for key, value in {**settings, "model.dim": 16, "model.heads": 2, "data.sequences": 16}.items():
            config[key] = value
        runner = hf_causal_lm.HFRunner.from_pretrained(config, source)
        assert runner.global_step == 0 and runner.restore_source.kind == "pretrained"
        assert_equal(runner.model.state_dict(), state)
        runner.close()

    # `perdure ckpt export` reads them too, and its safetensors output stays marked as Hugging Face's layout.
    for source, out in ((sharded, tmp_path / "out.safetensors"), (single / "model.safetensors", tmp_path / "o.pth")):
        code, said = perdure(capsys, "export", source, out)
        assert code == 0, said
        assert f"exported model weights of {source}" in said
        assert_equal(read_weights(out), state)
    assert is_hf_source(tmp_path / "out.safetensors")
    code, said = perdure(capsys, "export", sharded, tmp_path / "ema.pth", "--ema")
    assert code == 2 and "--ema needs a checkpoint" in said


@pytest.mark.timeout(60)
def test_perdure_own_model_safetensors_reads_back_equal_to_model_pth(tmp_path, capsys):
    runner = ResumableRunner(make_config(tmp_path, steps=4, **{"ckpt.export_format": ["pth", "safetensors"]}))
    runner.train()
    run = run_dir(tmp_path)
    exported = torch.load(run / "model.pth", weights_only=True)
    assert_equal(read_weights(run / "model.safetensors"), exported)
    assert not is_hf_source(run / "model.safetensors")  # the model's own names: no adapter applies
    assert not is_hf_source(run)  # a run directory with a model.safetensors export is still a run directory
    code, said = perdure(capsys, "export", run / "model.safetensors", tmp_path / "copy.pth")
    assert code == 0, said
    assert_equal(torch.load(tmp_path / "copy.pth", weights_only=True), exported)
    fresh = ResumableRunner(make_config(tmp_path / "b", steps=4, pretrained=str(run / "model.safetensors")))
    assert_equal(fresh.model.state_dict(), exported)
    fresh.close()


@pytest.mark.timeout(120)
def test_a_torchtitan_style_llama_starts_from_hugging_face_llama_weights_through_its_adapter(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import llama
    from llama_hf import HFLlamaRunner, LlamaStateDictAdapter

    def config(name: str, **settings) -> llama.Config:
        made = llama.Config()
        values = {"stack": "torch", "steps": 2, "data.tokens": 1000, "model.vocab": 32, **settings}
        for key, value in {**values, "workspace.root": str(tmp_path / "runs"), "workspace.id": name}.items():
            made[key] = value
        made.workspace.code_id = "tests"
        return made

    fresh = HFLlamaRunner(config("fresh"))
    torch.manual_seed(5)
    published = transformers.LlamaForCausalLM(fresh.hf_config())
    fresh.close()
    source = saved(published, tmp_path / "hf-llama", max_shard_size=20_000)
    runner = HFLlamaRunner(config("tuned", pretrained=str(source)))
    m = runner.config.model
    assert_equal(runner.model.state_dict(), LlamaStateDictAdapter(m.heads).from_hf(published.state_dict()))
    tokens = torch.randint(0, m.vocab, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(runner.model(tokens), published(tokens).logits, rtol=1e-5, atol=1e-5)
    runner.close()

    # Without the adapter the Hugging Face names do not fit, and the refusal names them.
    with pytest.raises(WeightsMisfitError, match=r"do not fit Llama: \d+ missing: tok_embeddings.weight"):
        llama.LlamaRunner(config("plain", pretrained=str(source)))
    assert not list((tmp_path / "runs").glob("*/plain*")), "bad --pretrained input: refused before anything is written"


def safetensors_bytes(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded) if length is None else length) + encoded + data


TENSOR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (safetensors_bytes(b"{}", length=1 << 62), "header claims 4,611,686,018,427,387,904 bytes, more than the 104"),
        (safetensors_bytes(b"{}", length=1000), "header claims 1,000 bytes, more than the file holds"),
        (b"\x01\x02", "shorter than the 8-byte header length"),
        (safetensors_bytes(b"not json"), "its header is not JSON"),
        (safetensors_bytes([1, 2]), "its header is a JSON list, not an object of tensors"),
        (safetensors_bytes({"w": {**TENSOR, "data_offsets": [0, 1 << 40]}}, bytes(8)), "spans bytes 0..1099511627776"),
        (safetensors_bytes({"w": {**TENSOR, "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}), "file holds 0 data"),
        (safetensors_bytes({"w": {**TENSOR, "dtype": "PY_OBJECT"}}, bytes(8)), "has dtype 'PY_OBJECT', not one of"),
        (safetensors_bytes({"w": TENSOR, "v": TENSOR}, bytes(16)), "starts at byte 0 of the data, not at 8"),
        (safetensors_bytes({"w": TENSOR, "__metadata__": {"a": 1}}, bytes(8)), "__metadata__ is not an object of"),
        (safetensors_bytes({"w": {**TENSOR, "shape": [-2]}}, bytes(8)), "has shape '[-2]', not a list of sizes"),
    ],
)
def test_a_hostile_safetensors_header_is_refused_before_anything_reads_the_file(tmp_path, content, message):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a safetensors file perdure can read") as error:
        read_weights(path)
    assert str(path) in str(error.value) and message in str(error.value)
    with pytest.raises(CheckpointError, match="not a safetensors file perdure can read"):
        ResumableRunner(make_config(tmp_path / "runs", steps=2, pretrained=str(path)))
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


def test_an_index_naming_files_outside_its_directory_or_symlinked_shards_is_refused(tmp_path):
    model = tiny_llama()
    sharded = saved(model, tmp_path / "sharded", max_shard_size=4000)
    index = sharded / "model.safetensors.index.json"
    original = json.loads(index.read_text())
    shards = sorted(set(original["weight_map"].values()))
    (tmp_path / "outside.safetensors").write_bytes((sharded / shards[0]).read_bytes())
    for name in ("../outside.safetensors", "/etc/passwd", ".."):
        hostile = {**original, "weight_map": {**original["weight_map"], "model.norm.weight": name}}
        index.write_text(json.dumps(hostile))
        with pytest.raises(CheckpointError, match="which is not a plain file name in") as error:
            read_weights(sharded)
        assert str(index) in str(error.value)
    index.write_text(json.dumps({**original, "weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match="holds no weight_map"):
        read_weights(sharded)
    index.write_text(json.dumps(original))
    first = sharded / shards[0]
    first.unlink()
    os.symlink(tmp_path / "outside.safetensors", first)
    with pytest.raises(PerdureError, match="is a symlink"):
        read_weights(sharded)
    first.unlink()
    with pytest.raises(CheckpointError, match="which is missing from"):
        read_weights(sharded)


def test_the_header_check_returns_what_the_library_would_read(tmp_path):
    model = tiny_llama()
    single = saved(model, tmp_path / "single")
    metadata, header = check_safetensors_header(single / "model.safetensors")
    assert metadata == {"format": "pt"}
    assert sorted(header) == sorted(model.state_dict())


@pytest.mark.timeout(60)
def test_a_tied_model_starts_from_a_directory_save_pretrained_wrote_without_its_tied_copy(tmp_path):
    from tests.scripts.hf_export_lm import Config, TiedRunner

    model = tiny_llama(tie_word_embeddings=True)
    source = saved(model, tmp_path / "tied")
    assert "lm_head.weight" not in read_weights(source)  # save_pretrained leaves the tied copy out
    config = Config()
    for key, value in {"workspace.root": str(tmp_path / "runs"), "workspace.code_id": "tests"}.items():
        config[key] = value
    runner = TiedRunner.from_pretrained(config, source)
    assert_equal(runner.model.state_dict(), model.state_dict())
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    runner.close()


def test_ckpt_verify_checks_a_safetensors_file_or_a_save_pretrained_directory(tmp_path, capsys):
    sharded = saved(tiny_llama(), tmp_path / "sharded", max_shard_size=4000)
    code, said = perdure(capsys, "verify", sharded)
    assert code == 0 and said.startswith(f"OK      {sharded}  (") and "21 tensors, Hugging Face layout)" in said
    code, said = perdure(capsys, "verify", sharded / sorted(sharded.glob("model-*"))[0].name)
    assert code == 0, said
    hostile = tmp_path / "hostile.safetensors"
    hostile.write_bytes(safetensors_bytes({"w": TENSOR}, bytes(4)))
    code, said = perdure(capsys, "verify", hostile)
    assert code == 1 and said.startswith(f"FAILED  {hostile}: ") and "the file holds 4 data bytes" in said
