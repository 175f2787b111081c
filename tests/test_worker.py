"""Device workers on the embedded SmolLM2: refill after pruning, out-of-memory splits, several devices."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from plora_hpo import PackedObjective, PackedSweep, SweepTracker, create_study, load_sweep, optimize_in_packs, planner
from plora_hpo import worker as worker_module
from plora_hpo.adapter import AdapterConfig
from plora_hpo.admission import PlannerAdmission
from plora_hpo.checkpoint_writer import CheckpointWriter
from plora_hpo.engine import PackedTrainer
from plora_hpo.study import serve

from .test_sweep_e2e import small_sweep

pytestmark = pytest.mark.slow


def open_sweep(tmp_path, name, device=None, **overrides):
    config = load_sweep(small_sweep(tmp_path, name=name, **overrides))
    tracker = SweepTracker(f"sqlite:///{tmp_path / f'{name}-mlflow.db'}", config.name)
    sweep = PackedSweep(config, tracker=tracker, run_dir=tmp_path / f"{name}-runs", device=device)
    tracker.start(config.name, {})
    study = create_study(config, "synthetic", f"sqlite:///{tmp_path / f'{name}-optuna.db'}")
    return sweep, study, tracker


def train_batch(tmp_path, name, **overrides):
    sweep, study, _ = open_sweep(tmp_path, name, budget={"steps": 5}, train={"checkpoint_every": 2}, **overrides)
    try:
        outcomes = optimize_in_packs(study, sweep, "synthetic", n_trials=4, pack_size=4)
    finally:
        sweep.close()
    return {o.request.config: (o.value, o.losses, o.failed) for o in outcomes}, sweep


def test_out_of_memory_splits_the_pack_and_loses_nothing(tmp_path, monkeypatch):
    """A split pack trains on as if nothing had happened; the failed step's memory is back first,
    even what only a reference cycle of its frames held (the collector is paused here, as it may not
    run before the split)."""
    reference, _ = train_batch(tmp_path, "whole")

    real_step, calls, failed_steps_tensor, freed_before_next_step = PackedTrainer.step, [], [], []

    def step(self):  # fault injection: the third step of the 4-adapter pack runs out of memory
        calls.append(len(self.jobs))
        if len(calls) == 3:
            activations: dict = {"tensor": torch.zeros(1 << 16)}
            activations["cycle"] = activations
            failed_steps_tensor.append(weakref.ref(activations["tensor"]))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if len(calls) == 4:
            freed_before_next_step.append(failed_steps_tensor[0]() is None)
        return real_step(self)

    monkeypatch.setattr(PackedTrainer, "step", step)
    gc.disable()
    try:
        split, sweep = train_batch(tmp_path, "split")
    finally:
        gc.enable()

    assert freed_before_next_step == [True]
    assert calls[:3] == [4, 4, 4] and max(calls[3:]) < 4  # re-planned into smaller packs
    assert sweep.workers[0].memory_correction > 1.0  # the corrected estimate keeps them apart
    # every trial finished as if nothing had happened (to rounding: CPU matmuls of a 2-adapter
    # batch may sum in another order than those of the 4-adapter batch)
    assert split.keys() == reference.keys()
    for config, (value, losses, failed) in split.items():
        assert not failed and value == reference[config][0]
        assert losses == pytest.approx(reference[config][1], rel=1e-5)


def test_pack_memory_knobs_reach_engine_and_admission(tmp_path, monkeypatch):
    """``pack.micro_batch_tokens`` / ``pack.activation_checkpointing`` change how a step is run
    and what the worker's cost model expects, never what the trials compute."""
    reference, plain = train_batch(tmp_path, "plain")
    real_step, seen = PackedTrainer.step, []

    def step(self):
        reports = real_step(self)
        seen.append((self.micro_batch_tokens, self.stats.micro_batches / self.stats.steps))
        return reports

    recorded = []
    monkeypatch.setattr(PackedTrainer, "step", step)
    monkeypatch.setattr(worker_module, "CALIBRATION_STEPS", 2)  # the 5-step pack becomes an observation
    fitted = planner.Calibration(launch=1.5)  # what the refit returns: the worker admits with it
    monkeypatch.setattr(planner, "record_observation", lambda *args, **kwargs: recorded.append(kwargs) or fitted)
    knobs = {"size": 4, "gather_seconds": 5, "micro_batch_tokens": 96, "activation_checkpointing": True}
    split, sweep = train_batch(tmp_path, "knobs", pack=knobs)

    assert seen and all(tokens == 96 and per_step > 1 for tokens, per_step in seen)
    # the calibration learns from the pack as it ran, not as a plain pack
    assert recorded and all(r["micro_batch_tokens"] == 96 and r["checkpointing"] for r in recorded)
    assert sweep.workers[0].cost.calibration is fitted
    configs = list(split)
    assert sweep.workers[0].cost.peak_memory(configs) < plain.workers[0].cost.peak_memory(configs)
    assert split.keys() == reference.keys()
    for config, (value, losses, failed) in split.items():
        assert not failed and value == reference[config][0]
        assert losses == pytest.approx(reference[config][1], rel=1e-5)


