"""Sweep files: YAML → validated :class:`SweepConfig`, with one-line errors that say where.

A sweep file names everything one run of ``plora-hpo sweep`` needs: base model, task(s),
target modules, sequence length, training budget, evaluation, seed, pack size, and the
hyperparameter search space (see :mod:`plora_hpo.space`).
"""

from __future__ import annotations

import difflib
import re
import types
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from plora_hpo.errors import ConfigError
from plora_hpo.shapes import TARGET_MODULES

TASK_NAMES = ("synthetic", "gsm8k", "mrpc", "cola")
SAMPLERS = ("grid", "tpe", "gp", "random")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamSpec(_Strict):
    """One hyperparameter: either ``choices`` (categorical) or a ``low``..``high`` range of positive values."""

    choices: list[float] | None = Field(None, description="Categorical values (grid-searchable).")
    low: float | None = Field(None, gt=0, description="Lower bound of a range.")
    high: float | None = Field(None, gt=0, description="Upper bound of a range.")
    log: bool = Field(False, description="Sample the range log-uniformly.")

    _RULE: ClassVar[str] = "> 0"  # what every value must be, as errors say it

    @staticmethod
    def _allowed(value: float) -> bool:
        return value > 0

    @model_validator(mode="after")
    def _one_kind(self) -> ParamSpec:
        if (self.choices is None) == (self.low is None or self.high is None):
            raise ValueError("give either 'choices' or both 'low' and 'high'")
        if self.choices is not None:
            if not self.choices:
                raise ValueError("'choices' is empty")
            if not all(self._allowed(c) for c in self.choices):
                raise ValueError(f"every choice must be {self._RULE}, got {self.choices}")
            for value in dict.fromkeys(self.choices):  # a repeated grid value would train the same trials twice
                count = self.choices.count(value)
                if count > 1:
                    times = "twice" if count == 2 else f"{count} times"
                    shown = int(value) if value == int(value) else value
                    raise ValueError(f"choice {shown} appears {times}; list each value once")
        elif self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        return self

    @property
    def is_categorical(self) -> bool:
        return self.choices is not None


class RateSpec(ParamSpec):
    """A probability hyperparameter: values in [0, 1), so 0 (off) is a valid choice or range end."""

    low: float | None = Field(None, ge=0, lt=1, description="Lower bound of a range.")
    high: float | None = Field(None, ge=0, lt=1, description="Upper bound of a range.")

    _RULE: ClassVar[str] = "in [0, 1)"

    @staticmethod
    def _allowed(value: float) -> bool:
        return 0 <= value < 1

    @model_validator(mode="after")
    def _log_above_zero(self) -> RateSpec:
        if self.log and self.low == 0:
            raise ValueError("a log range needs low > 0")
        return self


class SpaceSpec(_Strict):
    """The LoRA hyperparameters. Alpha is ``alpha_multiplier × rank``, so one grid spans r/4 … 4r at every rank."""

    rank: ParamSpec = Field(description="LoRA rank r; ranges are sampled as integers.")
    alpha_multiplier: ParamSpec = Field(description="alpha = multiplier × rank (r/4 → 0.25, 4r → 4).")
    learning_rate: ParamSpec = Field(description="Peak AdamW learning rate.")
    batch_size: ParamSpec = Field(description="Sequences per step for this adapter; ranges are integers.")
    lora_dropout: RateSpec | None = Field(
        None,
        description="Dropout p on the adapter's input, as PEFT's lora_dropout (the base layer sees it undropped); "
        "omitted: 0. One choice sets it for every trial.",
    )

    def params(self) -> list[tuple[str, ParamSpec]]:
        """The searched hyperparameters, in sweep-file order (optional ones only when given)."""
        return [(name, spec) for name, spec in self if spec is not None]

    @model_validator(mode="after")
    def _integers(self) -> SpaceSpec:
        for name in ("rank", "batch_size"):
            spec: ParamSpec = getattr(self, name)
            values = spec.choices if spec.is_categorical else [spec.low, spec.high]
            if any(int(v) != v for v in values):
                raise ValueError(f"{name} values must be whole numbers, got {values}")
        return self


class BudgetSpec(_Strict):
    """Training length of every adapter: ``steps`` (optimizer steps) or ``epochs`` over its data."""

    steps: int | None = Field(None, gt=0, description="Optimizer steps per adapter.")
    epochs: float | None = Field(None, gt=0, description="Passes over the training set per adapter.")
    max_train_examples: int | None = Field(
        None, gt=0, description="Use only the first N training examples (after a seeded shuffle)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> BudgetSpec:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of 'steps' or 'epochs'")
        return self


