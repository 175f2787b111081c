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
from typing import TYPE_CHECKING

from plora_hpo.errors import PloraError

if TYPE_CHECKING:
    from plora_hpo.config import SweepConfig
    from plora_hpo.run_state import RunState

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
    p.add_argument(
        "--device",
        help="cpu, cuda (every visible GPU, one pack each), cuda:N or a list such as cuda:0,cuda:1 "
        "(default: every GPU, else cpu)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep in --run-dir (an error if there is none); a plain rerun also resumes",
    )


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
    """Check the inputs, take the run directory, run the sweep in it."""
    from plora_hpo.checkpoints import CheckpointStore
    from plora_hpo.config import load_sweep
    from plora_hpo.ownership import RunDirOwner
    from plora_hpo.preflight import check_sweep_inputs
    from plora_hpo.run_state import check_resumable
    from plora_hpo.study import default_n_trials
    from plora_hpo.sweep import checkpoint_dir

    config = load_sweep(args.file, {"model": args.model, "n_trials": args.n_trials, "pack.size": args.pack_size})
    n_trials = default_n_trials(config)
    run_dir: Path = args.run_dir
    # bad device/model/data/URIs stop here: before the model loads and before anything is written
    check_sweep_inputs(
        config,
        run_dir=run_dir,
        data_dir=args.data_dir,
        device=args.device,
        mlflow_uri=args.mlflow_uri,
        storage=args.storage,
    )
    saved = check_resumable(run_dir, config, resume=args.resume)  # read-only checks of a rerun first
    for task in config.tasks:  # a corrupt checkpoint stops the rerun before anything starts
        CheckpointStore(checkpoint_dir(run_dir, config, task)).validate_all()
    run_dir_existed = run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = RunDirOwner(run_dir)  # a second sweep on a live run directory stops here
    try:
        owner.acquire()
    except BaseException:
        if not run_dir_existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        return _run_owned_sweep(args, config, n_trials, run_dir, run_dir_existed, saved)
    finally:
        owner.release()


def _run_owned_sweep(
    args: argparse.Namespace,
    config: SweepConfig,
    n_trials: int,
    run_dir: Path,
    run_dir_existed: bool,
    saved: RunState | None,
) -> int:
    """The sweep in a run directory this process owns: stores, recovery, trials, summary."""
    from optuna.trial import TrialState

    from plora_hpo.progress import RichPackProgress
    from plora_hpo.report import print_summary
    from plora_hpo.run_state import RunState
    from plora_hpo.study import PackedObjective, create_study, finished_trials, run_waiting_trials
    from plora_hpo.sweep import PackedSweep
    from plora_hpo.tracking import SweepTracker, default_tracking_uri

    storage = args.storage or default_storage(run_dir)
    tracker = SweepTracker(args.mlflow_uri or default_tracking_uri(run_dir), config.name, artifact_root=run_dir)

    progress = RichPackProgress()
    with progress:
        try:  # until the stores exist, a failure leaves no run directory behind that was not there
            progress.note(f"loading {config.model} and data for {', '.join(config.tasks)}")
            sweep = PackedSweep(
                config, tracker=tracker, run_dir=run_dir, data_dir=args.data_dir, device=args.device, progress=progress
            )
            progress.note(
                f"packs chosen by the {config.pack.policy} policy on {len(sweep.workers)} device(s)"
                + (" (degree 1: one pack per device)" if len(sweep.workers) > 1 else "")
            )
            tracker.check_reachable()
            # this process owns the run directory: trials left RUNNING by a killed run are retried
            studies = {task: create_study(config, task, storage, recover_stale=True) for task in config.tasks}
        except BaseException:
            if not run_dir_existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        state = saved or RunState.of(config)
        parent = {**config.model_dump(mode="json", exclude={"space"}), "space": config.space.model_dump()}
        if state.mlflow_parent_run_id is None or not tracker.resume(state.mlflow_parent_run_id):
            state.mlflow_parent_run_id = tracker.start(config.name, parent, {"plora.storage": storage})
        state.save(run_dir)
        resumed_runs = {
            t.user_attrs["mlflow_run_id"]
            for study in studies.values()
            for t in study.get_trials(deepcopy=False)
            if t.state == TrialState.WAITING and "mlflow_run_id" in t.user_attrs
        }
        closed = tracker.close_orphan_runs(keep=resumed_runs)
        if closed:
            progress.note(f"closed {len(closed)} MLflow runs a killed process left RUNNING")
        started = time.perf_counter()
        try:
            for task, study in studies.items():
                objective = PackedObjective(sweep, task)
                retries = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                progress.add_trials(max(0, n_trials - finished_trials(study)))
                if retries:
                    progress.note(f"{task}: resuming {len(retries)} trials a killed run left in flight")
                run_waiting_trials(study, objective)
                remaining = max(0, n_trials - finished_trials(study))
                study.optimize(objective, n_trials=remaining, n_jobs=sweep.concurrency, catch=())
        except BaseException:
            tracker.finish("FAILED")
            raise
        finally:
            sweep.close()
        tracker.finish()
    print_summary(
        studies, wall_seconds=time.perf_counter() - started, storage=storage, tracking_uri=tracker.tracking_uri
    )
    line = pack_record_line(sweep.pack_segments, run_dir)
    if line is not None:
        print(line)
    note = tracker.delivery_note()
    if note is not None:
        print(note)
    return 0


def pack_record_line(segments: list, run_dir: Path) -> str | None:
    """One line on the packs that ran: how many, who chose them, how good the step-time predictions were."""
    from plora_hpo.pack_record import summarise

    if not segments:
        return None
    s = summarise(segments)
    ratio = s["measured_over_predicted_step_median"]
    fit = f"; measured ÷ predicted step time, median {ratio:.2f}" if ratio is not None else ""
    return (
        f"packs: {s['packs']} packs in {s['segments']} compositions, chosen by {', '.join(s['policies'])} "
        f"({', '.join(s['solvers']) or 'no solver'}; slowest decision {s['plan_seconds_max']:.3f} s){fit}; "
        f"record and Gantt chart in {run_dir / 'packs'}"
    )


def run_results(args: argparse.Namespace) -> int:
    import optuna

    from plora_hpo.config import load_sweep
    from plora_hpo.report import print_summary
    from plora_hpo.study import study_name

    if args.top < 1:
        raise PloraError(f"--top must be at least 1, got {args.top}; pass --top 1 or more")
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

    if not 0 < args.load_factor <= 1:
        raise PloraError(f"--load-factor must be in (0, 1], got {args.load_factor:g}; pass a fraction such as 0.9")
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
