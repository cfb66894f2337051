"""Bad output places: --out and export folders on a full disk or a read-only file system (real tmpfs
mounts, root only), --out onto a FIFO, a character device or a link to stdout, a distillation checkpoint
on a full disk, the pipeline on a read-only output folder. The old file or export is always kept.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time

import pytest

from analysis import cli
from tests._bad_input import (SENTINEL, ckpt, model_dir, snapshot, assert_one_line_error, EXPORT, tmpfs, fill_disk,
                              PIPE, real_cli, distill_pair, IDS, CFG)  # noqa: F401 (fixtures)


def test_out_on_a_full_disk_keeps_the_old_file(tmpfs, ckpt, capsys):
    disk = tmpfs("size=1m")
    out = disk / "scores.csv"
    out.write_bytes(SENTINEL)
    fill_disk(disk)
    before = snapshot(disk)
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--format", "csv", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 2
    line = assert_one_line_error(err, r"disk is full", r"free some space")
    assert "another format" not in line and "previous file was kept" in line
    assert snapshot(disk) == before and out.read_bytes() == SENTINEL


def test_out_on_a_read_only_disk(tmpfs, ckpt, capsys):
    disk = tmpfs("size=1m")
    (disk / "scores.json").write_bytes(SENTINEL)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(disk / "scores.json")])
    _, err = capsys.readouterr()
    assert code == 2
    assert_one_line_error(err, r"read-only", r"writable disk")
    assert (disk / "scores.json").read_bytes() == SENTINEL


def test_export_on_a_full_disk_says_so_and_keeps_the_previous_export(tmpfs, model_dir, capsys):
    disk = tmpfs("size=5m")
    argv = [*EXPORT, "--model", str(model_dir), "--out-dir", str(disk), "--name", "cut", "--export-format", "zeroed"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    previous = snapshot(disk / "cut")
    fill_disk(disk, leave=16 * 1024)
    before = snapshot(disk)
    code = cli.main([*argv, "--overwrite"])
    _, err = capsys.readouterr()
    assert code == 2
    line = assert_one_line_error(err, r"disk is full", r"free some space")
    assert "another format" not in line and "previous export was kept" in line
    assert snapshot(disk) == before and snapshot(disk / "cut") == previous


def test_checkpoint_on_a_full_disk_is_the_projects_error(tmpfs):
    from analysis.compress.recover.distill import CheckpointError, DistillConfig, distill
    disk = tmpfs("size=256k")
    fill_disk(disk, leave=8192)
    with pytest.raises(CheckpointError, match=r"disk is full.*no earlier checkpoint exists.*free some space"):
        distill(*distill_pair(), IDS, DistillConfig(**CFG), checkpoint_dir=disk / "ck")
    assert not [p for p in (disk / "ck").iterdir() if ".tmp-" in p.name]


# -- 2: --out onto a device, a FIFO, a link to stdout ------------------------------------------------

def test_out_onto_a_fifo_with_a_reader_writes_into_it(ckpt, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(fifo)])
    reader.join(30)
    assert code == 0 and stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO became a regular file"
    assert json.loads(got[0])["scores"]


def test_out_onto_a_fifo_without_a_reader_is_an_error_not_a_hang(ckpt, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(fifo)])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, r"pipe has no reader", r"start the reader")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_out_onto_a_character_device_writes_to_it(ckpt, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("making a character device (mknod) needs root")
    dev = tmp_path / "null"
    try:
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))        # /dev/null's numbers, in a scratch folder
    except PermissionError as err:
        pytest.skip(f"mknod is not permitted here: {err}")
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(dev)])
    assert code == 0 and stat.S_ISCHR(os.lstat(dev).st_mode), "the device became a regular file"
    assert [p.name for p in tmp_path.iterdir()] == ["null"]            # no temporary left beside it


@pytest.mark.slow
def test_out_onto_a_link_to_stdout_prints_and_keeps_the_link(ckpt, tmp_path):
    link = tmp_path / "stdout"
    os.symlink("/proc/self/fd/1", link)
    done = real_cli(["score", "--quiet", "--checkpoint", ckpt, "--out", link], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["scores"]
    assert os.path.islink(link) and os.readlink(link) == "/proc/self/fd/1"


# -- 9: the pipeline's run folder ----------------------------------------------------------------------

def test_pipeline_on_a_read_only_out_dir_fails_before_the_first_round(tmpfs, model_dir, capsys):
    disk = tmpfs("size=1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    started = time.perf_counter()
    code = cli.main([*PIPE, "--model", str(model_dir), "--out-dir", str(disk / "runs"), "--name", "run"])
    assert code == 2 and time.perf_counter() - started < 30, "it ran the rounds before checking the output"
    assert_one_line_error(capsys.readouterr().err, r"read-only", r"writable")
    assert list(disk.iterdir()) == []
