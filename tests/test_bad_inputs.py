"""Bad input catalogue: every malformed input to ``plora-hpo sweep|plan|results`` stops with exactly one
``error:`` line on stderr that names the problem and the fix, exit code 2, and nothing written (no run
directory, no Optuna study, no MLflow run, no chart, no new file anywhere under the working directory).

Cases that fail before the base model loads run in-process (fast); the ones that need the loaded
model and data (batch larger than the dataset, an unknown or model-less folder) are grouped in
``test_bad_sweep_input_after_loading`` and marked slow. Two run through a real subprocess.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from plora_hpo.cli import main

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "search_spaces" / "demo.yaml"


def _demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def _write(tmp: Path, data: dict | str, name: str = "sweep.yaml") -> Path:
    path = tmp / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _mutated(tmp: Path, mutate: Callable[[dict], object]) -> Path:
    data = _demo()
    mutate(data)
    return _write(tmp, data)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory (default outputs such as plora_runs/ or plan-*.png would land here)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PLORA_HPO_DATA_DIR", raising=False)
    return tmp_path


def _assert_one_error(rc: int, stderr: str, problem: str, fix: str, *, strict: bool = True) -> str:
    """Exit 2 and one ``error:`` line; ``strict``: nothing else on stderr (else progress lines may precede it)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, f"exit code {rc}; stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert [line for line in lines if "error:" in line] == lines[-1:], f"expected one error line last:\n{stderr}"
    if strict:
        assert len(lines) == 1, f"expected only the error line on stderr, got:\n{stderr}"
    line = lines[-1]
    assert line.startswith("error: "), line
    assert re.search(problem, line), f"problem {problem!r} not named in: {line}"
    assert re.search(fix, line), f"fix {fix!r} not named in: {line}"
    return line


def _run(workdir: Path, capsys, argv: list[str], problem: str, fix: str, *, strict: bool = True) -> str:
    before = _files(workdir)
    rc = main(argv)
    _, err = capsys.readouterr()
    line = _assert_one_error(rc, err, problem, fix, strict=strict)
    assert _files(workdir) == before, f"files written: {sorted(_files(workdir) - before)}"
    assert not (workdir / "run").exists() and not (workdir / "plora_runs").exists()
    return line


# Each case: (id, argv builder given the working directory, problem regex, fix regex).
# The builder writes its input files; the run directory is always ``<workdir>/run``.
def _sweep(path: Path, *extra: str) -> list[str]:
    return ["sweep", str(path), "--run-dir", "run", "--device", "cpu", *extra]


_LR_DOWN = {"low": 1, "high": 0.1}