def test_the_cost_model_learns_a_pack_from_its_typical_step(tmp_path, monkeypatch):
    """A pack's first warm steps refit the cost model on their median, so one slow step (a compile,
    the allocator growing) does not stand for the pack; when the composition ends it is refitted on
    all of its steps, and that record replaces the first in the calibration store."""
    seconds = [0.5, 9.0, 1.0, 1.0, 3.0]  # the 4-adapter pack's five steps, as the trainer times them
    real_step, real_record, recorded = PackedTrainer.step, planner.record_observation, []

    def step(self):
        reports = real_step(self)
        self.stats.step_seconds[-1] = seconds[len(self.stats.step_seconds) - 1]
        return reports

    def record(*args, **kwargs):
        recorded.append((kwargs["step_seconds"], kwargs["steps_measured"], len(args[2])))
        return real_record(*args, **kwargs)

    monkeypatch.setenv("PLORA_HPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(PackedTrainer, "step", step)
    monkeypatch.setattr(planner, "record_observation", record)
    monkeypatch.setattr(worker_module, "CALIBRATION_STEPS", 3)
    _, sweep = train_batch(tmp_path, "typical")

    # after 3 warm steps: median(9, 1, 1) (their mean is 3.7); at the end: median(9, 1, 1, 3)
    assert recorded == [(1.0, 3, 4), (2.0, 4, 4)]
    [store] = (tmp_path / "cache" / "calibration").iterdir()
    [kept] = json.loads(store.read_text())["observations"]
    assert (kept["step_seconds"], kept["steps_measured"]) == (2.0, 4)
    assert sweep.workers[0].cost.calibration.observations == 1


class PruneTrialZero(optuna.pruners.BasePruner):
    """A real Optuna pruner with a fixed verdict, so the test knows which slot frees up."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number == 0


def test_pruned_adapter_leaves_and_its_slot_trains_the_next_trial(tmp_path):
    sweep, study, tracker = open_sweep(
        tmp_path,
        "prune",
        budget={"steps": 6},
        pack={"size": 2, "gather_seconds": 10},
        pruning={"pruner": "median", "interval": 2, "eval_limit": 4},
    )
    study.pruner = PruneTrialZero()
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=4, n_jobs=sweep.concurrency)
    finally:
        sweep.close()

    trials = study.trials
    assert [t.state for t in trials] == [TrialState.PRUNED] + [TrialState.COMPLETE] * 3
    assert trials[0].user_attrs["pruned_at_step"] == 2 and list(trials[0].intermediate_values) == [2]
    assert all(sorted(t.intermediate_values) == [2, 4] for t in trials[1:])  # the last step is the final score
    # one pack the whole time: trial 2 took trial 0's slot, trial 3 the next free one
    assert {t.user_attrs["pack_id"] for t in trials} == {"pack-0"}
    client = MlflowClient(tracker.tracking_uri)
    pruned = client.get_run(trials[0].user_attrs["mlflow_run_id"])
    assert pruned.info.status == "KILLED" and pruned.data.tags["plora.pruned_at_step"] == "2"
    assert [m.step for m in client.get_metric_history(pruned.info.run_id, "intermediate_acc")] == [2]


def test_the_pack_trains_on_while_its_finished_trials_are_recorded(tmp_path, monkeypatch):
    """Writing a finished adapter and its MLflow run happens beside the training loop: the trial
    that takes the freed slot trains while the first finished trial's run is still being logged."""
    sweep, study, tracker = open_sweep(
        tmp_path, "finishing", budget={"steps": 4}, pack={"size": 2, "gather_seconds": 10}
    )
    real_step, steps, trained_on = PackedTrainer.step, [], threading.Event()

    def step(self):
        reports = real_step(self)
        steps.append(sorted(self.jobs))
        if len(steps) > 4:  # the first two trials are done after 4 steps: this is the third's
            trained_on.set()
        return reports

    monkeypatch.setattr(PackedTrainer, "step", step)
    real_completed, waited = sweep.reporter.trial_completed, []

    def slow_completed(record, *args):
        if not waited:  # the first finished trial's record waits for the next trial to train
            waited.append(trained_on.wait(timeout=30))
        return real_completed(record, *args)

    monkeypatch.setattr(sweep.reporter, "trial_completed", slow_completed)
    real_delete, removed_at = CheckpointWriter.delete, []

    def delete(self, store, lineage):  # when each finished trial's checkpoint removal is asked for
        removed_at.append(len(steps))
        return real_delete(self, store, lineage)

    monkeypatch.setattr(CheckpointWriter, "delete", delete)
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=3, n_jobs=3)
    finally:
        sweep.close()

    assert waited == [True]  # training went on while that trial was being recorded
    assert len(steps) == 8 and len(steps[0]) == 2 and len(steps[-1]) == 1
    assert len(removed_at) == 3 and max(removed_at[:2]) < 8  # the first two went while the third trained
    trials = study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    client = MlflowClient(tracker.tracking_uri)
    for t in trials:
        assert (Path(t.user_attrs["adapter_dir"]) / "adapter_model.safetensors").is_file()
        assert client.get_run(t.user_attrs["mlflow_run_id"]).info.status == "FINISHED"


