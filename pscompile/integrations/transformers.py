"""The Hugging Face ``Trainer`` on pscompile's engine: ``PscompileTrainer``.

A script that trains with ``transformers.Trainer`` changes one line and adds a config::

    trainer = PscompileTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                               pscompile_config=pscompile.Config(device_memory="8GiB"))

The Trainer keeps its loop: data loading, the learning-rate schedule, gradient accumulation's
boundaries, logging, the evaluation and save strategies, callbacks, ``resume_from_checkpoint``.
pscompile replaces what happens to the model inside that loop (docs/hugging-face.md has the
table of every ``TrainingArguments`` field):

- ``training_step`` keeps the micro-batches of one accumulation and, at its last one, runs
  ``engine.step(micro_batches)``: forward, backward, clipping and the AdamW update under the
  budget. The Trainer's own ``optimizer.step()`` that follows only takes the groups' values again,
  and its scheduler then writes the next step's rate into them (``engine.optimizer``).
- AdamW's values come from the arguments: ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``,
  ``weight_decay`` (with the Trainer's own no-decay group: biases and norms), ``max_grad_norm``.
- A model that takes ``num_items_in_batch`` (Hugging Face's causal LMs do) gets the Trainer's
  token count, divided by the number of micro-batches because ``engine.step`` averages them, so its
  gradient is the Trainer's: the summed token losses over the tokens of the whole accumulation.
- Evaluation takes its loss from ``engine.evaluate``; logits (for ``compute_metrics``) come from the
  plain model with the current weights materialized on the device.
- A checkpoint folder holds ``pscompile.ckpt`` (``pscompile.save``: masters, Adam states, groups,
  RNG) beside the Trainer's files, and ``save_model`` writes a normal Hugging Face folder.

The Trainer's own mixed precision (autocast, ``GradScaler``) and model placement stay off:
pscompile casts to its ``Config.dtype``, loss-scales float16 and places the model's data itself.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer import TRAINING_ARGS_NAME
except ImportError as e:                   # (accelerate too: the Trainer needs it)
    raise ImportError('pscompile.integrations.transformers needs transformers and accelerate: '
                      'pip install "pscompile[hf]"') from e

from pscompile.api import compile as pscompile_compile, min_device_memory as pscompile_min_device_memory
from pscompile.saving import load, save
from pscompile.config import AdamW, Config
from pscompile.runtime.batching import LossFn, as_batch
from pscompile.runtime.rng import rng_state, set_rng_state

CHECKPOINT = "pscompile.ckpt"          # pscompile's state, in each Trainer checkpoint folder
SCHEDULER = "scheduler.pt"             # the Trainer's own name for its scheduler's state
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")


def training_dtype(args: TrainingArguments) -> torch.dtype:
    """The compute dtype the flags ask for: ``fp16``, ``bf16``, else float32 (masters are fp32)."""
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def resolved_config(args: TrainingArguments, config: Config | None) -> Config:
    """``config`` (default ``Config()``) with the Trainer's device where it names none, and the
    flags' dtype where its dtype is the default (a dtype set otherwise must agree: ``refusals``)."""
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"pscompile_config={config!r} must be a pscompile.Config")
    default_dtype = next(f.default for f in dataclasses.fields(Config) if f.name == "dtype")
    return dataclasses.replace(config, device=config.device if config.device is not None else str(args.device),
                               dtype=training_dtype(args) if config.dtype == default_dtype else config.dtype)


