"""``plora-hpo plan``: predict how a sweep packs onto GPUs, before renting them.

Example::

    plora-hpo plan search_spaces/paper120.yaml --model qwen2.5-7b --gpus 8 --gpu-memory-gib 80 --json

The file is a sweep file (its model, sequence length, targets, budget and pack size are used) or a
bare search space (the four parameters at the top level; pass --model and --steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from plora_hpo.adapter import AdapterConfig
from plora_hpo.config import PackSpec, SpaceSpec, SweepConfig, load_sweep
from plora_hpo.errors import ConfigError, PloraError, first_line
from plora_hpo.planner.cost_model import GpuSpec
from plora_hpo.planner.gantt import write_gantt
from plora_hpo.planner.ilp import SOLVERS
from plora_hpo.planner.model_names import resolve_model, shape_name_for_model
from plora_hpo.planner.plan import plan_packs, steps_for_epochs
from plora_hpo.planner.schedule import Schedule
from plora_hpo.shapes import TARGET_MODULES
from plora_hpo.space import SearchSpace

# Training-split sizes of the built-in tasks (public datasets), for epoch budgets.
TRAIN_EXAMPLES = {"gsm8k": 7473, "mrpc": 3668, "cola": 8551}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` subcommand's arguments to ``parser``."""
    parser.add_argument("file", help="sweep file or search-space file (YAML)")
    parser.add_argument("--model", help="model shape name (e.g. qwen2.5-7b); default: the sweep's model")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the pool")
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU in GiB")
    parser.add_argument("--gpu-name", default="H200", help="GPU kind, for its stored calibration (default H200)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON only")
    parser.add_argument(
        "--samples",
        type=int,
        help="configs to draw from the space (default: a sweep file's n_trials; a grid sweep plans the grid "
        "points its trials take)",
    )
    parser.add_argument("--max-degree", type=int, help="most GPUs per pack, a power of two (default: all)")
    parser.add_argument("--max-pack-size", type=int, help="most adapters per pack (default: the sweep's pack.size)")
    parser.add_argument("--steps", type=int, help="optimizer steps per config (overrides the sweep's budget)")
    parser.add_argument("--train-examples", type=int, help="training examples, for an epoch budget")
    parser.add_argument(
        "--seq-len",
        type=int,
        help="tokens per training row to plan with (default for a sweep file: its longest tokenized training "
        "example, as the sweep pads each step only to its longest row; else 512)",
    )
    parser.add_argument(
        "--data-dir", help="a sweep file's task data, to read its training examples (default $PLORA_HPO_DATA_DIR)"
    )
    parser.add_argument("--load-factor", type=float, default=0.9, help="fraction of GPU memory to plan with")
    parser.add_argument("--checkpointing", action="store_true", help="plan with activation checkpointing")
    parser.add_argument(
        "--no-rotate",
        action="store_true",
        help="plan trials that do not fit in a full pack to wait for a free GPU, as a sweep with "
        "pack.rotate: false or a pruner runs them (default: as the sweep file's pack settings, where "
        "they take turns in the full pack)",
    )
    parser.add_argument("--solver", choices=SOLVERS, default="auto", help="ILP solver (default: auto)")
    parser.add_argument("--gantt", help="where to write the Gantt chart PNG (default: plan-<file>.png)")
    parser.add_argument("--no-gantt", action="store_true", help="do not write a Gantt chart")
    parser.add_argument(
        "--allow-unschedulable",
        action="store_true",
        help="plan the configs that fit and list those that fit nowhere, instead of failing",
    )


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; pass a sweep or space YAML such as search_spaces/paper120.yaml")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML syntax error: {str(err).splitlines()[0]}; fix the file there") from None


