"""The ``pscompile`` logger: plan summaries at INFO in both modes (a user turns them on with
``logging.getLogger("pscompile").setLevel(logging.INFO)``); slow fall-backs are WARNINGs
(tests/test_region_probe.py, tests/test_checkpoint.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import pscompile
from conftest import make_batches, make_model


@pytest.mark.parametrize("mode, says", [("compiled", "planned the train schedule"), ("hooks", "traced a step")])
def test_plans_are_summarized_at_info(mode, says, caplog):
    batches = make_batches("gpt", 2)
    config = pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=None)
    with caplog.at_level(logging.INFO, logger="pscompile"):
        engine = pscompile.compile(make_model("gpt"), config=config)
        assert not caplog.records, "the lazy form plans nothing before its first step"
        engine.step(batches[0])
    said = [r for r in caplog.records if says in r.getMessage()]
    assert said and all(r.levelno == logging.INFO and r.name.startswith("pscompile") for r in said)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        engine.step(batches[1])
    assert not caplog.records, "a step of an engine that fell back from nothing warned"
