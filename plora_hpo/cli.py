"""``plora-hpo``: run packed sweeps, plan packs, inspect results.

Every user-facing failure prints one ``error:`` line naming the problem and the fix, and exits 2.

The program (:func:`entry`) runs torch's CUDA caching allocator with :mod:`plora_hpo.allocator`'s
setting, made before the command loads torch; worker processes it starts inherit it. Importing
this module, or calling :func:`main` from a process of one's own, leaves the allocator alone.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from plora_hpo.allocator import use_default_allocator
from plora_hpo.errors import PloraError, disk_full
from plora_hpo.local_workers import AWAIT_ARGUMENTS, LocalWorkers, await_arguments, report_done
from plora_hpo.storage import GRACE_HEARTBEATS, HEARTBEAT_SECONDS
from plora_hpo.timeline import EXIT_PHASE, phase, record, watch_collections
from plora_hpo.trials import TrialInterrupted

if TYPE_CHECKING:
    from plora_hpo.config import SweepConfig
    from plora_hpo.replica import Replica

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
    p.add_argument(
        "--workers",
        choices=("processes", "threads"),
        help="one worker process per device, or one thread per device in this process "
        "(default: processes when there are several devices)",
    )
    _add_heartbeat(p)


def _add_heartbeat(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--heartbeat",
        type=float,
        default=HEARTBEAT_SECONDS,
        help=f"seconds between heartbeats of trials in training; a trial silent for {GRACE_HEARTBEATS} of "
        f"them is re-run by another worker (default {HEARTBEAT_SECONDS:g})",
    )


def _add_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="join a running sweep: train its trials on this machine's devices")
    p.add_argument("--storage", required=True, help="the sweep's Optuna storage URL, e.g. postgresql://…")
    p.add_argument("--study", required=True, help="the study to serve: <sweep name>-<task>")
    p.add_argument("--run-dir", type=Path, help="the sweep's shared run directory here (default: its recorded path)")
    p.add_argument("--device", help="as for sweep --device (default: every GPU, else cpu)")
    p.add_argument("--data-dir", help="offline task data here (default: the sweep's recorded path)")
    p.add_argument("--mlflow-uri", help="the sweep's MLflow tracking URI as reached from here (default: the sweep's)")
    p.add_argument("--sweep-file", type=Path, help="check that the study runs this sweep file before joining")
    _add_heartbeat(p)


def _add_results_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("results", help="print the best trials of a sweep's studies")
    p.add_argument("file", type=Path, help="the sweep YAML the studies came from")
    p.add_argument("--run-dir", type=Path, default=Path("plora_runs"))
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///<run-dir>/optuna.db)")
    p.add_argument("--top", default="5", help="rows per task: the N best trials (and the default), or 'all'")


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from plora_hpo.planner.cli import add_plan_arguments

    p = sub.add_parser("plan", help="pack a search space onto GPUs (DTM planner) and compare with baselines")
    add_plan_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plora-hpo", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show library logs and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep_parser(sub)
    _add_worker_parser(sub)
    _add_plan_parser(sub)
    _add_results_parser(sub)
    return parser


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """SIGTERM (what SLURM and Kubernetes send) or Ctrl-C: stop the sweep in an orderly way.

    Before there is anything to stop, the signal interrupts at once. Afterwards ``stop`` runs in
    a thread of its own (it waits for packs to checkpoint) and the training threads end with
    :class:`~plora_hpo.trials.TrialInterrupted`; a second signal interrupts at once.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.stop: Callable[[], None] | None = None

    def install(self) -> Preemption:
        """Handle the signals (from the main thread only; :func:`main` restores the earlier handlers)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signal is not None or self.stop is None:
            self.signal = signum
            raise KeyboardInterrupt
        self.signal = signum
        threading.Thread(target=self.stop, name="plora-preempted", daemon=True).start()

    def line(self, what: str) -> str:
        name = signal.Signals(self.signal or signal.SIGTERM).name
        return (
            f"stopped by {name}: {what}; in-flight adapters were checkpointed and their trials queued "
            "to resume (rerun the same command, or another worker takes them)"
        )


def run_sweep(args: argparse.Namespace) -> int:
    """Run the sweep file in its run directory (resuming what an earlier process left), then print
    the summary."""
    from plora_hpo.config import load_sweep

    preemption = Preemption().install()
    with phase("read-sweep-file"):
        config = load_sweep(args.file, {"model": args.model, "n_trials": args.n_trials, "pack.size": args.pack_size})
    processes = None if args.workers is None else args.workers == "processes"
    with phase("find-devices"):  # counting GPUs imports torch
        workers = start_workers_ahead(config, args.device, processes, args.data_dir)
    try:
        from plora_hpo.progress import RichPackProgress
        from plora_hpo.report import print_summary
        from plora_hpo.run import SweepRun

        progress = RichPackProgress()
        run = SweepRun(
            config,
            run_dir=args.run_dir,
            storage=args.storage,
            mlflow_uri=args.mlflow_uri,
            data_dir=args.data_dir,
            device=args.device,
            resume=args.resume,
            progress=progress,
            sweep_file=args.file,
            heartbeat=args.heartbeat,
            processes=processes,
            local_workers=workers,
        )
    except BaseException:
        if workers is not None:
            workers.stop()
        raise
    run.open()  # refusals (bad input, a live owner, a changed resume) print one line, no progress bars
    freeze_loaded()
    preemption.stop = run.interrupt
    with progress:
        try:
            assert run.tracker is not None
            where = (
                f"{len(run.devices)} worker processes ({', '.join(run.devices)})"
                if run.processes
                else f"{len(run.devices)} device(s)"
            )
            degree = config.pack.degree
            per_pack = "one pack per device" if degree == 1 else f"each pack split over {degree} devices"
            progress.note(f"packs chosen by the {config.pack.policy} policy on {where}; degree {degree}: {per_pack}")
            if run.closed_runs:
                progress.note(f"closed {len(run.closed_runs)} MLflow runs a killed process left RUNNING")
            for task, n in run.retries.items():
                if n:
                    progress.note(f"{task}: resuming {n} trials a killed run left in flight")
            started = time.perf_counter()
            studies = run.optimize()
        except BaseException as err:
            if preemption.signal is not None and isinstance(err, (TrialInterrupted, PloraError)):
                run.close(status="KILLED")
                print(preemption.line(f"sweep {config.name} stopped"), file=sys.stderr)
                return 128 + preemption.signal
            run.close(status="FAILED")
            raise
        run.close()
    print_summary(
        studies, wall_seconds=time.perf_counter() - started, storage=run.storage, tracking_uri=run.tracker.tracking_uri
    )
    line = pack_record_line(run.pack_segments, run.run_dir)
    if line is not None:
        print(line)
    note = run.tracker.delivery_note()
    if note is not None:
        print(note)
    return 0


def start_workers_ahead(
    config: SweepConfig, device: str | None, processes: bool | None, data_dir: str | None
) -> LocalWorkers | None:
    """The sweep's worker processes for its first task, started before this process imports the
    rest of what a sweep uses (for an explicit device list, torch too), so that they import and
    load while it does; None when it trains in threads here, or its devices are bad (its input
    checks say so, and stop processes started for devices that are not there)."""
    from plora_hpo.devices import in_processes, named_devices, resolve_devices

    devices = named_devices(device)
    if devices is None:  # counting the GPUs takes torch
        try:
            devices = [str(d) for d in resolve_devices(device)]
        except PloraError:
            return None
    if not in_processes(processes, len(devices), config.pack.degree):
        return None
    return LocalWorkers.for_task(config, config.tasks[0], devices, data_dir=data_dir)


def run_worker(args: argparse.Namespace, replica: Replica | None = None) -> int:
    """Serve a running sweep's study on this machine until its trials are done (with ``replica``:
    the base model and data a sweep's own worker process loaded while it waited)."""
    from plora_hpo.cluster import SweepWorker
    from plora_hpo.pack_group import GroupFailed
    from plora_hpo.progress import RichPackProgress

    preemption = Preemption().install()
    progress = RichPackProgress()
    worker = SweepWorker(
        args.storage,
        args.study,
        run_dir=args.run_dir,
        device=args.device,
        data_dir=args.data_dir,
        mlflow_uri=args.mlflow_uri,
        heartbeat=args.heartbeat,
        sweep_file=args.sweep_file,
        progress=progress,
        replica=replica,
    )
    try:
        worker.open()
        freeze_loaded()
        preemption.stop = worker.interrupt
        with progress:
            worker.serve()
    except GroupFailed as err:
        raise PloraError(
            f"worker {worker.label} left study {args.study}: {err}; its trials resume from their last "
            "checkpoints in another worker, or in a rerun of the sweep"
        ) from None
    except TrialInterrupted:
        if preemption.signal is None:
            raise
        print(preemption.line(f"worker {worker.label} left study {args.study}"), file=sys.stderr)
        return 128 + preemption.signal
    finally:
        worker.close()
    print(f"worker {worker.label}: study {args.study} has its trials; done", file=sys.stderr)
    return 0