FAST_SWEEP_CASES = [
    (
        "yaml-syntax-error",
        lambda d: _sweep(_write(d, "name: x\ntasks: [synthetic\nseed: 1\n")),
        r"sweep\.yaml:\d+:\d+: YAML syntax error",
        "fix the file there",
    ),
    (
        "yaml-tab-indentation",
        lambda d: _sweep(_write(d, DEMO.read_text().replace("  steps: 30", "\tsteps: 30"))),
        "YAML syntax error",
        "fix the file there",
    ),
    (
        "empty-file",
        lambda d: _sweep(_write(d, "")),
        "sweep.yaml: the file is empty",
        "search_spaces/demo.yaml",
    ),
    (
        "top-level-list",
        lambda d: _sweep(_write(d, "- name: x\n- tasks: [synthetic]\n")),
        "expected a mapping of sweep settings",
        "search_spaces/demo.yaml",
    ),
    (
        "wrong-type-seq-len",
        lambda d: _sweep(_mutated(d, lambda c: c.update(seq_len="long"))),
        "seq_len: .*integer",
        "fix seq_len in",
    ),
    (
        "wrong-type-tasks-not-a-list",
        lambda d: _sweep(_mutated(d, lambda c: c.update(tasks="synthetic"))),
        "tasks: .*list",
        "fix tasks in",
    ),
    (
        "wrong-type-space-param",
        lambda d: _sweep(_mutated(d, lambda c: c["space"].update(rank=16))),
        "space.rank: .*(mapping|dictionary|object)",
        "fix space.rank in",
    ),
    (
        "negative-learning-rate",
        lambda d: _sweep(_mutated(d, lambda c: c["space"]["learning_rate"].update(choices=[-2e-4, 2e-4]))),
        r"space.learning_rate: every choice must be > 0",
        "fix space.learning_rate in",
    ),
    (
        "pack-degree-not-a-power-of-two",
        lambda d: _sweep(_mutated(d, lambda c: c["pack"].update(degree=3)), "--device", "cpu,cpu,cpu"),
        r"pack.degree: must be a power of two",
        "fix pack.degree in",
    ),
    (
        "pack-degree-not-dividing-the-heads",
        lambda d: _sweep(_mutated(d, lambda c: c["pack"].update(degree=2)), "--device", "cpu,cpu"),
        r"pack.degree 2 does not fit model 'smollm2-135m': .* 9 attention heads, 3 key-value heads",
        "use a degree among 1$",
    ),
    (
        "pack-degree-above-the-devices",
        lambda d: _sweep(_mutated(d, lambda c: c.update(model="random:qwen2.5-1.5b", pack={"degree": 2}))),
        r"pack.degree 2 trains each pack on 2 devices, but --device gives 1 \(cpu\)",
        "pass a multiple of 2 devices .* or lower pack.degree",
    ),
    (
        "devices-not-a-multiple-of-the-degree",
        lambda d: _sweep(
            _mutated(d, lambda c: c.update(model="random:qwen2.5-1.5b", pack={"degree": 2})), "--device", "cpu,cpu,cpu"
        ),
        r"--device gives 3 \(cpu, cpu, cpu\)",
        "pass a multiple of 2 devices",
    ),
    (
        "pack-degree-in-threads",
        lambda d: _sweep(
            _mutated(d, lambda c: c.update(model="random:qwen2.5-1.5b", pack={"degree": 2})),
            *("--device", "cpu,cpu", "--workers", "threads"),
        ),
        r"pack.degree 2 trains each pack on a group of worker processes",
        "leave out --workers threads",
    ),
    (
        "rank-zero",
        lambda d: _sweep(_mutated(d, lambda c: c["space"]["rank"].update(choices=[0, 16]))),
        r"space.rank: every choice must be > 0",
        "fix space.rank in",
    ),
    (
        "fractional-rank",
        lambda d: _sweep(_mutated(d, lambda c: c["space"]["rank"].update(choices=[8.5]))),
        "rank values must be whole numbers",
        "fix space in",
    ),
    (
        "lr-low-above-high",
        lambda d: _sweep(_mutated(d, lambda c: c.update(sampler="tpe") or c["space"].update(learning_rate=_LR_DOWN))),
        r"low \(1.0\) is above high \(0.1\)",
        "fix space.learning_rate in",
    ),
    (
        "pack-size-zero-in-file",
        lambda d: _sweep(_mutated(d, lambda c: c["pack"].update(size=0))),
        "pack.size: .*greater than 0",
        "fix pack.size in",
    ),
    (
        "pack-size-zero-flag",
        lambda d: _sweep(DEMO, "--pack-size", "0"),
        "--pack-size: .*greater than 0",
        "pass a positive --pack-size",
    ),
    (
        "n-trials-negative-flag",
        lambda d: _sweep(DEMO, "--n-trials", "-3"),
        "--n-trials: .*greater than 0",
        "pass a positive --n-trials",
    ),
    (
        "warmup-ratio-out-of-range",
        lambda d: _sweep(_mutated(d, lambda c: c["train"].update(warmup_ratio=1.5))),
        "train.warmup_ratio: .*less than 1",
        "fix train.warmup_ratio in",
    ),
    (
        "unknown-top-level-key",
        lambda d: _sweep(_mutated(d, lambda c: c.update(colour="red"))),
        "unknown key 'colour'",
        r"remove it or check its spelling \(keys here: name, model, tasks",
    ),
    (
        "unknown-nested-key-typo",
        lambda d: _sweep(_mutated(d, lambda c: c["budget"].update(stpes=3))),
        "unknown key 'budget.stpes'",
        r"did you mean 'steps'\?",
    ),
    (
        "misspelled-space-key",
        lambda d: _sweep(_mutated(d, lambda c: c["space"].update(rnak=c["space"].pop("rank")))),
        r"sweep\.yaml: unknown key 'space\.rnak'",
        r"did you mean 'rank'\?$",
    ),
    (
        "misspelled-key-among-other-problems",
        lambda d: _sweep(
            _mutated(d, lambda c: c.update(seq_len="long") or c["pack"].update(size=0) or c["space"].update(rnak={}))
        ),
        r"unknown key 'space\.rnak'; did you mean 'rank'\?",
        r"\(\+2 more problems: seq_len, pack\.size\)$",
    ),
    (
        "duplicate-grid-value",
        lambda d: _sweep(_mutated(d, lambda c: c["space"]["rank"].update(choices=[16, 16, 64]))),
        "space.rank: choice 16 appears twice",
        "list each value once",
    ),
    (
        "duplicate-learning-rate-choice",
        lambda d: _sweep(_mutated(d, lambda c: c["space"]["learning_rate"].update(choices=[2e-4, 2e-5, 0.0002]))),
        r"space\.learning_rate: choice 0\.0002 appears twice",
        "list each value once",
    ),
    (
        "empty-space",
        lambda d: _sweep(_mutated(d, lambda c: c.update(space={}))),
        "space: the search space is empty",
        "rank, alpha_multiplier, learning_rate and batch_size",
    ),
    (
        "empty-choices",
        lambda d: _sweep(_mutated(d, lambda c: c["space"]["batch_size"].update(choices=[]))),
        "space.batch_size: 'choices' is empty",
        "fix space.batch_size in",
    ),
    (
        "unknown-task",
        lambda d: _sweep(_mutated(d, lambda c: c.update(tasks=["squad"]))),
        "unknown task 'squad'",
        "choose from synthetic, gsm8k, mrpc, cola",
    ),
    (
        "unknown-target-module",
        lambda d: _sweep(_mutated(d, lambda c: c.update(target_modules=["qkv"]))),
        "unknown target module 'qkv'",
        "choose from",
    ),
    (
        "unknown-sampler",
        lambda d: _sweep(_mutated(d, lambda c: c.update(sampler="bayes"))),
        "sampler: .*'grid', 'tpe', 'gp' or 'random'",
        "fix sampler in",
    ),
    (
        "steps-and-epochs",
        lambda d: _sweep(_mutated(d, lambda c: c.update(budget={"steps": 10, "epochs": 1}))),
        "exactly one of 'steps' or 'epochs'",
        "fix budget in",
    ),
    (
        "unknown-model-name",
        lambda d: _sweep(DEMO, "--model", "no-such-org/no-such-model"),
        "cannot load model 'no-such-org/no-such-model'",
        "pass a local path or use the embedded default 'smollm2-135m'",
    ),
    (
        "model-path-does-not-exist",
        lambda d: _sweep(DEMO, "--model", "./models/missing"),
        "cannot load model './models/missing': no such directory",
        "pass a model folder or a hub id",
    ),
    (
        "missing-sweep-file",
        lambda d: _sweep(d / "nope.yaml"),
        "nope.yaml: no such sweep file",
        "search_spaces/demo.yaml",
    ),
    (
        "directory-instead-of-file",
        lambda d: _sweep(d),
        "is a directory, not a sweep file",
        "search_spaces/demo.yaml",
    ),
    (
        "data-dir-does-not-exist",
        lambda d: _sweep(_mutated(d, lambda c: c.update(tasks=["gsm8k"])), "--data-dir", str(d / "no-data")),
        "--data-dir .*no-data: no such directory",
        "pass a folder holding",
    ),
    (
        "data-file-missing",
        lambda d: (
            (d / "data" / "gsm8k").mkdir(parents=True),
            (d / "data" / "gsm8k" / "test.jsonl").write_text("{}\n"),
            _sweep(_mutated(d, lambda c: c.update(tasks=["gsm8k"])), "--data-dir", str(d / "data")),
        )[-1],
        r"task 'gsm8k': missing data file .*train\.jsonl",
        "the data directory must hold",
    ),
    (
        "data-dir-is-a-file",
        lambda d: _sweep(_mutated(d, lambda c: c.update(tasks=["mrpc"])), "--data-dir", str(_write(d, "x", "f"))),
        "--data-dir .*: not a directory",
        "pass a folder holding",
    ),
    (
        "unreachable-mlflow-uri",
        lambda d: _sweep(DEMO, "--mlflow-uri", "http://127.0.0.1:9"),
        "cannot reach the MLflow tracking store 'http://127.0.0.1:9'",
        "start the server or pass --mlflow-uri",
    ),
    (
        "mlflow-uri-unknown-scheme",
        lambda d: _sweep(DEMO, "--mlflow-uri", "ftp://example.invalid/mlflow"),
        "cannot reach the MLflow tracking store 'ftp://example.invalid/mlflow'",
        "pass --mlflow-uri with a reachable store",
    ),
    (
        "storage-url-directory-missing",
        lambda d: _sweep(DEMO, "--storage", f"sqlite:///{d / 'missing' / 'optuna.db'}"),
        "cannot open the Optuna storage",
        "--storage",
    ),
    (
        "storage-url-unknown-dialect",
        lambda d: _sweep(DEMO, "--storage", "nosuchdb://localhost/optuna"),
        "cannot open the Optuna storage 'nosuchdb://localhost/optuna'",
        "--storage",
    ),
    (
        "run-dir-inside-a-file",
        lambda d: _sweep(DEMO, "--run-dir", str(_write(d, "not a folder", "taken") / "run")),
        r"--run-dir .*taken/run is not writable \(.*taken is a file, not a folder\)",
        "pass a writable --run-dir",
    ),
    (
        "run-dir-is-a-file",
        lambda d: _sweep(DEMO, "--run-dir", str(_write(d, "not a folder", "taken"))),
        r"--run-dir .*taken is not writable \(.*taken is a file, not a folder\)",
        "pass a writable --run-dir",
    ),
    (
        "device-unknown",
        lambda d: [*_sweep(DEMO)[:-1], "quantum"],
        "--device quantum: 'quantum' is not a device",
        "use cpu, cuda or cuda:N",
    ),
]


