"""State dicts and export: a mixin of ``ChunkEngine``.

``state_dict`` holds the fp32 masters, the Adam states, the step, the loss scale, the parameter
groups and what the mode measured (``_mode_state``); ``load_state_dict`` checks all of it before it
changes anything. ``full_state_dict`` gives the model's trained weights under their own names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from pscompile.config import AdamW
from pscompile.errors import closed_message
from pscompile.dist import checkpoint as shard_ckpt


class EngineState:
    """Mixin of ``ChunkEngine``: its state dicts (the module docstring)."""

    def _scalar_state(self) -> dict:
        return {**self._mode_state(), "step": self.adam.step_count, "param_groups": self.param_groups,
                "loss_scale": self.scaler.scale if self.scaler is not None else 1.0,
                "loss_scale_good_steps": self.scaler.good_steps if self.scaler is not None else 0}

    def state_dict(self) -> dict:
        """fp32 master weights, Adam states (per parameter fqn), step, loss scale. Sharded (ZeRO):
        this rank's shards and the layout they are cut from (``pscompile.consolidate`` joins the
        ranks' dicts into the one-process form). Lock-free: every queued update is applied first."""
        with self.exclusive("state_dict"):
            return self._state_dict()

    # an engine a failed update stopped (its weights partly updated) until a state is loaded: this
    # file owns that state; the update stops it, a load lets it go on
    def _stop(self, why: str) -> None:
        self._broken: str | None = why

    def _go_on(self) -> None:
        self._broken = None

    def _stopped(self) -> bool:
        return self._broken is not None

    def _refuse_if_stopped(self) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _state_dict(self) -> dict:
        if self.closed:
            raise RuntimeError("state_dict() of a closed engine: its state went back to the model at close() "
                               "(model.state_dict() holds the trained weights); save before closing")
        self._apply_queued_updates()
        self._refuse_if_stopped()
        if self.comm is not None:
            return shard_ckpt.shard_state_dict(self.store, self.layout, rank=self.rank, world=self.world,
                                               extra=self._scalar_state())
        trained = self._trained()
        sd = {
            "master": {f: self.store.gather("master", f) for f in trained},
            "exp_avg": {f: self.store.gather("exp_avg", f) for f in trained},
            "exp_avg_sq": {f: self.store.gather("exp_avg_sq", f) for f in trained},
            **self._scalar_state(),
        }
        self._count_outside_steps()
        return sd

    def _trained(self) -> list[str]:
        """The parameters that train (a frozen one has no master or Adam states to save)."""
        return [f for f in self.params if self.layout.entry(f).kind.has_states]

    def scalar_problems(self, state: Any) -> list[str]:
        """What keeps a checkpoint's scalars (step, loss scale, parameter groups) from loading."""
        if not isinstance(state, dict):
            return [f"state: a dict is needed, got {type(state).__name__}"]
        out = _scalar_problems(state, loss_scaled=self.scaler is not None)
        try:
            self._saved_groups(state)
        except (ValueError, KeyError, TypeError) as e:
            out.append(f"param_groups: {e}")
        return out

    def state_problems(self, sd: Any) -> list[str]:
        """Everything that keeps ``sd`` from loading into this engine (empty: it loads), checked
        before anything changes: its fields, every tensor's shape, the step, finite masters, the
        parameter groups, and for a shard its rank, world size and layout."""
        out = self.scalar_problems(sd)
        if not isinstance(sd, dict):
            return out
        if shard_ckpt.is_shard(sd):
            if self.comm is None:
                return out + [f"state_dict is rank {sd.get('rank')}'s shard of a {sd.get('world_size')}-rank run; "
                              "load pscompile.consolidate(paths of every rank's state_dict) instead"]
            return out + shard_ckpt.shard_problems(self.store, self.layout, sd, rank=self.rank, world=self.world)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            part = sd.get(key)
            if not isinstance(part, dict):
                out.append(f"state_dict[{key!r}]: a dict of parameter name -> tensor is needed")
                continue
            trained = set(self._trained())
            missing, frozen = trained - set(part), (set(self.params) - trained) & set(part)
            if missing:
                out.append(f"state_dict[{key!r}] lacks parameters {sorted(missing)[:3]}")
            if frozen and key != "master":
                out.append(f"state_dict[{key!r}] has Adam states for {sorted(frozen)[:3]}, frozen in this model "
                           "(requires_grad=False): freeze the same parameters as the run that saved it")
            for f in sorted(trained & set(part)):
                t, want = part[f], tuple(self.params[f].shape)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.is_floating_point():
                    out.append(f"state_dict[{key!r}][{f!r}] has shape {tuple(getattr(t, 'shape', ()))}, "
                               f"the model has {want}" if isinstance(t, torch.Tensor) and t.is_floating_point()
                               else f"state_dict[{key!r}][{f!r}]: a float tensor of shape {want} is needed")
                elif (fault := state_fault(key, [t])) is not None:
                    out.append(f"state_dict[{key!r}][{f!r}] {fault}")
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Load a one-process (or consolidated) state dict at any world size, or this rank's own
        shard of a run with the same world size and layout. The parameter groups must hold the
        same parameters; their saved hyper-parameters (a scheduled learning rate) come back.
        Every check (``state_problems``) passes before anything changes."""
        if self.closed:
            raise RuntimeError(closed_message("load_state_dict"))
        problems = self.state_problems(sd)
        if problems:
            raise ValueError("load_state_dict: nothing was loaded:\n  - " + "\n  - ".join(problems))
        hps = self._saved_groups(sd)
        if self.updater is not None:        # what the queued updates would change is loaded over
            self.updater.discard()
        if shard_ckpt.is_shard(sd):
            shard_ckpt.load_shard(self.store, self.layout, sd, rank=self.rank, world=self.world)
        else:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                for f in self._trained():
                    self.store.scatter(key, f, sd[key][f])
        self._undo_all()       # param chunks = master cast to the compute dtype
        self._count_outside_steps()
        self._load_scalars(sd, hps)

    def _saved_groups(self, sd: dict) -> list[AdamW] | None:
        """The hyper-parameters of ``sd``'s parameter groups (None for a state dict without them),
        after checking they hold the parameters this engine's groups hold."""
        saved = sd.get("param_groups")
        if saved is None:
            return None
        ours = self.param_groups
        if [list(g["params"]) for g in saved] != [g["params"] for g in ours]:
            def show(groups):
                return [f"{len(g['params'])} params ({', '.join(list(g['params'])[:2])}...)" for g in groups]
            raise ValueError(f"state_dict['param_groups'] holds other parameters than this engine's groups: saved "
                             f"{show(saved)}, engine {show(ours)}; build the engine with the same "
                             "AdamW(param_groups=...)")
        return [dataclasses.replace(hp, lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"],
                                    weight_decay=g["weight_decay"]) for hp, g in zip(self.adam.hps, saved)]

    def _mode_state(self) -> dict:
        """Mode hook: what the mode saves besides the model state (e.g. measurements)."""
        return {}

    def _load_mode_state(self, sd: dict) -> None:
        """Mode hook: take back what ``_mode_state`` saved."""

    def _load_scalars(self, sd: dict, hps: list[AdamW] | None = None) -> None:
        self._go_on()                       # every chunk holds the loaded state now
        self._load_mode_state(sd)
        if hps is not None:
            self._put_groups(hps, sd.get("param_groups"))
        self.adam.load_state_dict({"step": sd["step"]})
        if self.scaler is not None:
            self.scaler.scale = float(sd["loss_scale"])
            self.scaler.good_steps = int(sd.get("loss_scale_good_steps", 0))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with fp32 master weights (tied names included), for export
        (lock-free: after every queued update)."""
        self._apply_queued_updates()
        out: dict[str, torch.Tensor] = {}
        full = self._full_masters() if self.comm is not None else None    # a collective
        sd_keys = self.model.state_dict(keep_vars=True)
        for key, value in sd_keys.items():
            try:
                entry = self.layout.entry(key)
            except KeyError:
                out[key] = value.detach().clone()
                continue
            out[key] = full[entry.fqn].clone() if full is not None else self.store.gather("master", entry.fqn)
        self._count_outside_steps()
        return out


def state_fault(kind: str, pieces) -> str | None:
    """What is wrong with a master or Adam state (``kind``) given as ``pieces`` (the tensor, or its
    blocks): inf or NaN anywhere, or an ``exp_avg_sq`` (a running mean of squares) below 0."""
    pieces = list(pieces)
    if not all(bool(torch.isfinite(b).all()) for b in pieces):
        return "holds inf or NaN"
    if kind == "exp_avg_sq" and any(bool((b < 0).any()) for b in pieces):
        return "holds negative values (a running mean of squares)"
    return None


def _scalar_problems(sd: dict, *, loss_scaled: bool) -> list[str]:
    """The step and the loss scale of a state dict."""
    out = []
    step = sd.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        out.append(f"state_dict['step']: the number of steps taken (an int >= 0 that fits int64) is needed, "
                   f"got {step!r}")
    if not loss_scaled:
        return out
    scale, good = sd.get("loss_scale", 1.0), sd.get("loss_scale_good_steps", 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        out.append(f"state_dict['loss_scale']: a finite positive number is needed, got {scale!r}")
    if isinstance(good, bool) or not isinstance(good, int) or not 0 <= good < 2**63:
        out.append(f"state_dict['loss_scale_good_steps']: an int >= 0 that fits int64 is needed, got {good!r}")
    return out

