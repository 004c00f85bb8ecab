"""``PscompileTrainer``: the Hugging Face Trainer's own loop on pscompile's engine.

A tiny GPT-2 trains through ``transformers.Trainer`` and through ``PscompileTrainer`` (same seed,
same data) with gradient accumulation 2, warm-up + linear decay, ``max_grad_norm`` and weight
decay, the latter under a device budget 1.1x its minimum, which evicts every step. The labels
carry padding (-100) in varying amounts, so the token-weighted loss of an accumulation differs
from the mean of its micro-batches' means: the Trainer's token count must reach the model.
Backend "eager" (the compiled-mode Inductor path is tested elsewhere; here every region runs
eager, which the budget tests below do not depend on).
"""

from __future__ import annotations

import pytest
import torch

import pscompile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from pscompile.integrations.transformers import PscompileTrainer

STEPS, SAVE_AT, SEQ = 6, 3, 32
TOL = 1e-5
MODES = ("compiled", "hooks")


def gpt2(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


class Windows(torch.utils.data.Dataset):
    """Random token windows whose labels end in 0-12 padding positions (-100)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, SEQ), generator=g)
        self.pad = torch.randint(0, 13, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[SEQ - int(self.pad[i]):] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class Record(transformers.TrainerCallback):
    """The logged losses, and (with an engine) each step's measured peak and evictions."""

    def __init__(self):
        self.logs, self.steps, self.shares, self.engine = [], [], [], None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append((state.global_step, logs["loss"], logs["grad_norm"], logs["learning_rate"]))

    def on_step_end(self, args, state, control, **kwargs):
        if self.engine is not None:
            s = self.engine.stats
            self.steps.append((s.peak_device_bytes, s.num_evictions))
            self.shares.append(s.compiled_share)


def arguments(out, **overrides) -> transformers.TrainingArguments:
    kw = {"output_dir": str(out), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
          "learning_rate": 1e-3, "warmup_steps": 2, "lr_scheduler_type": "linear", "max_grad_norm": 0.5,
          "weight_decay": 0.1, "max_steps": STEPS, "logging_steps": 1, "save_strategy": "steps",
          "save_steps": SAVE_AT, "report_to": [], "use_cpu": True, "seed": 0, "disable_tqdm": True,
          "per_device_eval_batch_size": 2}
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def config(mode: str, budget=None) -> pscompile.Config:
    return pscompile.Config(device="cpu", dtype=torch.float32, backend="eager", mode=mode, device_memory=budget)


def budget_for(mode: str, dropout: float = 0.0) -> int:
    batch = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, SEQ, dtype=torch.long)}
    return int(1.1 * pscompile.min_device_memory(gpt2(dropout=dropout), batch, config(mode)))


def pscompile_trainer(mode: str, out, model=None, budget=None, **overrides) -> tuple[PscompileTrainer, Record]:
    record = Record()
    trainer = PscompileTrainer(model=model if model is not None else gpt2(), args=arguments(out, **overrides),
                               train_dataset=Windows(24, 1), eval_dataset=Windows(6, 2), callbacks=[record],
                               pscompile_config=config(mode, budget))
    record.engine = trainer.engine
    return trainer, record


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer's run: its logs, final weights and evaluation."""
    record = Record()
    trainer = transformers.Trainer(model=gpt2(), args=arguments(tmp_path_factory.mktemp("plain"), save_strategy="no"),
                                   train_dataset=Windows(24, 1), eval_dataset=Windows(6, 2), callbacks=[record])
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return record.logs, weights, trainer.evaluate()["eval_loss"]


@pytest.fixture(scope="module", params=MODES)
def trained(request, tmp_path_factory):
    """PscompileTrainer's uninterrupted run (checkpoints at step 3 and 6) in one mode."""
    out = tmp_path_factory.mktemp(f"run-{request.param}")
    budget = budget_for(request.param)
    trainer, record = pscompile_trainer(request.param, out, budget=budget)
    trainer.train()
    yield request.param, out, budget, trainer, record
    trainer.engine.close()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(abs(a), abs(b), 1e-8)


def test_tracks_the_plain_trainer_under_an_evicting_budget(plain, trained):
    logs, weights, _ = plain
    mode, _, budget, trainer, record = trained
    assert len(record.logs) == len(logs) == STEPS
    for (step, loss, norm, lr), (_, want, want_norm, want_lr) in zip(record.logs, logs):
        assert _close(loss, want), (mode, step, loss, want)
        assert _close(norm, want_norm), (mode, step, norm, want_norm)     # the norm before clipping
        assert lr == want_lr, (mode, step)
    assert len(record.steps) == STEPS
    for step, (peak, evictions) in enumerate(record.steps):
        assert peak <= budget, (mode, step, peak, budget)
        assert evictions > 0, (mode, step)
    state = trainer.engine.full_state_dict()
    for name, want in weights.items():
        torch.testing.assert_close(state[name], want, rtol=TOL, atol=1e-6, msg=f"{mode}: {name}")


