"""The errors pscompile raises on purpose. All are ``ValueError``s: each names the field, node or
moment at fault and, where there is one, the number that would work."""

from __future__ import annotations


class BudgetError(ValueError):
    """``device_memory`` cannot hold what one node (compiled mode) or moment (hooks mode) of the
    iteration needs. ``minimum``: the budget that would work, when the error knows it."""

    def __init__(self, message: str, minimum: int | None = None, detail: str | None = None):
        super().__init__(message)
        self.minimum = minimum
        self.detail = detail        # where and why, without the advice (for a caller's own message)


class ResidencyError(BudgetError):
    """plan_residency: the budget cannot hold what node ``node`` reads; ``minimum`` is the budget
    that node needs (-1 when optimizer states kept on the device are what leaves too little room)."""

    def __init__(self, message: str, node: int, minimum: int):
        super().__init__(message, minimum)
        self.node = node


class ScheduleError(ValueError):
    """verify_schedule: a scheduled graph breaks a memory invariant at the node it names."""


def closed_message(call: str) -> str:
    """What a call on a closed engine says (``call``: the engine method under way; "save" for
    ``pscompile.save``; "" when unknown): why, and the two ways to go on."""
    where = {"save": "pscompile.save()", "": "this call"}.get(call, f"engine.{call}()")
    return (f"{where}: this engine was closed: close() gave the model its trained weights back and released the "
            "engine's chunks. To go on training, build a new engine: pscompile.compile(model, batch, ...) starts "
            "from the weights close() gave back; to resume a checkpoint saved before close() (optimizer states "
            "too), load it into a new engine: pscompile.load(new_engine, path)")
