"""Config help: `--help` shows the values in effect and one help line per key, names from other trainers point to
perdure's keys, suggestions only when close, and the docs' defaults are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from perdure.config import RunnerConfig, flatten
from perdure.config_help import ALIASES, key_help, markdown_reference
from perdure.errors import ConfigError
from perdure.runners.cadence import DEFAULT_STEP_INTERVAL

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


class UserConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 100
        self.net.hidden = 128  # width of the hidden layers
        # probability of zeroing an activation
        # (only while training)
        self.net.dropout = 0.1
        self.eval_iters = 5  # a user's own key may have another trainer's name
        self.ckpt.interval = 20  # every 20 steps here


def help_lines(capsys, *args: str) -> dict[str, str]:
    with pytest.raises(SystemExit) as info:
        UserConfig().parse(list(args), exit_on_error=False)
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: ")
    rows = [line.split(None, 2) for line in lines if line.startswith("  ")]
    return {row[0]: " ".join(row[1:]) for row in rows}


def test_help_shows_the_values_in_effect_after_config_files_and_options(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("steps: 300\noptim:\n  lr: 0.0005\nnet:\n  hidden: 256\n")
    rows = help_lines(capsys, "--config", str(tmp_path / "run.yaml"), "--net.hidden", "64", "--help")
    assert rows["steps"].startswith("300 ") and rows["steps"].endswith("[from run.yaml]")
    assert rows["optim.lr"].startswith("0.0005 ") and rows["optim.lr"].endswith("[from run.yaml]")
    assert rows["net.hidden"].startswith("64 ") and rows["net.hidden"].endswith("[from command line]")
    assert rows["seed"].startswith("0 ") and "[from" not in rows["seed"]
    # one line per key, for perdure's keys and the user's alike
    assert set(rows) == set(flatten(UserConfig().to_plain()))


def test_help_lines_come_from_the_comments_where_keys_are_set(capsys):
    rows = help_lines(capsys, "-h")
    assert rows["net.hidden"] == "128 width of the hidden layers"
    assert rows["net.dropout"] == "0.1 probability of zeroing an activation (only while training)"
    assert rows["ckpt.interval"] == "20 every 20 steps here"  # the subclass's comment wins
    assert rows["max_grad_norm"].startswith("null clip the gradient norm")
    assert rows["eval.steps"] == "null batches of each split an evaluation reads (all ranks together); None: all of it"


def test_every_perdure_key_has_a_help_line():
    helps = key_help(RunnerConfig)
    missing = [key for key in flatten(RunnerConfig().to_plain()) if not helps.get(key)]
    assert not missing, f"add a comment on the line that sets each of {missing} in RunnerConfig.__init__"


@pytest.mark.parametrize(
    "name, key",
    [
        ("learning_rate", "optim.lr"),
        ("lr", "optim.lr"),
        ("max_iters", "steps"),
        ("gradient_accumulation_steps", "accum_steps"),
        ("grad_clip", "max_grad_norm"),
        ("gradient_clip_val", "max_grad_norm"),
        ("max_epochs", "epochs"),
        ("batch_size", "dataloader.batch_size"),
        ("warmup_iters", "sched.warmup_steps"),
        ("eval_interval", "eval.interval"),
        ("save_total_limit", "ckpt.keep_latest_k"),
        ("compile", "compile.enabled"),
    ],
)
def test_names_from_other_trainers_point_to_perdure_keys(name, key):
    with pytest.raises(ConfigError) as info:
        UserConfig().parse([f"--{name}", "1"], exit_on_error=False)
    assert info.value.key == name
    assert f"did you mean '{key}'? (perdure's name for {name}" in str(info.value)


def test_every_alias_names_an_existing_key():
    known = set(flatten(RunnerConfig().to_plain()))
    assert not {alias: key for alias, key in ALIASES.items() if key not in known}


def test_a_users_own_key_wins_over_the_alias_table():
    assert UserConfig().parse(["--eval_iters", "7"], exit_on_error=False).eval_iters == 7


def test_suggestions_only_when_close(tmp_path):
    with pytest.raises(ConfigError) as info:  # nanoGPT's name: the alias, not the user's look-alike key eval_iters
        UserConfig().parse(["--max_iters", "5"], exit_on_error=False)
    assert "'steps'" in str(info.value) and "eval_iters" not in str(info.value)
    (tmp_path / "sched.yaml").write_text("sched: cosine\n")
    with pytest.raises(ConfigError) as info:  # a section given a value: its keys, not `seed`
        UserConfig().parse(["--config", str(tmp_path / "sched.yaml")], exit_on_error=False)
    message = str(info.value)
    assert "'sched' is a section" in message and "sched.name" in message and "'seed'" not in message
    with pytest.raises(ConfigError) as info:  # nothing alike: the top-level keys, no guess
        UserConfig().parse(["--quux", "1"], exit_on_error=False)
    assert "did you mean" not in str(info.value) and "top-level keys" in str(info.value)


def test_max_grad_norm_zero_means_no_clipping(tmp_path):
    from tests.scripts.resumable import ResumableRunner, make_config

    assert UserConfig().parse(["--max_grad_norm", "0"], exit_on_error=False).max_grad_norm == 0
    runs = {}
    for norm in (0, None, 1e-4):
        runner = ResumableRunner(make_config(tmp_path / str(norm), steps=3, max_grad_norm=norm))
        runner.train()
        runs[norm] = [p.detach().clone() for p in runner.model.parameters()]
    assert all(a.equal(b) for a, b in zip(runs[0], runs[None]))
    assert not all(a.equal(b) for a, b in zip(runs[0], runs[1e-4]))


def test_old_eval_interval_key_is_refused_with_its_new_name():
    config = UserConfig()
    config.eval_interval = 5
    with pytest.raises(ConfigError, match="eval.interval"):
        config.check()
    stored = RunnerConfig.from_plain({"steps": 10, "eval_interval": 4})  # a config stored before the rename
    assert stored.eval.interval == 4 and stored.check() is stored


# ---------------------------------------------------------------------- docs match the code


def test_config_reference_is_generated_from_the_code():
    expected = markdown_reference(RunnerConfig)
    fix = "regenerate it: python scripts/config_reference.py > docs/config.md"
    assert (DOCS / "config.md").read_text() == expected, fix


# "`key` (default 50", "`key K` (default 0:", "`key` defaults to `val`", "`key` (default: true": a key in backticks,
# then within a few characters the word default and a literal (a number, true / false / null / none, or backticked)
DEFAULT_MENTION = re.compile(
    r"`(?P<key>[a-z_]+(?:\.[a-z_]+)*)(?: [A-Z]+)?`[^.`]{0,12}?\(?defaults?:? (?:to |is )?"
    r"(?:`(?P<quoted>[^`]+)`|(?P<literal>-?\d[\d.e+-]*|true|false|null|none)\b)"
)


# What a key whose default is None means, where the docs state that instead: the loop's own fallbacks.
EFFECTIVE_DEFAULTS = {"ckpt.interval": str(DEFAULT_STEP_INTERVAL), "eval.interval": "ckpt.interval"}


def test_defaults_stated_in_the_docs_are_the_codes():
    defaults = flatten(RunnerConfig().to_plain())
    shown = {key: "null" if value is None else str(value).lower() for key, value in defaults.items()}
    checked = 0
    for page in sorted(DOCS.glob("*.md")):
        for match in DEFAULT_MENTION.finditer(page.read_text()):
            key, value = match["key"], (match["quoted"] or match["literal"]).lower()
            if key not in shown:
                continue
            checked += 1
            allowed = {shown[key], repr(defaults[key]).lower(), EFFECTIVE_DEFAULTS.get(key, shown[key])}
            assert value in allowed | ({"none"} if defaults[key] is None else set()), (
                f"{page.name} says the default of {key} is {value}, the code says {defaults[key]!r}"
            )
    assert checked >= 10, checked
