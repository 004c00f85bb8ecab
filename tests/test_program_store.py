"""Every process after the first starts warm: a compiled program is kept (``compiled/program_store.py``)
and a later process that schedules the same graph loads it instead of compiling it again."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pscompile.compiled.program_store import ProgramStore
from pscompile.compiled.whole import WholeProgram

HERE = Path(__file__).parent


def _worker(out: Path, cache: Path, *args: str) -> dict:
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(HERE / "program_cache_worker.py"), str(out), *args], cwd=HERE, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _without_rates(state):
    """The state less the machine's measured rates (``memory/rates.py``): a process that measures the
    machine much faster than the kept figures replaces them, so they may differ between processes."""
    if isinstance(state, dict):
        return {k: _without_rates(v) for k, v in state.items() if k != "rates"}
    return state


def _same_state(a: dict, b: dict) -> bool:
    """Equal to the bit: every tensor of the (nested) state, and every other value but the rates."""
    from torch.utils._pytree import tree_flatten
    (xs, sa), (ys, sb) = tree_flatten(_without_rates(a)), tree_flatten(_without_rates(b))
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(xs, ys))


def test_a_second_process_loads_the_program_and_trains_bit_for_bit(tmp_path):
    """Three fresh processes, one Inductor cache folder: the first compiles the program (after
    its measuring step) and saves a checkpoint after step 1; a rerun loads the program (no
    compile) and gives the first's losses and weights to the bit; a resume from the checkpoint
    loads it too, runs it from its first step (no measuring step: the checkpoint's measurements),
    and continues the first run's losses and weights to the bit. Every step within the budget,
    nothing said at WARNING."""
    cache, ckpt = tmp_path / "inductor", str(tmp_path / "run.pscompile")
    first = _worker(tmp_path / "1.pt", cache, "--save", ckpt)
    rerun = _worker(tmp_path / "2.pt", cache)
    resume = _worker(tmp_path / "3.pt", cache, "--load", ckpt)
    for run, loaded in ((first, False), (rerun, True), (resume, True)):
        programs = [m for m in run["messages"] if "compiled as one program" in m]
        assert len(programs) == 1 and ("(loaded:" in programs[0]) == loaded, run["messages"]
        assert not [m for m in run["messages"] if m.startswith("WARNING")], run["messages"]
        assert max(run["peaks"]) <= run["budget"], (run["peaks"], run["budget"])
    assert first["shares"] == rerun["shares"] == [0.0, 1.0, 1.0, 1.0]
    assert resume["shares"] == [1.0, 1.0]
    # the layout weighed and the activations chosen once: the later processes take the first's
    # choices (compiled/choice_store.py). How many activation choices a process makes (at compile,
    # after its measuring step or a checkpoint's measurements) and so how many it finds kept varies:
    # their facts hold the measured rates' verdicts (``minimum.choose_activations``), which a loaded
    # machine can tip (a CI run found 2 in the resume); each process finds at least one
    assert len(first["layout"][1]) > 1 and first["choice_hits"] == {"layout": 0, "activations": 0}
    for run in (rerun, resume):
        assert run["choice_hits"]["layout"] == 1 and run["choice_hits"]["activations"] >= 1, run["choice_hits"]
    assert rerun["layout"] == resume["layout"] == first["layout"]
    assert rerun["losses"] == first["losses"] and _same_state(rerun["state"], first["state"])
    assert resume["losses"] == first["losses"][2:] and _same_state(resume["state"], first["state"])


@pytest.fixture(scope="module")
def stored():
    """The tiny GPT's measured schedule (``test_program.tight``'s), compiled once into the process's
    store, and its inputs."""
    from test_program import tight_schedule
    yield from tight_schedule()


def _outputs(prog: WholeProgram, inputs: list) -> list:
    copies = [t.clone() for t in inputs]
    return [*prog._fn(list(copies)), *copies]


def test_the_same_graph_loads_its_program_and_an_unusable_entry_is_compiled_afresh(stored, caplog):
    """The same scheduled graph again: the program is loaded (``cache_hit``). An entry made
    unreadable is a miss said once at WARNING: compiled afresh, and stored again (the next one is
    loaded). The loaded program's buffer plan and outputs (every input it writes included) equal
    the fresh compile's to the bit."""
    gm, inputs, prog = stored
    if not ProgramStore.enabled():
        pytest.skip("Inductor's FX graph cache is off in this process")
    again = WholeProgram(gm, torch.device("cpu"))
    again.compile()
    assert again.cache_hit and again.key == prog.key
    entry = prog.store.root / f"{prog.key}.json"
    entry.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        afresh = WholeProgram(gm, torch.device("cpu"))
        afresh.compile()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "cannot be used" in warned[0] and "compiled afresh" in warned[0], warned
    assert not afresh.cache_hit and afresh.buffers == again.buffers == prog.buffers
    assert all(torch.equal(a, b) for a, b in zip(_outputs(again, inputs), _outputs(afresh, inputs)))
    json.loads(entry.read_text())
    last = WholeProgram(gm, torch.device("cpu"))
    last.compile()
    assert last.cache_hit


