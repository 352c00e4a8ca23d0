"""``caffe train``'s signal handling (``caffe::SignalHandler``): SIGINT and SIGHUP become
requests the solver reads between iterations (:meth:`Solver.set_action_function
<keras_cct.caffe.train.solver.Solver.set_action_function>`).

Effects, as Caffe's ``-sigint_effect`` / ``-sighup_effect``: ``stop`` (finish the iteration,
then end training as if ``max_iter`` were reached: the solver writes its final snapshot when
``snapshot_after_train`` is true, Caffe's default, and the command exits with status 0),
``snapshot`` (write a snapshot and go on), ``none`` (ignore the signal). Defaults as Caffe:
SIGINT ``stop``, SIGHUP ``snapshot``. A second SIGINT while a stop is pending interrupts at
once (``KeyboardInterrupt``), for a training step that does not return.
"""

from __future__ import annotations

import signal
from typing import Optional

from keras_cct.errors import KerasCCTError

__all__ = ["SignalHandler", "EFFECTS"]

EFFECTS = ("stop", "snapshot", "none")


def check_effect(value: str, flag: str) -> str:
    """``value`` if it is one of :data:`EFFECTS` (Caffe's spelling), else a typed error."""
    if value not in EFFECTS:
        raise KerasCCTError(f"{flag} {value!r}: use snapshot, stop or none (as caffe train)")
    return value


class SignalHandler:
    """Install the SIGINT/SIGHUP handlers for a ``with`` block; :meth:`requested_action` is the
    solver's action function.

    Args:
        sigint_effect: what SIGINT asks for (``stop``, ``snapshot``, ``none``).
        sighup_effect: what SIGHUP asks for.
    """

    def __init__(self, sigint_effect: str = "stop", sighup_effect: str = "snapshot") -> None:
        self.sigint_effect = check_effect(sigint_effect, "--sigint-effect")
        self.sighup_effect = check_effect(sighup_effect, "--sighup-effect")
        self._got_sigint = False
        self._got_sighup = False
        self._stop_pending = False
        self._old = {}

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self._stop_pending:
                raise KeyboardInterrupt
            self._got_sigint = True
            self._stop_pending = self.sigint_effect == "stop"
        else:
            self._got_sighup = True

    def requested_action(self) -> str:
        """Caffe's ``GetRequestedAction``: the effect of the signal received since the last call
        (SIGINT first), or ``none``."""
        if self._got_sigint:
            self._got_sigint = False
            return self.sigint_effect
        if self._got_sighup:
            self._got_sighup = False
            return self.sighup_effect
        return "none"

    def __enter__(self) -> "SignalHandler":
        for name in ("SIGINT", "SIGHUP"):
            sig: Optional[int] = getattr(signal, name, None)
            if sig is not None:
                try:
                    self._old[sig] = signal.signal(sig, self._on_signal)
                except ValueError:  # not the main thread: signals stay as they are
                    pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
