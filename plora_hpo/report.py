"""The end-of-sweep table: best trials per task against the reference (default) trial."""

from __future__ import annotations

import optuna
from rich.console import Console
from rich.table import Table

from plora_hpo.study import REFERENCE_PARAMS


def _is_reference(trial: optuna.trial.FrozenTrial) -> bool:
    p = trial.params
    return all(abs(float(p.get(k, -1)) - float(v)) <= 1e-12 for k, v in REFERENCE_PARAMS.items())


def print_summary(
    studies: dict[str, optuna.Study],
    *,
    storage: str,
    wall_seconds: float | None = None,
    tracking_uri: str | None = None,
    top: int = 5,
    console: Console | None = None,
) -> None:
    console = console or Console()
    for study in studies.values():
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)
        retried = {t.user_attrs["retry_of"] for t in study.trials if "retry_of" in t.user_attrs}
        failed = sum(t.state == optuna.trial.TrialState.FAIL and t.number not in retried for t in study.trials)
        metric = (study.metric_names or ["value"])[0]
        extra = "".join(f", {n} {what}" for n, what in ((pruned, "pruned"), (failed, "failed")) if n)
        table = Table(title=f"{study.study_name}: {len(done)} complete trials{extra}, metric {metric}")
        for column in ("trial", "rank", "alpha", "lr", "batch", "value", "final loss", "pack"):
            table.add_column(column, justify="right")
        ranked = sorted(done, key=lambda t: t.value, reverse=True)
        reference = next((t for t in done if _is_reference(t)), None)
        rows = ranked[:top] + ([reference] if reference is not None and reference not in ranked[:top] else [])
        for t in rows:
            p = t.params
            loss = t.user_attrs.get("final_train_loss")
            table.add_row(
                f"{t.number}{' (default)' if t is reference else ''}",
                str(p.get("rank")),
                f"{p.get('alpha_multiplier', 0) * p.get('rank', 0):g}",
                f"{p.get('learning_rate', 0):.1e}",
                str(p.get("batch_size")),
                f"{t.value:.4f}",
                "-" if loss is None else f"{loss:.4f}",
                t.user_attrs.get("pack_id", "-"),
            )
        console.print(table)
        if ranked and reference is not None:
            console.print(
                f"best {ranked[0].value:.4f} vs default (r16, alpha16, lr2e-4, batch2) {reference.value:.4f}: "
                f"{ranked[0].value - reference.value:+.4f}"
            )
    if wall_seconds is not None:
        console.print(f"wall time {wall_seconds:.0f} s")
    console.print(f"Optuna storage: {storage}  (optuna-dashboard {storage})")
    if tracking_uri:
        console.print(f"MLflow: {tracking_uri}  (mlflow ui --backend-store-uri {tracking_uri})")