@pytest.mark.parametrize(
    ("argv", "problem", "fix"), [c[1:] for c in FAST_SWEEP_CASES], ids=[c[0] for c in FAST_SWEEP_CASES]
)
def test_bad_sweep_input(workdir, capsys, argv, problem, fix):
    _run(workdir, capsys, argv(workdir), problem, fix)


def _fail_in(folder: Path, real: Callable, fault: Callable[[], object]) -> Callable:
    """``real`` with ``fault()`` injected for paths inside ``folder`` only (everything else untouched)."""

    def wrapped(*args, **kwargs):
        target = kwargs.get("dir", args[0] if args else None)
        if isinstance(target, (str, os.PathLike)) and Path(os.path.abspath(target)).is_relative_to(folder):
            return fault()
        return real(*args, **kwargs)

    return wrapped


def _raise(err: OSError) -> Callable[[], object]:
    def fault() -> object:
        raise err

    return fault


def _read_only_by_access(folder: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "access", _fail_in(folder, os.access, lambda: False))


def _read_only_by_probe(folder: Path, monkeypatch) -> None:
    # what root meets on a read-only mount: os.access says yes, creating a file fails with EROFS
    fault = _raise(OSError(errno.EROFS, "Read-only file system"))
    monkeypatch.setattr(tempfile, "mkstemp", _fail_in(folder, tempfile.mkstemp, fault))


