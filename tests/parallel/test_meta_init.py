"""A Llama built on the meta device (TorchTitan's way: tests/scripts/meta_llama.py, `init_weights(buffer_device=)`) on
stack=parallel: each rank allocates and initialises only its shards. It starts from the same weights on 1 rank, on
FSDP2 (2 ranks), on FSDP2 x TP (4 ranks) and on the torch stack, RoPE buffers included; killed at step 7 and rerun it
ends bit-equal to an uninterrupted run; a rank's peak memory once the model is sharded stays below the eager
construction's by more than half the model; and a meta model that nothing initialises is refused, naming the module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from perdure.loggers.metrics_csv import read_metrics_csv
from tests.runs import assert_all_ok, assert_same_weights, final_weights, read_rises, run_dir, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama  # noqa: E402  (examples/llama.py)

COMMON = ("--dist.timeout", "60")
TOPOLOGIES = {"fsdp2": (2, ()), "fsdp2-tp": (4, ("--parallel.axes.tensor", "2"))}
# ~26M parameters (103 MB in fp32), a small vocabulary: the data's bigram table (vocab x vocab) stays small
BIG = ("--model.dim", "512", "--model.heads", "8", "--model.hidden", "2048", "--model.layers", "6")
BIG += ("--model.vocab", "512", "--data.tokens", "200")
BIG_BYTES = 4 * (512 * 512 * 2 + 6 * (4 * 512 * 512 + 3 * 512 * 2048) + 13 * 512)


def losses(root):
    rows = read_metrics_csv(run_dir(root) / "metrics.csv")
    return {step: value for step, split, name, value in rows if (split, name) == ("train", "loss")}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The initial weights (and buffers) of a 1-rank run of the same seed."""
    path = tmp_path_factory.mktemp("one-rank")
    assert_all_ok(run_ranks(1, "meta_llama.py", path / "runs", *COMMON, INITIAL_WEIGHTS=path / "initial.pt",
                            SETUP_ONLY="1"))  # fmt: skip
    return torch.load(path / "initial.pt", weights_only=True)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(TOPOLOGIES))
def test_meta_model_starts_as_on_one_rank_and_resumes_bit_for_bit(tmp_path, one_rank, case):
    ranks, axes = TOPOLOGIES[case]
    args = (*COMMON, *axes)
    initial = tmp_path / "initial.pt"
    assert_all_ok(run_ranks(ranks, "meta_llama.py", tmp_path / "reference", *args, INITIAL_WEIGHTS=initial))
    assert_same_weights(one_rank, torch.load(initial, weights_only=True))
    # The RoPE tables are non-persistent buffers: init_weights recomputed them on every rank.
    cos, sin = llama.rope_tables(8, 8, 10000.0)
    assert torch.equal(one_rank["rope_cos"], cos) and torch.equal(one_rank["rope_sin"], sin)

    killed = run_ranks(ranks, "meta_llama.py", tmp_path / "killed", *args, KILL_AT_STEP="7")
    assert all(result.returncode == -9 for result in killed), [result.stdout[-2000:] for result in killed]
    rerun = run_ranks(ranks, "meta_llama.py", tmp_path / "killed", *args)
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and "ckpt-s000000000005" in rerun[0].stdout, rerun[0].stdout
    assert_same_weights(final_weights(tmp_path / "reference"), final_weights(tmp_path / "killed"))
    assert losses(tmp_path / "reference") == losses(tmp_path / "killed")
    first = losses(tmp_path / "reference")
    assert first[10] < first[5] and all(torch.isfinite(torch.tensor(list(first.values()))))


@pytest.mark.timeout(120)
def test_the_torch_stack_materialises_a_meta_model_on_its_device(tmp_path, one_rank):
    """The same initial weights as the parallel stack's; the optimizer the program built over the meta parameters
    trains the materialised ones (the runner's coverage check refuses anything else before the first step)."""
    result = run_ranks(1, "meta_llama.py", tmp_path, *COMMON, "--stack", "torch", BUILD="meta",
                       USER_OPTIMIZER="1", INITIAL_WEIGHTS=tmp_path / "initial.pt")  # fmt: skip
    assert_all_ok(result)
    assert_same_weights(one_rank, torch.load(tmp_path / "initial.pt", weights_only=True))
    trained = losses(tmp_path)
    assert trained[10] < trained[5]


@pytest.mark.timeout(300)
def test_meta_construction_holds_less_than_the_eager_one_by_half_the_model(tmp_path):
    """How far each rank's resident memory rose from the start of the program to the model built, sharded and
    materialised (the eager construction holds the whole model, then its shards). Every block of 128 KiB or more its
    own mapping, so that what is freed leaves the resident set at once."""
    peaks = {}
    for build in ("eager", "meta"):
        assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path / build, *COMMON, *BIG, BUILD=build, SETUP_ONLY="1",
                                PEAK_RSS=tmp_path / f"{build}-{{rank}}", MALLOC_MMAP_THRESHOLD_="131072"))  # fmt: skip
        peaks[build] = read_rises(tmp_path / f"{build}-{{rank}}", 2)
    for rank in range(2):
        saved = peaks["eager"][rank] - peaks["meta"][rank]
        assert saved > BIG_BYTES / 2, f"rank {rank}: {peaks}, the model is {BIG_BYTES} bytes"


@pytest.mark.timeout(120)
def test_a_meta_model_that_nothing_initialises_is_refused(tmp_path):
    result = run_ranks(1, "meta_llama.py", tmp_path, *COMMON, BUILD="bare", SETUP_ONLY="1")[0]
    assert result.returncode != 0
    assert "config key 'model' = 'BareLlama built on the meta device'" in result.stdout, result.stdout[-3000:]
    assert "the model (BareLlama: rope_cos, rope_sin)" in result.stdout and "init_weights()" in result.stdout


def test_a_model_partly_on_meta_is_refused_naming_the_parameters_on_a_device():
    """Allocating it would overwrite the parameters that have values."""
    from torch import nn

    from perdure import ConfigError
    from perdure.runners.meta_init import check_initialisable

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1] = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"1\.weight, 1\.bias \(2 parameters\) are on a device"):
        check_initialisable(model)
