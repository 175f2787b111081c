"""Eager PEFT measured on one H200: the reference the cost model's PEFT prior is fitted and checked against.

One adapter trained with transformers + PEFT, LoRA r 16 on all seven projections, seq 512, bf16,
full logits: what users run without packing.
"""

PEFT_H200_REFERENCE: list[tuple[str, int, float, float]] = [  # (model, batch, tokens/s, peak GiB)
    ("qwen2.5-0.5b", 4, 15.6e3, 8.9),
    ("qwen2.5-0.5b", 32, 53.2e3, 63.5),
    ("qwen2.5-1.5b", 1, 3.2e3, 6.2),
    ("qwen2.5-1.5b", 4, 11.7e3, 15.1),
    ("qwen2.5-1.5b", 16, 25.5e3, 50.7),
    ("qwen2.5-7b", 4, 9.1e3, 36.0),
    ("qwen2.5-7b", 8, 9.6e3, 57.2),
]