def _permission_denied_by_probe(folder: Path, monkeypatch) -> None:
    fault = _raise(PermissionError(errno.EACCES, "Permission denied"))
    monkeypatch.setattr(tempfile, "mkstemp", _fail_in(folder, tempfile.mkstemp, fault))


@pytest.mark.parametrize(
    ("existing", "inject"),
    [
        (True, _read_only_by_access),
        (True, _read_only_by_probe),
        (False, _read_only_by_probe),
        (False, _permission_denied_by_probe),
    ],
    ids=[
        "existing-dir-no-access",
        "existing-dir-read-only-mount",
        "parent-read-only-mount",
        "parent-permission-denied",
    ],
)
def test_read_only_run_dir(workdir, capsys, monkeypatch, existing, inject):
    """A run directory that exists but cannot be written, or a new one whose parent cannot be written."""
    folder = workdir / "ro"
    folder.mkdir()
    run_dir = folder if existing else folder / "run"
    inject(folder, monkeypatch)
    _run(
        workdir,
        capsys,
        _sweep(DEMO, "--run-dir", str(run_dir)),
        rf"--run-dir {re.escape(str(run_dir))} is not writable \(read-only or permission denied\)",
        "pass a writable --run-dir$",
    )
    assert list(folder.iterdir()) == []


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs")
def test_run_dir_on_a_filesystem_that_refuses_new_files(workdir, capsys):
    """No injected fault: sysfs refuses new files even to root, which os.access alone does not see."""
    _run(workdir, capsys, _sweep(DEMO, "--run-dir", "/sys/kernel/plora-run"), "is not writable", "--run-dir")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to a folder whatever its mode")
