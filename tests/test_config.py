"""RunnerConfig: defaults, subclassing, the strict CLI parser and validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from perdure.config import RunnerConfig
from perdure.errors import ConfigError
from tests import zygote

ROOT = Path(__file__).resolve().parents[1]


class UserConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 1000
        self.optim.lr = 3e-4
        self.model_width = 64
        self.model.dropout = 0.1
        self.data.name = "toy"


def parse(*args: str, config: RunnerConfig | None = None) -> RunnerConfig:
    return (config if config is not None else UserConfig()).parse(list(args), exit_on_error=False)


def error(*args: str, config: RunnerConfig | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(*args, config=config)
    return info.value


# ---------------------------------------------------------------------- defaults and subclassing


def test_defaults():
    c = RunnerConfig().to_plain()
    assert c["stack"] == "torch" and c["seed"] == 0 and c["steps"] is None and c["epochs"] is None
    assert c["accum_steps"] == 1 and c["precision"] == "fp32" and c["resume"] == "auto"
    assert c["ckpt"] == {
        "enabled": True,
        "backend": "auto",
        "interval": None,
        "mtbf": None,
        "interval_steps": None,
        "keep_latest_k": 3,
        "save_best": True,
        "export_dtype": None,
        "async_mode": "disabled",
        "device_staging": "auto",
        "on_error": "warn",
        "hang_warning_s": 300.0,
        "export_format": ["pth"],
        "mirror": None,
        "mirror_every": 1,
        "mirror_drain_s": 600.0,
    }
    assert c["optim"]["betas"] == [0.9, 0.999] and c["optim"]["lr"] == 1e-3
    assert c["dataloader"]["batch_size"] == 32 and c["score"]["mode"] == "min"
    assert c["workspace"]["tags"] == [] and c["log"]["interval"] == 50
    assert c["ema"] == {"enabled": False, "decay": 0.999}
    assert c["compile"] == {"enabled": False, "backend": "inductor", "mode": None}
    axes = c["parallel"]["axes"]
    assert axes == {"replicate": 1, "shard": -1, "tensor": 1, "pipeline": 1, "context": 1, "expert": 1}
    assert c["parallel"]["pipeline"] == {"schedule": "1F1B", "microbatches": None, "virtual_stages": 1}


def test_defaults_need_a_budget():
    with pytest.raises(ConfigError, match="steps/epochs"):
        RunnerConfig().check()
    config = RunnerConfig()
    config.epochs = 3
    assert config.check() is config
    assert config.training_mode() == "epochs"


def test_user_subclass_keys_are_known_and_typed():
    config = parse("--model_width", "128", "--model.dropout", "0.2", "--data.name", "other")
    assert config.model_width == 128 and config.model.dropout == 0.2 and config.data.name == "other"
    assert config.training_mode() == "steps" and config.optim.lr == 3e-4
    assert "model_width" in config.known_keys()


def test_to_plain_is_yaml_dumpable_and_drops_empty_sections():
    config = UserConfig()
    config.optim.get("missing")  # chanfig may create empty sections on reads
    _ = config.nothing_here  # attribute read of a missing key creates an empty section
    plain = config.to_plain()
    assert "nothing_here" not in plain
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    assert json.loads(json.dumps(plain)) == plain


def test_from_plain_round_trip_adds_unknown_keys():
    config = parse("--optim.lr", "0.01", "--dataloader.val.batch_size", "8")
    stored = config.to_plain()
    stored["extra"] = {"depth": 3}
    rebuilt = RunnerConfig.from_plain(stored)
    assert rebuilt.to_plain() == stored
    assert rebuilt.model_width == 64 and rebuilt.extra.depth == 3
    assert rebuilt.loader_options("val")["batch_size"] == 8


# ---------------------------------------------------------------------- parsing


def test_parse_space_equals_and_bare_flags():
    config = parse(
        "--optim.lr", "1e-3", "--seed=7", "--ema.enabled", "--ckpt.save_best", "false", "--sched.name", "none"
    )
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)
    assert config.seed == 7 and config.ema.enabled is True and config.ckpt.save_best is False
    assert config.sched.name == "none"


def test_parse_booleans_case_insensitive():
    for text, expected in [("TRUE", True), ("yes", True), ("1", True), ("False", False), ("NO", False), ("0", False)]:
        assert parse("--ckpt.enabled", text).ckpt.enabled is expected


def test_bare_flag_before_another_option():
    config = parse("--ema.enabled", "--steps", "5")
    assert config.ema.enabled is True and config.steps == 5


@pytest.mark.parametrize(
    "args, expected",
    [([], "auto"), (["--resume"], True), (["--resume", "false"], False), (["--resume=auto"], "auto")],
)
def test_resume(args, expected):
    assert parse(*args).resume == expected


def test_bare_resume_followed_by_option():
    config = parse("--resume", "--optim.lr", "0.5")
    assert config.resume is True and config.optim.lr == 0.5


def test_none_valued_keys_are_typed_by_yaml():
    config = parse("--max_grad_norm", "1e-1", "--eval.interval", "5", "--ckpt.interval", "10")
    assert config.max_grad_norm == 0.1 and config.eval.interval == 5 and config.ckpt.interval == 10
    assert parse("--max_grad_norm", "2").max_grad_norm == 2
    config = parse("--ckpt.interval", "10")
    assert parse("--ckpt.interval", "none", config=config).ckpt.interval is None


def test_path_and_name_keys_stay_strings(tmp_path):
    weights = tmp_path / "123"
    weights.write_text("x")
    config = parse("--pretrained", str(weights), "--workspace.id", "0042", "--workspace.root", str(tmp_path))
    assert config.pretrained == str(weights) and config.workspace.id == "0042"
    assert config.workspace.root == str(tmp_path)
    assert parse("--workspace.id", "none").workspace.id is None


@pytest.mark.parametrize("short_hash", ["73327e9", "1234567", "0042e10"])
def test_a_short_git_hash_that_reads_as_a_number_stays_the_code_id(short_hash):
    """The warning of a requeue after a commit tells the user `--workspace.code_id <short hash>`: one hash in 27 is
    all digits, and some read as floats; either was refused ('use a string or None'), so the old run could not go on."""
    assert parse("--workspace.code_id", short_hash).workspace.code_id == short_hash
    assert parse("--workspace.code_id", "none").workspace.code_id is None


def test_a_name_in_a_config_file_that_yaml_reads_as_a_number_is_the_text_written(tmp_path):
    """YAML types `0123456` as the octal 42798 and `1e3` as a float: a short git hash, a run id or a lineage written
    in a config file was silently changed into another name (and so another run directory)."""
    file = tmp_path / "names.yaml"
    file.write_text("workspace:\n  code_id: 0123456\n  id: 1e3\n  lineage: 0755\nsteps: 7\n")
    config = parse("--config", str(file))
    assert (config.workspace.code_id, config.workspace.id, config.workspace.lineage) == ("0123456", "1e3", "0755")
    assert config.steps == 7  # a number where the key holds one
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text("workspace.code_id: 1234567\n")
    assert parse("--config", str(dotted)).workspace.code_id == "1234567"
    (tmp_path / "names.json").write_text('{"workspace": {"code_id": 1234567}}')
    assert parse("--config", str(tmp_path / "names.json")).workspace.code_id == "1234567"


def test_lists():
    assert parse("--optim.betas", "[0.8, 0.9]").optim.betas == [0.8, 0.9]
    assert parse("--optim.betas", "0.5,0").optim.betas == [0.5, 0.0]
    assert parse("--workspace.tags", "a,b").workspace.tags == ["a", "b"]
    assert parse("--workspace.tags", "").workspace.tags == []


def test_budget_switch_clears_the_other():
    config = parse("--epochs", "3")  # UserConfig sets steps = 1000
    assert config.epochs == 3 and config.steps is None and config.training_mode() == "epochs"
    assert error("--epochs", "3", "--steps", "5").key == "steps/epochs"


def test_dash_spelling_is_accepted():
    assert parse("--max-grad-norm", "1.5", "--accum-steps", "2").accum_steps == 2


def test_config_file_merged_before_cli(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(
        "optim:\n  lr: 1e-2\n  betas: [0.5, 0.6]\nseed: 3\nresume: false\ndataloader:\n  val:\n    batch_size: 4\n"
    )
    config = parse("--optim.lr", "0.5", "--config", str(file))
    assert config.optim.lr == 0.5  # the CLI wins wherever --config sits
    assert config.seed == 3 and config.optim.betas == [0.5, 0.6] and config.resume is False
    assert config.loader_options("val")["batch_size"] == 4
    config = parse(f"--config={file}")
    assert config.optim.lr == 0.01 and isinstance(config.optim.lr, float)


def test_config_file_json_and_int_widening(tmp_path):
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"optim": {"lr": 1}, "epochs": 2}))
    config = parse("--config", str(file))
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.epochs == 2 and config.steps is None


def test_config_file_errors(tmp_path):
    assert "did you mean 'optim.lr'" in str(_file_error(tmp_path, "optim:\n  lrr: 1\n"))
    assert _file_error(tmp_path, "- 1\n- 2\n").key == "config"
    assert _file_error(tmp_path, "a: [\n").key == "config"
    assert error("--config", str(tmp_path / "missing.yaml")).key == "config"
    assert error("--config").key == "config"


def test_config_file_that_is_not_a_file_says_what_it_is(tmp_path):
    assert str(error("--config", str(tmp_path / "missing.yaml"))).endswith(
        "missing.yaml': no such file; pass an existing .yaml or .json file to --config"
    )
    message = str(error("--config", str(tmp_path)))
    assert (
        message == f"config key 'config' = '{tmp_path}': it is a directory, not a file; pass an existing .yaml or "
        ".json file to --config"
    )
    assert "it is a character device, not a file" in str(error("--config", "/dev/null"))


def _file_error(tmp_path: Path, text: str) -> ConfigError:
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    return error("--config", str(file))


def test_help_prints_keys_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse("--help")
    assert info.value.code == 0
    assert "optim.lr" in capsys.readouterr().out


# ---------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "name, suggestion",
    [
        ("optim.lrr", "optim.lr"),
        ("lr", "optim.lr"),
        ("stepz", "steps"),
        ("model_widht", "model_width"),
        ("ckpt.keep_latest", "ckpt.keep_latest_k"),
        ("dataloader.val.batchsize", "dataloader.val.batch_size"),
    ],
)
def test_unknown_key_did_you_mean(name, suggestion):
    err = error(f"--{name}", "1")
    assert err.key == name and f"did you mean '{suggestion}'?" in str(err)


def test_unknown_key_lists_nearby_keys():
    message = str(error("--optim.foo", "1"))
    assert "optim.foo" in message and "optim.lr" in message and "optim.weight_decay" in message
    assert "optim" in str(error("--zzz.qqq", "1"))


def test_positional_argument_rejected():
    assert error("stray").value == "stray"


def test_unknown_keys_are_not_created():
    config = UserConfig()
    with pytest.raises(ConfigError):
        config.parse(["--optim.nope", "1"], exit_on_error=False)
    assert "nope" not in config.to_plain()["optim"]


# ---------------------------------------------------------------------- per-split dataloader options


def test_loader_options_per_split():
    config = parse(
        "--dataloader.val.batch_size", "64", "--dataloader.val.shuffle", "false", "--dataloader.test.shuffle"
    )
    assert config.loader_options("train") == {
        "batch_size": 32,
        "shuffle": True,
        "num_workers": 0,
        "drop_last": False,
        "pin_memory": False,
    }
    val = config.loader_options("val")
    assert val["batch_size"] == 64 and val["shuffle"] is False and val["num_workers"] == 0
    assert config.loader_options("test")["shuffle"] is True
    assert config.dataloader.val.batch_size == 64


def test_loader_options_user_global_key_and_subclass_split():
    config = UserConfig()
    config.dataloader.persistent_workers = False
    config.dataloader.val.batch_size = 7
    config.parse(["--dataloader.test.persistent_workers", "true"], exit_on_error=False)
    assert config.loader_options("val")["batch_size"] == 7
    assert config.loader_options("val")["persistent_workers"] is False
    assert config.loader_options("test")["persistent_workers"] is True


def test_split_override_rejects_unknown_option():
    config = UserConfig()
    config.dataloader.val.batchsize = 7
    with pytest.raises(ConfigError, match="dataloader.val.batchsize"):
        config.check()


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "args, key",
    [
        (["--steps", "0"], "steps"),
        (["--steps", "-3"], "steps"),
        (["--steps", "10.0"], "steps"),
        (["--steps", "none"], "steps/epochs"),
        (["--epochs", "0"], "epochs"),
        (["--epochs", "2.5"], "epochs"),
        (["--accum_steps", "0"], "accum_steps"),
        (["--accum_steps", "1.5"], "accum_steps"),
        (["--eval.interval", "0"], "eval.interval"),
        (["--eval.interval", "2.0"], "eval.interval"),
        (["--eval.steps", "0"], "eval.steps"),
        (["--compile.enabled", "maybe"], "compile.enabled"),
        (["--compile.mode", "fast"], "compile.mode"),
        (["--compile.backend", ""], "compile.backend"),
        (["--perf.peak_flops", "0"], "perf.peak_flops"),
        (["--ckpt.interval", "0"], "ckpt.interval"),
        (["--ckpt.interval_steps", "-1"], "ckpt.interval_steps"),
        (["--ckpt.keep_latest_k", "-1"], "ckpt.keep_latest_k"),
        (["--log.interval", "0"], "log.interval"),
        (["--score.patience", "-1"], "score.patience"),
        (["--dataloader.batch_size", "0"], "dataloader.batch_size"),
        (["--dataloader.num_workers", "-1"], "dataloader.num_workers"),
        (["--dataloader.val.batch_size", "0"], "dataloader.val.batch_size"),
        (["--dataloader.val.num_workers", "-2"], "dataloader.val.num_workers"),
        (["--seed", "1.5"], "seed"),
        (["--seed", "abc"], "seed"),
        (["--seed", "99999999999999999999"], "seed"),
        (["--seed", "-8796093022208"], "seed"),
        (["--optim.lr", "inf"], "optim.lr"),
        (["--dist.timeout", "1e400"], "dist.timeout"),
        (["--max_grad_norm", "inf"], "max_grad_norm"),
        (["--resilience.max_consecutive_skips", "0"], "resilience.max_consecutive_skips"),
        (["--resilience.max_attempts_without_progress", "0"], "resilience.max_attempts_without_progress"),
        (["--workspace.continue_unfinished", "maybe"], "workspace.continue_unfinished"),
        (["--stack", "jax"], "stack"),
        (["--precision", "fp8"], "precision"),
        (["--ckpt.backend", "s3"], "ckpt.backend"),
        (["--optim.name", "lion"], "optim.name"),
        (["--sched.name", "step"], "sched.name"),
        (["--score.mode", "best"], "score.mode"),
        (["--ckpt.export_dtype", "int8"], "ckpt.export_dtype"),
        (["--checkpoint", "/no/such/checkpoint"], "checkpoint"),
        (["--pretrained", "/no/such/weights.pth"], "pretrained"),
        (["--resume", "maybe"], "resume"),
        (["--max_grad_norm", "-1"], "max_grad_norm"),
        (["--ema.decay", "1"], "ema.decay"),
        (["--ema.decay", "0"], "ema.decay"),
        (["--ema.enabled", "maybe"], "ema.enabled"),
        (["--optim.lr", "fast"], "optim.lr"),
        (["--optim.lr"], "optim.lr"),
        (["--optim.betas", "[0.9, 1.5]"], "optim.betas"),
        (["--resilience.grace_s", "0"], "resilience.grace_s"),
    ],
)
def test_bad_input_names_the_key(args, key):
    err = error(*args)
    assert err.key == key
    assert f"'{key}'" in str(err)


def test_choice_errors_list_allowed_values():
    message = str(error("--stack", "jax"))
    assert "'jax'" in message and all(name in message for name in ("torch", "parallel", "deepspeed"))
    assert "fp32" in str(error("--precision", "fp8"))
    assert "auto" in str(error("--resume", "maybe"))


@pytest.mark.parametrize(
    "key, value",
    [
        ("steps", True),
        ("steps", 10.0),
        ("accum_steps", 0),
        ("seed", None),
        ("seed", False),
        ("resume", "true"),
        ("resume", 1),
        ("ckpt.enabled", "yes"),
        ("ckpt.keep_latest_k", None),
        ("dataloader.shuffle", 1),
        ("max_grad_norm", True),
        ("workspace.tags", "a,b"),
    ],
)
def test_check_rejects_values_set_in_code(key, value):
    config = UserConfig()
    config.set(key, value)
    with pytest.raises(ConfigError) as info:
        config.check()
    assert info.value.key == key and info.value.value == value


def test_existing_checkpoint_and_pretrained_paths_pass(tmp_path):
    ckpt = tmp_path / "ckpt-s000000000010"
    ckpt.mkdir()
    weights = tmp_path / "model.pth"
    weights.write_bytes(b"x")
    config = parse("--checkpoint", str(ckpt), "--pretrained", str(weights))
    assert config.checkpoint == str(ckpt) and config.pretrained == str(weights)


def test_all_backends_and_choices_accepted():
    for backend in ("auto", "file", "dcp"):
        assert parse("--ckpt.backend", backend).ckpt.backend == backend
    assert parse("--stack", "deepspeed", "--ckpt.backend", "deepspeed").ckpt.backend == "deepspeed"
    with pytest.raises(ConfigError, match="'ckpt.backend' = 'deepspeed': the DeepSpeed engine's checkpoints need"):
        parse("--ckpt.backend", "deepspeed")
    with pytest.raises(ConfigError, match="'ckpt.backend' = 'dcp': stack=deepspeed saves through the engine"):
        parse("--stack", "ds", "--ckpt.backend", "dcp")
    for name in ("none", "constant", "cosine", "linear"):
        assert parse("--sched.name", name).sched.name == name
    assert parse("--ckpt.export_dtype", "bf16").ckpt.export_dtype == "bf16"


# ---------------------------------------------------------------------- CLI error path


def _run_script(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return zygote.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )


SCRIPT = """
    from perdure import config

    class Config(config.RunnerConfig):
        def __init__(self):
            super().__init__()
            self.steps = 10

    Config().parse()
    print("parsed")
"""


def test_cli_typo_exits_2_with_one_line(tmp_path):
    result = _run_script(tmp_path, SCRIPT, "--optim.lrr", "0.1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: config key 'optim.lrr' = '0.1': unknown key; did you mean 'optim.lr'?"
    ]
    assert "parsed" not in result.stdout


def test_cli_good_args_run(tmp_path):
    result = _run_script(tmp_path, SCRIPT, "--resume", "--optim.lr", "0.1")
    assert result.returncode == 0 and "parsed" in result.stdout


def test_excepthook_prints_uncaught_perdure_error(tmp_path):
    body = SCRIPT + "\n    raise config.ConfigError('x', 1, 'fix it')\n"
    result = _run_script(tmp_path, body)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == "error: config key 'x' = 1: fix it"


def test_excepthook_leaves_other_errors_alone(tmp_path):
    result = _run_script(tmp_path, SCRIPT + "\n    raise RuntimeError('boom')\n")
    assert result.returncode == 1 and "Traceback" in result.stderr and "boom" in result.stderr
