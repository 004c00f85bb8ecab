"""The byte-level corpus (pscompile.cli.data) and ``python -m pscompile train`` (fast: ~20 s); the
default run and docs/cli.md's sample of it are in tests/test_cli_docs.py."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch

from pscompile.cli.main import build_parser, main
from pscompile.cli.train import TrainSettings, run_train
from pscompile.cli.data import Corpus, fallback_text
from conftest import free_port
from inprocess import in_process

TINY_RUN = ["--model", "gpt-tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--no-progress"]


def _cli(*args, cwd):
    """``python -m pscompile train args`` in ``cwd``: its exit code and output, run in this process
    (the console script and ``python -m`` start a new one in the tests below and in test_readme)."""
    with contextlib.chdir(cwd):
        return in_process(lambda: main(["train", *args]))


# ------------------------------------------------------------------ corpus
@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_stdlib(max_bytes=256 * 1024)


def test_corpus_builds_from_stdlib_with_a_90_10_split(corpus):
    n = len(corpus.train) + len(corpus.val)
    assert corpus.source == "stdlib" and n == 256 * 1024
    assert len(corpus.train) == int(n * 0.9)
    for split in (corpus.train, corpus.val):
        assert split.dtype == torch.int64 and split.dim() == 1
        assert 0 <= int(split.min()) and int(split.max()) < Corpus.vocab_size == 256
    assert b"def " in bytes(corpus.train[:50_000].tolist())


def test_corpus_is_deterministic(corpus):
    again = Corpus.from_stdlib(max_bytes=256 * 1024)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    a = corpus.batch("train", 4, 16, torch.Generator().manual_seed(7))
    b = again.batch("train", 4, 16, torch.Generator().manual_seed(7))
    c = corpus.batch("train", 4, 16, torch.Generator().manual_seed(8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("split", ["train", "val"])
def test_batches_have_shapes_dtypes_and_shifted_targets(corpus, split):
    idx, targets = corpus.batch(split, 3, 32, torch.Generator().manual_seed(0))
    assert idx.shape == targets.shape == (3, 32)
    assert idx.dtype == targets.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    data = corpus.split(split)
    for row_idx, row_tgt in zip(idx, targets):   # each row is a real window of the split
        windows = data.unfold(0, 33, 1)
        hit = (windows == torch.cat([row_idx, row_tgt[-1:]])).all(dim=1)
        assert hit.any()


def test_targets_are_the_next_byte():
    c = Corpus.from_bytes(bytes(range(256)) * 8, val_fraction=0.25)
    idx, targets = c.batch("train", 5, 20, torch.Generator().manual_seed(1))
    assert torch.equal(targets, (idx + 1) % 256)


def test_falls_back_when_no_stdlib_sources(monkeypatch, tmp_path):
    import pscompile.cli.data as data
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "missing")})
    c = Corpus.from_stdlib()
    assert c.source == "fallback" and len(c.train) + len(c.val) == len(fallback_text())


def test_fallback_text_and_errors():
    c = Corpus.from_bytes(fallback_text(), source="fallback")
    assert len(c.train) > 10_000 and b"Beautiful is better than ugly" in bytes(c.train[:200].tolist())
    with pytest.raises(ValueError, match="split='test'"):
        c.batch("test", 1, 8)
    with pytest.raises(ValueError, match="seq_len"):
        c.batch("val", 1, len(c.val))
    with pytest.raises(ValueError, match="val_fraction"):
        Corpus.from_bytes(b"x" * 100, val_fraction=1.5)


# ------------------------------------------------------------------ CLI
def test_parser_has_train_with_documented_defaults():
    args = build_parser().parse_args(["train"])
    assert (args.mode, args.backend, args.dtype, args.device, args.chunk_size) == ("compiled", "eager", "float32", "cpu", "auto")
    assert build_parser().parse_args(["train", "--chunk-size", "4096", "--device-memory", "none"]).chunk_size == 4096
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--dtype", "int8"])


def test_every_flag_of_every_command_has_help_and_the_shared_ones_one_name(capsys):
    """One vocabulary: each flag is documented, and the model, batch and memory flags every command
    takes are spelled the same in each; ``--version`` names the package and torch."""
    import argparse
    import pscompile
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    shared = {"--model", "--n-layer", "--d-model", "--n-head", "--vocab-size", "--seq-len", "--batch-size", "--dtype",
              "--chunk-size", "--activations"}
    for name, p in sub.choices.items():
        if name == "bench":              # (its flags are bench/compare.py's, passed through)
            continue
        flags = {o for a in p._actions for o in a.option_strings}
        for a in p._actions:
            assert a.help and a.help.strip(), f"{name} {a.option_strings}: no help text"
        if name in ("train", "inspect", "plan"):
            assert shared <= flags, f"{name} lacks {shared - flags}"
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    assert f"pscompile {pscompile.__version__} (torch {torch.__version__})" in capsys.readouterr().out


def test_the_console_script_is_installed_beside_python_m_pscompile():
    """``pip install`` puts a ``pscompile`` command beside the interpreter (pyproject.toml's
    [project.scripts]); it is the same CLI as ``python -m pscompile``."""
    import subprocess
    import sys
    from pathlib import Path
    import pscompile
    script = Path(sys.executable).parent / "pscompile"
    assert script.exists(), f"no console script at {script}: pip install -e . makes it"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"pscompile {pscompile.__version__} "), out


@pytest.mark.parametrize("flags, field", [(["--steps", "0"], "--steps"), (["--lr", "-1"], "--lr"),
                                           (["--d-model", "64", "--n-head", "3"], "--n-head"),
                                           (["--json", "/no-such-folder/out.json"], "--json"),
                                           (["--batch-size", "6", "--grad-accum", "4"], "--grad-accum"),
                                           (["--eval-batches", "-1"], "--eval-batches"),
                                           (["--lock-free", "--staleness", "0"], "--staleness"),
                                           (["--vocab-size", "100"], "--vocab-size")])
def test_bad_flags_exit_2_naming_the_flag(flags, field, capsys):
    assert main(["train", "--model", "gpt-tiny", *flags]) == 2
    assert field in capsys.readouterr().err


def test_train_runs_prints_summary_and_writes_json(tmp_path):
    out = tmp_path / "out.json"
    r = _cli(*TINY_RUN, "--device-memory", "4MiB", "--vocab-size", "300", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for row in ("model", "chunks", "device budget", "loss first / last", "tokens/s", "peak device",
                "peak model / non-model", "moved per step", "fetches / evictions per step"):
        assert f"| {row} " in r.stdout
    assert "<= 4.0 MiB OK" in r.stdout and "| 4.0 MiB (4,194,304 bytes) " in r.stdout
    s = json.loads(out.read_text())
    expected = {"model", "chunk_size", "num_chunks", "utilisation", "budget_bytes", "steps", "loss_first",
                "loss_last", "losses", "tokens_per_s", "mean_step_s", "peak_device_bytes",
                "peak_device_model_bytes", "peak_nonmodel_bytes", "within_budget", "h2d_bytes_per_step",
                "d2h_bytes_per_step", "fetches_per_step", "evictions_per_step", "settings"}
    assert expected <= s.keys()
    assert s["steps"] == 3 and len(s["losses"]) == 3 and s["budget_bytes"] == 4 * 2**20
    assert s["peak_device_bytes"] <= s["budget_bytes"] and s["within_budget"]
    assert s["model"]["preset"] == "gpt-tiny" and s["model"]["vocab_size"] == 300 and "vocab 300," in r.stdout
    assert [v["step"] for v in s["val_losses"]] == [3] and "| validation loss " in r.stdout


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_train_with_gradient_accumulation_and_validation(mode):
    """--grad-accum splits each step's batch into micro-batches: the same losses as one batch in
    fp32 (the mean gradient is the same), and validation runs every --eval-every steps."""
    common = dict(model="gpt-tiny", steps=4, batch_size=4, seq_len=32, progress=False, log_every=0,
                  mode=mode, backend="eager", device_memory="4MiB", eval_batches=2)
    whole = run_train(TrainSettings(**common))
    accum = run_train(TrainSettings(**common, grad_accum=2, eval_every=2))
    assert accum["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    assert [v["step"] for v in accum["val_losses"]] == [2, 4]
    assert accum["val_losses"][-1]["loss"] == pytest.approx(whole["val_losses"][-1]["loss"], rel=1e-4)
    assert accum["within_budget"] and accum["peak_device_bytes"] <= whole["peak_device_bytes"]


def test_too_small_budget_exits_2_with_one_line_message(tmp_path):
    r = _cli(*TINY_RUN, "--device-memory", "64KiB", cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    # the error is one line, whatever else the environment prints (e.g. torch's warning at import
    # when numpy is missing): exactly one line is ours, and it carries the whole message
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("pscompile train: error:")]
    assert len(ours) == 1, r.stderr
    assert "device_memory" in ours[0] and "give device_memory >=" in ours[0]


def test_bad_preset_lists_valid_names(tmp_path):
    r = _cli("--model", "gpt-nope", cwd=tmp_path)
    assert r.returncode != 0
    assert "gpt-nope" in r.stderr and "gpt-tiny" in r.stderr and "gpt-mini" in r.stderr
    assert "Traceback" not in r.stderr


# hooks mode here; compiled mode (the default) runs through torchrun in the README's command
# (tests/test_readme.py), and its two ranks match one process in tests/test_dist.py
@pytest.mark.parametrize("mode", ["hooks"])
def test_torchrun_two_ranks_trains_with_zero_and_rank_0_reports(tmp_path, mode):
    """``torchrun --nproc_per_node 2 -m pscompile train``: both ranks train their half of each global
    batch (gloo), rank 0 alone prints progress and the summary; the loss matches one process
    training on the whole batch with the same ranks' halves as accumulated micro-batches."""
    out = tmp_path / "zero.json"
    flags = ["--model", "gpt-tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--no-progress",
             "--device-memory", "3MiB", "--mode", mode, "--eval-batches", "1"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master-port", str(free_port()), "-m", "pscompile",
                          "train", *flags, "--json", str(out)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("| ZeRO ranks") == 1, "one summary, from rank 0"
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["dist_backend"] == "gloo" and r["within_budget"]
    assert r["allgather_bytes_per_step"] > 0 and r["reduce_scatter_bytes_per_step"] > 0
    one = run_train(TrainSettings(model="gpt-tiny", steps=4, batch_size=4, seq_len=32, progress=False, log_every=0,
                                  device_memory="3MiB", mode=mode, eval_batches=1, grad_accum=2))
    for a, b in zip(r["losses"], one["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (r["losses"], one["losses"])
