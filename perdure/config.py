"""RunnerConfig: every knob of a run, with defaults, a strict command-line parser and validation.

Users subclass `RunnerConfig` and set or add keys in `__init__` after `super().__init__()`; whatever the config holds
after construction is a known key. `parse()` reads `--a.b value`, `--a.b=value`, bare boolean flags and
`--config file.yaml`, rejects unknown keys with a suggestion, and ends with `check()`, which validates every value
before anything is written.
"""

from __future__ import annotations

import copy
import os
import stat
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import chanfig
import yaml
from typing_extensions import Self

from perdure import config_help, config_text
from perdure.config_checks import (
    check_bool,
    check_choice,
    check_int,
    check_loader,
    check_number,
    check_path,
    check_path_component,
    check_root,
    section_checks,
    section_keys,
    stack_names,
)
from perdure.config_text import is_int, is_number
from perdure.errors import ConfigError, PerdureError, show_traceback
from perdure.plain import flatten as flatten  # re-exported: perdure.config.flatten is public
from perdure.plain import plain_dict as plain_dict
from perdure.safe_io import (
    MAX_YAML_BYTES,
    UnsafeFileError,
    escape_terminal,
    kind_of,
    load_yaml,
    loads_json,
    read_regular,
)

MAX_SEED = 2**43  # |seed| below it: every seed perdure derives from it fits torch's 64-bit generators
PRECISIONS = ("fp32", "bf16", "fp16")
CKPT_BACKENDS = ("auto", "file", "dcp", "deepspeed")
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("none", "constant", "cosine", "linear")
SCORE_MODES = ("min", "max")
EXPORT_DTYPES = (None, "fp32", "bf16", "fp16")
RESUME_VALUES = ("auto", True, False)
ASYNC_MODES = ("disabled", "thread", "process")
DEVICE_STAGING = ("auto", "off")
ON_ERROR = ("warn", "raise")
WANDB_MODES = ("online", "offline", "disabled")
PROGRESS_MODES = ("auto", "bar", "lines")
DIST_BACKENDS = ("auto", "nccl", "gloo")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
EXPORT_FORMATS = ("pth", "safetensors", "hf")
LOSS_NORMALIZATIONS = ("mean", "tokens")  # perdure.runners.accumulation
LOADER_KEYS = ("batch_size", "shuffle", "num_workers", "drop_last", "pin_memory")


_CHOICES: dict[str, tuple] = {
    "precision": PRECISIONS,
    "resume": RESUME_VALUES,
    "ckpt.backend": CKPT_BACKENDS,
    "ckpt.export_dtype": EXPORT_DTYPES,
    "optim.name": OPTIMIZERS,
    "sched.name": SCHEDULERS,
    "score.mode": SCORE_MODES,
    "ckpt.async_mode": ASYNC_MODES,
    "ckpt.device_staging": DEVICE_STAGING,
    "ckpt.on_error": ON_ERROR,
    "wandb.mode": WANDB_MODES,
    "log.progress": PROGRESS_MODES,
    "dist.backend": DIST_BACKENDS,
    "compile.mode": COMPILE_MODES,
    "loss.normalize": LOSS_NORMALIZATIONS,
}
MAX_ACCUM_STEPS = 1 << 16  # perdure.data.loader.MAX_UNTAKEN_BATCHES
# key: (minimum, None allowed)
_COUNTS: dict[str, tuple[int, bool]] = {
    "accum_steps": (1, False),
    "eval.steps": (1, True),
    "eval.interval": (1, True),
    "ckpt.interval_steps": (1, True),
    "ckpt.keep_latest_k": (0, False),
    "ckpt.mirror_every": (1, False),
    "sched.warmup_steps": (0, False),
    "sched.total_steps": (1, True),
    "score.patience": (0, False),
    "log.interval": (1, False),
    "resilience.max_consecutive_skips": (1, True),
    "resilience.max_attempts_without_progress": (1, False),
}
_BOOLS = (
    "skip_nonfinite_grad",
    "workspace.continue_unfinished",
    "deterministic",
    "ckpt.enabled",
    "ckpt.save_best",
    "ema.enabled",
    "tensorboard.enabled",
    "wandb.enabled",
    "compile.enabled",
)
_MISSING = object()
# Non-key attribute (chanfig `setattr`) holding the dotted keys given on the command line: not in to_plain / yaml /
# the canonical config, so it never changes config_id.
_CLI_KEYS_ATTR = "_perdure_cli_keys"