@pytest.mark.parametrize("change", ["torch", "code", "events", "symbols"])
def test_an_entry_of_another_torch_or_other_code_is_a_miss_with_a_warning(stored, tmp_path, caplog, change):
    """An entry written by another torch, one naming other code than Inductor's cache holds for the
    key, one with an event this version does not know, or one for other size symbols: ``load``
    returns None (a miss: the program is compiled afresh) and says so at WARNING; nothing raises."""
    gm, _, prog = stored
    if not ProgramStore.enabled():
        pytest.skip("Inductor's FX graph cache is off in this process")
    data = json.loads((prog.store.root / f"{prog.key}.json").read_text())
    data.update({"torch": "1.0.0"} if change == "torch" else {"code": "f" + "0" * 51} if change == "code" else
                {"events": [["grow", "buf0", 8]]} if change == "events" else {"symbols": ["s0", "s1"]})
    store = ProgramStore(tmp_path)
    (tmp_path / f"{prog.key}.json").write_text(json.dumps(data))
    from pscompile.compiled.whole import _examples
    mode, examples, symbols = _examples(gm, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="pscompile"), \
            torch._guards.tracing(torch._guards.TracingContext(mode)), mode:
        assert store.load(prog.key, gm, examples, symbols) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "cannot be used" in warned[0], warned
    assert store.warned == [prog.key]


def _layout_store_entry(tmp_path):
    from types import SimpleNamespace

    from pscompile.compiled.choice_store import ChoiceStore
    from pscompile.graph.pipeline import LayoutChoice
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    layouts = [SimpleNamespace(chunk_size=4096), SimpleNamespace(chunk_size=1024)]
    store = ChoiceStore(tmp_path)
    key = store.key(gm, layouts, (1 << 20, 1, False, "config"))
    rows = (LayoutChoice(4096, 0, 0.9, 100, 5000), LayoutChoice(1024, 2, 0.95, 90, None))
    store.keep(key, layouts[1], rows)
    return store, key, layouts, rows, gm


def test_a_layout_choice_is_kept_and_an_unusable_entry_is_weighed_again(tmp_path, caplog):
    """The choice comes back as it was kept; other facts are another key; an entry that is not JSON,
    or names a chunk size no candidate has, is a miss said once at WARNING."""
    from pscompile.compiled.choice_store import ChoiceStore
    store, key, layouts, rows, gm = _layout_store_entry(tmp_path)
    again = ChoiceStore(tmp_path)
    assert again.recall(key, layouts) == (layouts[1], rows) and again.hits["layout"] == 1
    assert again.key(gm, layouts, (1 << 20, 2, False, "config")) != key
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        assert again.recall(key, layouts[:1]) is None          # its chunk size is no candidate's
        (tmp_path / f"{key}.json").write_text("{not json")
        assert again.recall(key, layouts) is None
    warned = [r.getMessage() for r in caplog.records if "stored layout choice" in r.getMessage()]
    assert len(warned) == 2 and "none of the candidates" in warned[0] and "JSONDecodeError" in warned[1]
    assert again.hits["layout"] == 1


def test_an_activation_choice_is_kept_checked_and_made_again_when_it_does_not_hold(tmp_path, caplog):
    """Over budgets from the graph's own minimum down to the least "auto" reaches: a process with
    an empty store chooses and keeps; a fresh store takes each choice (no rewrite weighed) and it is
    the same plan; an entry naming segments the graph lacks, or a fit that no longer holds, is a miss
    said at WARNING and the choice is made again, the same as before."""
    import json

    from pscompile.compiled.choice_store import ChoiceStore
    from pscompile.graph.minimum import least_budget
    from pscompile.graph.pipeline import choose_activations, plan_inputs
    from pscompile import Config
    from conftest import make_batches, make_model
    config = Config(device="cpu", dtype=torch.float32)
    layout, analyzed = plan_inputs(make_model("gpt", dropout=0.1), make_batches("gpt", 1)[0], config)
    sizes = dict(slot_bytes=layout.chunk_size * 4)
    least = least_budget(analyzed, layout, policy="auto", **sizes).nbytes
    keep = least_budget(analyzed, layout, policy="keep", **sizes).nbytes
    budgets = [keep - (keep - least) * k // 4 for k in range(5)]
    first, variants = ChoiceStore(tmp_path), {}
    chosen = [choose_activations(analyzed, layout, policy="auto", budget=b, variants=variants, kept=first, **sizes)
              for b in budgets]
    assert first.hits["activations"] == 0 and len({c.activations.recomputed for c in chosen}) >= 3
    again, fresh = ChoiceStore(tmp_path), {}
    taken = [choose_activations(analyzed, layout, policy="auto", budget=b, variants=fresh, kept=again, **sizes)
             for b in budgets]
    assert again.hits["activations"] == len(budgets)
    assert [t.activations for t in taken] == [c.activations for c in chosen]
    assert len(fresh) <= len(budgets) + 1 < len(variants)      # one rewrite per choice, not the search's
    entries = sorted(tmp_path.glob("a*.json"))
    assert len(entries) == len(budgets)
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        for entry, bad in zip(entries, ({"segments": 99}, {"fits": None})):
            data = json.loads(entry.read_text())
            entry.write_text(json.dumps({**data, **({"fits": not data["fits"]} if "fits" in bad else bad)}))
        third = ChoiceStore(tmp_path)
        made = [choose_activations(analyzed, layout, policy="auto", budget=b, kept=third, **sizes) for b in budgets]
    assert [m.activations for m in made] == [c.activations for c in chosen]
    warned = [r.getMessage() for r in caplog.records if "stored activations choice" in r.getMessage()]
    assert len(warned) == 2 and third.hits["activations"] == len(budgets) - 2, warned
    assert any("segments, this graph has" in w for w in warned) and any("budget then" in w for w in warned)
