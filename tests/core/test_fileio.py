"""core.fileio's fsync helpers: what they fsync (os.fsync recorded by inode)."""

from __future__ import annotations

import os

from hivetune.core.fileio import fsync_tree


def test_fsync_tree_fsyncs_every_file_and_folder_once_and_changes_nothing(tmp_path, monkeypatch):
    root = tmp_path / "tree"
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    files = {root / "top.json": b"{}\n", root / "a" / "x.bin": b"\x00\x01", root / "a" / "b" / "y.txt": b"y"}
    for path, data in files.items():
        path.write_bytes(data)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real(fd))
    fsync_tree(root)
    folders = [root, root / "a", root / "a" / "b", root / "empty"]
    assert sorted(synced) == sorted(p.stat().st_ino for p in [*files, *folders])
    assert all(path.read_bytes() == data for path, data in files.items())
