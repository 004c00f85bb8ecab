"""docs/cli.md and the CLI agree.

- The flag table: each command takes every flag its column gives a value for (parsed with that
  value), refuses every flag marked "—", and takes no flag the table leaves out.
- Every ``python -m pscompile ...`` command of the page runs here, and every block is checked:
  ``train``'s sample summary against the default run's first steps (its deterministic rows exactly),
  ``plan``'s machine lines exactly, ``inspect``'s header lines, ``bench --list``'s legend.
- Sizes are read one way: "GB" is 10^9 bytes, "GiB" 2^30, in every size flag.

The default ``train`` run (4 of its 450 steps, ~8 s) is the one train run here; tests/test_cli.py
runs tiny ones.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path

import pytest

from inprocess import in_process
from pscompile.cli.bench import LEGEND, index_rows
from pscompile.cli.main import build_parser, command_parsers, main
from pscompile.cli.train import summary_table

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "cli.md").read_text()
STEPS = 450                      # the documented run's steps (TrainSettings' default)


def _section(title: str) -> str:
    """The text of the ``## `` section whose heading starts with ``title``."""
    (body,) = [s for s in re.split(r"^## ", DOC, flags=re.M) if s.startswith(title)]
    return body


def _blocks(text: str) -> list[str]:
    return re.findall(r"^```text\n(.*?)^```", text, flags=re.M | re.S)


def _command(first: str) -> list[str]:
    """The page's one ``python -m pscompile FIRST ...`` command, as argv after ``pscompile``."""
    (argv,) = [a for a in _documented_commands() if a[0] == first]
    return argv


def _documented_commands() -> list[list[str]]:
    return [shlex.split(c)[3:] for c in re.findall(r"`(python -m pscompile [^`<]*)`", DOC)]


def _rows(table: str) -> dict[str, str]:
    """``| label | value |`` lines as {label: value}."""
    cells = (line.strip().strip("|").split("|", 1) for line in table.splitlines() if line.startswith("| "))
    return {label.strip(): value.strip() for label, value in cells}


def _flag_table() -> tuple[list[str], dict[str, list[str]]]:
    """(the commands of the table's columns, {flag: its cell per command})."""
    lines = [ln for ln in _section("Flags").splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    commands = header[1:header.index("what it sets")]
    table = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0].strip("`")] = cells[1:1 + len(commands)]
    return commands, table


def _cell_argv(cell: str) -> list[str] | None:
    """A cell's example: its value as argv, ``[]`` for a switch, None for "—" (not taken)."""
    if cell.startswith("—"):
        return None
    return [] if cell == "yes" else [cell.strip("`")]


# ------------------------------------------------------------------ the flag table
def test_the_documented_commands_are_each_run_here():
    firsts = sorted(a[0] for a in _documented_commands())
    assert firsts == ["--version", "bench", "inspect", "plan", "train"], \
        f"docs/cli.md's commands {firsts}: each needs a test here that runs it"
    assert len(_blocks(DOC)) == 2 and DOC.count("```") == 4, "a new block in docs/cli.md needs a test here"


def test_each_command_takes_the_flags_the_table_gives_it_and_no_others():
    parser = build_parser()
    parsers = command_parsers(parser)
    commands, table = _flag_table()
    assert commands == ["train", "inspect", "plan"]
    for command in commands:
        takes = {a.option_strings[0] for a in parsers[command]._actions} - {"-h"}  # (old spellings after)
        documented = {flag for flag, cells in table.items() if _cell_argv(cells[commands.index(command)]) is not None}
        assert takes == documented, (f"{command}: takes but the table lacks {sorted(takes - documented)}; "
                                     f"the table gives it but it refuses {sorted(documented - takes)}")
        for flag, cells in table.items():
            argv = _cell_argv(cells[commands.index(command)])
            if argv is None:
                assert flag not in parsers[command]._option_string_actions, f"{command} takes {flag}: the table says —"
            else:
                parser.parse_args([command, flag, *argv])      # a refusal exits, naming the flag


def test_every_model_command_takes_the_shared_vocabulary():
    """The issue's command: ``inspect --n-layer 3`` (and the rest of the shared flags) parse."""
    commands, table = _flag_table()
    for flag in ("--model", "--n-layer", "--d-model", "--n-head", "--vocab-size", "--seq-len", "--batch-size",
                 "--chunk-size", "--dtype", "--activations"):
        assert all(_cell_argv(c) is not None for c in table[flag]), flag
    assert build_parser().parse_args(["inspect", "--n-layer", "3"]).n_layer == 3


def test_a_flag_of_another_command_is_refused_naming_that_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--gpu-memory", "3GB"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--gpu-memory is a flag of plan" in err and "inspect --help" in err