def _another_adapter_written(adapter_dir: Path, timeout: float = 30.0) -> bool:
    """Wait until another finished adapter's files are beside ``adapter_dir``; whether they came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(d != adapter_dir and (d / "adapter_config.json").is_file() for d in adapter_dir.parent.iterdir()):
            return True
        time.sleep(0.05)
    return False


def _record_two_finishing_together(sweep, study, monkeypatch, completed) -> None:
    """Train two trials that finish together, each one's MLflow record going through
    ``completed(real_trial_completed, *its_args)``; both end COMPLETE."""
    real = sweep.reporter.trial_completed
    monkeypatch.setattr(sweep.reporter, "trial_completed", lambda *args: completed(real, *args))
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=2, n_jobs=2)
    finally:
        sweep.close()
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


def test_a_finished_trial_s_files_are_written_while_the_one_before_is_reported(tmp_path, monkeypatch):
    """Two trials finish together: the second one's adapter files are written while the first one's
    MLflow run is still being reported (the report waits here for them; recorded one after the
    other on a single thread, it would wait in vain)."""
    sweep, study, tracker = open_sweep(tmp_path, "stages", budget={"steps": 3}, pack={"size": 2, "gather_seconds": 10})
    waited = []

    def slow_completed(real, record, pack_id, metrics, adapter_dir, stats):
        if not waited:
            waited.append(_another_adapter_written(adapter_dir))
        return real(record, pack_id, metrics, adapter_dir, stats)

    _record_two_finishing_together(sweep, study, monkeypatch, slow_completed)

    assert waited == [True]
    client = MlflowClient(tracker.tracking_uri)
    for t in study.trials:
        assert (Path(t.user_attrs["adapter_dir"]) / "adapter_model.safetensors").is_file()
        assert client.get_run(t.user_attrs["mlflow_run_id"]).info.status == "FINISHED"


def test_checkpoints_of_trials_that_finish_together_go_once_all_are_recorded(tmp_path, monkeypatch):
    """Two trials finish together: the first one's checkpoint stays on disk while the second one
    is still being recorded (removing it would hold up that record's store commits), and neither
    is left once the sweep is done."""
    sweep, study, _ = open_sweep(
        tmp_path, "removals", budget={"steps": 3}, pack={"size": 2, "gather_seconds": 10}, train={"checkpoint_every": 1}
    )
    checkpoints, seen = sweep.run_dir / "checkpoints", []

    def slow_completed(real, record, pack_id, metrics, adapter_dir, stats):
        if not seen:  # the second trial's files are written, so its record is queued behind this one
            assert _another_adapter_written(adapter_dir)
            time.sleep(0.3)
        else:
            time.sleep(1.0)  # time enough for a removal started when the first record ended
        seen.append(len(list(checkpoints.rglob("t*.pt"))))
        return real(record, pack_id, metrics, adapter_dir, stats)

    _record_two_finishing_together(sweep, study, monkeypatch, slow_completed)

    assert seen == [2, 2]  # both checkpoints still there during the second record
    assert not list(checkpoints.rglob("t*.pt"))  # and both gone after


def test_a_finished_trial_s_curve_reaches_mlflow_while_it_is_scored(tmp_path):
    """The curve's last steps go out as the scoring starts, beside it, not after it with the
    run's last report: the scorer waits here until MLflow holds every step of each trial it scores."""
    steps = 4
    pack = {"size": 2, "gather_seconds": 10}
    sweep, study, tracker = open_sweep(tmp_path, "curves", budget={"steps": steps}, pack=pack)
    client, seen = MlflowClient(tracker.tracking_uri), []
    for device_worker in sweep.workers:
        real_score = device_worker.score

        def score(packed, adapter_ids, task, limit, real_score=real_score):
            experiments = [e.experiment_id for e in client.search_experiments()]
            for adapter_id in adapter_ids:
                (run,) = client.search_runs(experiments, filter_string=f"attributes.run_name = '{adapter_id}'")
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    logged = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
                    if len(logged) == steps:
                        break
                    time.sleep(0.05)
                seen.append(logged)
            return real_score(packed, adapter_ids, task, limit)

        device_worker.score = score
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=2, n_jobs=2)
    finally:
        sweep.close()

    assert seen == [list(range(1, steps + 1))] * 2
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:  # and each step once
        history = client.get_metric_history(t.user_attrs["mlflow_run_id"], "train_loss")
        assert [m.step for m in history] == list(range(1, steps + 1))


