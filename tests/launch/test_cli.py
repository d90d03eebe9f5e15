"""`mgrpo`'s entry point: Ctrl-C, megatron-core's import-time fallback notes, make-tiny/make-data's --out."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import launch.cli as cli


def test_ctrl_c_is_one_line_and_exit_status_130(monkeypatch, tmp_path, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_make_tiny", interrupted)
    monkeypatch.setenv("PYTHONWARNINGS", "")
    assert cli.main(["make-tiny", "--out", str(tmp_path / "t")]) == 130
    err = capsys.readouterr().err
    assert err == "\nmgrpo make-tiny: interrupted (Ctrl-C)\n"


def test_fallback_notes_are_silenced_here_and_in_child_processes(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    cli._quiet_fallback_notes()
    cli._quiet_fallback_notes()  # idempotent: the filters are not appended twice
    env = os.environ["PYTHONWARNINGS"]
    assert env == ("default::DeprecationWarning,ignore:Transformer Engine and Apex are not installed:UserWarning,"
                   "ignore:Apex is not installed:UserWarning")
    code = ("import warnings\n"
            "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
            "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
            "warnings.warn('another UserWarning')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=60)
    assert p.returncode == 0
    assert "another UserWarning" in p.stderr
    assert "not installed" not in p.stderr


@pytest.mark.parametrize("cmd", ["make-tiny", "make-data"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_out_that_is_a_file_is_refused_before_any_work(cmd, force, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for out, message in ((afile, f"--out {afile} is a file, not a directory: pass a directory"),
                         (afile / "sub", f"--out {afile / 'sub'}: {afile} is a file, not a directory: pass a directory")):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--out", str(out), *force])
        assert e.value.code == 2 and capsys.readouterr().err == f"mgrpo {cmd}: {message}\n"
    assert afile.read_text() == "keep" and sorted(tmp_path.iterdir()) == [afile]
