"""Preflight: check a sweep's command-line inputs before anything loads or is written.

The sweep file itself is validated by :mod:`plora_hpo.config`; this checks what the command line
adds (run directory, device, model, data directory, tracking and storage URLs) without leaving
anything behind, so that a bad value stops the run in about a second with one clear line instead
of after the model loads.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from plora_hpo.config import SweepConfig
from plora_hpo.timeline import phase

_MLFLOW_FIX = "start the server or pass --mlflow-uri with a reachable store"
_STORAGE_FIX = "pass --storage with a reachable database URL, or leave it out for sqlite:///<run-dir>/optuna.db"


def check_sweep_inputs(
    config: SweepConfig,
    *,
    run_dir: Path,
    data_dir: str | None = None,
    device: str | None = None,
    mlflow_uri: str | None = None,
    storage: str | None = None,
) -> None:
    """Check a sweep's command-line inputs before anything loads or is written; one-line errors.

    Run directory (it, or the folder it would be created in, must be writable), device, base model
    (a missing folder, an unknown hub id offline), data directory and task files, the sweep file's
    own tasks (each lm-eval task loaded and checked: :mod:`plora_hpo.tasks.custom`), the MLflow
    tracking URI and the Optuna storage URL. Leaves nothing behind: the run directory is not
    created, and stores inside ``run_dir`` (the defaults) do not exist yet and are not checked here.
    """
    check_run_dir_writable(run_dir)
    with phase("check-device"):
        _check_device(device)
    with phase("check-model"):
        _check_model(config.model)
        _check_degree(config, device)
    custom = [t for t in config.tasks if t in config.custom_tasks]
    if custom:
        from plora_hpo.tasks import resolve_task

        with phase("check-tasks"):
            for task in custom:
                resolve_task(task, config.custom_tasks)
    real_tasks = [t for t in config.tasks if t != "synthetic" and t not in config.custom_tasks]
    with phase("check-data"):
        _check_data(data_dir, real_tasks)
    with phase("check-stores"):
        if mlflow_uri is not None:
            _check_mlflow_uri(mlflow_uri, run_dir)
        if storage is not None:
            _check_storage(storage, run_dir)


def _check_data(data_dir: str | None, real_tasks: list[str]) -> None:
    """The data directory (the flag's, else the environment's) and each built-in task's files in it."""
    from plora_hpo.errors import DataError

    if data_dir is not None or real_tasks:
        from plora_hpo.tasks import get_task
        from plora_hpo.tasks._sources import DATA_DIR_ENV, check_local_files, resolve_data_dir

        directory = resolve_data_dir(data_dir)
        flag = "--data-dir" if data_dir is not None else f"${DATA_DIR_ENV}"
        if directory is not None:
            needs = ", ".join(get_task(t).expected_files() for t in real_tasks) or "gsm8k/, mrpc/ or cola/ files"
            if not directory.exists():
                raise DataError(f"{flag} {directory}: no such directory; pass a folder holding {needs}")
            if not directory.is_dir():
                raise DataError(f"{flag} {directory}: not a directory; pass a folder holding {needs}")
            for task in real_tasks:
                check_local_files(get_task(task), directory)