def test_a_checkpoint_that_finds_the_writer_s_queue_full_waits_for_a_later_step(tmp_path, monkeypatch):
    """A slow disk holds the first save's write; the second adapter's save, due at the same step,
    does not fit in the writer's queue. The pack trains on, and that save copies the adapter at
    the step where room frees up (before, the loop stopped until the first write was on disk)."""
    from plora_hpo.checkpoints import CheckpointStore

    sweep, study, _ = open_sweep(tmp_path, "deferred", budget={"steps": 8}, train={"checkpoint_every": 2})
    for device_worker in sweep.workers:
        device_worker.writer.max_queued_bytes = 1  # one state at a time: the second waits for the first's write
    real_step, steps = PackedTrainer.step, []

    def step(self):
        reports = real_step(self)
        steps.append(dict(self.steps_done))
        return reports

    monkeypatch.setattr(PackedTrainer, "step", step)
    real_save, saves, held = CheckpointStore.save, [], []

    def slow_save(self, lineage, state, extra=None):
        if not saves:  # the disk is slow for the first write: the pack must train two more steps meanwhile
            deadline = time.monotonic() + 20
            while len(steps) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            held.append(len(steps))
        saves.append((lineage, state.steps_done))
        return real_save(self, lineage, state, extra)

    monkeypatch.setattr(CheckpointStore, "save", slow_save)
    try:
        outcomes = optimize_in_packs(study, sweep, "synthetic", n_trials=2, pack_size=2)
    finally:
        sweep.close()

    assert held == [4]  # the loop stepped on while the first checkpoint was being written
    assert [o.failed for o in outcomes] == [False, False]
    first, second = saves[0], saves[1]
    assert first[1] == 2 and second[0] != first[0]
    assert second[1] > 2  # the other adapter's step-2 save waited, and copied it as it was then
    assert len({lineage for lineage, _ in saves}) == 2  # both adapters were checkpointed


def test_a_finished_trial_whose_record_fails_gets_the_error_and_its_run_ends_failed(tmp_path, monkeypatch):
    sweep, study, tracker = open_sweep(
        tmp_path, "unrecorded", budget={"steps": 3}, pack={"size": 2, "gather_seconds": 10}
    )
    real_completed, calls = sweep.reporter.trial_completed, []

    def completed(record, *args):
        calls.append(record.run_id)
        if len(calls) == 1:
            raise RuntimeError("the tracking server rejected the run (injected)")
        return real_completed(record, *args)

    monkeypatch.setattr(sweep.reporter, "trial_completed", completed)
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=2, n_jobs=2, catch=(RuntimeError,))
    finally:
        sweep.close()

    by_run = {t.user_attrs.get("mlflow_run_id"): t for t in study.trials}
    assert by_run[calls[0]].state == TrialState.FAIL
    assert by_run[calls[1]].state == TrialState.COMPLETE  # it had left the pack: recorded as usual
    client = MlflowClient(tracker.tracking_uri)
    assert [client.get_run(r).info.status for r in calls] == ["FAILED", "FINISHED"]


def test_trials_proposed_once_finished_ones_are_told_join_the_pack_that_runs(tmp_path):
    """As many trials in flight as the pack holds: the next ones are asked for only when finished
    ones are told, beside the training loop. The pack waits for them rather than ending."""
    sweep, study, _ = open_sweep(tmp_path, "refill", budget={"steps": 3}, pack={"size": 2, "gather_seconds": 10})
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=4, n_jobs=sweep.concurrency)  # the grid
    finally:
        sweep.close()

    trials = study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert {t.user_attrs["pack_id"] for t in trials} == {"pack-0"}


