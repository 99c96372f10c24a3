"""The e2e node's setup, without root: containerd runs the shim built with it, whatever the PATH holds."""

from __future__ import annotations

import os
from pathlib import Path

from node import BIN, Node, node_env


def test_containerd_runs_the_shim_built_with_it_not_one_found_on_the_path(tmp_path: Path, monkeypatch) -> None:
    # Debian's containerd package puts its own containerd-shim-runc-v2 on the PATH.
    distro = tmp_path / "usr-bin"
    distro.mkdir()
    (distro / "containerd-shim-runc-v2").write_text("#!/bin/sh\nexit 1\n")
    monkeypatch.setenv("PATH", f"{distro}{os.pathsep}/usr/bin")
    node = Node(None, tmp_path / "state")  # type: ignore[arg-type]
    node.state.mkdir()
    text = node._containerd_config(tmp_path / "cni", tmp_path / "cni-bin", "pause:1").read_text()
    runc = text.split('.containerd.runtimes.runc]\n', 1)[1].split("[", 1)[0]
    settings = dict(line.strip().split(" = ", 1) for line in runc.splitlines() if " = " in line)
    assert settings["runtime_type"] == '"io.containerd.runc.v2"'
    assert settings["runtime_path"] == f'"{BIN / "containerd-shim-runc-v2"}"'
    # What containerd and the kubelet look up on the PATH is ours first.
    assert node_env()["PATH"].split(os.pathsep)[:2] == [str(BIN), str(distro)]
