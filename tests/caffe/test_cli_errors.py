"""Every bad ``cct`` command line: one clear line on stderr, exit status 1 or 2, no traceback,
no hang (issue 15's 96-case sweep: its tracebacks, hangs and accepted nonsense).

Most cases run ``keras_cct.cli.main`` in this process (the argument checks come before any
work, and an unexpected exception would fail the test). The cases that hung -- ``cct train``
of a net with an HDF5Data layer stopping on an error while the prefetch thread reads -- and one
argparse case run the real entry point in a subprocess, timed from the error line to the exit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from keras_cct.cli import main
from keras_cct.errors import DataError

ROOT = Path(__file__).resolve().parents[2]

# TensorFlow's and absl's own log lines on stderr (not cct's): "I0000 00:00:... file.cc:N] ..."
_NOISE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl|"
                    r"To enable the following instructions)")

_HDF5_NET = """name: "tiny_hdf5"
layer { name: "d" type: "HDF5Data" top: "data" top: "label"
  hdf5_data_param { source: "files.txt" batch_size: 4 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
  inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""

_DEPLOY = """name: "deploy"
input: "data"
input_dim: 1 input_dim: 1 input_dim: 6 input_dim: 6
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 2 kernel_size: 3 } }
"""

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"),
                                reason="uses /proc as a folder no one can write in")


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder with an HDF5Data net and its solver, a deploy net, .npz arrays and a plain
    file; the working directory (the solver names its files relative to it, as Caffe)."""
    import h5py
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = rng.normal(size=(8, 1, 6, 6)).astype(np.float32)
        f["label"] = (np.arange(8) % 3).astype(np.float32)
    (tmp_path / "files.txt").write_text("a.h5\n")
    (tmp_path / "net.prototxt").write_text(_HDF5_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 2 display: 1 '
        'snapshot: 2 snapshot_prefix: "snap/tiny"\n')
    (tmp_path / "deploy.prototxt").write_text(_DEPLOY)
    images = np.zeros((8, 4, 4, 3), np.uint8)
    np.savez(tmp_path / "ok.npz", images=images, labels=np.arange(8))
    np.savez(tmp_path / "mismatch.npz", images=images, labels=np.arange(3))
    np.savez(tmp_path / "nokeys.npz")
    np.savez(tmp_path / "noimages.npz", images=images[:0], labels=np.arange(0))
    (tmp_path / "zero.npz").write_bytes(b"")
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "empty.solverstate").write_bytes(b"")
    (tmp_path / "wrong.solverstate").write_bytes((tmp_path / "a.h5").read_bytes())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cct_lines(err: str):
    """cct's lines of ``err``: without TensorFlow's log lines and argparse's usage block."""
    lines, usage = [], False
    for line in err.splitlines():
        if not line.strip() or _NOISE.match(line):
            continue
        if line.startswith("usage: "):
            usage = True
            continue
        if usage and line.startswith(" "):  # the usage block's continuation lines
            continue
        usage = False
        lines.append(line)
    return lines


def _assert_one_error_line(err: str, command: str, *needles: str) -> str:
    assert "Traceback" not in err, err
    lines = _cct_lines(err)
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"cct {command}: error: "), line
    assert "(unexpected" not in line, line  # a typed error, not the guard's
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def _id(value):
    """Test ids: the command line (the needles get pytest's own ids)."""
    commands = ("train", "test", "time", "data", "convert", "export", "bench")
    if isinstance(value, list) and value and value[0] in commands:
        return " ".join(value)
    return None


