"""Crash-consistent ZeRO checkpoints (2 gloo ranks, hooks mode): a rank killed at any moment of a
save leaves the previous checkpoint loadable on both ranks, and a folder whose files do not all
belong to the committed checkpoint is refused on every rank with nothing changed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import dist_worker
import pscompile
from test_dist import spawn

MOMENTS = {"rank1-before-file": 1, "rank0-before-commit": 1, "rank0-after-commit": 2}


def _loaded(tmp_path, name):
    spawn(dist_worker.load_checkpoint, str(tmp_path), name)
    return [torch.load(tmp_path / f"loaded-{name}-rank{r}.pt", weights_only=False) for r in range(2)]


def _equal(state: dict, want: dict) -> bool:
    return state["step"] == want["step"] and all(
        torch.equal(a, b) for key in ("master", "exp_avg", "exp_avg_sq") for a, b in zip(state[key], want[key]))


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_rank_killed_during_a_save_leaves_a_checkpoint_that_loads_on_both_ranks(tmp_path, moment):
    spawn(dist_worker.killed_save, str(tmp_path), moment)
    outcomes = [torch.load(tmp_path / f"outcome-rank{r}.pt") for r in range(2) if
                (tmp_path / f"outcome-rank{r}.pt").exists()]
    assert outcomes, "no rank survived to report"
    if moment != "rank0-after-commit":
        assert all("CollectiveError" in o for o in outcomes), outcomes      # the survivor was told
    step = MOMENTS[moment]
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == step and manifest["world_size"] == 2
    runs = _loaded(tmp_path, "ckpt")
    for r, run in enumerate(runs):
        assert run["error"] is None, run["error"]
        want = torch.load(tmp_path / f"state{step}-rank{r}.pt", weights_only=True)
        assert _equal(run["state"], want), f"rank {r} did not load the step-{step} state"
    if moment == "rank0-before-commit":
        # the uncommitted folder is complete but not named by the manifest: splice its rank 1 file
        # into the committed folder -- a mix of two steps, which both ranks refuse unchanged
        partial = [p for p in (tmp_path / "ckpt").iterdir() if p.is_dir() and p.name != manifest["folder"]]
        assert len(partial) == 1 and (partial[0] / "rank1.pt").exists()
        mixed = tmp_path / "mixed"
        shutil.copytree(tmp_path / "ckpt", mixed)
        shutil.copy(partial[0] / "rank1.pt", mixed / manifest["folder"] / "rank1.pt")
        runs = _loaded(tmp_path, "mixed")
        for run in runs:
            assert run["error"] is not None and "nothing was loaded on any rank" in run["error"], run["error"]
            assert "rank 1:" in run["error"] and run["unchanged"]
        with pytest.raises(ValueError, match="not the file its manifest committed"):
            pscompile.consolidate(mixed)                  # consolidate refuses the mix too
        # the next save commits and removes what the killed one left: one folder, two files
        spawn(dist_worker.load_and_save, str(tmp_path), "ckpt")
        manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(["manifest.json", manifest["folder"]])
        assert sorted(p.name for p in (tmp_path / "ckpt" / manifest["folder"]).iterdir()) == ["rank0.pt", "rank1.pt"]

