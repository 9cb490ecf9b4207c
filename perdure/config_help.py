"""Config help: one line of help per key, the values in effect, and the names other trainers give perdure's keys.

The help of a key is the comment on the line of the config's `__init__` that sets it, or else the block of comment
lines directly above that line. perdure's own keys are documented that way in `RunnerConfig.__init__` (the keys of a
registered section, `parallel.*`, `deepspeed.*`, `ft.*`, by the help its module declares with
`config_checks.register_section`), and a user's config class documents its keys the same way:

    class Config(RunnerConfig):
        def __init__(self):
            super().__init__()
            self.net.hidden = 128  # width of the hidden layers
            # probability of zeroing an activation during training
            self.net.dropout = 0.1

A subclass's comment wins over its base's for a key both set. `--help` prints every key with its value after
`--config` files and command-line options and its help line; `docs/config.md` is generated from the same source
(`python scripts/config_reference.py > docs/config.md`).
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from collections.abc import Mapping
from typing import Any

import yaml

from perdure.config_checks import section_keys
from perdure.plain import flatten

# Names other trainers (nanoGPT, Hugging Face Trainer, Lightning, TorchTitan) use, and the key perdure has for each.
# Only suggested in an error (never applied silently): a user's config may define any of these names itself.
ALIASES: dict[str, str] = {
    "lr": "optim.lr",
    "learning_rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "beta1": "optim.betas",
    "beta2": "optim.betas",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "adam_epsilon": "optim.eps",
    "optimizer": "optim.name",
    "max_iters": "steps",
    "max_steps": "steps",
    "num_steps": "steps",
    "training_steps": "steps",
    "max_epochs": "epochs",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "gradient_accumulation_steps": "accum_steps",
    "accumulate_grad_batches": "accum_steps",
    "grad_accum_steps": "accum_steps",
    "grad_clip": "max_grad_norm",
    "gradient_clip_val": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "batch_size": "dataloader.batch_size",
    "per_device_train_batch_size": "dataloader.batch_size",
    "micro_batch_size": "dataloader.batch_size",
    "num_workers": "dataloader.num_workers",
    "dataloader_num_workers": "dataloader.num_workers",
    "warmup_iters": "sched.warmup_steps",
    "warmup_steps": "sched.warmup_steps",
    "lr_scheduler_type": "sched.name",
    "lr_scheduler": "sched.name",
    "decay_lr": "sched.name",
    "lr_decay_iters": "sched.total_steps",
    "min_lr": "sched.min_lr_ratio",
    "eval_interval": "eval.interval",
    "val_check_interval": "eval.interval",
    "evaluation_steps": "eval.interval",
    "eval_iters": "eval.steps",
    "limit_val_batches": "eval.steps",
    "save_interval": "ckpt.interval",
    "save_steps": "ckpt.interval",
    "checkpoint_interval": "ckpt.interval",
    "save_total_limit": "ckpt.keep_latest_k",
    "keep_latest_k": "ckpt.keep_latest_k",
    "log_interval": "log.interval",
    "logging_steps": "log.interval",
    "log_every_n_steps": "log.interval",
    "log_freq": "log.interval",
    "dtype": "precision",
    "mixed_precision": "precision",
    "bf16": "precision",
    "fp16": "precision",
    "compile": "compile.enabled",
    "torch_compile": "compile.enabled",
    "ema_decay": "ema.decay",
    "out_dir": "workspace.root",
    "output_dir": "workspace.root",
    "resume_from_checkpoint": "checkpoint",
    "init_from": "pretrained",
    "wandb_log": "wandb.enabled",
    "wandb_project": "wandb.project",
    "early_stopping_patience": "score.patience",
    "metric_for_best_model": "score.metric",
    "greater_is_better": "score.mode",
}
# What a name means in perdure when it is not a one-to-one rename.
ALIAS_NOTES: dict[str, str] = {
    "min_lr": "a fraction of optim.lr, not a learning rate",
    "decay_lr": "cosine, linear, constant or none",
    "lr_decay_iters": "the steps the schedule spans",
    "beta1": "a list [beta1, beta2]",
    "beta2": "a list [beta1, beta2]",
    "adam_beta1": "a list [beta1, beta2]",
    "adam_beta2": "a list [beta1, beta2]",
    "bf16": "--precision bf16",
    "fp16": "--precision fp16",
    "dtype": "fp32, bf16 or fp16",
    "greater_is_better": "max or min",
    "val_check_interval": "in steps (epochs in epoch mode)",
    "eval_iters": "batches of each split an evaluation reads",
    "limit_val_batches": "batches of each split an evaluation reads",
    "evaluation_steps": "steps between evaluations",
    "init_from": "model weights only; --checkpoint for the full state",
    "eval_interval": "renamed",
}


def alias_hint(name: str, known: set[str]) -> str | None:
    """`did you mean 'optim.lr'? (perdure's name for lr)` when `name`, or its last part (`optim.learning_rate`), is
    another trainer's name for a key `known` holds, else None."""
    for alias in (name.replace("-", "_").lower(), name.rsplit(".", 1)[-1].replace("-", "_").lower()):
        key = ALIASES.get(alias)
        if key is not None and key in known:
            break
    else:
        return None
    note = ALIAS_NOTES.get(alias)
    return f"did you mean '{key}'? (perdure's name for {name}{': ' + note if note else ''})"