def test_run_dir_in_a_folder_without_write_permission(workdir, capsys):
    folder = workdir / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        _run(
            workdir,
            capsys,
            _sweep(DEMO, "--run-dir", str(folder / "run")),
            r"is not writable \(read-only or permission denied\)",
            "pass a writable --run-dir",
        )
    finally:
        folder.chmod(0o700)


def _plan(path: Path | str, *extra: str) -> list[str]:
    return ["plan", str(path), *extra]


PLAN_CASES = [
    (
        "plan-zero-gpus",
        lambda d: _plan(DEMO, "--gpus", "0", "--gpu-memory-gib", "80"),
        "need at least one GPU",
        "pass --gpus 1 or more",
    ),
    (
        "plan-negative-memory",
        lambda d: _plan(DEMO, "--gpus", "2", "--gpu-memory-gib", "-80"),
        "--gpu-memory-gib",
        "positive",
    ),
    (
        "plan-unknown-shape",
        lambda d: _plan(DEMO, "--model", "llama-9000b", "--gpus", "1", "--gpu-memory-gib", "80"),
        "llama-9000b",
        "(choose|one of|e\\.g\\.)",
    ),
    (
        "plan-missing-file",
        lambda d: _plan(d / "nope.yaml", "--gpus", "1", "--gpu-memory-gib", "80"),
        "nope.yaml: no such file",
        "search_spaces/paper120.yaml",
    ),
    (
        "plan-bad-load-factor",
        lambda d: _plan(DEMO, "--gpus", "1", "--gpu-memory-gib", "80", "--load-factor", "1.5"),
        "--load-factor",
        r"\(0, 1\]",
    ),
]