def refusals(args: TrainingArguments, config: Config, kwargs: dict) -> list[str]:
    """What this Trainer cannot do as asked, one line per field, naming what would work."""
    out = []
    dtype = training_dtype(args)
    if config.dtype != dtype:
        flags = "fp16=True" if args.fp16 else "bf16=True" if args.bf16 else "fp16=False, bf16=False"
        out.append(f"TrainingArguments({flags}) trains in {dtype}, but Config(dtype={config.dtype}): the flags "
                   f"choose pscompile's compute dtype (masters stay fp32); give Config(dtype={dtype}) or change "
                   "the flags")
    if torch.device(config.device).type != args.device.type:
        out.append(f"Config(device={config.device!r}) is not the Trainer's device ({args.device}); give "
                   "Config(device=None) to take the Trainer's, or TrainingArguments(use_cpu=...)")
    for field, what in (("deepspeed", "DeepSpeed"), ("fsdp", "FSDP")):
        if getattr(args, field, None):
            out.append(f"TrainingArguments({field}=...): {what} and pscompile would both place and shard the "
                       f"model; drop {field}= (pscompile's Config(device_memory=...) is the budget)")
    if args.torch_compile:
        out.append("TrainingArguments(torch_compile=True): pscompile compiles the step itself; drop it and give "
                   "Config(backend='inductor') (the default)")
    if args.fp16_full_eval or args.bf16_full_eval:
        out.append("TrainingArguments(fp16_full_eval/bf16_full_eval): evaluation runs in the training dtype "
                   "(Config.dtype); drop the flag")
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_NAMES or args.optim_args:
        out.append(f"TrainingArguments(optim={optim!r}, optim_args={args.optim_args!r}): pscompile's update is "
                   f"AdamW with torch.optim.AdamW's semantics; give optim='adamw_torch' and no optim_args")
    if args.label_smoothing_factor:
        out.append(f"TrainingArguments(label_smoothing_factor={args.label_smoothing_factor}): the loss is the "
                   "model's own; give a loss_fn= to PscompileTrainer for another loss")
    if args.neftune_noise_alpha is not None:
        out.append("TrainingArguments(neftune_noise_alpha=...): NEFTune adds a hook to the embedding that the "
                   "captured step would not run; drop it")
    if args.world_size > 1 or args.n_gpu > 1:
        out.append(f"world_size={args.world_size}, n_gpu={args.n_gpu}: PscompileTrainer runs one process on one "
                   "device (CUDA_VISIBLE_DEVICES=0); for ZeRO over several ranks use engine.step under torchrun "
                   "(docs/zero.md)")
    if kwargs.get("optimizers", (None, None)) != (None, None) or kwargs.get("optimizer_cls_and_kwargs"):
        out.append("optimizers=/optimizer_cls_and_kwargs=: the optimizer is the engine's AdamW "
                   "(trainer.optimizer is engine.optimizer); set its values in TrainingArguments, and a "
                   "scheduler with lr_scheduler_type")
    if kwargs.get("compute_loss_func") is not None:
        out.append("compute_loss_func=: give the loss to PscompileTrainer(loss_fn=...) instead: a "
                   "function(model output, batch) -> loss that pscompile captures with the step")
    if kwargs.get("model_init") is not None:
        out.append("model_init= (hyper-parameter search): give model= instead")
    return out