# ------------------------------------------------------------------ the commands and their samples
@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The documented ``train`` command, its first 4 steps: the printed table and the JSON summary."""
    folder = tmp_path_factory.mktemp("train")
    argv = [*_command("train"), "--steps", "4", "--no-progress", "--log-every", "0", "--json", "summary.json"]
    with contextlib.chdir(folder):
        r = in_process(lambda: main(argv))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, json.loads((folder / "summary.json").read_text())


def test_the_default_budget_evicts_chunks_every_step(default_run):
    _, s = default_run
    assert s["budget_bytes"] == 44 * 2**20 and s["within_budget"]
    assert min(s["per_step"]["evictions"]) > 0 and min(s["per_step"]["fetches"]) > 0
    model_data = s["num_chunks"] * s["chunk_size"] * 16    # fp32 param + master + exp_avg + exp_avg_sq
    assert s["peak_device_model_bytes"] < model_data                # not everything fits


def test_the_train_sample_is_what_the_command_prints(default_run):
    """Every row of the sample is a row of the summary, in its order; the rows that do not vary
    with the machine are exact. ``moved`` and ``fetches / evictions`` are means over steps 2-450:
    step 2's, then step 3's for the rest once steps 3 and 4 show that they repeat."""
    out, s = default_run
    (sample,) = _blocks(_section("`pscompile train`"))
    shown, printed = _rows(sample), _rows(out)
    labels = [label for label in printed if label in shown]
    assert labels == list(shown), f"rows missing from or out of order in the sample: {list(shown)} vs {list(printed)}"
    full = dict(s, steps=STEPS)
    for key, column in (("fetches_per_step", "fetches"), ("evictions_per_step", "evictions"),
                        ("h2d_bytes_per_step", "h2d_bytes"), ("d2h_bytes_per_step", "d2h_bytes")):
        per_step = s["per_step"][column]
        assert per_step[2] == per_step[3], f"{column} {per_step}: steps 3 and 4 differ, so no steady state"
        full[key] = (per_step[1] + (STEPS - 2) * per_step[2]) / (STEPS - 1)
    expected = _rows(summary_table(full))
    for label in ("engine", "chunks", "device budget", "model data", "activations", "peak device",
                  "peak model / non-model", "moved per step", "fetches / evictions per step"):
        assert shown[label] == expected[label], f"docs/cli.md's {label!r} row is stale"


def test_the_documented_inspect_command_prints_what_the_page_says(tmp_path):
    with contextlib.chdir(tmp_path):
        r = in_process(lambda: main(_command("inspect")))
    assert r.returncode == 0, r.stderr[-2000:]
    promised = re.findall(r"`(# [^`]*)`", _section("`pscompile inspect`"))
    assert len(promised) == 2
    for line in promised:
        assert line.split("...")[0].strip() in r.stdout, line     # (what "..." stands for varies)
    assert (tmp_path / "pscompile-schedule" / "schedule.txt").is_file()


def test_the_documented_plan_command_prints_the_machine_it_assumed(tmp_path, capsys):
    """The sample's lines exactly, and the sizes as written: 24GB and 64GB both 10^9 bytes each."""
    assert main([*_command("plan"), "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    (sample,) = _blocks(_section("`pscompile inspect` and `pscompile plan`"))
    assert out.startswith(sample), out[:1000]
    machine = json.loads((tmp_path / "plan.json").read_text())["machine"]
    assert machine == {"preset": "yard", "assumed": True, "gpus": 8, "gpu_memory": 24 * 10**9,
                       "cpu_memory": 64 * 10**9, "disk": None}


def test_the_version_command_names_the_package(capsys):
    with pytest.raises(SystemExit) as e:
        main(_command("--version"))
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pscompile ")


def test_bench_list_explains_every_mark_of_its_times(capsys):
    """Each mark the index's time columns use is in the printed legend and in the page."""
    assert main(_command("bench")) == 0
    out = capsys.readouterr().out
    legend = out.split("\nminutes: ", 1)[1]
    rows = index_rows((ROOT / "bench" / "README.md").read_text())
    marks = {ch for r in rows for cell in (r[3], r[4]) for ch in cell if not (ch.isalnum() or ch in " .,()`-:")}
    assert marks, "no marks found: the index's columns moved"
    explained = {mark for mark, _ in LEGEND}
    assert marks <= explained, f"marks without a meaning: {marks - explained}"
    bench_section = _section("`pscompile bench`")
    for mark in marks:
        assert f"{mark} " in legend and f"`{mark}`" in bench_section, mark


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("argv, flag", [(["plan", "--gpu-memory", "24XB"], "--gpu-memory"),
                                        (["plan", "--cpu-memory", "lots"], "--cpu-memory"),
                                        (["plan", "--disk", "2PB"], "--disk"),
                                        (["train", "--device-memory", "44MIBS"], "--device-memory"),
                                        (["inspect", "--device-memory", "x"], "--device-memory"),
                                        (["train", "--host-memory", "2 GB/s"], "--host-memory")])
def test_a_size_that_cannot_be_read_is_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: " in err and "GB (24 x 10^9 bytes)" in err


def test_a_gpu_of_1gb_is_refused_naming_the_flag_and_what_works(capsys):
    """1GB (10^9 bytes) is less than the 1 GiB a GPU keeps for the CUDA context."""
    assert main(["plan", "--gpu-memory", "1GB"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-memory 1GB leaves nothing after the 1.0 GiB" in err and "e.g. --gpu-memory 24GiB" in err


def test_every_size_flag_reads_gb_as_decimal_and_gib_as_binary():
    from pscompile.cli.plan import DEFAULT_HARDWARE, machine_lines
    from pscompile.planner import hardware_preset
    from pscompile.units import parse_size
    args = build_parser().parse_args(["plan", "--gpu-memory", "24GiB", "--cpu-memory", "64GB", "--disk", "2TB"])
    hw = hardware_preset(DEFAULT_HARDWARE).with_(gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory,
                                                 disk=args.disk)
    assert (hw.gpu_memory, hw.cpu_memory, hw.disk) == (24 * 2**30, 64 * 10**9, 2 * 10**12)
    lines = machine_lines(args, hw)
    assert "24.0 GiB = 25.8 GB (25,769,803,776 bytes) each (--gpu-memory 24GiB)" in lines[2]
    assert "59.6 GiB = 64.0 GB (64,000,000,000 bytes) (--cpu-memory 64GB)" in lines[3]
    for text, n in (("44MiB", 44 * 2**20), ("44MB", 44 * 10**6), ("2GB", 2 * 10**9), ("1.5KiB", 1536)):
        assert parse_size(build_parser().parse_args(["train", "--device-memory", text]).device_memory, "x") == n