@pytest.mark.parametrize(("argv", "problem", "fix"), [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_input(workdir, capsys, argv, problem, fix):
    _run(workdir, capsys, argv(workdir), problem, fix)


RESULTS_CASES = [
    (
        "results-without-run-dir",
        lambda d: ["results", str(DEMO), "--run-dir", "run"],
        "no studies in run",
        "run `plora-hpo sweep",
    ),
    (
        "results-bad-storage-url",
        lambda d: ["results", str(DEMO), "--storage", "nosuchdb://localhost/optuna"],
        "cannot (load study|open the Optuna storage)",
        "--storage",
    ),
    (
        "results-missing-sweep-file",
        lambda d: ["results", str(d / "nope.yaml"), "--run-dir", "run"],
        "no such sweep file",
        "search_spaces/demo.yaml",
    ),
    (
        "results-top-zero",
        lambda d: ["results", str(DEMO), "--run-dir", "run", "--top", "0"],
        "--top",
        "at least 1",
    ),
]


@pytest.mark.parametrize(("argv", "problem", "fix"), [c[1:] for c in RESULTS_CASES], ids=[c[0] for c in RESULTS_CASES])
def test_bad_results_input(workdir, capsys, argv, problem, fix):
    _run(workdir, capsys, argv(workdir), problem, fix)


SLOW_CASES = [
    (
        "batch-larger-than-dataset",
        lambda d, data: _sweep(
            _mutated(
                d,
                lambda c: c.update(tasks=["mrpc"], budget={"steps": 2, "max_train_examples": 4}),
            ),
            "--data-dir",
            str(data),
        ),
        r"space.batch_size: 8 is larger than the 4 training examples of task 'mrpc'",
        "lower the batch size or raise budget.max_train_examples",
    ),
    (
        "model-folder-without-weights",
        lambda d, data: (
            (d / "model").mkdir(),
            (d / "model" / "config.json").write_text('{"model_type": "llama"}'),
            _sweep(DEMO, "--model", str(d / "model")),
        )[-1],
        "cannot (load|use) model",
        "(save_pretrained|pass a local path)",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "problem", "fix"), [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES])
def test_bad_sweep_input_after_loading(workdir, capsys, data_dir, argv, problem, fix):
    # these fail while the model or data loads: the progress display may already have written to stderr
    _run(workdir, capsys, argv(workdir, data_dir), problem, fix, strict=False)


@pytest.mark.slow
def test_a_failure_while_loading_leaves_an_existing_run_dir_as_it_was(workdir, capsys, data_dir):
    """The MLflow store opens beside the model's load; a load that fails takes it back."""
    (workdir / "run").mkdir()
    (workdir / "run" / "notes.txt").write_text("the user's")
    _, build, problem, fix = next(c for c in SLOW_CASES if c[0] == "model-folder-without-weights")
    argv = build(workdir, data_dir)
    before = _files(workdir)
    rc = main(argv)
    _, err = capsys.readouterr()
    _assert_one_error(rc, err, problem, fix, strict=False)
    written = _files(workdir) - before - {"run/.owner"}  # the run directory's lock file stays (ownership)
    assert not written, f"files written: {sorted(written)}"


@pytest.mark.parametrize(
    ("argv", "problem", "fix"),
    [
        (["sweep", "nope.yaml", "--run-dir", "run"], "nope.yaml: no such sweep file", "search_spaces/demo.yaml"),
        (["sweep", "bad.yaml", "--run-dir", "run"], r"bad\.yaml:\d+:\d+: YAML syntax error", "fix the file there"),
    ],
    ids=["missing-file", "yaml-syntax-error"],
)
def test_bad_input_through_the_console_script(workdir, argv, problem, fix):
    (workdir / "bad.yaml").write_text("name: x\ntasks: [synthetic\n")
    before = _files(workdir)
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    _assert_one_error(proc.returncode, proc.stderr, problem, fix)
    assert proc.stdout == ""
    assert _files(workdir) == before


def test_the_catalogue_has_at_least_twenty_cases():
    assert len(FAST_SWEEP_CASES) + len(PLAN_CASES) + len(RESULTS_CASES) + len(SLOW_CASES) + len(RESUME_CASES) + 2 >= 20


def _started_run(workdir: Path, **changed) -> Path:
    """A run directory as a killed sweep of demo.yaml left it (its sweep.json), with ``changed``
    settings recorded instead of the file's."""
    from plora_hpo.config import load_sweep
    from plora_hpo.run_state import RunState

    config = load_sweep(DEMO)
    (workdir / "run").mkdir()
    RunState.of(config.model_copy(update=changed)).save(workdir / "run")
    return workdir / "run"


def _corrupt_checkpoint(workdir: Path) -> None:
    ckpt = _started_run(workdir) / "checkpoints" / "demo-synthetic"
    ckpt.mkdir(parents=True)
    (ckpt / "t3.pt").write_bytes(b"PK\x03\x04 torn by a full disk")


RESUME_CASES = [
    ("resume-without-run", lambda d: None, "nothing to resume in run", "drop --resume"),
    (
        "resume-changed-seq-len",
        lambda d: _started_run(d, seq_len=32),
        "incompatible resume: seq_len was 32",
        "new --run-dir",
    ),
    (
        "resume-changed-model",
        lambda d: _started_run(d, model="random:qwen2.5-0.5b"),
        "incompatible resume: model",
        "original settings",
    ),
    ("resume-corrupt-checkpoint", _corrupt_checkpoint, r"checkpoint .*t3\.pt is unreadable", "delete it to retrain"),
    (
        "resume-unreadable-state",
        lambda d: (d / "run").mkdir() or (d / "run" / "sweep.json").write_text("{"),
        "sweep.json is unreadable",
        "new --run-dir",
    ),
]


@pytest.mark.parametrize(("setup", "problem", "fix"), [c[1:] for c in RESUME_CASES], ids=[c[0] for c in RESUME_CASES])
def test_bad_resume_input(workdir, capsys, setup, problem, fix):
    """A rerun that cannot continue its run directory changes nothing in it."""
    setup(workdir)
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    rc = main(_sweep(DEMO, "--resume"))
    _assert_one_error(rc, capsys.readouterr().err, problem, fix)
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before
