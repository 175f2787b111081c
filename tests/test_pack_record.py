"""The pack record: worker processes' records, each on its own clock, gathered onto one."""

from __future__ import annotations

import json

from plora_hpo.pack_record import gather_pack_records, write_pack_record
from plora_hpo.reporting import PackSegment


def segment(pack_id: str, start: float, end: float | None) -> PackSegment:
    return PackSegment(
        pack_id=pack_id,
        device="cuda:0",
        policy="planner",
        solver="highs",
        plan_seconds=0.01,
        members=["t0", "t1"],
        labels=["r8-a8-lr1e-04-b2", "r16-a16-lr2e-04-b2"],
        joined=["t0", "t1"],
        start=start,
        end=end,
        steps=10,
        predicted_step_seconds=0.2,
        measured_step_seconds=0.25,
    )


def test_worker_records_of_this_run_are_put_on_its_clock(tmp_path):
    packs = tmp_path / "packs"
    write_pack_record([segment("pack-0@a", 1.0, 4.0)], packs / "a", started_at=1000.0)
    write_pack_record([segment("pack-0@b", 0.5, None), segment("pack-1@b", 2.0, 3.0)], packs / "b", started_at=1002.5)
    write_pack_record([segment("pack-0@old", 0.0, 9.0)], packs / "old", started_at=900.0)  # an earlier run's
    (packs / "cut").mkdir()
    (packs / "cut" / "packs.json").write_text('{"summary": {}, "started_at": 1001.0, "segm')  # killed mid-write

    gathered = gather_pack_records(packs, since=999.0)

    assert [(s.pack_id, s.device, s.start, s.end) for s in gathered] == [
        ("pack-0@a", "cuda:0@a", 2.0, 5.0),
        ("pack-0@b", "cuda:0@b", 4.0, None),
        ("pack-1@b", "cuda:0@b", 5.5, 6.5),
    ]
    folder = write_pack_record(gathered, packs, started_at=999.0, title="merged")
    record = json.loads((folder / "packs.json").read_text())
    assert record["started_at"] == 999.0 and record["summary"]["devices"] == ["cuda:0@a", "cuda:0@b"]
    assert record["summary"]["packs"] == 3 and (folder / "packs.png").stat().st_size > 0
