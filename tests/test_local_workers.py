"""A sweep's own worker processes: started before their study, loading ahead for it, ended when the
sweep stops first, reporting their exit code before they exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest
import torch
from transformers import AutoConfig

from plora_hpo import cli as cli_module
from plora_hpo import run as run_module
from plora_hpo.cli import main
from plora_hpo.config import SweepConfig, load_sweep
from plora_hpo.errors import PloraError
from plora_hpo.local_workers import AWAIT_ARGUMENTS, AWAIT_STUDY_PHASE, DONE_FD_ENV, LocalWorkers
from plora_hpo.replica import load_replica, replica_key
from plora_hpo.run import SweepRun
from plora_hpo.sweep import PackedSweep
from plora_hpo.timeline import ENV, EXIT_PHASE

from .test_sweep_e2e import small_sweep


def test_a_started_worker_exits_quietly_when_the_sweep_gives_it_no_study():
    done = subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", "worker", AWAIT_ARGUMENTS],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_stop_ends_workers_never_given_a_study_and_leaves_served_ones(tmp_path):
    waiting = LocalWorkers(["cpu", "cpu"])
    assert waiting.devices == ["cpu", "cpu"]
    waiting.stop()
    assert all(p.returncode is not None for p in waiting.processes)

    served = LocalWorkers(["cpu"])
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    [process] = served.serve(
        storage, "s", run_dir=tmp_path, data_dir=None, mlflow_uri=f"sqlite:///{tmp_path / 'm.db'}", heartbeat=10
    )
    served.stop()  # no longer the sweep's to end: it serves (here: it stops at the study that is not there)
    assert process.wait(timeout=300) == 2


def test_served_workers_report_their_exit_code_and_a_killed_one_its_signal(tmp_path):
    workers = LocalWorkers(["cpu", "cpu"])
    workers.processes[1].kill()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    workers.serve(
        storage, "s", run_dir=tmp_path, data_dir=None, mlflow_uri=f"sqlite:///{tmp_path / 'm.db'}", heartbeat=10
    )
    assert workers.wait_done() == [2, -9]  # 2: the study that is not there; -9: no report, its exit status
    workers.reap()
    assert [p.returncode for p in workers.processes] == [2, -9]


def test_a_worker_reports_its_exit_code_before_its_exit_waits_for_other_threads(tmp_path):
    """What lets the sweep close while its worker processes exit: the report comes once the worker
    is done, not once the process is gone (here a thread that is not a daemon keeps it). The
    timeline says which exit it takes and what it waits for."""
    read, write = os.pipe()
    code = (
        "import sys, threading, time\n"
        "from plora_hpo.cli import entry\n"
        "threading.Thread(target=time.sleep, args=(60,), name='callers-thread').start()\n"
        f"sys.argv = ['plora-hpo', 'worker', {AWAIT_ARGUMENTS!r}]\n"
        "entry()\n"
    )
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    argv = ["--storage", storage, "--study", "s", "--run-dir", str(tmp_path), "--device", "cpu"]
    timeline = tmp_path / "timeline.jsonl"
    env = {**os.environ, DONE_FD_ENV: str(write), ENV: str(timeline)}
    process = subprocess.Popen(
        [sys.executable, "-c", code], env=env, pass_fds=(write,), stdin=subprocess.PIPE, stderr=subprocess.PIPE
    )
    os.close(write)
    try:
        process.stdin.write((json.dumps(argv) + "\n").encode())
        process.stdin.close()
        with os.fdopen(read, "rb") as done:
            assert done.readline() == b"2\n"  # the study that is not there
        assert process.poll() is None  # still waiting for its thread
        [exit_record] = [e for e in map(json.loads, timeline.read_text().splitlines()) if e["phase"] == EXIT_PHASE]
        assert (exit_record["pid"], exit_record["teardown"]) == (process.pid, True)
        assert exit_record["waits_for"] == ["callers-thread"]
    finally:
        process.kill()
        process.wait()


def test_a_command_without_other_threads_exits_without_python_s_teardown(tmp_path):
    timeline = tmp_path / "timeline.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", "results", str(tmp_path / "no-such-sweep.yaml")],
        env={**os.environ, ENV: str(timeline)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "no such sweep file" in done.stderr
    [exit_record] = [e for e in map(json.loads, timeline.read_text().splitlines()) if e["phase"] == EXIT_PHASE]
    assert (exit_record["teardown"], exit_record["waits_for"]) == (False, [])


def recorded_workers(monkeypatch) -> list[LocalWorkers]:
    """Every :class:`LocalWorkers` the CLI and :class:`SweepRun` start from now on (the real class,
    remembered so the test can look at its processes)."""
    started: list[LocalWorkers] = []

    class Recorded(LocalWorkers):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(run_module, "LocalWorkers", Recorded)
    monkeypatch.setattr(cli_module, "LocalWorkers", Recorded)
    return started


def test_the_cli_starts_worker_processes_before_it_imports_what_a_sweep_uses(tmp_path):
    """They import and load while it does: for an explicit device list, by then it has read the
    settings only; and checking a model folder does not import the modeling code, the engine or
    Triton, which its workers load."""
    model = tmp_path / "model"
    AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(model)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from plora_hpo.cli import start_workers_ahead\n"
        "from plora_hpo.config import load_sweep\n"
        "config = load_sweep(sys.argv[1])\n"
        "workers = start_workers_ahead(config, 'cpu,cpu', True, None)\n"
        "heavy = ('torch', 'transformers', 'mlflow', 'lm_eval', 'plora_hpo.run', 'plora_hpo.sweep')\n"
        "print(len(workers.processes), [m for m in heavy if m in sys.modules])\n"
        "workers.stop()\n"
        "from plora_hpo.preflight import check_sweep_inputs\n"
        "check_sweep_inputs(config, run_dir=Path(sys.argv[2]), data_dir=None, device='cpu,cpu', mlflow_uri=None, "
        "storage=None)\n"
        "print([m for m in ('transformers.models.llama.modeling_llama', 'plora_hpo.engine', 'triton') "
        "if m in sys.modules])\n"
    )
    sweep_file = small_sweep(tmp_path, model=str(model))
    argv = [sys.executable, "-c", code, str(sweep_file), str(tmp_path / "runs")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "[]", "[]"]


def test_a_sweep_that_fails_its_checks_leaves_no_worker_process(tmp_path, monkeypatch):
    started = recorded_workers(monkeypatch)
    config = load_sweep(small_sweep(tmp_path, model=str(tmp_path / "no-such-model")))
    sweep = SweepRun(config, run_dir=tmp_path / "runs", device="cpu,cpu", processes=True)
    with pytest.raises(PloraError, match="no-such-model"):
        sweep.open()
    [workers] = started
    assert len(workers.processes) == 2 and all(p.poll() is not None for p in workers.processes)
    assert not (tmp_path / "runs").exists()


def test_a_worker_process_loads_its_model_and_data_once_ahead_of_its_study(tmp_path, monkeypatch):
    """The process the CLI started loads while the sweep opens its stores, and serves the study
    with that load."""
    started = recorded_workers(monkeypatch)
    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(timeline))  # inherited by the worker process
    run_dir = tmp_path / "runs"
    argv = ["sweep", str(small_sweep(tmp_path)), "--run-dir", str(run_dir), "--device", "cpu", "--workers", "processes"]
    assert main(argv) == 0
    assert len(started) == 1 and len(started[0].processes) == 1  # the sweep took over those the CLI started
    study = optuna.load_study(study_name="e2e-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    phases = {e["phase"]: e for e in events}
    assert [e["phase"] for e in events].count("load-model") == 1  # not again once given the study
    assert [e["phase"] for e in events].count("load-data") == 1
    assert phases["load-model"]["end"] <= phases["load-data"]["end"] <= phases[AWAIT_STUDY_PHASE]["start"]
    # the sweep process's start-up, in parts: what the input checks spend their time on is on the timeline
    checks = phases["check-inputs"]
    assert phases["read-sweep-file"]["end"] <= phases["find-devices"]["start"] <= checks["start"]
    parts = ["check-device", "check-model", "check-data", "check-stores", "check-resume"]
    assert all(checks["start"] <= phases[p]["start"] <= phases[p]["end"] <= checks["end"] for p in parts)
    assert [e["phase"] for e in events if e["phase"] in parts] == parts


def test_a_replica_serves_only_the_settings_it_was_loaded_for(tmp_path):
    """What a worker process loads ahead (its settings sent as JSON) matches the study's settings
    (read back from the study's attributes, narrowed to its task) key for key; other settings load anew."""
    config = load_sweep(small_sweep(tmp_path))
    sent = SweepConfig.model_validate(
        json.loads(json.dumps(config.model_copy(update={"tasks": ["synthetic"]}).model_dump(mode="json")))
    )
    from_study = SweepConfig.model_validate(json.loads(json.dumps(config.model_dump(mode="json"))))
    from_study = from_study.model_copy(update={"tasks": ["synthetic"]})
    cpu, data_dir = torch.device("cpu"), tmp_path / "data"
    assert replica_key(sent, cpu, str(data_dir)) == replica_key(from_study, cpu, str(data_dir))

    replica = load_replica(sent, cpu, str(data_dir))
    run_dir = tmp_path / "runs"
    with PackedSweep(
        from_study, tracker=None, run_dir=run_dir, data_dir=str(data_dir), device="cpu", replica=replica
    ) as sweep:
        assert sweep.base is replica.base and sweep.tasks is replica.tasks
    other_seed = from_study.model_copy(update={"seed": from_study.seed + 1})
    with PackedSweep(
        other_seed, tracker=None, run_dir=run_dir, data_dir=str(data_dir), device="cpu", replica=replica
    ) as sweep:
        assert sweep.base is not replica.base
    with PackedSweep(from_study, tracker=None, run_dir=run_dir, data_dir=None, device="cpu", replica=replica) as sweep:
        assert sweep.base is not replica.base  # another data directory