def test_two_devices_train_packs_at_the_same_time(tmp_path):
    """``--device cpu,cpu``: two workers, each with its own model replica, one pack each."""
    sweep, study, tracker = open_sweep(
        tmp_path, "devices", device="cpu,cpu", budget={"steps": 4}, pack={"size": 2, "gather_seconds": 10}
    )
    assert sweep.concurrency == 4
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=4, n_jobs=sweep.concurrency)
    finally:
        sweep.close()

    trials = study.trials
    assert all(t.state == TrialState.COMPLETE for t in trials)
    packs = {t.user_attrs["pack_id"] for t in trials}
    assert packs == {"pack-0@cpu#0", "pack-1@cpu#1"} or packs == {"pack-0@cpu#1", "pack-1@cpu#0"}
    client = MlflowClient(tracker.tracking_uri)
    spans = {}
    for t in trials:
        run = client.get_run(t.user_attrs["mlflow_run_id"])
        start, end = spans.get(t.user_attrs["pack_id"], (run.info.start_time, run.info.end_time))
        spans[t.user_attrs["pack_id"]] = (min(start, run.info.start_time), max(end, run.info.end_time))
    (s0, e0), (s1, e1) = spans.values()
    assert s0 < e1 and s1 < e0  # the two packs trained concurrently


class RecordingPlanner(PlannerAdmission):
    """The real planner policy, keeping what it was asked: (members training, waiting, chosen)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, int]] = []

    def select(self, waiting, room):
        chosen = super().select(waiting, room)
        self.calls.append((len(room.members), len(waiting), len(chosen)))
        return chosen


def test_planner_replans_when_a_trial_is_pruned_fails_or_finishes(tmp_path, monkeypatch):
    """Pack size 2, five trials: trial 0 is pruned at step 2, trial 1 turns non-finite at its
    sixth step; each time the planner is asked again with the remaining member and refills the
    slot from the pool. The pack record lists every composition with predicted and measured time."""
    sweep, study, _ = open_sweep(
        tmp_path,
        "replan",
        budget={"steps": 8},
        pack={"size": 2, "gather_seconds": 10},
        pruning={"pruner": "median", "interval": 2, "eval_limit": 4},
    )
    study.pruner = PruneTrialZero()
    policy = RecordingPlanner()
    sweep.workers[0].admission = policy
    original_step = PackedTrainer.step

    def step(trainer):  # fault injection only: trial 1's lora_B turns NaN before its sixth step
        one = next((a for a in trainer.jobs if a.startswith("synthetic-t1-")), None)
        if one is not None and trainer.steps_done[one] == 5:
            with torch.no_grad():
                trainer.packed.parameters_of(one)[1].fill_(float("nan"))
        return original_step(trainer)

    monkeypatch.setattr(PackedTrainer, "step", step)
    try:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=5, n_jobs=sweep.concurrency)
    finally:
        sweep.close()

    states = {t.number: t.state for t in study.trials}
    assert states[0] == TrialState.PRUNED and states[1] == TrialState.FAIL
    assert sorted(states.values()).count(TrialState.COMPLETE) == 3
    assert {t.user_attrs.get("pack_id") for t in study.trials} == {"pack-0"}  # refilled, never restarted
    assert policy.calls[0][0] == 0  # the pack's first decision, from an empty pack
    refills = [c for c in policy.calls if c[0] == 1 and c[2] == 1]  # one member left, one slot refilled
    assert len(refills) >= 2  # after the prune and after the failure (and after a finish)
    record = json.loads((sweep.run_dir / "packs" / "packs.json").read_text())
    segments = record["segments"]
    assert {m.split("-")[1] for s in segments for m in s["members"]} == {f"t{n}" for n in range(5)}
    assert all(s["policy"] == "planner" and s["predicted_step_seconds"] > 0 for s in segments)
    # the room admission had: what the device offered, and every composition within it
    assert all(0 < s["predicted_peak_gib"] <= s["memory_limit_gib"] for s in segments)
    assert segments[0]["memory_limit_gib"] == pytest.approx(sweep.workers[0].memory_limit / 2**30)
    assert any(s["measured_step_seconds"] for s in segments)
    assert (sweep.run_dir / "packs" / "packs.png").stat().st_size > 0


def test_only_a_serial_optimize_is_warned_about_not_serve_s_last_trial(tmp_path):
    import warnings

    from plora_hpo.study import serve

    sweep, study, _ = open_sweep(tmp_path, "serial", budget={"steps": 2}, pack={"size": 2})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            serve(study, PackedObjective(sweep, "synthetic"), n_trials=1)  # n_jobs = min(2, one to do) = 1
        assert not [w for w in caught if "one trial at a time" in str(w.message)]
        with pytest.warns(UserWarning, match=r"n_jobs=sweep.concurrency \(2\)") as caught:
            study.optimize(PackedObjective(sweep, "synthetic"), n_trials=2, n_jobs=1)
        assert len([w for w in caught if "one trial at a time" in str(w.message)]) == 1  # once per objective
    finally:
        sweep.close()
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 3


def recording_step(held: list, losses: dict):
    """PackedTrainer.step that also records the labels each pack step held (in ``held``) and
    each adapter's (step, loss) records (in ``losses``, by label)."""
    real_step = PackedTrainer.step

    def step(self):
        labels = {a: self.jobs[a].config.label() for a in self.jobs}
        reports = real_step(self)
        held.append(sorted(labels.values()))
        for r in reports:
            losses.setdefault(labels[r.adapter_id], []).append((r.step, r.loss))
        return reports

    return step


