"""benchmarks/sweep_e2e.py's engine_only stage finds the sweep's biggest pack and its steps on the timeline;
its GPU sampler averages the samples inside given spans, and the GPU's idle seconds go to the worker
phase they fell in; the tail after the last step says when each thread ended; it writes the bytecode a package on
PYTHONPATH lacks before anything is timed; an earlier call's sweep stands in for this call's only when it ran the
same workload and sweep file; a sequential trial still running when the call's budget ends is stopped, and the
trials done before it are the measurement; a baseline config whose loss went non-finite is named; the baselines keep
this environment's CUDA allocator setting while the sweep gets the program's."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import sweep_e2e  # noqa: E402
from sweep_e2e import (  # noqa: E402
    GpuSampler,
    biggest_segment,
    has_bytecode,
    segment_step_starts,
    sweep_key,
    write_bytecode,
)

from plora_hpo.allocator import DEFAULT, VARIABLES  # noqa: E402


def segment(members: int, steps: int, device: str = "cuda:0") -> dict:
    return {"pack_id": "pack-0", "device": device, "members": members, "steps": steps}


def train(start: float, thread: str = "plora-cuda:0") -> dict:
    return {"phase": "train", "start": start, "end": start + 0.5, "thread": thread}


def test_the_biggest_pack_with_warm_steps_is_picked():
    segments = [segment(1, 0), segment(4, 2), segment(3, 10), segment(3, 12), segment(2, 40)]
    assert biggest_segment(segments) == 3  # 4 adapters ran too few steps to time; then the most steps
    assert biggest_segment([segment(4, 2)]) is None


def test_a_segment_gets_its_slice_of_its_workers_steps():
    segments = [segment(2, 2), segment(1, 5, device="cuda:1"), segment(3, 3)]
    events = [train(t) for t in (1, 2, 3, 4, 5)] + [train(t, "plora-cuda:1") for t in range(5)]
    events += [{"phase": "evaluate", "start": 2.6, "end": 2.9, "thread": "plora-cuda:0"}]
    assert segment_step_starts(segments, events[::-1], 2) == [3, 4, 5]  # in time order, other devices apart


def test_steps_that_do_not_add_up_give_no_starts():
    segments = [segment(2, 2), segment(3, 3)]
    events = [train(t) for t in (1, 2, 3, 4, 5, 6)]  # a step that ran out of memory: a phase, no step
    assert segment_step_starts(segments, events, 1) is None


def test_a_kernel_compiled_inside_a_step_is_named_with_its_step():
    from sweep_e2e import summarize_timeline

    events = [train(t) for t in (1, 2, 3)]
    events += [{"phase": "triton-compile", "start": 2.1, "end": 2.4, "thread": "plora-cuda:0", "kernel": "k"}]
    tl = summarize_timeline(events, start=0.0, end=4.0)
    assert tl["triton_compiles"] == [{"kernel": "k", "at_s": 2.1, "seconds": 0.3, "train_step": 1}]
    assert tl["seconds"]["triton-compile"] == 0.3 and tl["seconds"]["train"] == 1.2  # the step's own time


def test_slow_steps_say_what_slowed_them():
    from sweep_e2e import summarize_timeline

    spans = [(1.0, 1.5, 0, 900), (2.0, 3.9, 0, 1200), (4.0, 4.5, 0, 1500), (4.6, 5.8, 2, 1400), (6.0, 6.5, 0, 800)]
    events = [{**train(a), "end": b, "alloc_retries": r, "padded_tokens": n} for a, b, r, n in spans]
    events += [{"phase": "triton-compile", "start": 2.1, "end": 3.5, "thread": "plora-cuda:0", "kernel": "k"}]
    # a full collection set off by the checkpoint writer holds the worker's step too; one between steps does not
    events += [{"phase": "gc", "start": 5.0, "end": 5.6, "thread": "plora-cuda:0-checkpoints", "generation": 2}]
    events += [{"phase": "gc", "start": 5.85, "end": 5.9, "thread": "plora-cuda:0", "generation": 2}]
    events += [{"phase": "mlflow-live", "start": 3.5, "end": 4.2, "thread": "mlflow-live-curves"}]  # into step 2
    # two trials' heartbeats at once count once: 4.7-5.2 inside step 4
    beats = [(4.7, 5.0, "hb-1"), (4.8, 5.2, "hb-2")]
    events += [{"phase": "heartbeat", "start": a, "end": b, "thread": t} for a, b, t in beats]
    slow = summarize_timeline(events, start=0.0, end=7.0)["slow_steps"]
    assert slow == [  # over twice the 0.5 s median: a kernel compiled in one, the allocator retried in the other
        {"train_step": 1, "seconds": 1.9, "alloc_retries": 0, "padded_tokens": 1200, "most_tokens_yet": True,
         "compiled": ["k"], "gc_s": 0.0, "mlflow_live_s": 0.4, "heartbeat_s": 0.0},
        {"train_step": 3, "seconds": 1.2, "alloc_retries": 2, "padded_tokens": 1400, "most_tokens_yet": False,
         "compiled": [], "gc_s": 0.6, "mlflow_live_s": 0.0, "heartbeat_s": 0.5},
    ]  # fmt: skip


def test_the_tail_says_when_each_thread_ended_after_the_last_step():
    from sweep_e2e import summarize_timeline

    def event(phase, start, end, thread):
        return {"phase": phase, "start": start, "end": end, "thread": thread}

    events = [train(1.0), train(9.5)]  # the last step ends at 10
    events += [
        event("evaluate", 10.0, 12.0, "plora-cuda:0"),
        event("export", 12.0, 12.5, "plora-cuda:0"),
        event("checkpoint-write", 9.0, 11.0, "plora-cuda:0-checkpoints"),  # counts from the step's end
        event("checkpoint-write", 13.0, 16.5, "plora-cuda:0-checkpoints"),
        event("checkpoint-delete", 13.0, 14.0, "plora-cuda:0-checkpoint-deletes_0"),  # two side by side
        event("checkpoint-delete", 13.5, 15.0, "plora-cuda:0-checkpoint-deletes_1"),
        event("export", 12.5, 13.0, "plora-cuda:0-exports"),
        event("export", 13.0, 13.5, "plora-cuda:0-exports"),
        event("mlflow", 13.0, 16.0, "plora-cuda:0-finishing"),
        event("mlflow-live", 10.0, 11.5, "mlflow-live-curves"),
        event("heartbeat", 12.0, 12.1, "Thread-3 (_record_heartbeat)"),
        event("close", 16.5, 17.0, "MainThread"),
    ]
    timeline = summarize_timeline(events, start=0.0, end=18.0)
    tail = timeline["tail"]
    assert tail["after_last_step_s"] == 8.0
    assert tail["threads"] == {
        "worker": {"ends_s": 2.5, "phases_s": {"evaluate": 2.0, "export": 0.5}},
        "export thread": {"ends_s": 3.5, "phases_s": {"export": 1.0}},
        "finishing thread": {"ends_s": 6.0, "phases_s": {"mlflow": 3.0}},
        "checkpoint writer": {"ends_s": 6.5, "phases_s": {"checkpoint-write": 4.5}},
        "checkpoint deletes": {"ends_s": 5.0, "phases_s": {"checkpoint-delete": 2.5}},
        "live curves": {"ends_s": 1.5, "phases_s": {"mlflow-live": 1.5}},
        "main": {"ends_s": 7.0, "phases_s": {"close": 0.5}},
    }
    assert "checkpoint-delete" not in timeline["seconds"]  # the removal threads are not the worker's
    assert (timeline["background_checkpoint_delete_s"], timeline["background_checkpoint_deletes"]) == (2.5, 2)
    assert timeline["background_finishing"] == {"export": 1.0, "mlflow": 3.0}  # both recording threads'
    assert "mlflow" not in timeline["seconds"]  # neither is the worker's


def test_gpu_utilisation_inside_spans_counts_each_sample_once():
    sampler = GpuSampler()
    sampler.samples = [(t, u, 1.0) for t, u in [(0.5, 10), (1.2, 90), (1.8, 100), (2.5, 0), (3.1, 80), (9.0, 50)]]
    # two steps overlapping (two devices' threads) and one more; samples at 0.5, 2.5 and 9.0 fall outside
    spans = [(3.0, 3.5), (1.0, 1.5), (1.4, 2.0)]
    assert sampler.mean_util_during(spans) == (90 + 100 + 80) / 3 / 100
    assert sampler.mean_util_during([]) is None


def test_the_gpu_s_idle_seconds_go_to_the_worker_phase_they_fell_in():
    from sweep_e2e import summarize_timeline

    events = [train(1.0), train(2.0)]  # steps at 1.0-1.5 and 2.0-2.5; the loop between them
    events += [{"phase": "evaluate", "start": 3.0, "end": 4.0, "thread": "plora-cuda:0"}]
    events += [{"phase": "export", "start": 3.0, "end": 3.5, "thread": "plora-cuda:0-exports"}]  # beside it
    samples = [(0.0, 0, 0.0), (1.0, 100, 9.0), (1.25, 50, 9.0), (1.5, 0, 9.0), (3.0, 20, 9.0), (5.0, 0, 9.0)]
    idle = summarize_timeline(events, start=0.0, end=5.0, samples=samples)["gpu_idle_s_by_phase"]
    # start-up 0-1 s idle; the steps: 0.25 s at half busy, the second at 0% from the 1.5 s sample; the loop
    # 1.5-2 and 2.5-3 idle; evaluation at 20% busy; the export thread's export is no phase of the worker's
    assert idle == {"train": 0.62, "startup": 1.0, "loop": 1.0, "evaluate": 0.8, "shutdown": 0.8}
    assert list(idle) == sorted(idle, key=idle.get, reverse=True)
    assert summarize_timeline(events, 0.0, 5.0, samples[:1])["gpu_idle_s_by_phase"] == {}  # too few to say


def test_a_package_without_bytecode_on_pythonpath_gets_it(tmp_path, monkeypatch):
    package = tmp_path / "site" / "plora_probe_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr("sweep_e2e.BYTECODE_PROBES", ("plora_probe_pkg",))
    assert has_bytecode("plora_probe_pkg") is False and has_bytecode("no_such_package_here") is None

    written = write_bytecode()

    assert written["before"] == {"plora_probe_pkg": False} and written["after"] == {"plora_probe_pkg": True}
    assert str((tmp_path / "site").resolve()) in written["dirs"]


def test_an_earlier_sweep_matches_only_with_the_same_workload_and_sweep_file():
    def result(folder: str, steps: int) -> dict:
        sweep_file = f"name: e2e-mrpc\nmodel: /tmp/{folder}/model\nbudget:\n  steps: {steps}\n"
        return {"workload": f"mrpc, 32 paper120 configs x {steps} steps", "sweep_file": sweep_file}

    assert sweep_key(result("plora-e2e-a", 800)) == sweep_key(result("plora-e2e-b", 800))  # each call's own folder
    assert sweep_key(result("plora-e2e-a", 800)) != sweep_key(result("plora-e2e-a", 650))
    other_file = result("plora-e2e-a", 800) | {"workload": result("plora-e2e-a", 650)["workload"]}
    assert sweep_key(other_file) != sweep_key(result("plora-e2e-a", 800))


def test_a_sequential_trial_past_the_budget_is_stopped_and_the_trials_before_it_count(monkeypatch):
    def trial(params: dict, setup: dict) -> dict:  # the fault: the second config outlasts the budget
        time.sleep(0.2 if params["rank"] == 8 else 30)
        return {"params": params, "value": 0.5, "total_s": 0.2}

    monkeypatch.setattr(sweep_e2e, "peft_trial", trial)
    configs = [{"rank": r, "alpha_multiplier": 1, "learning_rate": 2.0e-4, "batch_size": 2} for r in (8, 16)]
    began = time.time()
    with GpuSampler() as sampler:
        out = sweep_e2e.run_sequential(configs, {}, sampler, deadline_s=1.5)
    assert time.time() - began < 10
    assert [r["params"]["rank"] for r in out["measured"]["trials"]] == [8]
    assert out["measured"]["configs"] == 1 and 0.2 <= out["measured"]["wall_s"] < 1.5
    assert out["errors"] and "--budget-s ran out" in out["errors"][0]


def test_a_baseline_config_whose_loss_went_non_finite_is_named(capsys):
    # the device's own output: one of four co-located PEFT trials ended with a NaN loss, its sweep twin did not
    result = json.loads((REPO / "benchmarks/results/sweep-e2e-mrpc-800s-colocated-h100.json").read_text())
    summary = sweep_e2e.summarize(result, 32)
    nan_config = {"rank": 8, "alpha_multiplier": 4.0, "learning_rate": 0.0004, "batch_size": 2}
    assert summary["colocated_nonfinite_loss"] == [{"params": nan_config, "sides": ["colocated"]}]
    assert len(result["colocated"]["per_trial"]) == 4
    result["summary"] = summary
    sweep_e2e.print_table(result)
    assert f"final loss not finite (colocated): {nan_config}" in capsys.readouterr().out


def test_the_baselines_keep_this_environments_allocator_while_the_sweep_gets_the_programs():
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    script = (
        "import json, os, sys; sys.path.insert(0, 'benchmarks'); import sweep_e2e; "
        "sweep_e2e.summarize_timeline([], 0.0, 1.0); record = sweep_e2e.allocator_record(); "
        f"print(json.dumps([record, {{k: os.environ.get(k) for k in {VARIABLES!r}}}]))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    record, after = json.loads(out.stdout)
    assert record == {"sweep": {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT}, "baselines": {}}
    assert after == dict.fromkeys(VARIABLES)  # nothing the benchmark ran set it for the baselines' processes
