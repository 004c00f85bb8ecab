"""The examples run as a user runs them, on tiny shapes: ``examples/finetune_hf.py`` trains, evaluates,
samples, checkpoints and saves a Hugging Face model, and a run interrupted after a checkpoint goes
on with ``--resume`` exactly as the uninterrupted run did (the scheduler and the data position come
back); ``examples/torchrun_zero.py`` trains on 2 ranks and commits a sharded checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inprocess import in_process, load_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--d-model", "64", "--n-layer", "2", "--n-head", "2", "--seq-len", "32", "--batch-size", "2",
        "--warmup", "2", "--corpus-bytes", "200000", "--csv", "--save-every", "3", "--eval-every", "3",
        "--steps", "6", "--log-level", "INFO"]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _values(folder: Path, name: str) -> list[tuple[int, float]]:
    rows = [line.split(",") for line in (folder / "metrics.csv").read_text().splitlines()]
    return [(int(step), float(value)) for step, what, value in rows if what == name]


def _schedule_rates(steps: int) -> list[float]:
    """The rates finetune_hf.py's schedule gives at steps 1..steps (TINY's flags, the default lr)."""
    spec = importlib.util.spec_from_file_location("finetune_hf", EXAMPLES / "finetune_hf.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched, out = example.schedule(opt, 2, steps, 1e-3), []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_finetune_hf_trains_samples_saves_and_resumes_exactly(tmp_path):
    """A run interrupted after step 4 (its checkpoint: step 3) and resumed: step 4 runs again with
    the same loss and rate (the weights, the generators, the data position and the scheduler came
    back), and every step's rate is the schedule's."""
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    # the interrupted run here (a new interpreter costs ~7 s), the resumed one as a user runs it
    first = in_process(lambda: load_script(EXAMPLES / "finetune_hf.py").main(["--out", str(run), "--stop-after", "4",
                                                                             *TINY]))
    assert first.returncode == 0, first.stderr[-3000:]
    proc = _run(str(EXAMPLES / "finetune_hf.py"), "--out", str(run), "--resume", *TINY)
    assert "resuming at step 3" in proc.stderr
    assert "val loss" in proc.stderr and "sample:" in proc.stderr
    assert "planned the train schedule" in proc.stderr, "pscompile's plan summary is not on the log"
    losses, rates = _values(run, "loss"), _values(run, "lr")
    assert [s for s, _ in losses] == [1, 2, 3, 4, 4, 5, 6]
    assert losses[3] == losses[4], "the resumed step 4 differs from the interrupted run's"
    assert [r for _, r in rates] == pytest.approx([_schedule_rates(6)[s - 1] for s, _ in rates], rel=1e-12)
    assert len(set(r for _, r in rates)) >= 5, "the schedule hardly moved: proves little"
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
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
