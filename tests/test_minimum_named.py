"""One minimum: the figure ``pscompile.min_device_memory`` gives is the one a ``BudgetError`` names
and the one ``describe()`` names at that budget; at a larger budget ``describe()`` names what its
own layout and activation plan need, as that, not as a minimum. A ``BudgetError`` carries one
figure: no chained error with another."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from conftest import make_batches, make_model
from pscompile.units import format_bytes

BATCH = make_batches("gpt", 1)[0]


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_the_minimum_is_one_figure_everywhere(mode):
    config = pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32)
    least = pscompile.min_device_memory(make_model("gpt"), BATCH, config)
    engine = pscompile.compile(make_model("gpt"), BATCH, config=dataclasses.replace(config, device_memory=least))
    engine.step(BATCH)
    assert engine.stats.peak_device_bytes <= least
    said = engine.describe().splitlines()[1]
    assert said.startswith(f"this layout and activation plan need {format_bytes(least)} ") \
        and "pscompile.min_device_memory" in said, engine.describe()
    engine.close()
    with pytest.raises(pscompile.BudgetError) as e:
        pscompile.compile(make_model("gpt"), BATCH, config=dataclasses.replace(config, device_memory=least // 4))
    assert e.value.minimum == least and f"give device_memory >= {least}" in str(e.value), str(e.value)
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__), \
        "a chained error names another figure"


def test_a_larger_budget_names_its_own_plans_need_for_what_it_is():
    config = pscompile.Config(backend="eager", device="cpu", dtype=torch.float32)
    least = pscompile.min_device_memory(make_model("gpt"), BATCH, config)
    engine = pscompile.compile(make_model("gpt"), BATCH, config=dataclasses.replace(config, device_memory=8 * least))
    need = engine.min_device_memory
    assert need >= least and "minimum" not in engine.describe().splitlines()[0]
    assert f"this layout and activation plan need {format_bytes(need)} (the least budget" in engine.describe()
    engine.close()
