"""``python -m pscompile inspect``: compile a GPT preset, print and save its schedule (~15 s)."""

import importlib.util
import json
import subprocess
import sys

from pscompile.cli.main import build_parser, main

TINY = ["--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32"]


def _inspect(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pscompile", "inspect", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def test_inspect_prints_the_header_and_saves_the_schedule(tmp_path):
    out = tmp_path / "sched"
    r = _inspect(*TINY, "--device-memory", "2MiB", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# pscompile schedule (compiled mode, training iteration)")
    for name in ("capture_joint", "plan_residency", "insert_memory_ops", "verify_schedule"):
        assert f"#   {name} " in r.stdout
    assert "memory nodes (" in r.stdout and "pscompile.fetch" in r.stdout and "host->device" in r.stdout
    files = ["schedule.txt", "schedule_table.txt", "timeline.json"]
    if importlib.util.find_spec("matplotlib") is not None:
        files.append("timeline.png")
    for name in files:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
        assert str(out / name) in r.stdout                          # the written paths are printed
    listing = (out / "schedule.txt").read_text()
    assert "def iteration(" in listing and "# fetch chunk" in listing
    data = json.loads((out / "timeline.json").read_text())
    assert data["budget"] == 2 << 20
    assert max(n["total_bytes"] for n in data["nodes"]) <= data["budget"]


def test_inspect_budget_too_small_exits_2_naming_device_memory(tmp_path, capsys):
    code = main(["inspect", *TINY, "--device-memory", "256KiB", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pscompile inspect: error: ") and "device_memory=" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_inspect_flags_and_bad_values():
    args = build_parser().parse_args(["inspect"])
    assert (args.model, args.batch_size, args.seq_len, args.device_memory, args.dtype) == \
        ("gpt-small-test", 16, 128, "44MiB", "float32")
    args = build_parser().parse_args(["inspect", *TINY, "--device-memory", "none", "--chunk-size", "4096",
                                      "--dtype", "bfloat16", "--out", "d", "--measure"])
    assert (args.device_memory, args.chunk_size, args.dtype, args.out, args.measure) == \
        (None, 4096, "bfloat16", "d", True)
    assert main(["inspect", "--model", "gpt-tiny", "--batch-size", "0"]) == 2