class EvalSpec(_Strict):
    """How each trained adapter is scored (lm-eval task settings)."""

    limit: int | None = Field(
        None,
        gt=0,
        description="Score every adapter on the same N evaluation documents: a random sample drawn with the "
        "sweep's seed, stratified by answer for multiple-choice tasks (not the first N rows).",
    )
    batch_size: int = Field(
        32,
        gt=0,
        description="Rows per forward pass, shared by the adapters scored together (lm-eval's batch size "
        "counts one model's rows: the same per-adapter batch is that times the adapters, memory permitting).",
    )
    num_fewshot: int | None = Field(None, ge=0, description="Override the task's few-shot count.")
    max_new_tokens: int = Field(256, gt=0, description="Generation cap for generate_until tasks.")
    bootstrap_iters: int = Field(0, ge=0, description="lm-eval bootstrap iterations for stderr.")


class PackSpec(_Strict):
    """How trials are grouped into packs that train together."""

    size: int = Field(4, gt=0, description="Most adapters trained together in one pack.")
    policy: Literal["planner", "fifo"] = Field(
        "planner",
        description="Who decides which waiting trials join a pack: the planner's pack ILP over the calibrated "
        "cost model (longest-running first), or arrival order (fifo).",
    )
    solver: Literal["auto", "gurobi", "highs"] = Field(
        "auto", description="ILP solver for the planner: gurobipy (size-limited pip license), HiGHS, or auto."
    )
    gather_seconds: float = Field(
        2.0,
        ge=0,
        description="How long a pack waits for concurrent trials before it starts, and for the next ones "
        "once all its members finished.",
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Split each packed step into forwards of at most this many tokens (same gradients); "
        "activations then scale with this instead of the whole pack's batch, so more adapters fit. "
        "null = one forward per step.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer in the backward: less activation memory, ~1/3 more compute."
    )
    rotate: bool = Field(
        True,
        description="Once every trial left has been proposed, keep a full pack full: a member far ahead "
        "waits in host memory while a trial that does not fit trains in its place, instead of the trials "
        "that do not fit training last, as a small pack that leaves the device idle. Trials train exactly "
        "as without it. Not with a pruner or pack.degree > 1.",
    )
    degree: int = Field(
        1,
        ge=1,
        description="Devices (and worker processes) that train one pack together by tensor parallelism: the "
        "base model's attention and MLP projections are split over them, so a model too large for one device "
        "fits, and each pack step uses all of them. A power of two that divides the model's attention and "
        "key-value heads; the devices given are grouped into packs of this many. 1 = one pack per device.",
    )

    @field_validator("degree")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, 8, ...), got {value}")
        return value