_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def check_run_dir_writable(run_dir: Path) -> None:
    """Fail with one line when the sweep could not create or write ``run_dir``.

    Checks the run directory if it exists, else the nearest folder above it that does (where it
    would be created). ``os.access`` alone is not enough: it says yes to root on a read-only
    mount, so a temporary file is also created there and deleted at once. A regular file in
    the way (the run directory itself, or one of its parents) is reported the same way, since
    no one can create folders inside it.
    """
    from plora_hpo.errors import PloraError

    def fail(reason: str) -> PloraError:
        return PloraError(f"--run-dir {run_dir} is not writable ({reason}); pass a writable --run-dir")

    folder = Path(os.path.abspath(run_dir.expanduser()))
    while not folder.exists() and folder != folder.parent:
        if folder.is_symlink():  # a dangling link: mkdir cannot create its target
            raise fail(f"{folder} is a broken symbolic link")
        folder = folder.parent
    if not folder.is_dir():
        raise fail(f"{folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise fail("read-only or permission denied")
    try:
        handle, probe = tempfile.mkstemp(prefix=".plora-write-check-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise fail(
            "read-only or permission denied" if err.errno in _READ_ONLY else err.strerror or type(err).__name__
        ) from None


def _check_device(device: str | None) -> None:
    from plora_hpo.devices import resolve_devices

    resolve_devices(device)


def _check_model(model: str) -> None:
    from plora_hpo.model_spec import EMBEDDED_NAME, RANDOM_PREFIX, resolve_config

    if model.lower() == EMBEDDED_NAME or model.startswith(RANDOM_PREFIX):
        return  # embedded / random shapes are checked when they load (no download, fast)
    resolve_config(model)  # a missing folder, or a hub id that cannot be found: one-line ModelError


def _check_degree(config: SweepConfig, device: str | None) -> None:
    """``pack.degree`` must divide the model's heads, and the devices must form whole groups of it."""
    degree = config.pack.degree
    if degree == 1:
        return  # before the imports: the engine (and Triton) are not the sweep process's to load
    from types import SimpleNamespace

    from plora_hpo.devices import resolve_devices
    from plora_hpo.engine.tensor_parallel import check_degree
    from plora_hpo.errors import ConfigError
    from plora_hpo.model_spec import EMBEDDED_NAME, RANDOM_PREFIX, resolve_config
    from plora_hpo.shapes import shape_by_name

    devices = resolve_devices(device)
    if len(devices) % degree:
        raise ConfigError(
            f"pack.degree {degree} trains each pack on {degree} devices, but --device gives {len(devices)} "
            f"({', '.join(map(str, devices))}); pass a multiple of {degree} devices (e.g. "
            f"{','.join(f'cuda:{i}' for i in range(degree))}) or lower pack.degree"
        )
    if config.model.lower() == EMBEDDED_NAME or config.model.startswith(RANDOM_PREFIX):
        shape = shape_by_name(config.model.lower())
        model_config: object = SimpleNamespace(
            num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate
        )
    else:
        model_config = resolve_config(config.model)[1]
    try:
        check_degree(model_config, degree)
    except ValueError as err:
        raise ConfigError(f"pack.degree {degree} does not fit model {config.model!r}: {err}") from None


def _missing_sqlite_folder(url: str, run_dir: Path) -> Path | None:
    """For ``sqlite:///path``: the folder that must exist and does not (None when it exists, or
    is the run dir or inside it, which the sweep creates)."""
    raw = url.split("///", 1)[1] if "///" in url else ""
    if not raw or raw == ":memory:":
        return None
    folder = Path(raw).expanduser().resolve().parent
    run = run_dir.expanduser().resolve()
    if folder == run or run in folder.parents:
        return None
    return None if folder.is_dir() else folder


def _check_sqlite(url: str, run_dir: Path, problem: str, fix: str) -> None:
    from plora_hpo.errors import PloraError

    missing = _missing_sqlite_folder(url, run_dir)
    if missing is not None:
        raise PloraError(f"{problem} {url!r} (no folder {missing}); {fix}")


def _check_mlflow_uri(uri: str, run_dir: Path) -> None:
    if uri.startswith("sqlite:"):
        _check_sqlite(uri, run_dir, "cannot reach the MLflow tracking store", _MLFLOW_FIX)
        return
    if uri.startswith(("file:", "/", ".")):
        return  # a local folder store is created on first use
    from plora_hpo.tracking import SweepTracker

    tracker = SweepTracker(uri, "check")
    try:
        tracker.check_reachable()  # HTTP: /health, else the store's own client; reads only
    finally:
        tracker.close()


def _check_storage(url: str, run_dir: Path) -> None:
    from plora_hpo.errors import PloraError, first_line

    if url.startswith("sqlite:"):
        _check_sqlite(url, run_dir, "cannot open the Optuna storage", _STORAGE_FIX)
        return
    try:
        import sqlalchemy

        engine = sqlalchemy.create_engine(url)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as err:  # ArgumentError, NoSuchModuleError, OperationalError, missing drivers...
        raise PloraError(
            f"cannot open the Optuna storage {url!r} ({type(err).__name__}: {first_line(err)}); {_STORAGE_FIX}"
        ) from None
