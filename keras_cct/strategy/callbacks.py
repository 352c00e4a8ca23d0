"""Keras callback that logs CCTStrategy's per-layer device fractions."""

from __future__ import annotations

from typing import List

import keras


class FractionLogger(keras.callbacks.Callback):
    """Records :meth:`CCTStrategy.report` at the end of every epoch (and prints it when
    ``verbose``). ``history`` holds one report per epoch."""

    def __init__(self, strategy, verbose: int = 1) -> None:
        super().__init__()
        self.strategy = strategy
        self.verbose = verbose
        self.history: List[list] = []

    def on_epoch_end(self, epoch, logs=None) -> None:
        report = self.strategy.report()
        self.history.append(report)
        if not self.verbose:
            return
        by_layer = {}
        for row in report:
            by_layer.setdefault(row["layer"], []).append(row)
        for layer, rows in by_layer.items():
            parts = ", ".join(
                f"{r['device']} {r['fraction']:.2f} ({r['ms']:.1f} ms)"
                + ("" if r["active"] else " dropped") for r in rows)
            keras.utils.io_utils.print_msg(f"cct epoch {epoch + 1}: {layer}: {parts}")
