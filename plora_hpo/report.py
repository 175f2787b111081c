"""The end-of-sweep table: the best trials per task against the reference (default) trial,
each score with its standard error, each classifier's answer balance, and whether the best
config's lead over the default is larger than the noise. "Best" follows the study's direction;
a multi-objective study shows its Pareto front, one column per objective."""

from __future__ import annotations

import math

import optuna
from rich.console import Console
from rich.table import Table

from plora_hpo.evaluation.uncertainty import COLLAPSED_SHARE, collapsed, share_keys, stderr_key
from plora_hpo.study import FINAL_LOSS_STEPS, REFERENCE_PARAMS

NOISE_MULTIPLE = 2.0
"""A lead counts as real when it exceeds this many combined standard errors."""


def is_reference(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether the trial trained the common default config (r 16, alpha 16, lr 2e-4, batch 2)."""
    p = trial.params
    return all(abs(float(p.get(k, -1)) - float(v)) <= 1e-12 for k, v in REFERENCE_PARAMS.items())


def objective_key(study: optuna.Study) -> str:
    """The lm-eval key of the study's objective (``"mcc,none"`` of ``"cola:mcc,none"``)."""
    metric = (study.metric_names or ["value"])[0]
    return metric.partition(":")[2] or metric


def ranked_trials(study: optuna.Study, done: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Completed trials, best first by the task's metric (the first objective) in its direction."""
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    return sorted(done, key=lambda t: t.values[0], reverse=maximize)


def objectives_line(study: optuna.Study) -> str:
    """``cola:mcc,none (maximize)``, or every objective with its direction for a multi-objective study."""
    names = study.metric_names or [f"value {i}" for i in range(len(study.directions))]
    return ", ".join(f"{name} ({d.name.lower()})" for name, d in zip(names, study.directions))


def trial_stderr(trial: optuna.trial.FrozenTrial, metric_key: str) -> float | None:
    """The standard error the trial recorded for its objective (None if it has none)."""
    value = (trial.user_attrs.get("metrics") or {}).get(stderr_key(metric_key))
    return None if value is None or not math.isfinite(value) else float(value)


def gap_line(best: optuna.trial.FrozenTrial, reference: optuna.trial.FrozenTrial, metric_key: str) -> str:
    """``best 0.08 ± 0.06 vs default 0.00 ± 0.00: +0.08, within the noise (...)``."""

    def scored(t: optuna.trial.FrozenTrial) -> str:
        se = trial_stderr(t, metric_key)
        return f"{t.value:.4f}" + ("" if se is None else f" ± {se:.4f}")

    gap = best.value - reference.value
    line = f"best {scored(best)} vs default (r16, alpha16, lr2e-4, batch2) {scored(reference)}: {gap:+.4f}"
    errors = [trial_stderr(best, metric_key), trial_stderr(reference, metric_key)]
    if best is reference:
        return line + " (the default is the best)"
    if any(e is None for e in errors):
        return line + " (no standard errors recorded: cannot tell it from the noise)"
    noise = NOISE_MULTIPLE * math.sqrt(sum(e * e for e in errors))
    verdict = "larger than" if abs(gap) > noise else "within"
    return line + f", {verdict} the noise ({NOISE_MULTIPLE:g} × combined standard error = {noise:.4f})"


def answer_balance(trial: optuna.trial.FrozenTrial) -> str:
    """``"no 30% / yes 70%"`` (``COLLAPSED`` appended for a one-answer classifier); ``-`` if none."""
    metrics = trial.user_attrs.get("metrics") or {}
    shares = share_keys(metrics)
    if not shares:
        return "-"
    text = " / ".join(f"{choice} {share:.0%}" for choice, share in shares.items())
    return text + (" COLLAPSED" if collapsed(metrics) else "")


def print_summary(
    studies: dict[str, optuna.Study],
    *,
    storage: str,
    wall_seconds: float | None = None,
    tracking_uri: str | None = None,
    top: int | None = 5,
    console: Console | None = None,
) -> None:
    """Print each study's table (``top`` best trials and the default; None: every trial); a
    multi-objective study's table is its Pareto front."""
    console = console or Console()
    for study in studies.values():
        if len(study.directions) > 1:
            _print_pareto_front(study, console)
            continue
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)
        retried = {t.user_attrs["retry_of"] for t in study.trials if "retry_of" in t.user_attrs}
        failed = sum(t.state == optuna.trial.TrialState.FAIL and t.number not in retried for t in study.trials)
        metric_key = objective_key(study)
        extra = "".join(f", {n} {what}" for n, what in ((pruned, "pruned"), (failed, "failed")) if n)
        documents = study.user_attrs.get("eval_documents")
        title = f"{study.study_name}: {len(done)} complete trials{extra}, metric {objectives_line(study)}"
        table = Table(title=title + (f" on {documents}" if documents else ""))
        columns = ("trial", "rank", "alpha", "lr", "batch", "value ± stderr", "answers", "loss (last steps)", "pack")
        for column in columns:
            table.add_column(column, justify="right")
        ranked = ranked_trials(study, done)
        reference = next((t for t in done if is_reference(t)), None)
        shown = ranked if top is None else ranked[:top]
        rows = shown + ([reference] if reference is not None and reference not in shown else [])
        flagged = 0
        for t in rows:
            p = t.params
            loss = t.user_attrs.get("final_train_loss")
            steps = t.user_attrs.get("final_train_loss_steps")
            se = trial_stderr(t, metric_key)
            flagged += collapsed(t.user_attrs.get("metrics") or {})
            table.add_row(
                f"{t.number}{' (default)' if t is reference else ''}",
                str(p.get("rank")),
                f"{p.get('alpha_multiplier', 0) * p.get('rank', 0):g}",
                f"{p.get('learning_rate', 0):.1e}",
                str(p.get("batch_size")),
                f"{t.value:.4f}" + ("" if se is None else f" ± {se:.4f}"),
                answer_balance(t),
                "-" if loss is None else f"{loss:.4f}" + (f" ({steps})" if steps else ""),
                t.user_attrs.get("pack_id", "-"),
            )
        console.print(table)
        console.print(
            f"loss: mean training loss over each trial's last {FINAL_LOSS_STEPS} steps (steps in brackets); "
            f"answers: share of each answer among the predictions"
            + (f"; COLLAPSED: one answer for {COLLAPSED_SHARE:.0%} or more of the documents" if flagged else "")
        )
        if ranked and reference is not None:
            console.print(gap_line(ranked[0], reference, metric_key))
    if wall_seconds is not None:
        console.print(f"wall time {wall_seconds:.0f} s")
    console.print(f"Optuna storage: {storage}  (optuna-dashboard {storage})")
    if tracking_uri:
        console.print(f"MLflow: {tracking_uri}  (mlflow ui --backend-store-uri {tracking_uri})")


def _print_pareto_front(study: optuna.Study, console: Console) -> None:
    """The trials no other trial beats on every objective, ordered by the first objective."""
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    pareto = {t.number for t in study.best_trials}
    front = [t for t in ranked_trials(study, done) if t.number in pareto]
    names = study.metric_names or [f"value {i}" for i in range(len(study.directions))]
    table = Table(
        title=f"{study.study_name}: Pareto front, {len(front)} of {len(done)} complete trials, "
        f"objectives {objectives_line(study)}"
    )
    for column in ("trial", "rank", "alpha", "lr", "batch", *names, "pack"):
        table.add_column(column, justify="right")
    for t in front:
        p = t.params
        table.add_row(
            str(t.number),
            str(p.get("rank")),
            f"{p.get('alpha_multiplier', 0) * p.get('rank', 0):g}",
            f"{p.get('learning_rate', 0):.1e}",
            str(p.get("batch_size")),
            *(f"{v:.4f}" if abs(v) < 1e4 else f"{v:,.0f}" for v in t.values),
            t.user_attrs.get("pack_id", "-"),
        )
    console.print(table)