def freeze_loaded() -> None:
    """Take what this process has loaded for the sweep (modules, base model, data, stores) out of
    the garbage collector's scans before its first pack, and let the collector run again.

    Those objects live as long as the process, and there are hundreds of thousands of them: a full
    collection would scan them all, every time, holding every thread meanwhile (a training step it
    lands in launches nothing). Objects made from now on are collected as before.

    One full collection comes first: the cycles start-up left unreachable while the collector was
    paused (or a caller's process left before the sweep began) would otherwise be frozen with the
    rest and never freed, and the device memory they hold would be gone from every pack."""
    with phase("freeze") as details:
        details["garbage"] = gc.collect()
        gc.freeze()
        gc.enable()
        details["objects"] = gc.get_freeze_count()


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
    from plora_hpo.run import default_storage
    from plora_hpo.study import study_name

    top = None if args.top == "all" else int(args.top) if args.top.isdigit() else 0
    if top is not None and top < 1:
        raise PloraError(f"--top must be a number of at least 1 or 'all', got {args.top}; pass --top 5 or --top all")
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
    print_summary(studies, storage=storage, top=top)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from plora_hpo.planner.cli import run_plan as plan

    if not 0 < args.load_factor <= 1:
        raise PloraError(f"--load-factor must be in (0, 1], got {args.load_factor:g}; pass a fraction such as 0.9")
    return plan(args)


