"""GLUE TSV quirks: literal quotes, a UTF-8 BOM, a missing final newline; every row survives."""

from __future__ import annotations

import pytest

from plora_hpo.errors import DataError
from plora_hpo.tasks import cola, mrpc


def test_mrpc_rows_labels_and_quotes(data_dir):
    rows = mrpc.read_local({"train": data_dir / "mrpc/train.tsv", "validation": data_dir / "mrpc/dev.tsv"})
    assert (len(rows["train"]), len(rows["validation"])) == (3668, 408)
    assert sum(r["label"] for r in rows["train"]) == 2474
    assert sum(r["label"] for r in rows["validation"]) == 279
    first = rows["train"][0]
    assert first["sentence1"].startswith('Amrozi accused his brother , whom he called " the witness "')
    assert first["label"] == 1 and first["idx"] == 0
    assert set(first) == {"sentence1", "sentence2", "label", "idx"}
    assert [r["idx"] for r in rows["validation"]] == list(range(408))


def test_cola_rows_labels_and_last_line(data_dir):
    rows = cola.read_local({"train": data_dir / "cola/train.tsv", "validation": data_dir / "cola/dev.tsv"})
    assert (len(rows["train"]), len(rows["validation"])) == (8551, 1043)
    assert sum(r["label"] for r in rows["train"]) == 6023
    assert sum(r["label"] for r in rows["validation"]) == 721
    assert rows["validation"][-1]["sentence"] == "John talked to Bill about himself."  # no final newline
    assert any('"' in r["sentence"] for r in rows["train"])
    assert set(rows["train"][0]) == {"sentence", "label", "idx"}


def test_mrpc_wrong_header(tmp_path):
    bad = tmp_path / "train.tsv"
    bad.write_text("label\ta\tb\tc\td\n1\t1\t2\tx\ty\n")
    with pytest.raises(DataError, match=r"unexpected header"):
        mrpc.read_local({"train": bad})


def test_cola_wrong_column_count_names_line(tmp_path):
    bad = tmp_path / "train.tsv"
    bad.write_text('gj04\t1\t\tFine "quoted" sentence.\ngj04\t1\tonly three\n')
    with pytest.raises(DataError, match=r"train.tsv:2: expected 4 tab-separated fields, found 3"):
        cola.read_local({"train": bad})