def test_resume_from_checkpoint_repeats_the_run_exactly(trained, tmp_path):
    mode, out, budget, trainer, record = trained
    resumed, again = pscompile_trainer(mode, tmp_path, model=gpt2(seed=7), budget=budget)   # other init
    resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}"))
    assert again.logs == record.logs[SAVE_AT:]
    want, got = trainer.engine.full_state_dict(), resumed.engine.full_state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), (mode, name)
    resumed.engine.close()


def test_evaluate_and_save_model(plain, trained, tmp_path):
    """``evaluate()`` under the budget equals the plain Trainer's evaluation of the same weights
    (the folder ``save_model`` wrote, loaded with ``from_pretrained``), and the logits path
    (``compute_metrics``) gives the same loss."""
    _, _, plain_eval = plain
    mode, _, _, trainer, _ = trained
    ours = trainer.evaluate()["eval_loss"]
    assert _close(ours, plain_eval), (mode, ours, plain_eval)
    trainer.save_model(str(tmp_path / "model"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    reference = transformers.Trainer(model=loaded, args=arguments(tmp_path / "eval", save_strategy="no"),
                                     eval_dataset=Windows(6, 2))
    assert reference.evaluate()["eval_loss"] == ours
    trainer.compute_metrics = lambda p: {"n": float(len(p.predictions))}
    with_logits = trainer.evaluate()
    trainer.compute_metrics = None
    assert with_logits["eval_loss"] == ours and with_logits["eval_n"] == 6


def test_load_best_model_at_end(tmp_path):
    trainer, _ = pscompile_trainer("compiled", tmp_path, max_steps=4, save_steps=2, eval_strategy="steps",
                                   eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss")
    trainer.train()
    best = trainer.state.best_model_checkpoint
    saved = transformers.GPT2LMHeadModel.from_pretrained(best).state_dict()
    state = trainer.engine.full_state_dict()
    for name, want in saved.items():
        if name in state:
            assert torch.equal(state[name], want), name
    trainer.engine.close()


@pytest.mark.parametrize("overrides, trainer_kwargs, names", [
    ({"fp16": True}, {}, ["fp16=True", "Config(dtype=torch.float16)"]),
    ({"torch_compile": True, "optim": "sgd"}, {}, ["torch_compile=True", "optim='sgd'"]),
    ({"label_smoothing_factor": 0.1}, {"compute_loss_func": lambda *a, **k: 0},
     ["label_smoothing_factor", "loss_fn="]),
])
def test_refuses_what_it_cannot_do_and_changes_nothing(tmp_path, overrides, trainer_kwargs, names):
    model = gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        PscompileTrainer(model=model, args=arguments(tmp_path, **overrides),
                         pscompile_config=config("compiled"), **trainer_kwargs)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_resume_refuses_a_folder_without_pscompile_state(tmp_path):
    trainer, _ = pscompile_trainer("compiled", tmp_path / "out")
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(FileNotFoundError, match="has no pscompile.ckpt"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_the_flags_choose_the_dtype_of_a_default_config(tmp_path):
    for flags, dtype in (({}, torch.float32), ({"bf16": True}, torch.bfloat16)):
        trainer = PscompileTrainer(model=gpt2(), args=arguments(tmp_path, **flags),
                                   pscompile_config=pscompile.Config(backend="eager", device_memory="1MiB"))
        assert trainer.engine.config.dtype == dtype and trainer.engine.config.device == "cpu"


def masking_collator(items: list[dict]) -> dict:
    """Stacks the windows and hides 10% of the input tokens at random, drawing from torch's
    generator as ``DataCollatorForLanguageModeling`` does."""
    batch = transformers.default_data_collator(items)
    hide = torch.rand(batch["input_ids"].shape) < 0.1
    return {**batch, "input_ids": batch["input_ids"].masked_fill(hide, 0)}


def test_resume_at_an_epoch_boundary_with_dropout_and_a_random_collator(tmp_path):
    """The Trainer restores the generators at the epoch's start, then the collator draws: the first
    step's dropout must see the generator after those draws, as the uninterrupted run's did (the
    engine's own checkpoint load, at that step, must not restore them again)."""
    def run(out, model, **kw):
        record = Record()
        trainer = PscompileTrainer(model=model, args=arguments(out, max_steps=4, save_steps=2, **kw),
                                   train_dataset=Windows(8, 1), data_collator=masking_collator,
                                   callbacks=[record], pscompile_config=config("compiled", budget_for("compiled", 0.1)))
        return trainer, record
    trainer, whole = run(tmp_path / "whole", gpt2(dropout=0.1))
    trainer.train()
    resumed, again = run(tmp_path / "again", gpt2(seed=7, dropout=0.1))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert [s for s, *_ in again.logs] == [3, 4] and again.logs == whole.logs[2:]
    trainer.engine.close()
    resumed.engine.close()