class StoppedTrialsFilter(logging.Filter):
    """Drops Optuna's two warnings about each trial a stopping sweep interrupted or a full disk
    failed (a traceback and "failed with value None"): the CLI says why it stopped once, in one line."""

    def __init__(self) -> None:
        super().__init__()
        self._dropped: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and (isinstance(error, TrialInterrupted) or disk_full(error) is not None):
            self._dropped.add(message.split(" failed", 1)[0])  # "Trial 3"
            return False
        return message.split(" failed", 1)[0] not in self._dropped


def main(argv: list[str] | None = None) -> int:
    """The ``plora-hpo`` command line (``argv``: its arguments); returns the exit code.

    The garbage collector pauses until a sweep or worker has loaded what it keeps
    (:func:`freeze_loaded`): start-up makes objects that live as long as the process, few of them
    garbage, and full collections would scan them again and again meanwhile. A caller (a test, a
    notebook) gets its collector back as it was: its objects unfrozen, its callbacks its own."""
    collecting, frozen, callbacks = gc.isenabled(), gc.get_freeze_count(), list(gc.callbacks)
    gc.disable()
    try:
        return _command(argv)
    finally:
        gc.callbacks[:] = callbacks
        if not frozen:
            gc.unfreeze()
        if collecting:
            gc.enable()
        else:
            gc.disable()


def _command(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    replica = None
    if argv == ["worker", AWAIT_ARGUMENTS]:  # a sweep's own worker process, started before its study
        argv, replica = await_arguments()
    args = build_parser().parse_args(argv)
    watch_collections()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        for handler in logging.getLogger("optuna").handlers:
            if not any(isinstance(f, StoppedTrialsFilter) for f in handler.filters):
                handler.addFilter(StoppedTrialsFilter())
        # MLflow's SQL store logs each failed write with its traceback; the tracker reports what
        # did not arrive, and a full disk ends the sweep with one line
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    handlers = {"sweep": run_sweep, "worker": functools.partial(run_worker, replica=replica), "plan": run_plan,
                "results": run_results}  # fmt: skip
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if in_main_thread else {}
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
    except Exception as err:
        cause = disk_full(err)
        if args.verbose or cause is None:
            raise
        print(
            f"error: no space left on a device the sweep writes to ({cause}); free space or move --run-dir, "
            "then rerun the same command: it resumes from the last checkpoints",
            file=sys.stderr,
        )
        return 2
    finally:  # a caller of main() (a test, a notebook) gets its own signal handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def entry(argv: list[str] | None = None) -> NoReturn:
    """The ``plora-hpo`` command: :func:`main`, then exit without the interpreter's teardown.

    By the time :func:`main` returns, everything the command opened is closed (stores, MLflow
    runs, files; its own threads are daemons, idle). What Python's exit would still do is free
    the modules of torch, transformers, lm-eval and MLflow one object at a time: a second or
    more per process, which a sweep would wait for in each worker process and then in its own.
    A thread that is not a daemon (a caller's, say) gets the ordinary exit, which waits for it.
    A sweep's own worker process tells the sweep its code first (:func:`report_done`), so the
    sweep closes while this process exits.
    """
    use_default_allocator()  # before main loads torch, which reads it once
    code = main(argv)
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    now = time.time()  # on the timeline (when on): how this process exits, and which threads it waits for
    record(EXIT_PHASE, now, now, pid=os.getpid(), teardown=bool(others), waits_for=[t.name for t in others])
    if not others:
        logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    report_done(code)
    if others:
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    entry()
