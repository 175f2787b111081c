"""The synthetic task: deterministic, held-out validation words, short prompts, scored by lm-eval."""

from __future__ import annotations

from plora_hpo.tasks import build_eval_tasks, load_train_examples, synthetic
from plora_hpo.tasks._cache import CACHE_ENV


def test_generation_is_deterministic_and_balanced():
    data = synthetic.generate()
    assert data == synthetic.generate()
    train, validation = data["train"], data["validation"]
    assert len(train) == synthetic.TRAIN_SIZE and sum(r["label"] for r in train) == synthetic.TRAIN_SIZE // 2
    assert len(validation) == len({r["word"] for r in validation}) == 72
    assert not {r["word"] for r in train} & {r["word"] for r in validation}  # held-out words
    for row in train + validation:
        group = synthetic.ANIMALS if row["label"] == 0 else synthetic.FOODS
        assert row["word"] in group


def test_groups_are_disjoint():
    assert not set(synthetic.ANIMALS) & set(synthetic.FOODS)
    assert len(set(synthetic.ANIMALS)) == len(synthetic.ANIMALS)


def test_files_are_identical_across_caches(tmp_path, monkeypatch):
    contents = []
    for name in ("a", "b"):
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / name))
        folder = synthetic.make_config().parent
        contents.append([(folder / f).read_bytes() for f in ("train.jsonl", "validation.jsonl")])
    assert contents[0] == contents[1]


def test_short_prompts_and_examples(tokenizer):
    examples = load_train_examples("synthetic", tokenizer, seq_len=64)
    assert len(examples) == synthetic.TRAIN_SIZE
    assert max(len(e.input_ids) for e in examples) <= 24
    assert {e.num_trained_tokens for e in examples} == {2}  # " A"/" B" and EOS
    subset = load_train_examples("synthetic", tokenizer, seq_len=64, max_examples=8, seed=5)
    assert subset == load_train_examples("synthetic", tokenizer, seq_len=64, max_examples=8, seed=5)


def test_lm_eval_task_ignores_data_dir(tmp_path):
    task = build_eval_tasks("synthetic", data_dir=tmp_path)["tasks"]["synthetic_groups"]
    assert len(task.eval_docs) == 72
    assert task.get_config("num_fewshot") == 0
    assert "synthetic" in task.config.metadata["description"]
    doc = task.eval_docs[0]
    assert task.doc_to_text(doc) == f"Word: {doc['word']}\nGroup A or B?\nAnswer:"
    assert task.doc_to_choice(doc) == ["A", "B"]
