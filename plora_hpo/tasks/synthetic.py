"""Synthetic: is a word in group A (animals) or group B (foods)? A generated demo task.

It exists so the embedded default (SmolLM2-135M on a CPU) has a task a LoRA learns in a few
dozen steps while the untrained base model sits at chance. The labels " A"/" B" are arbitrary,
so the base model cannot know them; the split between animals and foods is something it
already represents, so an adapter can learn the mapping quickly and apply it to words it never
saw: validation words are held out from training. Measured through lm-eval on the 72
validation words (PEFT LoRA r=16, alpha=16, all seven projections, 30 AdamW steps, fp32 CPU):
base 0.53; lr 2e-4 / batch 8 → 0.90; lr 4e-4 / batch 8 → 0.90; lr 1e-4 / batch 8 → 0.67;
lr 2e-4 / batch 2 (the common default) → 0.72; lr 2e-5 / batch 8 → 0.53 (nothing learnt).
So a sweep shows real hyperparameter sensitivity. Prompts are ~10 tokens, so steps are fast.

Example item (the completion `` A`` is trained; lm-eval scores `` A`` against `` B``):

    Word: giraffe
    Group A or B?
    Answer: A

The data is generated deterministically (fixed seed) into the cache as JSON lines and scored
by lm-eval through a task config defined here (multiple choice, ``acc``).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import yaml

from plora_hpo.tasks._base import TaskSpec
from plora_hpo.tasks._cache import build_atomically, cache_root
from plora_hpo.tasks._sources import write_jsonl

LM_EVAL_TASK = "synthetic_groups"
VERSION = 1  # recorded in lm-eval's results metadata
DATA_SEED = 0
TRAIN_SIZE = 2000
HELD_OUT_FRACTION = 1 / 3  # of each group's words, used only for validation
CHOICES = ("A", "B")
DESCRIPTION = "synthetic demo task (generated, not real data): is a word an animal (A) or a food (B)"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Group A (label 0). No word here is also a common food, and vice versa.
ANIMALS = _words("""
aardvark alligator alpaca antelope ape armadillo baboon badger bat beaver bison boar buffalo
bull camel canary caribou cat cheetah chimpanzee chipmunk cobra cougar coyote crocodile crow
deer dingo dog dolphin donkey dove eagle elephant elk falcon ferret flamingo fox frog gazelle
gecko gerbil gibbon giraffe gopher gorilla hamster hare hawk hedgehog heron hippo horse hyena
iguana jackal jaguar kangaroo koala lemur leopard lion lizard llama lynx macaw meerkat mole
mongoose monkey moose mouse mule ocelot orangutan ostrich otter owl panda panther parrot
peacock pelican penguin pigeon platypus porcupine possum puma rabbit raccoon rat raven
reindeer rhino seal skunk sloth snake sparrow squirrel stork swan tiger toad tortoise walrus
weasel whale wolf wombat woodpecker zebra
""")

# Group B (label 1).
FOODS = _words("""
apple apricot avocado bagel banana biscuit bread brownie burrito butter cabbage cake candy
carrot cashew celery cereal cheese cherry chocolate coconut cookie cracker cream croissant
cucumber cupcake custard date donut dumpling eggplant fig flour garlic ginger grape granola
hummus jam jelly ketchup kiwi lasagna lemon lettuce lime mango margarine mayonnaise melon
muffin mushroom mustard noodle nutmeg oatmeal olive omelet onion orange pancake papaya pasta
peach peanut pear pepper pickle pie pineapple pizza plum popcorn potato pretzel pudding
pumpkin radish raisin ravioli rice salad sandwich sauce sausage spaghetti spinach strawberry
sugar sushi taco toast tofu tomato tortilla vinegar waffle walnut watermelon yogurt zucchini
""")


def split_words(seed: int = DATA_SEED) -> tuple[list[list[str]], list[list[str]]]:
    """Per group (A, B): (training words, held-out validation words), a seeded split."""
    train, held_out = [], []
    rng = random.Random(seed)
    for words in (ANIMALS, FOODS):
        shuffled = sorted(words)
        rng.shuffle(shuffled)
        cut = round(len(shuffled) * HELD_OUT_FRACTION)
        held_out.append(sorted(shuffled[:cut]))
        train.append(shuffled[cut:])
    return train, held_out


def generate(seed: int = DATA_SEED) -> dict[str, list[dict[str, Any]]]:
    """Rows ``{"word", "label", "idx"}``: train draws balanced labels; validation is each held-out word once."""
    train_words, held_out = split_words(seed)
    rng = random.Random(seed + 1)
    train = [{"word": rng.choice(train_words[i % 2]), "label": i % 2} for i in range(TRAIN_SIZE)]
    rng.shuffle(train)  # balanced labels in a random order
    validation = [{"word": w, "label": label} for label, words in enumerate(held_out) for w in words]
    rng.shuffle(validation)
    return {
        split: [{**row, "idx": idx} for idx, row in enumerate(rows)]
        for split, rows in (("train", train), ("validation", validation))
    }


def lm_eval_config(data_files: dict[str, str]) -> dict[str, Any]:
    """The lm-eval task definition: multiple choice between " A" and " B", accuracy, zero-shot."""
    return {
        "task": LM_EVAL_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": data_files},
        "output_type": "multiple_choice",
        "training_split": "train",
        "validation_split": "validation",
        "doc_to_text": "Word: {{word}}\nGroup A or B?\nAnswer:",
        "doc_to_target": "label",
        "doc_to_choice": list(CHOICES),
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "num_fewshot": 0,
        "metadata": {"version": float(VERSION), "synthetic": True, "description": DESCRIPTION},
    }


def make_config() -> Path:
    """Generate the data and the lm-eval YAML into the cache (once) and return the YAML's path.

    The cache folder is named by a hash of the rows and the config, so a changed generator or
    prompt never reuses files written by an older version.
    """
    rows = generate()
    fingerprint = json.dumps([rows, lm_eval_config({})], sort_keys=True).encode()
    target = cache_root() / "tasks" / "synthetic" / hashlib.sha256(fingerprint).hexdigest()[:16]

    def write(tmp: Path) -> None:
        data_files = {}
        for split, split_rows in rows.items():
            write_jsonl(tmp / f"{split}.jsonl", split_rows)
            data_files[split] = str(target / f"{split}.jsonl")  # the final location, after the rename
        (tmp / "task.yaml").write_text(yaml.safe_dump(lm_eval_config(data_files), sort_keys=False))

    return build_atomically(target, write) / "task.yaml"


TASK = TaskSpec(
    name="synthetic",
    lm_eval_task=LM_EVAL_TASK,
    description=DESCRIPTION,
    primary_metric="acc,none",
    metrics=("acc,none",),
    eval_split="validation",
    make_config=make_config,
)