# -- argparse: counts and sizes (status 2, before any work) ------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["test", "--model", "net.prototxt", "--weights", "w.caffemodel", "--iterations", "0"],
     "--iterations"),
    (["test", "--model", "net.prototxt", "--weights", "w.caffemodel", "--iterations", "-1"],
     "--iterations"),
    (["time", "--model", "net.prototxt", "--iterations", "0"], "--iterations"),
    (["time", "--model", "net.prototxt", "--iterations", "-3"], "--iterations"),
    (["time", "--model", "net.prototxt", "--batch", "0"], "--batch"),
    (["time", "--model", "net.prototxt", "--batch", "-1"], "--batch"),
    (["time", "--model", "net.prototxt", "--iterations", "many"], "--iterations"),
    (["data", "ok.npz", "db", "--resize-height", "-5"], "--resize-height"),
    (["export", "deploy.prototxt", "-o", "m.onnx", "--batch-size", "0"], "--batch-size"),
], ids=_id)
def test_bad_counts_exit_2_with_one_line(work, capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    _assert_one_error_line(capsys.readouterr().err, argv[0], needle)


# -- typed errors (status 1) ------------------------------------------------------------------

@pytest.mark.parametrize("argv, needles", [
    # unwritable outputs, found before the work
    (["convert", "deploy.prototxt", "-o", "afile/m.keras"], ["-o afile/m.keras", "not a folder"]),
    pytest.param(["convert", "deploy.prototxt", "-o", "/proc/no/m.keras"],
                 ["-o /proc/no/m.keras", "cannot write"], marks=needs_proc),
    (["export", "deploy.prototxt", "-o", "afile/m.onnx"], ["-o afile/m.onnx", "not a folder"]),
    pytest.param(["export", "deploy.prototxt", "-o", "/proc/m.onnx"],
                 ["-o /proc/m.onnx", "cannot write"], marks=needs_proc),
    (["export", "deploy.prototxt", "-o", "m.onnx", "--opset", "0"],
     ["--opset 0", "opsets 7 to"]),
    # time: an --input-shape for a blob the net does not have
    (["time", "--model", "net.prototxt", "--input-shape", "nope=1,1,6,6"],
     ["nope", "inputs are data, label"]),
    (["time", "--model", "net.prototxt", "--random-data", "--input-shape", "data=0,1,6,6"],
     ["data=0,1,6,6", "positive"]),
    (["time", "--model", "net.prototxt", "--devices", "bogus"], ["--devices bogus"]),
    (["time", "--model", "deploy.prototxt", "--batch", "100000000"],
     ["--batch 100000000", "GiB", "smaller batch"]),
    (["time", "--model", "net.prototxt", "--random-data"], ["--input-shape data=N,C,H,W"]),
    (["test", "--model", "deploy.prototxt", "--weights", "w.caffemodel"],
     ["deploy.prototxt", "no data layer"]),
    # cct data: bad arrays, unwritable DB or --mean, sizes
    (["data", "nokeys.npz", "db"], ["nokeys.npz", "must hold images"]),
    (["data", "zero.npz", "db"], ["zero.npz", "cannot read the arrays"]),
    (["data", "noimages.npz", "db"], ["noimages.npz", "no images"]),
    (["data", "mismatch.npz", "db"], ["mismatch.npz", "8 images", "one label per image"]),
    (["data", "ok.npz", "afile"], ["DB afile", "not a folder"]),
    (["data", "ok.npz", "afile/db"], ["DB afile/db", "not a folder"]),
    pytest.param(["data", "ok.npz", "/proc/db"], ["DB /proc/db", "cannot write"],
                 marks=needs_proc),
    (["data", "ok.npz", "db", "--mean", "afile/mean.binaryproto"],
     ["--mean afile/mean.binaryproto"]),
    (["data", "ok.npz", "db", "--resize-height", "5"], ["--resize-width 0", "both"]),
    (["data", "missing.npz", "db"], ["missing.npz", "not found"]),
    (["bench", "--out", "afile/results"], ["--out afile/results", "not a folder"]),
], ids=_id)
def test_bad_arguments_are_one_typed_line(work, capsys, argv, needles):
    rc = main(argv)
    assert rc == 1
    _assert_one_error_line(capsys.readouterr().err, argv[0], *needles)
    assert not (work / "db").exists() and not (work / "m.onnx").exists()


def test_train_unknown_opencl_device_is_one_line(work, capsys):
    """``--devices opencl:9:9`` is refused before the nets are built (it was TensorFlow's
    UnknownError with a traceback at the first step)."""
    rc = main(["train", "--solver", "solver.prototxt", "--devices", "opencl:9:9"])
    assert rc == 1
    _assert_one_error_line(capsys.readouterr().err, "train", "--devices opencl:9:9",
                           "no device 'opencl:9:9'")
    assert not (work / "snap").exists()


def test_cct_time_of_a_deploy_net_uses_random_data(work, capsys):
    """``caffe time -model deploy.prototxt``: a net without data layers is timed on random
    inputs (it asked for arrays, naming the Python API); ``--batch`` sets their batch."""
    rc = main(["time", "--model", "deploy.prototxt", "--iterations", "1", "--no-layers",
               "--batch", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "Average Forward pass" in out


def test_cct_data_still_works_with_both_sizes(work, capsys):
    """The checks leave good arguments alone: both resize sizes and a --mean are written."""
    rc = main(["data", "ok.npz", "db", "--resize-height", "2", "--resize-width", "3",
               "--mean", "out/mean.binaryproto"])
    assert rc == 0, capsys.readouterr().err
    from keras_cct.caffe.io.binary import blob_to_array, read_binaryproto
    assert blob_to_array(read_binaryproto("out/mean.binaryproto")).shape == (1, 3, 2, 3)
    assert not list(work.glob(".cct-write-check*"))  # the probe leaves nothing behind


def test_lmdb_writer_failure_is_a_data_error(work):
    """The writer itself (not only cct's check before it) reports a folder it cannot create
    as a DataError naming the path."""
    from keras_cct.caffe.io.lmdb_io import write_arrays
    with pytest.raises(DataError, match=r"afile/db: cannot create the LMDB"):
        write_arrays(work / "afile" / "db", np.zeros((2, 3, 3), np.uint8), [0, 1])


# -- the guard in cli.main ---------------------------------------------------------------------

def test_an_error_wrapped_by_a_library_is_printed_as_the_typed_one(work, capsys, monkeypatch):
    """TensorFlow re-raises a layer's error as its own type with the keras_cct error as the
    cause: cct prints the typed error's line."""
    from keras_cct.caffe import commands
    from keras_cct.errors import DeviceError

    def fails(args):
        try:
            raise DeviceError("opencl:0:0 stopped answering (restart it)")
        except DeviceError as exc:
            raise RuntimeError("UnknownError: ...\n\n[[node x]]") from exc

    monkeypatch.setattr(commands, "_info", fails)
    assert main(["info", "deploy.prototxt"]) == 1
    _assert_one_error_line(capsys.readouterr().err, "info", "opencl:0:0 stopped answering")


def test_an_unexpected_error_is_one_line_or_a_traceback_with_cct_debug(work, capsys,
                                                                       monkeypatch):
    from keras_cct.caffe import commands

    def fails(args):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(commands, "_info", fails)
    assert main(["info", "deploy.prototxt"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["cct info: error: ZeroDivisionError: division by zero "
                                "(unexpected; CCT_DEBUG=1 shows the traceback)"]
    monkeypatch.setenv("CCT_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["info", "deploy.prototxt"])


# -- prefetch threads never block exit --------------------------------------------------------

def test_stop_prefetchers_ends_every_reader_thread():
    from keras_cct.caffe.train.prefetch import prefetch, stop_prefetchers

    def endless():
        i = 0
        while True:
            i += 1
            yield i

    its = [prefetch(endless(), depth=2) for _ in range(3)]
    assert [next(it) for it in its] == [1, 1, 1]
    t0 = time.monotonic()
    stop_prefetchers(timeout=5.0)
    assert all(it.join(0) for it in its) and time.monotonic() - t0 < 5.0
    assert not [t for t in threading.enumerate() if t.name == "cct-prefetch" and t.is_alive()]
    with pytest.raises(DataError, match="was stopped"):  # not a wait forever
        for _ in range(4):  # the items queued before the stop, then the error
            next(its[0])


def test_main_in_process_stops_only_the_prefetchers_its_command_started(work, capsys):
    from keras_cct.caffe.train.prefetch import prefetch, running_prefetchers
    mine = prefetch(iter(range(1000)), depth=2)
    assert main(["train", "--solver", "solver.prototxt", "--snapshot-prefix", "afile/x"]) == 1
    assert "afile" in capsys.readouterr().err
    assert running_prefetchers() == [mine] and next(mine) == 0
    mine.close()


_H5_READER = """
import h5py, numpy as np
from keras_cct.caffe.train.prefetch import prefetch
def reads():  # the thread spends nearly all its time inside h5py (holding its global lock)
    while True:
        for _ in range(400):
            with h5py.File("a.h5", "r") as f:
                x = np.asarray(f["data"])
        yield x
it = prefetch(reads(), depth=1)
next(it)
print("cct: error: leaving with a reader thread inside h5py", flush=True)
"""


def test_a_reader_thread_inside_h5py_does_not_block_exit(work):
    """Without stopping the prefetch threads at exit, this process never ends (3 of 3 runs):
    the daemon thread is frozen holding h5py's lock, which the shutdown then waits for."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen([sys.executable, "-c", _H5_READER], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # after TensorFlow's import, however long it takes
        t0 = time.monotonic()
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the process did not exit: a prefetch thread blocked the shutdown")
    assert "leaving" in line and rc == 0
    assert time.monotonic() - t0 < 10.0


_STUCK_SHUTDOWN = """
import atexit, sys, time
from keras_cct.cli import main
from keras_cct.errors import DataError
atexit.register(time.sleep, 120)  # something that blocks the interpreter's shutdown
sys.argv = ["cct", "convert", "deploy.prototxt", "-o", "afile/m.keras"]
sys.exit(main())
"""


def test_a_stuck_shutdown_after_an_error_still_ends_the_cct_process(work):
    """The last resort: after an error, ``cct`` ends with status 1 within seconds even when
    something else blocks the shutdown (here an atexit handler sleeping 120 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_SHUTDOWN], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            if ": error: " in line:
                break
        t0 = time.monotonic()
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the cct process did not end: " + "".join(err))
    assert rc == 1 and time.monotonic() - t0 < 10.0
    _assert_one_error_line("".join(err) + proc.stderr.read(), "convert", "afile/m.keras")


# -- the real entry point: the cases that hung ------------------------------------------------

def _run_cct(argv, cwd, limit=150.0):
    """Run ``python -m keras_cct.cli ARGV``; returns (status, stderr, seconds from the error
    line to the exit). The overall limit covers TensorFlow's import on a loaded machine."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen([sys.executable, "-m", "keras_cct.cli"] + argv, cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err, seen = [], []

    def read():
        for line in proc.stderr:
            err.append(line)
            if not seen and ": error: " in line:
                seen.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"cct {' '.join(argv)} did not exit within {limit} s: {''.join(err)}")
    end = time.monotonic()
    reader.join(5)
    assert seen, "".join(err)
    return rc, "".join(err), end - seen[0]


@pytest.mark.parametrize("argv, needles", [
    (["train", "--solver", "solver.prototxt", "--snapshot", "missing.solverstate"],
     ["missing.solverstate", "not found"]),
    (["train", "--solver", "solver.prototxt", "--snapshot", "empty.solverstate"],
     ["empty.solverstate"]),
    (["train", "--solver", "solver.prototxt", "--snapshot", "wrong.solverstate"],
     ["wrong.solverstate"]),
    (["train", "--solver", "solver.prototxt", "--devices", "bogus"], ["--devices bogus"]),
    (["train", "--solver", "solver.prototxt", "--snapshot-prefix", "afile/x"],
     ["snapshot_prefix", "afile", "not a folder"]),
    (["time", "--model", "net.prototxt", "--iterations", "0"], ["--iterations"]),
], ids=["snapshot-missing", "snapshot-empty", "snapshot-wrong", "devices-bogus",
        "snapshot-prefix-under-a-file", "time-iterations-0"])
def test_cct_process_exits_promptly_with_one_line(work, argv, needles):
    rc, err, after = _run_cct(argv, work)
    assert rc in (1, 2), err
    assert after < 10.0, f"exited {after:.1f} s after the error: {err}"
    _assert_one_error_line(err, argv[0], *needles)
    assert not (work / "snap").exists()  # nothing trained, nothing snapshotted
