"""``plora-hpo``: run packed sweeps, plan packs, inspect results.

Every user-facing failure prints one ``error:`` line naming the problem and the fix, and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from plora_hpo.errors import PloraError

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a packed hyperparameter sweep from a sweep file")
    p.add_argument("file", type=Path, help="sweep YAML, e.g. search_spaces/demo.yaml")
    p.add_argument("--run-dir", type=Path, default=Path("plora_runs"), help="where studies, runs and adapters go")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///<run-dir>/optuna.db)")
    p.add_argument("--mlflow-uri", help="MLflow tracking URI (default: sqlite:///<run-dir>/mlflow.db)")
    p.add_argument(
        "--data-dir", help="offline task data (gsm8k/, mrpc/, cola/); default $PLORA_HPO_DATA_DIR or the Hub"
    )
    p.add_argument("--model", help="override the sweep file's base model")
    p.add_argument("--n-trials", type=int, help="trials per task (default: the file's n_trials or the grid size)")
    p.add_argument("--pack-size", type=int, help="most adapters per pack (default: the file's pack.size)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")


def _add_results_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("results", help="print the best trials of a sweep's studies")
    p.add_argument("file", type=Path, help="the sweep YAML the studies came from")
    p.add_argument("--run-dir", type=Path, default=Path("plora_runs"))
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///<run-dir>/optuna.db)")
    p.add_argument("--top", type=int, default=5, help="rows per task")


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from plora_hpo.planner.cli import add_plan_arguments

    p = sub.add_parser("plan", help="pack a search space onto GPUs (DTM planner) and compare with baselines")
    add_plan_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plora-hpo", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show library logs and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep_parser(sub)
    _add_plan_parser(sub)
    _add_results_parser(sub)
    return parser


def default_storage(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'optuna.db').resolve()}"


def run_sweep(args: argparse.Namespace) -> int:
    from plora_hpo.config import load_sweep
    from plora_hpo.progress import RichPackProgress
    from plora_hpo.report import print_summary
    from plora_hpo.study import PackedObjective, create_study, default_n_trials, finished_trials
    from plora_hpo.sweep import PackedSweep
    from plora_hpo.tracking import SweepTracker, default_tracking_uri

    config = load_sweep(args.file, {"model": args.model, "n_trials": args.n_trials})
    if args.pack_size is not None:
        config = config.model_copy(update={"pack": config.pack.model_copy(update={"size": args.pack_size})})
    n_trials = default_n_trials(config)
    run_dir: Path = args.run_dir
    storage = args.storage or default_storage(run_dir)
    tracker = SweepTracker(args.mlflow_uri or default_tracking_uri(run_dir), config.name, artifact_root=run_dir)

    progress = RichPackProgress()
    with progress:
        progress.note(f"loading {config.model} and data for {', '.join(config.tasks)}")
        sweep = PackedSweep(
            config, tracker=tracker, run_dir=run_dir, data_dir=args.data_dir, device=args.device, progress=progress
        )
        run_dir_existed = run_dir.exists()
        try:  # the first writes: the stores; undone if either cannot be opened
            run_dir.mkdir(parents=True, exist_ok=True)
            tracker.check_reachable()
            # this process owns the studies: trials left RUNNING by a killed run are retried
            studies = {task: create_study(config, task, storage, recover_stale=True) for task in config.tasks}
        except BaseException:
            if not run_dir_existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        tracker.start(
            config.name,
            {**config.model_dump(mode="json", exclude={"space"}), "space": config.space.model_dump()},
            {"plora.storage": storage},
        )
        started = time.perf_counter()
        try:
            for task, study in studies.items():
                done = finished_trials(study)
                remaining = max(0, n_trials - done)
                progress.add_trials(remaining)
                objective = PackedObjective(sweep, task)
                study.optimize(objective, n_trials=remaining, n_jobs=objective.pack_size, catch=())
        except BaseException:
            tracker.finish("FAILED")
            raise
        tracker.finish()
    print_summary(
        studies, wall_seconds=time.perf_counter() - started, storage=storage, tracking_uri=tracker.tracking_uri
    )
    return 0


def run_results(args: argparse.Namespace) -> int:
    import optuna

    from plora_hpo.config import load_sweep
    from plora_hpo.report import print_summary
    from plora_hpo.study import study_name

    config = load_sweep(args.file)
    if args.storage is None and not (args.run_dir / "optuna.db").is_file():
        raise PloraError(
            f"no studies in {args.run_dir} (no optuna.db); run `plora-hpo sweep {args.file}` first or pass --storage"
        )
    storage = args.storage or default_storage(args.run_dir)
    studies = {}
    for task in config.tasks:
        try:
            studies[task] = optuna.load_study(study_name=study_name(config, task), storage=storage)
        except Exception as err:  # KeyError for a missing study, SQLAlchemy errors for a bad URL
            raise PloraError(
                f"cannot load study {study_name(config, task)!r} from {storage} ({type(err).__name__}); "
                f"run `plora-hpo sweep {args.file}` first or pass the right --storage"
            ) from None
    print_summary(studies, storage=storage, top=args.top)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from plora_hpo.planner.cli import run_plan as plan

    return plan(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
    handlers = {"sweep": run_sweep, "plan": run_plan, "results": run_results}
    try:
        return handlers[args.command](args)
    except PloraError as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; rerun the same command to resume the sweep", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