def _plan_inputs(args: argparse.Namespace) -> tuple[list[AdapterConfig], dict[str, Any], str, str]:
    """(configs, plan_packs keyword arguments, one-line description, where the row length comes
    from) from the file and flags."""
    path = Path(args.file)
    data = _read_yaml(path)
    grid_configs: list[AdapterConfig] | None = None  # a grid sweep's own points
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {args.samples}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len must be at least 1, got {args.seq_len}")
    if isinstance(data, dict) and "space" in data:
        sweep = load_sweep(path)
        space = SearchSpace(sweep.space, seed=sweep.seed, use_rslora=sweep.train.use_rslora)
        samples = args.samples or (None if space.is_grid and sweep.n_trials is None else sweep.n_trials)
        if args.samples is None and sweep.sampler == "grid" and space.is_grid:
            grid_configs = _sweep_grid_configs(space, sweep.seed, sweep.n_trials)
        model = args.model or sweep.model
        targets, budget, task = tuple(sweep.target_modules), sweep.budget, sweep.tasks[0]
        rows_of: SweepConfig | None = sweep  # its training rows, read once the cheap checks pass
        pack_size = args.max_pack_size or sweep.pack.size
        dtype_bytes = 4 if sweep.dtype == "float32" else 2
        rotates = sweep.pack.rotate and sweep.pruning.pruner == "none" and sweep.pack.degree == 1
    else:
        try:
            spec = SpaceSpec.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise ConfigError(
                f"{path}: neither a sweep file (no 'space' key) nor a search space: {where}: {first['msg']}"
            ) from None
        space = SearchSpace(spec)
        samples, model, targets, budget, task = args.samples, args.model, TARGET_MODULES, None, None
        rows_of = None
        pack_size, dtype_bytes = args.max_pack_size, 2
        rotates = PackSpec().rotate  # what a sweep of this space does by default
    if not space.is_grid and samples is None:
        raise ConfigError(f"{path}: the space has ranges; pass --samples N to plan N sampled configs")
    if model is None:
        raise ConfigError(f"{path}: a search-space file names no model; pass --model, e.g. --model qwen2.5-7b")
    if shape_name_for_model(model) is None and args.model is None:
        raise ConfigError(f"model {model!r} of {path} is not a known shape; pass --model, e.g. --model qwen2.5-7b")
    shape_name, shape = resolve_model(model)
    configs = grid_configs if grid_configs is not None else space.enumerate_configs(samples)
    if not configs:
        raise ConfigError(f"{path}: the search space yields no configs; add choices or pass --samples N")
    steps = _steps(args, configs, budget, task, path)
    if args.seq_len is not None:
        seq_len, seq_source = args.seq_len, "--seq-len"
    elif rows_of is not None:  # loads the tokenizer and the task data: seconds, so after the one-line refusals
        seq_len, seq_source = _row_tokens(rows_of, args.data_dir)
    else:
        seq_len, seq_source = 512, "a search space's default"
    kwargs = {
        "shape": shape,
        "seq_len": seq_len,
        "targets": targets,
        "num_gpus": args.gpus,
        "steps": steps,
        "gpu": GpuSpec(args.gpu_name, args.gpu_memory_gib),
        "max_degree": args.max_degree,
        "max_pack_size": pack_size,
        "load_factor": args.load_factor,
        "dtype_bytes": dtype_bytes,
        "checkpointing": args.checkpointing,
        "solver": args.solver,
        "allow_unschedulable": args.allow_unschedulable,
        "fill": True,  # the packs a sweep starts
        "rotate": rotates and not args.no_rotate,
    }
    description = (
        f"{len(configs)} configs of {path} on {args.gpus} × {args.gpu_name} ({args.gpu_memory_gib:g} GiB, "
        f"load factor {args.load_factor:g}), model {shape_name}, seq {seq_len} ({seq_source})"
    )
    return configs, kwargs, description, seq_source


def _row_tokens(sweep: SweepConfig, data_dir: str | None) -> tuple[int, str]:
    """The tokens per training row the sweep's packs are sized by, and where that number comes from.

    A sweep pads each step only to its longest row, so it sizes packs by its longest tokenized
    training example (at most ``seq_len``); this reads the same examples with the sweep model's
    tokenizer (a hub model's from the local cache only: planning downloads nothing). Where they
    cannot be read here (no tokenizer for a random-init model or in the cache, no data), ``seq_len``,
    saying why.
    """
    from plora_hpo.models import load_tokenizer
    from plora_hpo.replica import sweep_train_examples
    from plora_hpo.tasks import padded_length, resolve_task

    fallback = "seq_len, as {}; pass --seq-len N with the longest tokenized training example".format
    try:
        tokenizer = load_tokenizer(sweep.model, cached_only=True)
    except PloraError:
        return sweep.seq_len, fallback(f"the tokenizer of {sweep.model} could not be loaded here")
    if tokenizer is None:
        return sweep.seq_len, fallback("a random-init model has no tokenizer")
    try:
        examples = [
            example
            for task in sweep.tasks
            for example in sweep_train_examples(sweep, resolve_task(task, sweep.custom_tasks), tokenizer, data_dir)
        ]
    except PloraError as err:
        return sweep.seq_len, fallback(f"the training data could not be read ({first_line(err)})")
    return padded_length(sweep.seq_len, examples), f"the longest training example of {', '.join(sweep.tasks)}"