class RunnerConfig(chanfig.Config):
    """Configuration of a run. Subclass it and set `self.steps`, `self.optim.lr`, your own keys, ... in `__init__`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # One line of help per key: the comment at the end of its line (`--help` shows it; docs/config.md lists it).
        super().__init__(*args, **kwargs)
        self.stack = "torch"  # training stack: torch (one process or DDP), parallel, deepspeed
        self.seed = 0  # seeds python, numpy and torch; each rank derives its own stream from it
        self.steps: int | None = None  # budget in optimizer steps (set exactly one of steps / epochs)
        self.epochs: int | None = None  # budget in passes over the training data (set exactly one of steps / epochs)
        self.accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
        self.precision = "fp32"  # fp32, or bf16 / fp16 autocast (fp16 also scales the loss)
        self.loss.normalize = "mean"  # mean: train_step returns a mean; tokens: a sum, divided by the window's tokens
        self.max_grad_norm: float | None = None  # clip the gradient norm to this; None or 0: no clipping
        self.skip_nonfinite_grad = True  # skip (and count) an optimizer step whose gradients are not finite
        self.deterministic = False  # deterministic kernels (GPU resumes bit-exact); see docs/checkpoints.md
        self.checkpoint: str | None = None  # start a new run from this checkpoint's full state
        self.resume: str | bool = "auto"  # auto: continue this run's latest checkpoint; false: refuse to start over one
        self.pretrained: str | None = None  # start from these model weights only (an export or a checkpoint)
        self.eval.steps = None  # batches of each split an evaluation reads (all ranks together); None: all of it
        self.eval.interval = None  # evaluate every N steps (epochs); None: every ckpt.interval steps (every epoch)
        self.ckpt.enabled = True  # false: write no checkpoint, pointer or export (reads still happen)
        self.ckpt.backend = "auto"  # auto: dcp with several ranks, else file; or file, dcp, deepspeed
        self.ckpt.interval = None  # every N steps (epochs in epoch mode); None: 500 steps or 1 epoch; auto: Young/Daly
        self.ckpt.mtbf = None  # ckpt.interval auto: seconds between interruptions; None: from the run's attempts
        self.ckpt.interval_steps = None  # epoch mode: also checkpoint every N steps inside an epoch
        self.ckpt.keep_latest_k = 3  # keep the K newest checkpoints (plus latest, best, resumed-from); 0: keep all
        self.ckpt.save_best = True  # a new best score between two interval saves is saved too
        self.ckpt.export_dtype = None  # cast model.pth to fp32, bf16 or fp16 (checkpoints keep full precision)
        self.ckpt.async_mode = "disabled"  # disabled, thread or process: write checkpoints in the background
        self.ckpt.device_staging = "auto"  # async saves on a GPU: auto copies the state on it first if it has room; off
        self.ckpt.on_error = "warn"  # a failed periodic save: warn and train on, or raise
        self.ckpt.hang_warning_s = 300.0  # warn when a save writes nothing for this long (a hung filesystem); 0: never
        self.ckpt.export_format = ["pth"]  # what the final export writes: pth, safetensors, hf (a directory)
        self.ckpt.mirror = None  # object-store URL (s3://bucket/prefix) each committed checkpoint is uploaded to
        self.ckpt.mirror_every = 1  # upload every N-th committed checkpoint (final and preemption ones always)
        self.ckpt.mirror_drain_s = 600.0  # when training ends, wait at most this long for uploads still in flight
        self.optim.name = "adamw"  # the default optimizer: adamw, adam, sgd (unless you assign self.optimizer)
        self.optim.lr = 1e-3  # learning rate
        self.optim.weight_decay = 0.0  # weight decay
        self.optim.betas = [0.9, 0.999]  # Adam betas
        self.optim.eps = 1e-8  # Adam epsilon
        self.optim.momentum = 0.9  # SGD momentum
        self.sched.name = "none"  # the default schedule: none, constant, cosine, linear (with linear warmup)
        self.sched.warmup_steps = 0  # linear warmup from 0 over this many steps
        self.sched.min_lr_ratio = 0.0  # cosine / linear end at this fraction of optim.lr
        self.sched.total_steps = None  # steps the schedule spans; None: the budget (pin it to extend a run later)
        self.dataloader.batch_size = 32  # samples per rank per micro-batch
        self.dataloader.shuffle = True  # shuffle the training split each epoch (evaluation never shuffles)
        self.dataloader.num_workers = 0  # loader worker processes
        self.dataloader.drop_last = False  # drop the training split's last, smaller batch
        self.dataloader.pin_memory = False  # pin host memory for faster copies to the GPU
        self.score.split = "val"  # the split whose metric is the score (best checkpoint, early stopping)
        self.score.metric = "loss"  # the metric that is the score
        self.score.mode = "min"  # min or max: which way is better
        self.score.patience = 0  # stop after this many evaluations without improvement; 0: never
        self.ema.enabled = False  # keep an exponential moving average of the weights (model-ema.pth)
        self.ema.decay = 0.999  # EMA decay per optimizer step
        self.compile.enabled = False  # torch.compile the model (checkpoints keep plain parameter names)
        self.compile.backend = "inductor"  # torch.compile backend: inductor, aot_eager (CPU tests), eager, ...
        self.compile.mode = None  # torch.compile mode: None, default, reduce-overhead, max-autotune, ...
        self.perf.peak_flops = None  # peak FLOP/s of one device for MFU; None: from the GPU table (no MFU on CPU)
        self.workspace.root = None  # where runs live; None: $PERDURE_ROOT, else ./runs
        self.workspace.lineage = None  # group runs under this name; None: from the runner class name
        self.workspace.id = None  # name the run directory yourself; None: <code_id>-<config_id>
        self.workspace.code_id = None  # pin the code part of the run's name, to continue a run after a code change
        self.workspace.continue_unfinished = True  # a fresh launch continues an unfinished run of other code
        self.workspace.tags = []  # free-form tags (perdure runs ls --tag)
        self.log.interval = 50  # a train log line (loss, lr, throughput, memory, ETA) every N steps
        self.log.progress = "auto"  # auto: a progress bar on a terminal, plain lines otherwise; bar; lines
        self.tensorboard.enabled = False  # also log to TensorBoard (tensorboard/ in the run dir)
        self.wandb.enabled = False  # also log to Weights & Biases
        self.wandb.project = None  # W&B project
        self.wandb.entity = None  # W&B entity (user or team)
        self.wandb.mode = "online"  # W&B mode: online, offline, disabled
        self.resilience.exit_code = None  # exit status after a preemption; None: 128 + signal number
        self.resilience.grace_s = None  # seconds from the stop signal to SIGKILL; None: read from torchrun / SLURM
        self.resilience.max_consecutive_skips = 100  # skipped (non-finite) steps in a row that end the run; None: never
        self.resilience.max_attempts_without_progress = 3  # failed attempts in a row, no new checkpoint: exit 93
        self.dist.backend = "auto"  # auto: nccl with CUDA, gloo on CPU
        self.dist.timeout = 600  # seconds a collective may wait before the run fails instead of hanging
        self.dist.step_timeout = 300  # seconds a step may take before its rank is named hung (exit 92); 0: never
        # The registered sections (`config_checks.register_section`): deepspeed, ft, parallel, ... each declared, with
        # its keys' help and validation, by the module that owns it (`perdure/sections.py` imports perdure's own).
        for key, declared in section_keys().items():
            self.set(key, copy.deepcopy(declared.default))

    # ------------------------------------------------------------------ views

    def to_plain(self) -> dict[str, Any]:
        """Nested plain dicts and lists (YAML / JSON dumpable); empty-dict leaves are dropped."""
        return plain_dict(self)

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> Self:
        """Build a config holding `data`'s values (a stored config): keys unknown to `cls` are added. Not checked."""
        config = cls()
        flat = flatten(data)
        if "eval_interval" in flat:  # stored by perdure before eval.interval existed
            flat.setdefault("eval.interval", flat.pop("eval_interval"))
        for key, value in flat.items():
            config.set(key, value)
        return config

    def lookup(self, key: str, default: Any = None) -> Any:
        """Value at dotted `key`, or `default`. Unlike attribute access / `get`, never creates a missing section."""
        value = _lookup(self, key)
        return default if value is _MISSING else value

    def training_mode(self) -> str:
        """`"steps"` when the budget is `steps`, else `"epochs"`."""
        return "steps" if self.lookup("steps") is not None else "epochs"

    def loader_options(self, split: str) -> dict[str, Any]:
        """Dataloader options for `split`: the global `dataloader.*` values, overridden by `dataloader.<split>.*`."""
        loader = self.to_plain().get("dataloader", {})
        options = {key: value for key, value in loader.items() if not isinstance(value, Mapping)}
        override = loader.get(split)
        if isinstance(override, Mapping):
            options.update(override)
        return options

    def known_keys(self) -> list[str]:
        """Every dotted leaf key the config holds now (sorted)."""
        return sorted(flatten(self.to_plain()))

    def command_line_keys(self) -> frozenset[str]:
        """Dotted keys that `parse()` set from command-line options (not from `--config` files, not in code)."""
        return self.getattr(_CLI_KEYS_ATTR, frozenset())

    def from_command_line(self, key: str) -> bool:
        """Whether dotted `key` was given on the command line (e.g. `--workspace.root`) in `parse()`."""
        return key in self.command_line_keys()

    # ------------------------------------------------------------------ parsing

    def parse(self, args: Sequence[str] | None = None, exit_on_error: bool = True) -> Self:  # type: ignore[override]
        """Apply `--config FILE` and `--key value` overrides from `args` (default `sys.argv[1:]`), then `check()`.

        Files are applied in order, then the command-line options, which win. The keys given on the command line are
        remembered (`command_line_keys()`), e.g. for the precedence of `workspace.root` over `$PERDURE_ROOT`.

        With `exit_on_error` (the CLI form) a `PerdureError` prints `error: <message>` to stderr and exits with
        status 2; otherwise it is raised. Also installs `install_excepthook()`.
        """
        install_excepthook()
        try:
            files, overrides = config_text.split_argv(list(sys.argv[1:] if args is None else args))
            wants_help = ("--help", config_text.BARE) in overrides
            overrides = [override for override in overrides if override[0] != "--help"]
            sources: dict[str, str] = {}
            for file in files:
                layer = self._file_layer(file)
                self._apply(layer)
                sources.update(dict.fromkeys(layer, Path(file).name))
            cli_layer = self._cli_layer(overrides)
            self._apply(cli_layer)
            self.setattr(_CLI_KEYS_ATTR, self.command_line_keys() | frozenset(cli_layer))
            if wants_help:
                sources.update(dict.fromkeys(cli_layer, "command line"))
                print(self.help_text(sources))
                raise SystemExit(0)
            return self.check()
        except PerdureError as error:
            if not exit_on_error:
                raise
            if show_traceback():
                traceback.print_exc()
            print(f"error: {escape_terminal(error, keep_newlines=True)}", file=sys.stderr)
            raise SystemExit(2) from None

    def _cli_layer(self, overrides: list[tuple[str, Any]]) -> dict[str, Any]:
        known = set(self.known_keys())
        layer: dict[str, Any] = {}
        for name, text in overrides:
            key = self._resolve_key(name, known, text)
            layer[key] = config_text.coerce_text(key, text, self._current(key))
        return layer

    def _file_layer(self, file: str) -> dict[str, Any]:
        data = read_config_file(file)
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise ConfigError("config", file, "the file must hold a mapping of keys to values")
        known = set(self.known_keys())
        layer: dict[str, Any] = {}
        written: dict[str, Any] | None = None  # the file's scalars as text, read when a name reads as a number
        for name, value in flatten(data).items():
            key = self._resolve_key(name, known, value)
            if key in config_text.OPTIONAL_STR_KEYS and config_text.is_number(value):
                # YAML typed it (`code_id: 0123456` is the octal 42798, `1e3` a float): the name is the text written.
                written = written if written is not None else flatten(read_config_file(file, scalars_as_text=True))
                value = written.get(name, value)
            layer[key] = config_text.coerce_value(key, value, self._current(key))
        return layer

    def _apply(self, layer: Mapping[str, Any]) -> None:
        """Set a layer of overrides. Setting only one of steps / epochs clears the other: the budget changes mode."""
        for key, value in layer.items():
            self.set(key, value)
        for key, other in (("steps", "epochs"), ("epochs", "steps")):
            if layer.get(key) is not None and other not in layer:
                self.set(other, None)

    def _resolve_key(self, name: str, known: set[str], value: Any) -> str:
        """The known dotted key `name` refers to, or a ConfigError with a suggestion (another trainer's name for a
        key, the keys of a section given a value, or a key spelled alike)."""
        for key in (name, name.replace("-", "_")):
            if key in known or self._is_split_key(key, known):
                return key
        hint = config_help.alias_hint(name, known) or config_help.section_hint(name, known)
        if hint is None:
            hint = config_text.suggest(name, known | self._split_candidates(name))
        raise ConfigError(name, config_text.shown(value), f"unknown key; {hint}")

    def _is_split_key(self, key: str, known: set[str]) -> bool:
        """`dataloader.<split>.<option>`: a per-split override for any split name."""
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "dataloader" or f"dataloader.{parts[1]}" in known:
            return False
        return parts[2] in self._split_options()

    def _split_options(self) -> list[str]:
        loader = self.to_plain().get("dataloader", {})
        return list(dict.fromkeys([*LOADER_KEYS, *(k for k, v in loader.items() if not isinstance(v, Mapping))]))

    def _split_candidates(self, name: str) -> set[str]:
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "dataloader":
            return {f"dataloader.{parts[1]}.{option}" for option in self._split_options()}
        return set()

    def _current(self, key: str) -> Any:
        """Current value of `key`; a per-split override not yet set takes its type from the global option."""
        value = _lookup(self, key)
        if value is _MISSING and key.startswith("dataloader."):
            value = _lookup(self, "dataloader." + key.rsplit(".", 1)[-1])
        return None if value is _MISSING else value

    def help_text(self, sources: Mapping[str, str] | None = None) -> str:
        """What `--help` prints: every key, its value now and its help line (see `perdure.config_help`);
        `sources` maps keys to what set them (a file name, "command line")."""
        program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "program"
        helps = config_help.key_help(type(self))
        return config_help.render_help(flatten(self.to_plain()), helps, sources or {}, program)

    # ------------------------------------------------------------------ validation

    def check(self) -> Self:
        """Validate every value; raise `ConfigError` naming the key, the bad value and the fix. Returns self."""
        c = self.to_plain()

        def get(key: str) -> Any:
            value = _lookup(c, key)
            return None if value is _MISSING else value

        steps, epochs = get("steps"), get("epochs")
        if (steps is None) == (epochs is None):
            fix = "set exactly one of them: --steps N (optimizer steps) or --epochs N (passes over the data)"
            raise ConfigError("steps/epochs", {"steps": steps, "epochs": epochs}, fix)
        budget = "steps" if steps is not None else "epochs"
        check_int(budget, get(budget), 1)
        check_int("seed", get("seed"), None)
        if abs(get("seed")) >= MAX_SEED:  # the loader seeds each epoch with seed * 1_000_003 + epoch, in 64 bits
            raise ConfigError("seed", get("seed"), f"use an integer between -{MAX_SEED - 1} and {MAX_SEED - 1}")
        check_number("dist.timeout", get("dist.timeout"), "a number of seconds > 0", lambda x: x > 0)
        check_number("dist.step_timeout", get("dist.step_timeout"), "seconds >= 0 (0: never)", lambda x: x >= 0)
        exit_code = get("resilience.exit_code")
        if exit_code is not None and not (is_int(exit_code) and 0 <= exit_code <= 255):
            raise ConfigError("resilience.exit_code", exit_code, "use an integer from 0 to 255, or None for 128+signal")
        declared = section_keys()  # the registered sections' keys, checked after perdure's own of each kind
        counts = {**_COUNTS, **{key: d.count for key, d in declared.items() if d.count is not None}}
        for key, (minimum, optional) in counts.items():
            check_int(key, get(key), minimum, optional)
        if get("accum_steps") > MAX_ACCUM_STEPS:  # the loader counts the samples of that many batches read ahead
            raise ConfigError("accum_steps", get("accum_steps"), f"use at most {MAX_ACCUM_STEPS} micro-batches a step")
        choices_of = {"stack": stack_names(), **_CHOICES}  # the registered stacks (config_checks.register_stack)
        for key, choices in {**choices_of, **{key: d.choices for key, d in declared.items() if d.choices}}.items():
            check_choice(key, get(key), choices)
        for key in [*_BOOLS, *(key for key, d in declared.items() if d.boolean)]:
            check_bool(key, get(key))
        for key in ("checkpoint", "pretrained"):
            check_path(key, get(key))
        check_number("max_grad_norm", get("max_grad_norm"), "a number >= 0 (0: no clipping)", lambda x: x >= 0, True)
        check_number("ckpt.hang_warning_s", get("ckpt.hang_warning_s"), "seconds >= 0 (0: never)", lambda x: x >= 0)
        check_number("resilience.grace_s", get("resilience.grace_s"), "None or seconds > 0", lambda x: x > 0, True)
        check_number("ckpt.mirror_drain_s", get("ckpt.mirror_drain_s"), "seconds >= 0", lambda x: x >= 0)
        check_number("perf.peak_flops", get("perf.peak_flops"), "None or FLOP/s > 0", lambda x: x > 0, True)
        backend = get("compile.backend")
        if not isinstance(backend, str) or not backend:
            raise ConfigError("compile.backend", backend, "use a torch.compile backend, e.g. inductor or aot_eager")
        if get("eval_interval") is not None:
            raise ConfigError("eval_interval", get("eval_interval"), "it is now eval.interval: --eval.interval N")
        check_number("ema.decay", get("ema.decay"), "a number between 0 and 1 (exclusive)", lambda x: 0 < x < 1)
        check_number("optim.lr", get("optim.lr"), "a number >= 0", lambda x: x >= 0)
        check_number("optim.weight_decay", get("optim.weight_decay"), "a number >= 0", lambda x: x >= 0)
        check_number("optim.eps", get("optim.eps"), "a number > 0", lambda x: x > 0)
        check_number("optim.momentum", get("optim.momentum"), "a number >= 0", lambda x: x >= 0)
        check_number("sched.min_lr_ratio", get("sched.min_lr_ratio"), "a number in [0, 1]", lambda x: 0 <= x <= 1)
        betas = get("optim.betas")
        if not (
            isinstance(betas, (list, tuple)) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError("optim.betas", betas, "use two numbers in [0, 1), e.g. [0.9, 0.999]")
        for key in ("score.split", "score.metric"):
            if not isinstance(get(key), str) or not get(key):
                raise ConfigError(key, get(key), "use a non-empty name")
        for key in ("workspace.root", "workspace.lineage", "workspace.id", "workspace.code_id"):
            if get(key) is not None and not isinstance(get(key), (str, os.PathLike)):
                raise ConfigError(key, get(key), "use a string or None")
        for key in ("workspace.lineage", "workspace.id", "workspace.code_id"):
            check_path_component(key, get(key))
        check_root(get("workspace.root"))
        tags = get("workspace.tags")
        if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
            raise ConfigError("workspace.tags", tags, "use a list of strings, e.g. --workspace.tags a,b")
        self._check_loaders(c.get("dataloader", {}))
        formats = get("ckpt.export_format")
        formats = [formats] if isinstance(formats, str) else formats
        if not isinstance(formats, list) or not formats or not all(f in EXPORT_FORMATS for f in formats):
            raise ConfigError(
                "ckpt.export_format",
                get("ckpt.export_format"),
                "use pth, safetensors, hf or a list of them: [pth, hf]",
            )
        for check in section_checks().values():  # each stack's, TorchFT's, the mirror's (config_checks.py)
            check(self, get)
        self.check_user_keys()
        return self

    def check_user_keys(self) -> None:
        """Override point: check the keys your subclass adds, raising `ConfigError(key, value, fix)` for a bad value.

        Called at the end of `check()`, which `parse()` runs, and again when a runner is built: always before anything
        is written, so a bad value never leaves a run directory behind. Must not change the config. Default: nothing.
        """

    def _check_loaders(self, loader: Mapping[str, Any]) -> None:
        check_loader("dataloader", loader, required=True)
        options = set(self._split_options())
        for split, override in loader.items():
            if not isinstance(override, Mapping):
                continue
            for option in override:
                if option not in options:
                    fix = f"per-split dataloader options are {', '.join(sorted(options))}"
                    raise ConfigError(f"dataloader.{split}.{option}", override[option], fix)
            check_loader(f"dataloader.{split}", override, required=False)


# ---------------------------------------------------------------------- plain data helpers


def _lookup(mapping: Mapping[str, Any], key: str) -> Any:
    """Value at dotted `key` or `_MISSING`, using `dict` access so chanfig never creates a missing section."""
    value: Any = mapping
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value.keys():
            return _MISSING
        value = dict.__getitem__(value, part) if isinstance(value, dict) else value[part]
    return value


def read_config_file(file: str | os.PathLike, key: str = "config", scalars_as_text: bool = False) -> Any:
    """The data of a YAML or JSON config file, which may come from someone else: a regular file (never a FIFO or a
    device; a symlink the user named is fine), at most `MAX_YAML_BYTES`, nested and alias-expanded within bounds
    (`safe_io.load_yaml`, `safe_io.loads_json`). Raises `ConfigError` naming `key` and the file. `scalars_as_text`:
    a YAML file's scalars as the text written (JSON's are typed by JSON itself)."""
    path = Path(file).expanduser()
    try:
        found = path.stat()  # a symlink the user named is followed
    except (OSError, ValueError):
        found = None
    if found is None or not stat.S_ISREG(found.st_mode):
        there = "no such file" if found is None else f"it is {kind_of(found.st_mode)}, not a file"
        raise ConfigError(key, str(file), f"{there}; pass an existing .yaml or .json file to --{key}")
    try:
        raw = read_regular(path, MAX_YAML_BYTES, follow_symlinks=True)
    except UnsafeFileError as error:
        raise ConfigError(key, str(file), f"cannot be read: {error.reason}") from None
    except (OSError, ValueError) as error:  # unreadable, a NUL byte or an over-long name
        raise ConfigError(key, str(file), f"cannot be read ({error})") from None
    try:
        return loads_json(raw) if path.suffix == ".json" else load_yaml(raw, scalars_as_text=scalars_as_text)
    except (ValueError, yaml.YAMLError) as error:
        raise ConfigError(key, str(file), f"cannot be read ({error}); fix the file") from None


def install_excepthook() -> None:
    """Print an uncaught `PerdureError` as one line `error: <message>` (no traceback unless `PERDURE_TRACEBACK=1`).
    Idempotent."""
    if getattr(sys.excepthook, "_perdure", False):
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, PerdureError):
            if show_traceback():
                traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
            print(f"error: {escape_terminal(exc, keep_newlines=True)}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    hook._perdure = True  # type: ignore[attr-defined]
    sys.excepthook = hook
