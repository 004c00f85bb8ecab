"""Typed keys of compiled mode's caches.

A *capture* is one traced graph: forward + backward, or forward only, for one model mode
(train()/eval(): dropout is captured as it is) and one batch signature (shapes and dtypes). A
*schedule* is one plan of a capture for one run kind: training and accumulation schedules share
the joint capture, evaluation has its own forward-only capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pscompile.kinds import RunKind
from pscompile.runtime.batching import signature


@dataclass(frozen=True)
class CaptureKey:
    backward: bool          # forward + backward (train, accum) or forward only (eval)
    training: bool          # model.training when it was captured
    batch: tuple            # runtime.batching.signature of the batch

    def describe(self) -> str:
        """A short name for messages: the kind of capture and its tensors' shapes."""
        shapes = ["(" + ", ".join("any" if d is None else str(d) for d in x[0]) + ")"
                  for x in self.batch[1:] if isinstance(x, tuple)]                 # (None: a range's size)
        kind = "the training step" if self.backward else "the evaluation"
        return f"{kind} of batch shapes {', '.join(shapes)}"

    @property
    def token(self) -> str:
        """The name a checkpoint keeps this capture's measurements under: the kind of capture, then
        the batch's structure and each leaf's shape and dtype (or a non-tensor leaf's value)."""
        spec, *leaves = self.batch
        parts = [f"{list(x[0])}:{str(x[1]).replace('torch.', '')}" if isinstance(x, tuple) else str(x) for x in leaves]
        return "|".join([("fwd+bwd" if self.backward else "fwd") + ("/train" if self.training else "/eval"),
                         str(spec)] + parts)


@dataclass(frozen=True)
class ScheduleKey:
    kind: RunKind
    training: bool
    batch: tuple

    @staticmethod
    def of(batch: Any, kind: RunKind, training: bool) -> "ScheduleKey":
        return ScheduleKey(RunKind(kind), training, signature(batch))

    @property
    def capture(self) -> CaptureKey:
        return CaptureKey(self.kind.backward, self.training, self.batch)
