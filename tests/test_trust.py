"""The key and tag behind a checkpoint's measurements (pscompile/compiled/trust.py)."""

from __future__ import annotations

import os
import stat
import threading

import torch

from pscompile.compiled import trust

CPU = torch.device("cpu")
MEASURED = {"context": {"budget": 1000}, "captures": {"g": {"measured": [1, 2], "node": [3]}}, "rates": [1.5, 2.0]}


def test_the_key_is_made_once_owner_only_and_two_makers_agree(tmp_path, monkeypatch):
    path = tmp_path / "keys" / "measurements.key"
    monkeypatch.setenv(trust.KEY_ENV, str(path))
    assert trust.machine_key(create=False) is None
    keys = []
    threads = [threading.Thread(target=lambda: keys.append(trust.machine_key(create=True))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys[0]) == trust.KEY_BYTES
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(path.parent)) == ["measurements.key"], "a temporary key was left behind"


def test_a_tag_holds_for_exactly_the_measurements_and_machine_it_was_made_for(tmp_path, monkeypatch):
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "a.key"))
    sealed = trust.seal(MEASURED, CPU)
    assert trust.verified(sealed, CPU)
    import json
    assert trust.verified(json.loads(json.dumps(sealed)), CPU), "a checkpoint's JSON round trip breaks the tag"
    changed = json.loads(json.dumps(sealed))
    changed["captures"]["g"]["measured"][0] = 0
    assert not trust.verified(changed, CPU)
    assert not trust.verified({**sealed, "tag": None}, CPU)
    assert not trust.verified({k: v for k, v in sealed.items() if k != "tag"}, CPU)
    monkeypatch.setattr(trust, "machine", lambda device: {"torch": "another"})
    assert not trust.verified(sealed, CPU), "measured with another torch, yet trusted"
    monkeypatch.undo()
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "b.key"))
    trust.machine_key(create=True)
    assert not trust.verified(sealed, CPU), "another user's key, yet trusted"


def test_no_key_where_none_can_be_made_saves_without_a_tag(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(trust.KEY_ENV, str(blocked / "measurements.key"))
    sealed = trust.seal(MEASURED, CPU)
    assert sealed["tag"] is None and not trust.verified(sealed, CPU)
