"""Crash-consistent ZeRO checkpoints (2 gloo ranks, hooks mode): a rank killed at any moment of a
save leaves the previous checkpoint loadable on both ranks, and a folder whose files do not all
belong to the committed checkpoint is refused on every rank with nothing changed, as is one
rank's file edited with its checksum recomputed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dist_worker
import pscompile
from conftest import rewrite_checkpoint
from test_dist import spawn

MOMENTS = {"rank1-before-file": 1, "rank0-before-commit": 1, "rank0-after-commit": 2}


def _loaded(tmp_path, name):
    spawn(dist_worker.load_checkpoint, str(tmp_path), name)
    return [torch.load(tmp_path / f"loaded-{name}-rank{r}.pt", weights_only=False) for r in range(2)]


RANK1_EDITS = {      # rank 1's file edited, its checksum and the manifest's record recomputed to match
    "nan": (None, lambda ts: {n: t.clone().fill_(float("nan")) if n.startswith("exp_avg.") else t
                              for n, t in ts.items()}, "holds inf or NaN"),
    "meta": (lambda h: {**h, "meta": [1]}, None, "its 'meta' is a list, not a JSON object"),
    "client": (lambda h: {**h, "client": "x"}, None, "its 'client' is a str, not a JSON object"),
    "step": (lambda h: {**h, "state": {**h["state"], "step": 2**70}}, None, "fits int64"),
}


def _edit_rank1(src: Path, dst: Path, header, tensors) -> None:
    """A copy of the committed ZeRO folder ``src`` whose rank 1 file is edited and recommitted."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    file = dst / manifest["folder"] / "rank1.pt"
    rewrite_checkpoint(src / manifest["folder"] / "rank1.pt", file, header=header, tensors=tensors)
    data = file.read_bytes()
    manifest["files"]["rank1.pt"] = {**manifest["files"]["rank1.pt"], "bytes": len(data), "sha256": data[-32:].hex()}
    (dst / "manifest.json").write_text(json.dumps(manifest))


def _refused_on_both_ranks_unchanged(tmp_path) -> None:
    """Every edit of rank 1's file alone is refused by both ranks, naming rank 1's problem, and
    neither rank's engine changed: the ranks agree on one list of problems before loading."""
    for name, (header, tensors, _) in RANK1_EDITS.items():
        _edit_rank1(tmp_path / "ckpt", tmp_path / name, header, tensors)
    spawn(dist_worker.load_checkpoint, str(tmp_path), list(RANK1_EDITS))
    for name, (_, _, words) in RANK1_EDITS.items():
        for r in range(2):
            run = torch.load(tmp_path / f"loaded-{name}-rank{r}.pt", weights_only=False)
            assert run["error"] is not None and "nothing was loaded on any rank" in run["error"], (name, r, run)
            assert "rank 1:" in run["error"] and words in run["error"] and run["unchanged"], (name, r, run)
            assert "rank 0:" not in run["error"], (name, r, run["error"])


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
    if moment == "rank0-after-commit":
        _refused_on_both_ranks_unchanged(tmp_path)
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

