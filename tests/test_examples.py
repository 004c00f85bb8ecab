"""The examples run as a user runs them, on tiny shapes: ``examples/finetune_hf.py`` trains, evaluates,
samples, checkpoints and saves a Hugging Face model, and a run interrupted after a checkpoint goes
on with ``--resume`` exactly as the uninterrupted run did (the scheduler and the data position come
back); ``examples/torchrun_zero.py`` trains on 2 ranks and commits a sharded checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--d-model", "64", "--n-layer", "2", "--n-head", "2", "--seq-len", "32", "--batch-size", "2",
        "--warmup", "2", "--corpus-bytes", "200000", "--csv", "--save-every", "3", "--eval-every", "3",
        "--steps", "6", "--log-level", "INFO"]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(folder: Path) -> list[tuple[int, float]]:
    rows = [line.split(",") for line in (folder / "metrics.csv").read_text().splitlines()]
    return [(int(step), float(value)) for step, name, value in rows if name == "loss"]


def test_finetune_hf_trains_samples_saves_and_resumes_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    proc = _run(str(EXAMPLES / "finetune_hf.py"), "--out", str(whole), *TINY)
    assert "val loss" in proc.stderr and "sample:" in proc.stderr
    assert "planned the train schedule" in proc.stderr, "pscompile's plan summary is not on the log"
    steps = _losses(whole)
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6]
    _run(str(EXAMPLES / "finetune_hf.py"), "--out", str(broken), "--stop-after", "4", *TINY)
    proc = _run(str(EXAMPLES / "finetune_hf.py"), "--out", str(broken), "--resume", *TINY)
    assert "resuming at step 3" in proc.stderr
    resumed = _losses(broken)
    assert resumed[:4] == steps[:4] and resumed[4:] == steps[3:], (resumed, steps)   # step 4 ran twice
    model = transformers.AutoModelForCausalLM.from_pretrained(whole / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not beside this interpreter")
def test_torchrun_zero_trains_on_two_ranks_and_commits_one_checkpoint(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", str(EXAMPLES / "torchrun_zero.py"), "--steps", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout and "mean over 2 ranks" in proc.stdout
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 2 and len(manifest["files"]) == 2
