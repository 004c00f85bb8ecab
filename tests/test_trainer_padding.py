"""``PscompileTrainer`` on examples of different lengths, padded per batch (issue 60).

A collator pads each batch to its longest example (pad id 0, label -100, an attention mask), as
Hugging Face's padding collators do, so every step has its own length; evaluation ends on a partial
batch. The run tracks the plain Trainer's losses, gradient norms and evaluation loss under an
evicting budget, in both modes, and compiled mode's plan serves the lengths from one range.
"""

from __future__ import annotations

import logging

import pytest
import torch

import pscompile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from pscompile.integrations.transformers import PscompileTrainer
from test_trainer import Record, arguments, gpt2

STEPS, LONGEST = 5, 32


class Varied(torch.utils.data.Dataset):
    """Token sequences of 6 to 32 tokens."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, 256, (int(k),), generator=g) for k in torch.randint(6, LONGEST + 1, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i]}


def pad(examples: list[dict]) -> dict:
    """Pads to the batch's longest example, as ``DataCollatorForLanguageModeling(mlm=False)`` does
    with a right-padding tokenizer: labels -100 and attention mask 0 at the padding."""
    n = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), n, dtype=torch.long)
    mask = torch.zeros(len(examples), n, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, :len(e["input_ids"])] = e["input_ids"]
        mask[row, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(trainer_class, out, **kw):
    record = Record()
    args = arguments(out, save_strategy="no", max_steps=STEPS, gradient_accumulation_steps=2)
    trainer = trainer_class(model=gpt2(), args=args, train_dataset=Varied(24, 1), eval_dataset=Varied(5, 2),
                            data_collator=pad, callbacks=[record], **kw)
    if trainer_class is PscompileTrainer:
        record.engine = trainer.engine
    trainer.train()
    return trainer, record, trainer.evaluate()["eval_loss"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    _, record, eval_loss = run(transformers.Trainer, tmp_path_factory.mktemp("plain"))
    return record.logs, eval_loss


@pytest.mark.parametrize("mode,backend", [("compiled", "eager"), ("compiled", "inductor"), ("hooks", "eager")])
def test_padded_batches_track_the_plain_trainer(plain, mode, backend, tmp_path, caplog):
    """With Inductor the range's symbolic programs (accumulation and training) run the last steps:
    compiled share 1.0 (the evaluation's partial batch is a range of its own, measured by its run)."""
    logs, eval_loss = plain
    batch = pad([{"input_ids": torch.ones(LONGEST, dtype=torch.long)}] * 2)
    config = pscompile.Config(device="cpu", dtype=torch.float32, backend=backend, mode=mode)
    budget = int(1.15 * pscompile.min_device_memory(gpt2(), batch, config))
    with caplog.at_level(logging.INFO, logger="pscompile"):
        trainer, record, got_eval = run(PscompileTrainer, tmp_path, pscompile_config=pscompile.Config(
            device="cpu", dtype=torch.float32, backend=backend, mode=mode, device_memory=budget))
    assert len(record.logs) == len(logs) == STEPS
    for (step, loss, norm, _), (_, want, want_norm, _) in zip(record.logs, logs):
        assert loss == pytest.approx(want, rel=1e-5), (mode, step)
        assert norm == pytest.approx(want_norm, rel=1e-5), (mode, step)
    assert got_eval == pytest.approx(eval_loss, rel=1e-5)
    assert all(peak <= budget and evictions > 0 for peak, evictions in record.steps), (budget, record.steps)
    if mode == "compiled":
        messages = [r.getMessage() for r in caplog.records]
        assert any("one symbolic capture serves them" in m for m in messages), \
            [m for m in messages if "plan of their own" in m][:3]
    if backend == "inductor":
        assert record.shares[-2:] == [1.0, 1.0], record.shares
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    trainer.engine.close()
