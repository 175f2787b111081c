"""Data sources: a data directory of original files (argument or env), missing files, an offline Hub."""

from __future__ import annotations

import shutil

import pytest

from plora_hpo.errors import DataError
from plora_hpo.tasks import DATA_DIR_ENV, build_eval_tasks, load_train_examples


def test_missing_file_names_exact_path(tmp_path):
    (tmp_path / "mrpc").mkdir()
    (tmp_path / "mrpc" / "train.tsv").write_text("")
    with pytest.raises(DataError) as err:
        build_eval_tasks("mrpc", data_dir=tmp_path)
    message = str(err.value)
    assert str(tmp_path / "mrpc" / "dev.tsv") in message and "\n" not in message
    assert "mrpc/train.tsv, mrpc/dev.tsv" in message


def test_missing_task_folder(tmp_path):
    with pytest.raises(DataError, match=r"task 'gsm8k': missing data file .*gsm8k/train.jsonl"):
        load_train_examples("gsm8k", None, seq_len=64, data_dir=tmp_path)


def test_offline_hub_without_data_dir(offline_hub):
    with pytest.raises(DataError) as err:
        build_eval_tasks("cola")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("task 'cola': cannot load its data from the Hugging Face Hub")
    assert "--data-dir DIR" in message and DATA_DIR_ENV in message and "cola/train.tsv, cola/dev.tsv" in message


def test_data_dir_from_environment(data_dir, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(data_dir))
    task = build_eval_tasks("cola")["tasks"]["cola"]
    assert len(task.eval_docs) == 1043
    assert task.config.dataset_path == "json"


def test_conversion_is_cached_and_tracks_content(data_dir, tmp_path, private_cache):
    local = tmp_path / "data"
    shutil.copytree(data_dir / "cola", local / "cola")
    build_eval_tasks("cola", data_dir=local)
    build_eval_tasks("cola", data_dir=local)
    entries = lambda: sorted(p.name for p in (private_cache / "data" / "cola").iterdir())  # noqa: E731
    first = entries()
    with (local / "cola" / "dev.tsv").open("a") as handle:
        handle.write("\nw_80\t0\t*\tAn extra row appended by the test.")
    task = build_eval_tasks("cola", data_dir=local)["tasks"]["cola"]
    assert len(task.eval_docs) == 1044
    assert len(entries()) == len(first) + 1  # a changed file gets a new entry; the old one is not reused
    assert not [p for p in (private_cache / "data" / "cola").iterdir() if p.name.startswith(".")]
