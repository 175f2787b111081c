"""Runs an earlier sweep process left behind: closing the orphans, reopening those a rerun continues.

Boundary: finding and changing runs this process did not create, on the tracking server. Errors
(a run that is gone, a server that is away) are raised; the tracker decides what they mean for the
sweep.
"""

from __future__ import annotations

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient
from mlflow.utils import get_results_from_paginated_fn

from plora_hpo._mlflow_ids import LOCAL_ID_TAG, RunIds, find_by_local_id

CLOSED_REASON_TAG = "plora.closed_reason"


def close_orphans(client: MlflowClient, experiment_id: str, keep: set[str], reason: str) -> list[str]:
    """Set every RUNNING run of the experiment to KILLED, tagged with ``reason``, except those in ``keep``.

    ``keep`` holds run ids and placeholders (matched against :data:`LOCAL_ID_TAG`). Returns the closed ids.
    """
    running = get_results_from_paginated_fn(  # all pages first: closing runs while paging would skip some
        lambda max_results, token: client.search_runs(
            [experiment_id],
            filter_string="attributes.status = 'RUNNING'",
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=max_results,
            page_token=token,
        ),
        max_results_per_page=1000,
    )
    orphans = [
        r.info.run_id for r in running if r.info.run_id not in keep and r.data.tags.get(LOCAL_ID_TAG) not in keep
    ]
    for run_id in orphans:
        client.set_tag(run_id, CLOSED_REASON_TAG, reason)
        client.set_terminated(run_id, status="KILLED")
    return orphans


def reopen(client: MlflowClient, experiment_id: str, ids: RunIds, run_id: str) -> bool:
    """Set run ``run_id`` (an id or an earlier process's placeholder) RUNNING again.

    False if it is not an active run of ``experiment_id``, or a placeholder the server never got. A
    placeholder found on the server is bound in ``ids``.
    """
    if ids.server_id(run_id) is None:  # an earlier process's placeholder: on the server if it got there
        server_id = find_by_local_id(client, experiment_id, run_id)
        if server_id is None:
            return False
        ids.bind(run_id, server_id)
    run = client.get_run(ids.resolve(run_id))
    if run.info.experiment_id != experiment_id or run.info.lifecycle_stage != "active":
        return False
    client.update_run(run.info.run_id, status="RUNNING")
    return True