def assert_trained_as_without_rotation(losses, plain_losses, values, plain_values, trials):
    """Every adapter trained each of its 12 steps once, in order, with the losses and final value
    of the run without rotation."""
    assert set(losses) == set(plain_losses) and len(losses) == trials
    for label, curve in losses.items():
        assert [s for s, _ in curve] == list(range(1, 13)), label
        assert [loss for _, loss in curve] == pytest.approx([loss for _, loss in plain_losses[label]], rel=1e-4)
    assert values == pytest.approx(plain_values, rel=1e-4)


def rotation_run(tmp_path, name, rotate, shrink_after=None):
    """Five trials asked at once where three fit (memory for three): the adapters each pack step
    held, each adapter's (step, loss) records, and each trial's value. ``shrink_after``: after that
    many pack steps the cost model puts three adapters 2% above the device's limit (as once it is
    refitted on a pack's measured peak)."""
    space = {
        "rank": {"choices": [8]},
        "alpha_multiplier": {"choices": [1]},
        "learning_rate": {"choices": [1e-5, 2e-5, 4e-5, 1e-4, 2e-4]},
        "batch_size": {"choices": [2]},
    }
    sweep, study, _ = open_sweep(
        tmp_path, name, budget={"steps": 12}, space=space, pack={"size": 5, "gather_seconds": 10, "rotate": rotate}
    )
    one = AdapterConfig(rank=8, alpha=8.0, learning_rate=1e-4, batch_size=2)
    held, losses = [], {}
    step = recording_step(held, losses)

    with pytest.MonkeyPatch.context() as patch:

        def room_for_three(self):
            shrunk = shrink_after is not None and len(held) >= shrink_after
            return (0.98 if shrunk else 1.001) * self.cost.peak_memory([one] * 3, self.degree)

        three = property(room_for_three)
        patch.setattr(worker_module.DeviceWorker, "memory_limit", three)  # a device with room for three
        patch.setattr(worker_module, "ROTATE_MIN_LEAD", 1)
        patch.setattr(worker_module, "ROTATION_TURNS", 4)  # a lead of 3 of the 12 steps
        patch.setattr(PackedTrainer, "step", step)
        try:
            serve(study, PackedObjective(sweep, "synthetic"), n_trials=5)
            assert not sweep.pool.last_round  # serve's rounds are over
        finally:
            sweep.close()
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5
    return held, losses, {t.params["learning_rate"]: t.value for t in study.trials}


def test_a_full_pack_rotates_the_last_trials_instead_of_training_them_alone_after_it(tmp_path):
    plain_held, plain_losses, plain_values = rotation_run(tmp_path, "plain", rotate=False)
    held, losses, values = rotation_run(tmp_path, "rotated", rotate=True)

    assert len(plain_held) == 24 and [len(h) for h in plain_held] == [3] * 12 + [2] * 12  # two left to the end
    assert len(held) < 24 and max(len(h) for h in held) == 3  # never more than fit
    assert sum(len(h) == 3 for h in held) > 12  # the pack stayed full longer
    assert_trained_as_without_rotation(losses, plain_losses, values, plain_values, trials=5)