def _sweep_grid_configs(space: SearchSpace, seed: int, n_trials: int | None) -> list[AdapterConfig]:
    """The configs a grid sweep of ``n_trials`` trials trains (the whole grid without), in the
    order its trials take them: its sampler's seeded grid order."""
    from plora_hpo.grid import OrderedGridSampler

    points = OrderedGridSampler(space.grid(), seed=seed).points(n_trials)
    return [space.to_config(point, seed=space.config_seed(point)) for point in points]


def _steps(args: argparse.Namespace, configs: list[AdapterConfig], budget: Any, task: str | None, path: Path):
    if args.steps is not None:
        return args.steps
    if budget is None:
        raise ConfigError(f"{path}: a search-space file has no training budget; pass --steps N")
    if budget.steps is not None:
        return budget.steps
    examples = args.train_examples or budget.max_train_examples or TRAIN_EXAMPLES.get(task)
    if examples is None:
        raise ConfigError(f"{path}: task {task!r} has no known size for the epoch budget; pass --train-examples N")
    return steps_for_epochs(configs, epochs=budget.epochs, train_examples=examples)


def _id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    parts, start = [], None
    for i, cid in enumerate(ids):
        if start is None:
            start = cid
        if i + 1 == len(ids) or ids[i + 1] != cid + 1:
            parts.append(str(start) if start == cid else f"{start}-{cid}")
            start = None
    return ",".join(parts)


def _print_table(schedule: Schedule, description: str, gantt: Path | None) -> None:
    print(f"plan: {description}")
    print(f"{'pack':>4} {'deg':>3} {'gpus':<10} {'mem GiB':>7} {'step s':>7} {'start s':>8} {'end s':>8}  configs")
    for p in schedule.packs:
        gpus = _id_ranges(p.gpus)
        turns = f" ({p.width} first, the rest by turns)" if p.width < len(p.configs) else ""
        print(
            f"{p.pack_id:>4} {p.degree:>3} {gpus:<10} {p.memory_bytes / 2**30:>7.1f} {p.step_seconds:>7.3f} "
            f"{p.start:>8.0f} {p.end:>8.0f}  {len(p.configs)}{turns}: {_id_ranges(p.configs)}"
        )
    b = schedule.baselines
    print(f"predicted makespan: {schedule.makespan:.0f} s ({schedule.makespan / 3600:.2f} h)")
    turns = " (of packs without turns)" if any(p.width < len(p.configs) for p in schedule.packs) else ""
    print(f"lower bound{turns}: {b.lower_bound:.0f} s; approximation ratio {schedule.approximation_ratio:.3f}")
    for name, speedup in schedule.speedups().items():
        print(f"speedup over {name.replace('_', ' ')}: {speedup:.2f}x ({getattr(b, name):.0f} s)")
    if schedule.unschedulable:
        print(f"unschedulable (left out): configs {_id_ranges(schedule.unschedulable)}")
    note = f" ({schedule.solver_note})" if schedule.solver_note else ""
    print(f"solver: {schedule.solver}{note}; planning took {schedule.planning_seconds:.2f} s")
    if gantt is not None:
        print(f"gantt chart: {gantt}")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``plora-hpo plan``; raises PloraError (one line) on bad input, returns 0 on success."""
    configs, kwargs, description, seq_source = _plan_inputs(args)
    schedule = plan_packs(configs, **kwargs)
    gantt = None
    if not args.no_gantt:
        gantt = Path(args.gantt or f"plan-{Path(args.file).stem}.png")
        write_gantt(schedule, gantt, title=description, configs=configs)
    if args.json:
        payload = schedule.to_dict()
        payload["config_labels"] = [c.label() for c in configs]
        payload["seq_len"], payload["seq_len_source"] = kwargs["seq_len"], seq_source
        payload["gantt"] = None if gantt is None else str(gantt)
        json.dump(payload, sys.stdout, indent=2)
        print()
    else:
        _print_table(schedule, description, gantt)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m plora_hpo.planner.cli``): ``plora-hpo plan`` without importing
    the rest of the command line."""
    parser = argparse.ArgumentParser(prog="plora-hpo plan", description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_plan(args)
    except PloraError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