class TrainSpec(_Strict):
    """Optimizer settings shared by all adapters (the search space varies the rest)."""

    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Per-adapter gradient clipping; null = off.")
    use_rslora: bool = False
    checkpoint_every: int | None = Field(
        None,
        gt=0,
        description="Save every adapter's weights, AdamW state and data position every N of its steps; "
        "a rerun after a crash resumes in-flight trials from there. null = automatic: a quarter of each "
        "trial's steps, so every trial is saved about four times. Each save writes 12 bytes per LoRA "
        "parameter (a rank-64 adapter on all projections of a 1.5B model: ~0.9 GB).",
    )

    checkpoint_overhead: float = Field(
        0.05,
        gt=0,
        le=1,
        description="With the automatic cadence, the largest share of a device's time that checkpoints "
        "may take from training (copying adapter state to host memory; a save that finds the background "
        "writer's queue full is taken at a later step, so the loop does not wait for the disk): a due save "
        "is skipped while it would exceed this share (measured from the saves so far). Fast GPU trials "
        "then risk a few seconds of training in a crash instead of stalling on multi-GB writes; slow "
        "trials are still saved about four times. An explicit "
        "checkpoint_every is always honoured.",
    )

    def checkpoint_interval(self, total_steps: int) -> int:
        """Steps between two checkpoints of an adapter that trains ``total_steps`` steps.

        An explicit ``checkpoint_every`` is used as given. Otherwise the interval follows the work:
        a quarter of the trial (at least one step), so a short trial such as the 30-step demo is
        still saved a few times and a long one does not pay for a save every few steps.
        """
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return max(1, total_steps // 4)


class PruningSpec(_Strict):
    """Early stopping: adapters are scored on a slice of the eval set every ``interval`` steps, an
    Optuna pruner decides, and a pruned adapter's slot trains the next proposed trial at once."""

    pruner: Literal["none", "median", "asha", "hyperband"] = Field(
        "none", description="Optuna pruner: MedianPruner, SuccessiveHalvingPruner (ASHA) or HyperbandPruner."
    )
    interval: int = Field(10, gt=0, description="Score (trial.report) every adapter every N of its steps.")
    eval_limit: int = Field(32, gt=0, description="Evaluation documents per intermediate score.")
    warmup_steps: int = Field(0, ge=0, description="Never prune before this step (the pruners' warm-up/min resource).")


class CustomTask(_Strict):
    """A task of the user's own: an lm-eval task by name, an lm-eval task YAML, or data files.

    Give exactly one of ``lm_eval``, ``yaml`` or ``train``+``eval``. Relative paths are read from
    the sweep file's folder.
    """

    lm_eval: str | None = Field(
        None, description="A task registered in lm-eval (e.g. 'arc_easy'): its prompts, targets and metrics."
    )
    yaml: str | None = Field(
        None, description="Path of an lm-eval task YAML of the user's own (it may 'include' others)."
    )
    data_files: dict[str, str] | None = Field(
        None,
        description="With lm_eval or yaml: local files replacing the task's dataset, per lm-eval split "
        "(e.g. {train: train.jsonl, validation: dev.jsonl}); .jsonl/.json, .csv or .parquet.",
    )
    train: str | None = Field(
        None, description="Training file (.jsonl/.json, .csv or .parquet) of prompt/completion rows."
    )
    eval: str | None = Field(None, description="Held-out file, same format and columns, that trials are scored on.")
    prompt_column: str = Field("prompt", description="Column of train/eval holding the prompt.")
    completion_column: str = Field("completion", description="Column of train/eval holding the completion (target).")
    target_delimiter: str = Field(" ", description="Put between prompt and completion (lm-eval's target_delimiter).")
    choices: list[str] | None = Field(
        None,
        description="A fixed answer set: each completion must be one of these; scored by comparing the "
        "log-likelihood of every choice (lm-eval multiple_choice). Without it the model generates.",
    )
    regex: str | None = Field(
        None, description="Generation only: compare the first match of this pattern (its first group) with the target."
    )
    until: list[str] = Field(["\n"], description="Generation only: stop generating at any of these strings.")
    metric: str | None = Field(
        None,
        description="lm-eval metric to optimise, optionally with its filter ('acc', 'exact_match,strict-match'). "
        "For data files: acc/acc_norm/f1/mcc with choices, exact_match for generation, perplexity "
        "(of the completion, scored by log-likelihood). Default: the task's first metric.",
    )
    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="Optimise the metric up or down; default: lm-eval's higher_is_better for it."
    )

    @field_validator("yaml", "train", "eval")
    @classmethod
    def _relative_to_sweep_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve_path(value, info)

    @field_validator("data_files")
    @classmethod
    def _files_relative_to_sweep_file(cls, value: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError(
                "data_files is empty; give a file per split, e.g. {train: train.jsonl, validation: dev.jsonl}"
            )
        return {split: _resolve_path(path, info) for split, path in value.items()}

    @model_validator(mode="after")
    def _one_kind(self) -> CustomTask:
        kinds = [k for k, given in (("lm_eval", self.lm_eval), ("yaml", self.yaml), ("train", self.train)) if given]
        if self.eval is not None and self.train is None:
            raise ValueError("'eval' needs 'train' (the training file) too")
        if len(kinds) != 1:
            shown = " and ".join(repr(k) for k in kinds) if kinds else "none"
            raise ValueError(f"give exactly one of 'lm_eval', 'yaml' or 'train'+'eval', got {shown}")
        if self.train is not None:
            if self.eval is None:
                raise ValueError("'train' needs 'eval', the held-out file trials are scored on")
            if self.data_files is not None:
                raise ValueError("'data_files' replaces an lm-eval task's dataset; with train/eval leave it out")
        elif self.choices is not None or self.regex is not None:
            raise ValueError("'choices' and 'regex' describe train/eval files; an lm-eval task defines its own")
        if self.choices is not None:
            if len(set(self.choices)) < 2 or len(set(self.choices)) != len(self.choices):
                raise ValueError(f"'choices' needs at least two different answers, each once, got {self.choices}")
            if self.regex is not None:
                raise ValueError("'regex' extracts answers from generations; with 'choices' nothing is generated")
        return self

    @property
    def kind(self) -> Literal["lm_eval", "yaml", "files"]:
        return "lm_eval" if self.lm_eval else "yaml" if self.yaml else "files"


def _resolve_path(value: str, info: ValidationInfo) -> str:
    """An absolute path: relative ones are taken from the sweep file's folder (the context's ``base_dir``)."""
    path = Path(value).expanduser()
    base = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    return str(path.resolve()) if path.is_absolute() or base is not None else value


class SweepConfig(_Strict):
    """A whole sweep: what to train, how to score it, and what to search over."""

    name: str = Field(description="Study and MLflow experiment name.")
    model: str = Field(
        "smollm2-135m",
        description="'smollm2-135m' (embedded), a hub id or local path, or 'random:<shape>' for benchmarks.",
    )
    tasks: list[str] = Field(
        description=f"Tasks to tune, one study each: {', '.join(TASK_NAMES)} or a name defined under custom_tasks."
    )
    custom_tasks: dict[str, CustomTask] = Field(
        {}, description="The user's own tasks by name: lm-eval tasks (by name or YAML) or prompt/completion files."
    )
    objectives: list[Literal["task", "adapter_params", "pack_tokens_per_second"]] = Field(
        ["task"],
        description="What each study optimises, in order: the task's metric (in its direction), the adapter's "
        "trainable parameters (minimised), its pack's training throughput (maximised). More than one gives a "
        "multi-objective study whose result is the Pareto front.",
    )
    target_modules: list[str] = Field(list(TARGET_MODULES), description="Projections that get adapters.")
    seq_len: int = Field(512, gt=0, description="Training sequences are truncated to this many tokens.")
    seed: int = Field(0, description="Seeds the sampler, adapter inits and data orders.")
    budget: BudgetSpec
    space: SpaceSpec
    sampler: Literal["grid", "tpe", "gp", "random"] = "tpe"
    n_trials: int | None = Field(None, gt=0, description="Trials per task; grid defaults to the grid size.")
    train: TrainSpec = TrainSpec()
    evaluation: EvalSpec = EvalSpec()
    pack: PackSpec = PackSpec()
    pruning: PruningSpec = PruningSpec()
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        if not tasks:
            raise ValueError("list at least one task")
        return tasks

    @field_validator("target_modules")
    @classmethod
    def _known_modules(cls, modules: list[str]) -> list[str]:
        if not modules:
            raise ValueError("list at least one target module")
        unknown = [m for m in modules if m not in TARGET_MODULES]
        if unknown:
            raise ValueError(f"unknown target module {unknown[0]!r}; choose from {', '.join(TARGET_MODULES)}")
        return modules

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, objectives: list[str]) -> list[str]:
        if objectives[:1] != ["task"]:
            raise ValueError("objectives must start with 'task' (the task's metric)")
        if len(set(objectives)) != len(objectives):
            raise ValueError(f"each objective once, got {objectives}")
        return objectives

    @model_validator(mode="after")
    def _tasks_defined(self) -> SweepConfig:
        for name in self.custom_tasks:
            if name in TASK_NAMES:
                raise _field_error(
                    ("custom_tasks", name),
                    f"custom task {name!r} has a built-in task's name; call it something else",
                    name,
                )
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise _field_error(
                    ("custom_tasks", name),
                    f"task name {name!r} names studies and folders; use letters, digits, '_', '.' and '-'",
                    name,
                )
        known = [*TASK_NAMES, *self.custom_tasks]
        unknown = [t for t in self.tasks if t not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _field_error(
                ("tasks",),
                f"unknown task {unknown[0]!r}; {hint}choose from {', '.join(known)}, or define it under custom_tasks",
                self.tasks,
            )
        if len(self.objectives) > 1 and self.pruning.pruner != "none":
            raise _field_error(
                ("objectives",),
                "pruning needs a single objective (Optuna cannot prune multi-objective studies); "
                "set pruning.pruner: none or list only 'task'",
                self.objectives,
            )
        return self

    @model_validator(mode="after")
    def _grid_is_categorical(self) -> SweepConfig:
        if self.sampler == "grid":
            ranged = [n for n, s in self.space.params() if not s.is_categorical]
            if ranged:
                raise ValueError(f"sampler 'grid' needs 'choices' for every parameter; {ranged[0]} is a range")
        return self


def _field_error(loc: tuple[str, ...], message: str, value: Any) -> ValidationError:
    """A validation error at ``loc`` from a whole-model check (which would otherwise have no key path)."""
    error = PydanticCustomError("value_error", "{message}", {"message": message})
    return ValidationError.from_exception_data(
        SweepConfig.__name__, [InitErrorDetails(type=error, loc=loc, input=value)]
    )


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The settings model whose keys sit at ``loc`` (``()`` → :class:`SweepConfig`), or None."""
    model: type[BaseModel] = SweepConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        candidates = [field.annotation]
        if get_origin(field.annotation) in (Union, types.UnionType):
            candidates = list(get_args(field.annotation))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _unknown_key_message(loc: tuple[str, ...]) -> tuple[str, str | None]:
    """``unknown key 'a.b'; <fix>`` for an unknown key, and the known key it most likely misspells."""
    where = ".".join(loc)
    model = _model_at(loc[:-1])
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(loc[-1], known, n=1)
    if close:
        return f"unknown key {where!r}; did you mean {close[0]!r}?", close[0]
    listed = f" (keys here: {', '.join(known)})" if known else ""
    return f"unknown key {where!r}; remove it or check its spelling{listed}", None


def _format_validation_error(path: Path, err: ValidationError, flags: dict[tuple, str] | None = None) -> str:
    """``<file>: <key path>: <problem>; <fix>``, or ``<--flag>: <problem>; <fix>`` for a bad CLI override.

    One line for the first problem; an unknown key comes first, since a misspelled key usually
    also causes the "missing" error of the key it was meant to be (which is then not repeated).
    Further problems are named by key path at the end so none stays hidden.
    """
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(str(p) for p in first["loc"])
    where = ".".join(loc) or "(top level)"
    message = first["msg"].removeprefix("Value error, ")
    rest = errors[1:]
    if first["type"] == "extra_forbidden":
        message, meant = _unknown_key_message(loc)
        if meant is not None:  # the misspelling is why the key it was meant to be is missing
            rest = [e for e in rest if not (e["type"] == "missing" and tuple(map(str, e["loc"])) == (*loc[:-1], meant))]
    others = list(dict.fromkeys(".".join(map(str, e["loc"])) or "(top level)" for e in rest))
    shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
    extra = f" (+{len(rest)} more {'problem' if len(rest) == 1 else 'problems'}: {shown})" if rest else ""
    flag = (flags or {}).get(loc)
    if flag is not None:
        fix = f"pass a positive {flag}" if first["type"] in ("greater_than", "greater_than_equal") else f"fix {flag}"
        return f"{flag}: {message} (got {first.get('input')!r}); {fix}{extra}"
    if first["type"] == "extra_forbidden":
        return f"{path}: {message}{extra}"
    if first["type"] == "missing":
        message = f"required key is missing; add it to {path.name} (see search_spaces/demo.yaml)"
    elif ";" not in message:  # pydantic's own messages name the problem only
        message = f"{message}; fix {where} in {path.name}"
    return f"{path}: {where}: {message}{extra}"


_START_FROM = "start from a sweep file such as search_spaces/demo.yaml"


def parse_sweep(data: Any, source: Path, flags: dict[tuple, str] | None = None) -> SweepConfig:
    """Validate already-parsed YAML; errors name the file and the key path (or the CLI flag in ``flags``)."""
    if data is None:
        raise ConfigError(f"{source}: the file is empty; {_START_FROM}")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sweep settings at the top level; {_START_FROM}")
    if "space" in data and not data["space"]:
        raise ConfigError(
            f"{source}: space: the search space is empty; give rank, alpha_multiplier, learning_rate and "
            "batch_size, each with 'choices' or 'low'/'high'"
        )
    try:
        return SweepConfig.model_validate(data, context={"base_dir": source.parent.resolve()})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err, flags)) from None


def load_sweep(path: str | Path, overrides: dict[str, Any] | None = None) -> SweepConfig:
    """Read and validate a sweep file.

    ``overrides`` replaces keys (CLI flags): ``"n_trials"`` a top-level key, ``"pack.size"`` a nested one.
    A bad override is reported against its flag (``--n-trials``, ``--pack-size``), not the file.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a sweep file; pass a YAML file such as search_spaces/demo.yaml")
    if not path.is_file():
        raise ConfigError(f"{path}: no such sweep file; pass a YAML file such as search_spaces/demo.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: YAML syntax error: {problem}; fix the file there") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the sweep file ({err}); pass a readable UTF-8 YAML file") from None
    flags: dict[tuple, str] = {}
    if isinstance(data, dict) and overrides:
        data = dict(data)
        for key, value in overrides.items():
            if value is None:
                continue
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                child = node.get(part, {})
                if not isinstance(child, dict):  # the file's own value is malformed: validation names it
                    break
                node[part] = node = dict(child)
            else:
                node[leaf] = value
            flags[tuple(key.split("."))] = "--" + key.replace(".", "-").replace("_", "-")
    return parse_sweep(data, path, flags)