def adamw_from(args: TrainingArguments, model: nn.Module, decay: list[str]) -> AdamW:
    """The Trainer's AdamW as ``pscompile.AdamW``: the trainable parameters ``decay`` does not name
    (biases, norms) get no weight decay, as ``Trainer.create_optimizer`` groups them."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [n for n in trainable if n not in set(decay)]
    whole = len(no_decay) == len(trainable)          # (no parameter decays: one group without decay)
    return AdamW(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                 weight_decay=0.0 if whole else args.weight_decay,
                 max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
                 param_groups=[{"params": no_decay, "weight_decay": 0.0}] if no_decay and not whole else [])


class PscompileTrainer(Trainer):
    """``transformers.Trainer`` with pscompile's engine under ``pscompile_config``'s budget (the
    module's docstring). ``trainer.engine`` is the engine (``engine.stats``, ``engine.schedule``,
    ``engine.materialize()``); ``trainer.engine.close()`` gives the model its trained weights."""

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *,
                 pscompile_config: Config | None = None, loss_fn: LossFn | None = None, **kwargs):
        if model is None:
            raise ValueError("PscompileTrainer(model=...): give the model (model_init is not supported)")
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        config = resolved_config(args, pscompile_config)
        problems = refusals(args, config, kwargs)
        if type(self).compute_loss is not Trainer.compute_loss:
            problems.append(f"{type(self).__name__}.compute_loss is overridden: the engine runs the model and its "
                            "loss inside the captured step; give PscompileTrainer(loss_fn=...) instead")
        if problems:
            raise ValueError("PscompileTrainer cannot train as asked (nothing was changed):\n  - "
                             + "\n  - ".join(problems))
        super().__init__(model=model, args=args, **kwargs)
        self.engine = pscompile_compile(model, optimizer=adamw_from(args, model, self.get_decay_parameter_names(model)),
                                        config=config, loss_fn=loss_fn)
        self._micro: list = []             # the micro-batches of the accumulation under way
        self._resuming = False             # a checkpoint waits for the engine's build (first step)

    def min_device_memory(self, batch: Any) -> int:
        """The least ``Config(device_memory=...)`` this Trainer accepts for ``batch``, one collated
        micro-batch (the longest the collator makes, for padded batches): ``pscompile.min_device_memory``
        on the batch the engine is given, with what the Trainer adds to each (the float32
        ``num_items_in_batch`` where the model takes it). Ask before ``train()``: a Trainer made with
        that figure trains."""
        if self.engine.built is not None:
            raise RuntimeError("trainer.min_device_memory(batch): the engine is built (the model's data lives in "
                               "its chunks); ask before train(), or call engine.describe() for what this plan needs")
        inputs = self._prepare_inputs(as_batch(batch, "min_device_memory"))
        inputs = self._with_items(inputs, self._get_num_items_in_batch([inputs], self.args.device), 1)
        return pscompile_min_device_memory(self.model, inputs, self.engine.config, optimizer=self.engine.hp,
                                           loss_fn=self.engine.loss_fn)

    # ---- what pscompile does instead of the Trainer --------------------------------------------
    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"      # pscompile casts to Config.dtype and loss-scales float16 itself
        out["device_placement"] = False    # and moves the model's data itself, chunk by chunk
        return out

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The model stays where it was built: the engine moves its chunks under the budget."""

    def create_optimizer(self, model: nn.Module | None = None):
        if self.optimizer is None:
            self.optimizer = self.engine.optimizer
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Keeps the micro-batch; at the accumulation's last, one ``engine.step`` over all of them
        (the update included). Returns the step's mean loss there and 0 before, so the Trainer's
        running sum logs the losses the plain Trainer logs."""
        self._micro.append(self._prepare_inputs(inputs))
        if not self.accelerator.gradient_state.sync_gradients:
            return torch.zeros((), device=self.args.device)
        micro, self._micro = self._micro, []
        micro = [self._with_items(b, num_items_in_batch, len(micro)) for b in micro]
        self.model.train()
        if self._resuming:
            self._build_keeping_rng(micro[0])
        loss = self.engine.step(micro if len(micro) > 1 else micro[0])
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)

    def _build_keeping_rng(self, batch: Any) -> None:
        """Build the engine, which loads the checkpoint the resume named, without its restoring
        the random number generators: the Trainer restored them itself (``rng_state.pth``) when
        its loop reached the saved position, and whatever drew from them since must stay drawn."""
        device = torch.device(self.engine.config.device)
        state = rng_state(device)
        self.engine.ensure_built(batch)
        set_rng_state(device, state)
        self._resuming = False

    def _with_items(self, batch: Any, num_items, k: int) -> Any:
        """``batch`` with the Trainer's token count for the model's loss (divided by ``k``: the
        engine means the ``k`` micro-batches' losses), where the model takes one."""
        if num_items is None or not self.model_accepts_loss_kwargs or not isinstance(batch, Mapping):
            return batch
        items = torch.as_tensor(num_items, device=self.args.device).to(torch.float32) / k
        return {**batch, "num_items_in_batch": items}

    def _clip_grad_norm(self, model: nn.Module):
        """The engine clipped inside its step; this is the norm it measured before clipping."""
        return self._step_norm()

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        return self._step_norm() if grad_norm is None else grad_norm

    def _step_norm(self) -> float | None:
        stats = getattr(self.engine.built, "stats", None)
        return stats.grad_norm if stats is not None else None

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The loss from ``engine.evaluate`` (under the budget); with logits wanted, the plain
        model's step with the current weights materialized on the device."""
        if not prediction_loss_only:
            with self.engine.materialize():
                return super().prediction_step(self.model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        if not self.label_names or any(inputs.get(k) is None for k in self.label_names):
            return (None, None, None)
        batch = self._with_items(inputs, self._get_num_items_in_batch([inputs], self.args.device), 1)
        return (torch.tensor(self.engine.evaluate(batch), device=self.args.device), None, None)

    # ---- checkpoints ------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A Hugging Face folder with the current fp32 weights (``from_pretrained`` loads it)."""
        if state_dict is not None:
            raise ValueError("save_model(state_dict=...): the weights are the engine's; it saves them itself")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if self.engine.built is not None:
            self.engine.save_pretrained(output_dir)
        else:                                   # (no step yet: the model holds its own weights)
            self.model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(self.engine, Path(output_dir) / CHECKPOINT)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load(self.engine, _state_file(checkpoint))     # (checked now, loaded at the first step)
        self._resuming = self.engine.built is None
        scheduler = Path(checkpoint) / SCHEDULER
        if scheduler.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The weights come back with ``pscompile.ckpt`` (``_load_optimizer_and_scheduler``)."""
        _state_file(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        load(self.engine, _state_file(self.state.best_model_checkpoint))


def _state_file(checkpoint: str | os.PathLike) -> Path:
    path = Path(checkpoint) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} has no {CHECKPOINT}: it was not written by PscompileTrainer (or "
                                "with save_only_model=True), so the optimizer states are not there to resume "
                                "from; start a new run from its weights (from_pretrained)")
    return path
