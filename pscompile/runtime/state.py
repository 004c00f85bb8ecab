"""State dicts and export: a mixin of ``ChunkEngine``.

``state_dict`` holds the fp32 masters, the Adam states, the step, the loss scale, the parameter
groups and what the mode measured (``_mode_state``); ``load_state_dict`` checks all of it before it
changes anything. ``full_state_dict`` gives the model's trained weights under their own names.
"""

from __future__ import annotations

import dataclasses

import torch

from pscompile.config import AdamW
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
        self._apply_queued_updates()
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self.comm is not None:
            return shard_ckpt.shard_state_dict(self.store, self.layout, rank=self.rank, world=self.world,
                                               extra=self._scalar_state())
        sd = {
            "master": {f: self.store.gather("master", f) for f in self.params},
            "exp_avg": {f: self.store.gather("exp_avg", f) for f in self.params},
            "exp_avg_sq": {f: self.store.gather("exp_avg_sq", f) for f in self.params},
            **self._scalar_state(),
        }
        self._count_outside_steps()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Load a one-process (or consolidated) state dict at any world size, or this rank's own
        shard of a run with the same world size and layout. The parameter groups must hold the
        same parameters; their saved hyper-parameters (a scheduled learning rate) come back."""
        hps = self._saved_groups(sd)
        if self.updater is not None:        # what the queued updates would change is loaded over
            self.updater.discard()
        if shard_ckpt.is_shard(sd):
            if self.comm is None:
                raise ValueError(f"state_dict is rank {sd['rank']}'s shard of a {sd['world_size']}-rank run; "
                                 "load pscompile.consolidate(paths of every rank's state_dict) instead")
            shard_ckpt.load_shard(self.store, self.layout, sd, rank=self.rank, world=self.world)
            self._undo_all()
            self._count_outside_steps()
            self._load_scalars(sd, hps)
            return
        for key in ("master", "exp_avg", "exp_avg_sq"):
            missing = set(self.params) - set(sd[key])
            if missing:
                raise ValueError(f"state_dict[{key!r}] lacks parameters {sorted(missing)[:3]}")
            for f in self.params:
                if tuple(sd[key][f].shape) != tuple(self.params[f].shape):
                    raise ValueError(f"state_dict[{key!r}][{f!r}] has shape {tuple(sd[key][f].shape)}, "
                                     f"the model has {tuple(self.params[f].shape)}")
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for f in self.params:
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
        self._broken = None                 # every chunk holds the loaded state now
        self._load_mode_state(sd)
        if hps is not None:
            self.adam.hps = hps
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
