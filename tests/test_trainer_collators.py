"""``PscompileTrainer`` with Hugging Face's own collators, as a fine-tuner's first run uses them.

They return a ``BatchEncoding`` (a ``Mapping``, not a ``dict``); pscompile reads any Mapping as a
keyword batch (``runtime/batching.as_batch``). Each collator below (``pad_to_multiple_of``
included) trains a tiny GPT-2 on examples of 4 to 62 characters from a character tokenizer built
here, in both modes, step for step with ``transformers.Trainer`` under a budget that evicts.
``trainer.min_device_memory(batch)`` counts what the Trainer adds to each batch (its float32
``num_items_in_batch``), so the figure it gives is a budget the Trainer accepts.
"""

from __future__ import annotations

import pytest
import torch

import pscompile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
tokenizers = pytest.importorskip("tokenizers")
from pscompile.integrations.transformers import PscompileTrainer
from test_trainer import Record, arguments

STEPS = 4
CHARS = "abcdefghijklmnopqrstuvwxyz .,"


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character (pad 0, unknown 1), built here: nothing is downloaded."""
    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


TOK = char_tokenizer()


def texts(n: int, seed: int, lengths=(4, 62)) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g)
    return ["".join(CHARS[int(i)] for i in torch.randint(0, len(CHARS), (int(k),), generator=g)) for k in sizes]


def model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(TOK), n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=3)
    return (transformers.GPT2ForSequenceClassification if kind == "classify" else transformers.GPT2LMHeadModel)(config)


def dataset(case: str, n: int, seed: int) -> list[dict]:
    """Tokenized examples as each collator expects them (lists of ids, unpadded)."""
    fixed = case == "default"                  # default_data_collator pads nothing: one length
    out = []
    for i, t in enumerate(texts(n, seed, (32, 32) if fixed else (4, 62))):
        ids = TOK(t)["input_ids"]
        item = {"input_ids": ids}
        if case in ("seq2seq", "default"):
            item["labels"] = list(ids)
        if case == "default":
            item = {k: torch.tensor(v) for k, v in item.items()}
        if case == "classify":
            item["labels"] = i % 3
        out.append(item)
    return out


def collator(case: str):
    return {"lm": transformers.DataCollatorForLanguageModeling(TOK, mlm=False),
            "lm-multiple-of-8": transformers.DataCollatorForLanguageModeling(TOK, mlm=False, pad_to_multiple_of=8),
            "seq2seq": transformers.DataCollatorForSeq2Seq(TOK, padding=True),
            "classify": transformers.DataCollatorWithPadding(TOK),
            "default": transformers.default_data_collator}[case]


CASES = ["lm", "lm-multiple-of-8", "seq2seq", "classify", "default"]


def config(mode: str, budget=None) -> pscompile.Config:
    return pscompile.Config(device="cpu", dtype=torch.float32, backend="eager", mode=mode, device_memory=budget)


def trainer(cls, case: str, out, **kw):
    record = Record()
    t = cls(model=model(case), args=arguments(out, save_strategy="no", max_steps=STEPS, gradient_accumulation_steps=1,
                                              warmup_steps=0),
            train_dataset=dataset(case, 2 * STEPS, 1), data_collator=collator(case), callbacks=[record], **kw)
    if cls is PscompileTrainer:
        record.engine = t.engine
    return t, record


def longest(case: str):
    """The largest batch the collator makes from the training set (the longest examples, padded)."""
    items = sorted(dataset(case, 2 * STEPS, 1), key=lambda e: -len(e["input_ids"]))[:2]
    return collator(case)(items)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Each collator's plain Trainer run (logged loss, gradient norm)."""
    runs = {}
    for case in CASES:
        t, record = trainer(transformers.Trainer, case, tmp_path_factory.mktemp(case))
        t.train()
        runs[case] = record.logs
    return runs


def test_the_collators_return_a_mapping_that_is_not_a_dict():
    """What this file guards: the collators' batches are not dicts (default_data_collator's is)."""
    kinds = {case: type(collator(case)(dataset(case, 2, 1))) for case in CASES}
    assert all(k is transformers.BatchEncoding for c, k in kinds.items() if c != "default"), kinds


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
@pytest.mark.parametrize("case", CASES)
def test_each_collator_trains_step_for_step_with_the_plain_trainer(plain, case, mode, tmp_path):
    probe, _ = trainer(PscompileTrainer, case, tmp_path / "probe", pscompile_config=config(mode))
    budget = int(1.15 * probe.min_device_memory(longest(case)))
    t, record = trainer(PscompileTrainer, case, tmp_path, pscompile_config=config(mode, budget))
    t.train()
    assert len(record.logs) == len(plain[case]) == STEPS
    for (step, loss, norm, _), (_, want, want_norm, _) in zip(record.logs, plain[case]):
        assert loss == pytest.approx(want, rel=1e-5), (case, mode, step)
        assert norm == pytest.approx(want_norm, rel=1e-5), (case, mode, step)
    assert all(peak <= budget for peak, _ in record.steps) and sum(e for _, e in record.steps) > 0, record.steps
    t.engine.close()


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_the_trainers_minimum_is_a_budget_it_accepts(mode, tmp_path):
    """The user's report: ``pscompile.min_device_memory`` on the longest padded batch, given to the
    Trainer, was refused by 4 bytes (the Trainer's ``num_items_in_batch``). The Trainer's own
    figure counts them: at exactly the largest over the batches it will train on, every step runs,
    within it. (The largest, not the longest's alone: a batch with padding has an attention mask,
    which GPT-2 attends with otherwise, and which hooks mode measures.)"""
    probe, _ = trainer(PscompileTrainer, "lm", tmp_path / "probe", pscompile_config=config(mode))
    batch = longest("lm")
    assert probe.min_device_memory(batch) > pscompile.min_device_memory(model("lm"), dict(batch), config(mode))
    least = max(probe.min_device_memory(b) for b in probe.get_train_dataloader())
    t, record = trainer(PscompileTrainer, "lm", tmp_path, pscompile_config=config(mode, least))
    t.train()
    assert len(record.steps) == STEPS and all(peak <= least for peak, _ in record.steps), (least, record.steps)
    with pytest.raises(RuntimeError, match="ask before train"):
        t.min_device_memory(batch)
    t.engine.close()


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_mapping_batch_is_a_keyword_batch_outside_the_trainer(mode):
    """``engine.step(BatchEncoding)``, micro-batches of them, ``evaluate`` and ``min_device_memory``
    read it as the dict of its items: the same losses as the dict, bit for bit."""
    import collections
    batch = collator("lm")(dataset("lm", 2, 1))
    losses = {}
    for kind in (dict, transformers.BatchEncoding, collections.UserDict):
        b = kind(dict(batch))
        engine = pscompile.compile(model("lm"), b, config=config(mode))
        losses[kind.__name__] = (engine.step(b), engine.step([b, b]), engine.evaluate(b),
                                 pscompile.min_device_memory(model("lm"), b, config(mode)))
        engine.close()
    assert len(set(losses.values())) == 1, losses


def test_a_batch_of_a_type_pscompile_cannot_read_is_named():
    engine = pscompile.compile(model("lm"), config=config("compiled"))
    with pytest.raises(TypeError, match=r"a batch of type builtins\.str; pscompile reads a tensor .* Mapping"):
        engine.step("abc")
    assert engine.built is None