def test_rotation_goes_on_when_the_running_pack_is_predicted_above_the_limit(tmp_path):
    """A pack the refitted cost model puts above the device's limit is still training: a member
    may give its place to a waiting trial that holds no more, rather than the waiting trials
    training on their own after the pack."""
    plain_held, _, plain_values = rotation_run(tmp_path, "plain", rotate=False, shrink_after=1)
    held, losses, values = rotation_run(tmp_path, "rotated", rotate=True, shrink_after=1)

    assert len(plain_held) == 24 and [len(h) for h in plain_held] == [3] * 12 + [2] * 12
    assert len(held) < 24 and max(len(h) for h in held) == 3
    assert sum(len(h) == 3 for h in held) > 12  # swaps went on after the limit fell under the pack
    assert all([s for s, _ in curve] == list(range(1, 13)) for curve in losses.values()) and len(losses) == 5
    assert values == pytest.approx(plain_values, rel=1e-4)


def mixed_rotation_run(tmp_path, name, rotate):
    """Three small trials and a large one asked at once, the large one last, on a device with
    room for the three small ones or for the large one beside one small one: the adapters each
    pack step held (labels), each adapter's (step, loss) records, each trial's value, and the
    cost model's prediction for the large one beside two small ones, against the room."""
    small = [AdapterConfig(rank=8, alpha=8.0, learning_rate=lr, batch_size=2) for lr in (1e-5, 2e-5, 4e-5)]
    large = AdapterConfig(rank=64, alpha=64.0, learning_rate=1e-4, batch_size=8)
    space = {
        "rank": {"choices": [8, 64]},
        "alpha_multiplier": {"choices": [1]},
        "learning_rate": {"choices": [1e-5, 2e-5, 4e-5, 1e-4]},
        "batch_size": {"choices": [2, 8]},
    }
    sweep, study, _ = open_sweep(
        tmp_path, name, budget={"steps": 12}, space=space, pack={"size": 4, "gather_seconds": 10, "rotate": rotate}
    )
    for c in [*small, large]:
        study.enqueue_trial(
            {"rank": c.rank, "alpha_multiplier": 1, "learning_rate": c.learning_rate, "batch_size": c.batch_size}
        )
    held, losses, sizes = [], {}, {}
    step = recording_step(held, losses)

    with pytest.MonkeyPatch.context() as patch:

        def room(self):
            sizes["room"] = 1.001 * max(self.cost.peak_memory(small), self.cost.peak_memory([large, small[0]]))
            sizes["large and two small"] = self.cost.peak_memory([large, *small[:2]])
            return sizes["room"]

        patch.setattr(worker_module.DeviceWorker, "memory_limit", property(room))
        patch.setattr(worker_module, "ROTATE_MIN_LEAD", 1)
        patch.setattr(worker_module, "ROTATION_TURNS", 4)  # a lead of 3 of the 12 steps
        patch.setattr(PackedTrainer, "step", step)
        try:
            serve(study, PackedObjective(sweep, "synthetic"), n_trials=4)
        finally:
            sweep.close()
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    values = {(t.params["rank"], t.params["learning_rate"]): t.value for t in study.trials}
    return held, losses, values, sizes, large.label()


def test_a_large_waiting_trial_takes_the_place_of_several_small_members(tmp_path):
    plain_held, plain_losses, plain_values, sizes, large = mixed_rotation_run(tmp_path, "plain", rotate=False)
    held, losses, values, _, _ = mixed_rotation_run(tmp_path, "rotated", rotate=True)

    assert sizes["large and two small"] > sizes["room"]  # it fits in place of no one small member
    assert not any(large in h and len(h) > 2 for h in held)  # never more than the room
    # the large trial came back in place of two small members that had steps left (they trained later)
    comebacks = [i for i in range(1, len(held)) if large in held[i] and large not in held[i - 1]]
    displaced = [(i, set(held[i - 1]) - set(held[i])) for i in comebacks]
    assert any(len(out) >= 2 and all(any(m in h for h in held[i:]) for m in out) for i, out in displaced)
    assert len(held) < len(plain_held)  # fewer pack steps than without rotation
    assert_trained_as_without_rotation(losses, plain_losses, values, plain_values, trials=4)


def serve_with_a_takeover(url, sweep, study, n_trials, *, pick=None, step_seconds=0.0):
    """Serve ``study`` while another process (a storage handle of its own on ``url``) fails one
    RUNNING trial as stale after the first pack step and queues its retry, as after a lapse of
    its heartbeats. ``pick`` chooses it among the RUNNING trials (default: the lowest number);
    each step lasts at least ``step_seconds``. Returns the failed trial's number and each step's
    adapters."""
    from plora_hpo.storage import open_storage, requeue

    other = optuna.load_study(study_name=study.study_name, storage=open_storage(url))
    failed: list[int] = []
    members: list[list[str]] = []
    real_step = PackedTrainer.step

    def step(self):
        members.append(list(self.jobs))
        started = time.monotonic()
        reports = real_step(self)
        if not failed:
            running = [t for t in other.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
            victim = (pick or (lambda ts: min(ts, key=lambda t: t.number)))(running)
            other._storage.set_trial_state_values(victim._trial_id, TrialState.FAIL)
            requeue(other, victim)
            failed.append(victim.number)
        time.sleep(max(0.0, step_seconds - (time.monotonic() - started)))
        return reports

    objective = PackedObjective(sweep, "synthetic")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PackedTrainer, "step", step)
        try:
            serve(study, objective, n_trials=n_trials)
        finally:
            sweep.close()
    assert objective.taken_over == failed
    return failed[0], members


