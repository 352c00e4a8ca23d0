"""Training logs: Caffe's ``tools/extra/parse_log.py`` and ``plot_training_log.py``.

:func:`parse_log` reads a log of ``cct train`` or of Caffe itself (glog lines such as
``I1203 10:00:00.000000 12345 solver.cpp:218] Iteration 100 (..), loss = 0.5``) into train and
test rows with parse_log.py's columns: ``NumIters``, ``Seconds``, ``LearningRate`` and one column
per net output (``loss``, ``accuracy``, ...). A row is complete when it has as many columns as
the first one, as in parse_log.py, with one difference: a complete last row that parse_log.py
never pushes (the only test of a short run) is kept. As in parse_log.py, a display block's
``LearningRate`` is the last ``lr =`` line before its outputs (Caffe logs the rate after them,
so a train row shows the previous display's rate; the first row takes the second's).
``Seconds`` counts from the ``Solving`` line by the glog timestamps; a ``cct train`` log has
none, so there it is the sum of the ``Ns/K iters`` lapses of its ``Iteration N (...)`` lines
(training time, tests and snapshots excluded).
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import os
import re
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from keras_cct._files import atomic_path, atomic_write
from keras_cct.errors import DataError

__all__ = ["parse_log", "write_csv", "plot_log", "COLUMNS"]

#: the first columns of every row, as parse_log.py writes them
COLUMNS = ("NumIters", "Seconds", "LearningRate")

_ITERATION = re.compile(r"Iteration (\d+)")
_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
_LAPSE = re.compile(r"Iteration \d+ \([^)]*?([\d.eE+-]+)s/\d+ iters\)")
_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) ")

Row = Dict[str, float]


def _glog_time(line: str, year: int) -> Optional[datetime.datetime]:
    """The timestamp of a glog line (``I1203 10:00:00.000000 ...``), or None."""
    m = _GLOG.match(line.strip())
    if not m:
        return None
    month, day, hour, minute, second, micro = (int(g) for g in m.groups())
    try:
        return datetime.datetime(year, month, day, hour, minute, second, micro)
    except ValueError:
        return None


def _net_output(regex, row: Optional[Row], rows: List[Row], line: str, iteration: float,
                seconds: float, rate: float) -> Optional[Row]:
    """parse_log.py's ``parse_line_for_net_output``: start, fill and push rows."""
    match = regex.search(line)
    if match:
        if not row or row["NumIters"] != iteration:
            if row:
                rows.append(row)
            row = OrderedDict([("NumIters", iteration), ("Seconds", seconds),
                               ("LearningRate", rate)])
        row[match.group(2)] = float(match.group(3))
    if row and rows and len(row) == len(rows[0]):
        rows.append(row)
        row = None
    return row


def parse_lines(lines: Iterable[str], *, year: Optional[int] = None
                ) -> Tuple[List[Row], List[Row]]:
    """``(train_rows, test_rows)`` of a log's lines (see the module docstring)."""
    year = year or datetime.date.today().year
    lines = list(lines)
    start = None
    for line in lines:
        if "Solving" in line:
            start = _glog_time(line, year)
            break
    iteration, rate, lapsed = -1.0, float("nan"), 0.0
    last = start
    train: List[Row] = []
    test: List[Row] = []
    train_row: Optional[Row] = None
    test_row: Optional[Row] = None
    for line in lines:
        m = _ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        lapse = _LAPSE.search(line)
        if lapse:
            lapsed += float(lapse.group(1))
        if iteration == -1:
            continue
        when = _glog_time(line, year)
        if start is not None and when is None:
            continue  # parse_log.py skips lines without a timestamp in a glog log
        if when is not None and last is not None and when.month < last.month:
            year += 1  # the log ran over new year
            when = _glog_time(line, year)
        if when is not None:
            last = when
        seconds = (when - start).total_seconds() if when is not None and start else lapsed
        m = _LEARNING_RATE.search(line)
        if m:
            rate = float(m.group(1))
        train_row = _net_output(_TRAIN_OUTPUT, train_row, train, line, iteration, seconds, rate)
        test_row = _net_output(_TEST_OUTPUT, test_row, test, line, iteration, seconds, rate)
    for rows, row in ((train, train_row), (test, test_row)):
        if row and (not rows or len(row) == len(rows[0])):
            rows.append(row)  # parse_log.py drops it (a log with one test, one display)
    for rows in (train, test):  # parse_log.py's fix_initial_nan_learning_rate
        if len(rows) > 1:
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
    return train, test


def parse_log(path: str) -> Tuple[List[Row], List[Row]]:
    """``(train_rows, test_rows)`` of the log file at ``path``.

    Raises:
        DataError: the file cannot be read, or holds no ``Iteration N`` line.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        raise DataError(f"cannot read the log: {exc.strerror or exc}", path=path,
                        hint="give the log written by `cct train` or `caffe train` "
                             "(e.g. `cct train ... 2>&1 | tee train.log`)") from None
    # parse_log.py takes the year from the file's creation time
    year = datetime.datetime.fromtimestamp(os.path.getmtime(path)).year
    train, test = parse_lines(text.splitlines(), year=year)
    if not train and not test:
        raise DataError("no 'Iteration N' line with a 'Train net output' or 'Test net output' "
                        "in it: not a training log", path=path,
                        hint="log with display > 0 (train rows) or test_interval > 0 (test "
                             "rows); glog lines must keep their 'I1203 10:00:00.000000' prefix")
    return train, test


def write_csv(path: str, rows: Sequence[Row], delimiter: str = ",") -> bool:
    """Write ``rows`` as parse_log.py does (header from the first row), atomically; False (no
    file) when there are no rows."""
    if not rows:
        return False
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), delimiter=delimiter,
                            lineterminator="\r\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, buf.getvalue())
    return True


def _outputs(rows: Sequence[Row]) -> List[str]:
    names: List[str] = []
    for row in rows:
        names += [k for k in row if k not in COLUMNS and k not in names]
    return names


def plot_log(train: Sequence[Row], test: Sequence[Row], path: str, *, x: str = "NumIters",
             title: str = "") -> None:
    """Training curves as plot_training_log.py draws them (train outputs, test outputs and the
    learning rate against ``x``: ``NumIters`` or ``Seconds``), written atomically to ``path``
    (PNG, SVG or PDF by its extension)."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    panels = [(f"Train {n}", train, n) for n in _outputs(train)] + \
             [(f"Test {n}", test, n) for n in _outputs(test)] + \
             [("Learning rate", train or test, "LearningRate")]
    cols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.5 * cols, 3.2 * nrows), dpi=100)
    label = "Iters" if x == "NumIters" else "Seconds"
    for i, (name, rows, key) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, i + 1)
        pts = [(r[x], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(name)
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    ext = os.path.splitext(path)[1].lower() or ".png"
    with atomic_path(path, suffix=ext) as tmp:
        fig.savefig(tmp, format=ext[1:])