def section_hint(name: str, known: set[str]) -> str | None:
    """For a section given a value (`sched: cosine`): which keys it holds."""
    inside = sorted(key for key in known if key.startswith(name + "."))
    if not inside:
        return None
    return f"'{name}' is a section, not a key; set one of its keys: {', '.join(inside)}"


# ---------------------------------------------------------------------- help text from the source


def key_help(config_class: type) -> dict[str, str]:
    """Dotted key -> help line: the registered sections' keys' help (`config_checks.register_section`), then the
    comments in `__init__` of `config_class` and its bases (which win)."""
    helps: dict[str, str] = {key: declared.help for key, declared in section_keys().items() if declared.help}
    for cls in reversed(config_class.__mro__):
        init = cls.__dict__.get("__init__")
        if init is None or cls.__module__ == "chanfig" or cls.__module__.startswith("chanfig."):
            continue
        helps.update(_comments_of(init))
    return helps


def _comments_of(function: Any) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):  # defined in an interactive session, a frozen module, ...
        return {}
    try:
        tree = ast.parse(source)
        comments = _line_comments(source)
    except (SyntaxError, tokenize.TokenError):
        return {}
    lines = source.splitlines()
    helps: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            key = _dotted_self_attribute(target)
            if key is None:
                continue
            text = comments.get(node.lineno) or comments.get(node.end_lineno or node.lineno)
            if text is None:
                text = _block_above(lines, node.lineno, comments)
            if text:
                helps[key] = text
    return helps


def _line_comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def _block_above(lines: list[str], lineno: int, comments: dict[int, str]) -> str | None:
    """The comment lines directly above line `lineno` (1-based), joined; None when there are none."""
    block: list[str] = []
    line = lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
        block.insert(0, comments.get(line, ""))
        line -= 1
    text = " ".join(part for part in block if part)
    return text or None


def _dotted_self_attribute(node: Any) -> str | None:
    """`self.a.b.c` -> "a.b.c"; anything else -> None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(parts)
    return None


# ---------------------------------------------------------------------- rendering


def shown(value: Any) -> str:
    """A value as it would be written in a YAML config (null, true, [0.9, 0.999], text)."""
    if isinstance(value, str):
        return value if value else "''"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text[: -len("\n...")] if text.endswith("\n...") else text


def help_rows(flat: Mapping[str, Any], helps: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(key, value, help) for every dotted key; a per-split loader key takes its option's help."""
    rows = []
    for key, value in flat.items():
        text = helps.get(key)
        if text is None and key.startswith("dataloader.") and key.count(".") == 2:
            text = helps.get("dataloader." + key.rsplit(".", 1)[-1])
        rows.append((key, shown(value), text or ""))
    return rows


def render_help(flat: Mapping[str, Any], helps: Mapping[str, str], sources: Mapping[str, str], program: str) -> str:
    """The `--help` text: usage, then one line per key with its value in effect, its help and what set it."""
    rows = help_rows(flat, helps)
    key_width = min(max((len(key) for key, _, _ in rows), default=0), 32)
    value_width = min(max((len(value) for _, value, _ in rows), default=0), 20)
    lines = [
        f"usage: {program} [--config FILE] [--key VALUE | --key=VALUE | --flag] ...",
        "",
        "Every key with the value in effect (after --config files and command-line options) and its help;",
        "[from ...] marks a value a file or an option set. Set a key with --key VALUE, clear an optional one with",
        "--key none. Names from other trainers (--lr, --max_iters, ...) are pointed to perdure's keys.",
        "",
    ]
    for key, value, text in rows:
        source = f"  [from {sources[key]}]" if key in sources else ""
        lines.append(f"  {key:<{key_width}}  {value:<{value_width}}  {text}{source}".rstrip())
    return "\n".join(lines)


def markdown_reference(config_class: type) -> str:
    """docs/config.md: every key of `config_class` with its default and help, as a table."""
    config = config_class()

    rows = help_rows(flatten(config.to_plain()), key_help(config_class))
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `python scripts/config_reference.py > docs/config.md`; a test checks that this file matches",
        "     the code. Edit the comments in RunnerConfig.__init__ (perdure/config.py) or, for a section a module",
        "     registers (deepspeed, ft, parallel), the help of its SectionKey there, not this table. -->",
        "",
        "Every key of `RunnerConfig` with its default. `python your_program.py --help` prints the same list with the",
        "values in effect after `--config` files and command-line options, plus your own keys with the comments on",
        "the lines that set them ([quickstart.md](quickstart.md#config-and-command-line)).",
        "",
        "| key | default | what it does |",
        "| --- | --- | --- |",
    ]
    for key, value, text in rows:
        lines.append(f"| `{key}` | `{value}` | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