def test_serve_goes_on_when_another_process_fails_a_trial_it_trains_as_stale(tmp_path):
    """Another process fails a trial as stale (as after a lapse of its heartbeats) while this one
    trains it, and queues its retry: Optuna refuses this process's result for it, and serve goes
    on and trains the retry instead of ending with "Cannot tell a FAIL trial"."""
    sweep, study, _ = open_sweep(tmp_path, "taken", budget={"steps": 3}, pack={"size": 2})
    failed, _ = serve_with_a_takeover(f"sqlite:///{tmp_path / 'taken-optuna.db'}", sweep, study, 2)
    states = {t.number: t.state for t in study.trials}
    [retry] = [t for t in study.trials if t.user_attrs.get("retry_of") == failed]
    assert states[failed] == TrialState.FAIL and retry.state == TrialState.COMPLETE
    assert len(states) == 3 and list(states.values()).count(TrialState.COMPLETE) == 2  # the other one, the retry
    assert retry.params == study.trials[failed].params


def test_a_trial_another_process_takes_over_leaves_its_pack_and_keeps_its_checkpoint(tmp_path):
    """Another process fails a trial as stale while this one trains it, and queues its retry: at
    its next look at the storage (as often as the heartbeat) this process lets the trial go at a
    step boundary instead of training it to the end beside its retry, and keeps its checkpoint,
    from which the retry resumes; the pack's other member trains on."""
    steps = 16
    sweep, _, _ = open_sweep(
        tmp_path, "withdrawn", budget={"steps": steps}, pack={"size": 2}, train={"checkpoint_every": 1}
    )
    url = f"sqlite:///{tmp_path / 'withdrawn-optuna.db'}"
    study = create_study(sweep.config, "synthetic", url, heartbeat=1)
    # steps long enough that the trial's look at the storage comes well before its end
    failed, members = serve_with_a_takeover(url, sweep, study, 2, step_seconds=0.25)
    [victim_id] = [a for a in members[0] if f"-t{failed}-" in a]
    trained = next((i for i, ids in enumerate(members) if victim_id not in ids), len(members))  # steps before it left
    assert 1 <= trained < steps
    [retry] = [t for t in study.trials if t.user_attrs.get("retry_of") == failed]
    assert retry.state == TrialState.COMPLETE and study.trials[failed].state == TrialState.FAIL
    assert 1 <= retry.user_attrs["resumed_from_step"] <= trained  # the checkpoint it left, not deleted
    [kept] = [t for t in study.trials if t.number not in (failed, retry.number)]
    assert kept.state == TrialState.COMPLETE
    assert sum(f"-t{kept.number}-" in a for ids in members for a in ids) == steps  # it trained on, every step


def test_a_retry_that_joins_beside_the_trial_it_retries_takes_its_place(tmp_path):
    """This process takes the retry of a trial it still trains (another process failed that one
    as stale, and this one has not looked yet): the retry takes its predecessor's place in the
    pack, from its checkpoint, instead of training beside it under the same adapter name."""
    space = {  # 16 examples: 8, 2 or 4 steps
        "rank": {"choices": [8]},
        "alpha_multiplier": {"choices": [1]},
        "learning_rate": {"choices": [4e-4]},
        "batch_size": {"choices": [2, 8, 4]},
    }
    sweep, study, _ = open_sweep(
        tmp_path,
        "retried",
        budget={"epochs": 1, "max_train_examples": 16},
        space=space,
        pack={"size": 2},
        train={"checkpoint_every": 1},
    )
    failed, _ = serve_with_a_takeover(  # the longest trial: the other one ends first
        f"sqlite:///{tmp_path / 'retried-optuna.db'}",
        sweep,
        study,
        3,
        pick=lambda running: min(running, key=lambda t: t.params["batch_size"]),
    )
    [retry] = [t for t in study.trials if t.user_attrs.get("retry_of") == failed]
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_from_step"] >= 2
    finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["batch_size"] for t in finished) == [2, 4, 8]
