"""Parent side of the OpenCL device worker: start, talk to, restart and stop worker processes.

One :class:`WorkerClient` per OpenCL device name (``"opencl:P:D"`` or ``"opencl:P:D.S"``) runs
``worker.py`` as a script in a child process (so that it never imports TensorFlow), lazily on
the first call. Arrays cross through a shared-memory arena (:mod:`multiprocessing.shared_memory`)
that the client grows as needed; only small requests are pickled. A worker that died (crash,
SIGKILL) is restarted transparently and the request retried (up to :data:`RESTARTS` times, with
a growing pause); errors inside it come back as :class:`~keras_cct.errors.OpenCLError` (with the
OpenCL message and build log) or :class:`~keras_cct.errors.WorkerError`.

Every request has a deadline (:func:`request_timeout`: ``KERAS_CCT_DEVICE_TIMEOUT`` seconds, or
by default :data:`DEFAULT_TIMEOUT` plus a share of the request's work; a worker's first request
of each command gets :data:`DEFAULT_START_TIMEOUT` more, ``KERAS_CCT_DEVICE_START_TIMEOUT``, for
its start and kernel builds). A worker that misses it (a hung driver, a stopped process) is
killed with SIGKILL and the request fails with :class:`~keras_cct.errors.DeviceTimeoutError`;
the next request starts a fresh worker.

Requests are asynchronous, like a GPU stream: :meth:`WorkerClient.submit` queues one and
returns a :class:`concurrent.futures.Future` at once; the client's *device thread* copies the
inputs into the arena, talks to the worker and copies the outputs back, one request at a time,
in order. So the caller (e.g. a TensorFlow op that launches a shard, then computes its own) is
not held up by the transfers, and with ``KERAS_CCT_WORKER_CPUS`` the device thread runs on the
device's own cores, like a DMA engine, not on the caller's.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from keras_cct.errors import DeviceError, DeviceTimeoutError, OpenCLError, WorkerError
from keras_cct.devices.opencl.worker import parse_cpus

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
ALIGN = 4096
DEFAULT_ICD_DIR = "/etc/OpenCL/vendors"
#: Seconds a request may take by default, plus its work at :data:`SLOW_FLOPS`.
DEFAULT_TIMEOUT = 60.0
#: Extra seconds for a worker's first request of each command (process start, kernel builds).
DEFAULT_START_TIMEOUT = 120.0
#: A pessimistic device speed (FLOP/s) for the work-size part of the default deadline.
SLOW_FLOPS = 1e9
#: Restarts of a worker that died during one request before it fails, and the first pause
#: between them (doubled each time).
RESTARTS = 3
RESTART_PAUSE = 0.1
TIMEOUT_VAR = "KERAS_CCT_DEVICE_TIMEOUT"
START_TIMEOUT_VAR = "KERAS_CCT_DEVICE_START_TIMEOUT"


def _seconds(var: str, env: Optional[Mapping[str, str]], default: float) -> float:
    """``var`` from ``env`` (a worker's extra environment), else the process' environment, as
    seconds (``0``: no deadline), else ``default``."""
    text = (env or {}).get(var, os.environ.get(var, "")).strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise DeviceError(f"{var}={text!r}: expected seconds, a number >= 0 (0: no deadline)")
    return value if value > 0 else float("inf")


def request_timeout(work: float = 0.0, env: Optional[Mapping[str, str]] = None) -> float:
    """Seconds one request of ``work`` floating-point operations may take: ``$KERAS_CCT_DEVICE_TIMEOUT``
    when set (``0``: no deadline), else :data:`DEFAULT_TIMEOUT` + ``work`` / :data:`SLOW_FLOPS`.

    Raises:
        DeviceError: the variable is not a number >= 0.
    """
    fixed = _seconds(TIMEOUT_VAR, env, 0.0)
    return fixed if fixed > 0 else DEFAULT_TIMEOUT + max(float(work), 0.0) / SLOW_FLOPS


def parse_opencl_name(name: str) -> str:
    """``"opencl:P:D"`` / ``"opencl:P:D.S"`` -> ``"P:D"`` / ``"P:D.S"`` (validated).

    Raises:
        DeviceError: the name is not an OpenCL device name.
    """
    parts = str(name).split(":")
    ok = len(parts) == 3 and parts[0] == "opencl" and parts[1].isdigit()
    if ok:
        d = parts[2].split(".")
        ok = len(d) in (1, 2) and all(p.isdigit() for p in d)
    if not ok:
        raise DeviceError(f"{name!r} is not an OpenCL device name; use 'opencl:P:D' (platform P, "
                          "device D) or 'opencl:P:D.S' (sub-device S); `cct devices` lists them")
    return f"{parts[1]}:{parts[2]}"


def worker_environment(extra: Optional[Mapping[str, str]] = None,
                       spec: Optional[str] = None) -> Dict[str, str]:
    """The environment a worker starts with: the parent's, with ``OCL_ICD_VENDORS`` pointing at
    the system's ICD folder when unset, ``POCL_MAX_PTHREAD_COUNT=1`` for a 1-CU sub-device
    (PoCL's fission alone does not limit its threads), then ``extra``."""
    env = dict(os.environ)
    if "OCL_ICD_VENDORS" not in env and os.path.isdir(DEFAULT_ICD_DIR):
        env["OCL_ICD_VENDORS"] = DEFAULT_ICD_DIR
    if spec is not None and "." in spec:
        env.setdefault("POCL_MAX_PTHREAD_COUNT", "1")
    # The worker must never import TensorFlow or keras_cct's package top level.
    env.pop("PYTHONSTARTUP", None)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


class WorkerClient:
    """A handle on one worker process (started lazily, restarted if it died).

    Args:
        spec: ``"P:D"``, ``"P:D.S"`` or ``None`` for a worker that only lists devices.
        env: extra environment variables for the worker (e.g. ``POCL_MAX_PTHREAD_COUNT``);
            changing them with :meth:`set_env` restarts the worker.
        name: the device name, used in error messages.
    """

    def __init__(self, spec: Optional[str], env: Optional[Mapping[str, str]] = None,
                 name: Optional[str] = None) -> None:
        self.spec = spec
        self.name = name or (f"opencl:{spec}" if spec else "opencl (discovery)")
        self.env = dict(env or {})
        self._lock = threading.RLock()
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._stderr = None
        self._shm: Optional[shared_memory.SharedMemory] = None
        self._arena: Optional[np.ndarray] = None
        self._attached = False
        self._pid_owner = os.getpid()
        self.starts = 0
        self._thread_lock = threading.Lock()
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._thread_cpus: Optional[frozenset] = None
        self._warm: set = set()  # the commands this worker has answered (kernels built)
        self._closing = False
        self._budget = float("inf")  # seconds of the request in flight

    # -- life cycle -----------------------------------------------------------------------------
    @property
    def pid(self) -> Optional[int]:
        """The worker's process id, or None when it is not running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def set_env(self, env: Mapping[str, str]) -> None:
        """Replace the extra environment; the worker restarts on its next call."""
        with self._lock:
            if dict(env) != self.env:
                self.env = dict(env)
                self.stop()

    def _start(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, WORKER_SCRIPT, str(child_sock.fileno()), self.spec or "-"],
                pass_fds=(child_sock.fileno(),), env=worker_environment(self.env, self.spec),
                stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr,
                cwd=os.path.dirname(WORKER_SCRIPT), close_fds=True)
        finally:
            child_sock.close()
        self._conn = Connection(os.dup(parent_sock.fileno()))
        parent_sock.close()
        self._attached = False
        self._warm = set()
        self._pid_owner = os.getpid()
        self.starts += 1

    def _ensure(self) -> None:  # on the device thread (a fork was handled by _start_thread)
        if self._proc is None or self._proc.poll() is not None:
            self._drop()
            self._start()

    def _stderr_tail(self) -> str:
        try:
            self._stderr.seek(0)
            return self._stderr.read()[-4000:].decode(errors="replace").strip()
        except Exception:  # noqa: BLE001
            return ""

    def _drop(self) -> None:
        """Forget a dead (or to-be-stopped) worker's process and connection."""
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        self._conn = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._attached = False

    def stop(self, wait: Optional[float] = None) -> None:
        """Ask the worker to exit (kill it if it does not) and free the arena.

        Args:
            wait: seconds to wait for a request that is running (it ends by its deadline at
                the latest); past them the worker is killed, and that request fails or is
                retried on a fresh worker. None: wait for it (the exit handler waits 2 s).
        """
        if self._pid_owner != os.getpid():
            return
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # the device thread sees the death
            return
        grace = 5.0 if wait is None else min(wait, 2.0)
        try:
            if self._conn is not None and self._proc is not None and self._proc.poll() is None:
                try:
                    self._conn.send(("exit", {}))
                    if self._conn.poll(grace):
                        self._conn.recv()
                    self._proc.wait(timeout=grace)
                except (OSError, EOFError, subprocess.TimeoutExpired):
                    pass
            self._drop()
            if self._shm is not None:
                self._arena = None
                try:
                    self._shm.close()
                    self._shm.unlink()
                except (OSError, BufferError):
                    pass
                self._shm = None
        finally:
            self._lock.release()

    # -- requests ---------------------------------------------------------------------------------
    def _exchange(self, cmd: str, kwargs: dict, until: float = float("inf")):
        """Send one request and wait for its answer until ``until`` (``time.monotonic()``)."""
        try:
            self._conn.send((cmd, kwargs))
            wait = until - time.monotonic()
            if wait < float("inf") and not self._conn.poll(max(wait, 0.0)):
                self._stalled(cmd)
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            try:
                code = self._proc.wait(timeout=10) if self._proc is not None else None
            except subprocess.TimeoutExpired:
                code = None
            tail = self._stderr_tail()
            self._drop()
            raise _WorkerDied(f"the OpenCL worker of {self.name} died (exit code {code}) "
                              f"during {cmd!r}" + (f"; its output:\n{tail}" if tail else "")) \
                from exc

    def _stalled(self, cmd: str) -> None:
        """The worker missed its deadline: kill it (SIGKILL ends a stopped process too)."""
        pid = self._proc.pid if self._proc is not None else None
        self._drop()
        raise DeviceTimeoutError(
            f"OpenCL device {self.name} did not answer {cmd!r} within its deadline of "
            f"{self._budget:.1f} s (a hung driver or a stopped worker process); its worker "
            f"(pid {pid}) was killed and a fresh one starts on the next call. If the device is "
            f"only slow, raise the deadline: {TIMEOUT_VAR}=SECONDS (0: none)")

    def _arena_for(self, nbytes: int) -> np.ndarray:
        if self._shm is None or self._shm.size < nbytes:
            if self._shm is not None:
                self._arena = None
                self._attached = False
                try:
                    self._shm.close()
                    self._shm.unlink()
                except (OSError, BufferError):
                    pass
                self._shm = None
            size = max(1 << 20, 1 << max(nbytes - 1, 1).bit_length())
            free = _shm_free_bytes()
            if free is not None and size > free:
                size = nbytes  # no headroom: exactly what this call needs
            if free is not None and size > free:
                # Touching pages of a shared-memory file beyond what tmpfs holds kills the process
                # with SIGBUS, so refuse here with a clear message instead.
                raise DeviceError(
                    f"OpenCL device {self.name}: the arrays of this call need "
                    f"{nbytes / 2**20:.0f} MiB of shared memory but /dev/shm has only "
                    f"{free / 2**20:.0f} MiB free (enlarge it, e.g. `docker run --shm-size=2g`, "
                    "or use a smaller batch)")
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self._arena = np.ndarray((size,), np.uint8, buffer=self._shm.buf)
            self._attached = False
        return self._arena

    def call(self, cmd: str, inputs: Optional[Mapping[str, np.ndarray]] = None,
             outputs: Optional[Mapping[str, Tuple[Tuple[int, ...], type]]] = None, *,
             work: float = 0.0, timeout: Optional[float] = None, **kwargs):
        """Run ``cmd`` in the worker with arrays crossing through shared memory, and wait.

        Args:
            cmd: a worker command (``worker.Worker.cmd_*``).
            inputs: name -> array, copied into the arena; their byte offsets are passed to the
                worker as ``off[name]``.
            outputs: name -> (shape, dtype) of arrays the worker writes into the arena.
            work: the request's floating-point operations (for the default deadline).
            timeout: seconds the request may take (None: :func:`request_timeout` of ``work``
                with this worker's environment); the first request of each command on a fresh
                worker gets ``KERAS_CCT_DEVICE_START_TIMEOUT`` more.
            **kwargs: small, picklable arguments.

        Returns:
            ``(result, {name: array})`` -- the worker's answer and fresh copies of the outputs.

        Raises:
            OpenCLError: an OpenCL call (build, launch) failed; the message carries its log.
            WorkerError: the worker died :data:`RESTARTS` + 1 times in a row, or failed
                unexpectedly.
            DeviceTimeoutError: the worker did not answer in time (it was killed).
            DeviceError: the worker rejected the request (bad shape or arguments).
        """
        return self.submit(cmd, inputs, outputs, work=work, timeout=timeout, **kwargs).result()

    def submit(self, cmd: str, inputs: Optional[Mapping[str, np.ndarray]] = None,
               outputs: Optional[Mapping[str, Tuple[Tuple[int, ...], type]]] = None, *,
               work: float = 0.0, timeout: Optional[float] = None, **kwargs) -> Future:
        """Queue a request (the arguments of :meth:`call`) and return at once.

        The inputs are read later, on the device thread: they must not change until the
        future is done. The future's result is :meth:`call`'s; its exception one of
        :meth:`call`'s errors. Requests run one at a time, in the order submitted.
        """
        if timeout is None:
            timeout = request_timeout(work, self.env)
        future: Future = Future()
        job = (future, cmd, dict(inputs or {}), dict(outputs or {}), float(timeout), kwargs)
        with self._thread_lock:  # not self._lock: that one is held while a request runs
            self._start_thread()
            self._jobs.put(job)
        return future

    # -- the device thread ----------------------------------------------------------------------
    def _start_thread(self) -> None:  # with self._thread_lock held
        if self._pid_owner != os.getpid():  # forked: the child must not share our worker
            self._proc, self._conn, self._shm, self._arena = None, None, None, None
            self._attached = False
            self._pid_owner = os.getpid()
            self._thread, self._jobs = None, queue.SimpleQueue()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name=f"cct-{self.name}",
                                            daemon=True)
            self._thread_cpus = None
            self._thread.start()

    def _serve(self) -> None:
        while True:
            future, cmd, inputs, outputs, timeout, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self._pin_thread()
                result = self._run(cmd, inputs, outputs, kwargs, timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, inputs, outputs, kwargs  # do not keep the arrays alive while idle

    def _pin_thread(self) -> None:
        """Run this (device) thread on the worker's CPUs when ``KERAS_CCT_WORKER_CPUS`` confines
        the worker: the transfers are the device's work, not its caller's."""
        # as worker_environment() resolves it, without copying the environment per request
        text = self.env.get("KERAS_CCT_WORKER_CPUS",
                            os.environ.get("KERAS_CCT_WORKER_CPUS", "")).strip()
        try:
            cpus = frozenset(parse_cpus(text)) if text else None
        except ValueError as exc:
            raise WorkerError(f"OpenCL device {self.name}: {exc}") from None
        if cpus == self._thread_cpus or not hasattr(os, "sched_setaffinity"):
            return
        # None: back to the process' own CPUs (those of the thread that started us)
        os.sched_setaffinity(0, cpus if cpus else os.sched_getaffinity(self._pid_owner))
        self._thread_cpus = cpus

    def _run(self, cmd: str, inputs: Dict[str, np.ndarray],
             outputs: Dict[str, Tuple[Tuple[int, ...], type]], kwargs: dict,
             timeout: float = float("inf")):
        with self._lock:
            for attempt in range(RESTARTS + 1):
                if attempt:  # every command is a pure function of its inputs: run it again
                    time.sleep(RESTART_PAUSE * 2 ** (attempt - 1))
                if self._closing:
                    raise WorkerError(f"OpenCL device {self.name}: the process is exiting")
                self._ensure()
                self._budget = timeout
                if cmd not in self._warm:  # process start, kernel builds
                    self._budget += _seconds(START_TIMEOUT_VAR, self.env, DEFAULT_START_TIMEOUT)
                until = time.monotonic() + self._budget
                layout, total = {}, 0
                for k, a in inputs.items():
                    layout[k] = total
                    total += -(-max(a.nbytes, 1) // ALIGN) * ALIGN
                for k, (shape, dtype) in outputs.items():
                    layout[k] = total
                    total += -(-max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
                               // ALIGN) * ALIGN
                args = kwargs
                try:
                    if layout:
                        arena = self._arena_for(total)
                        if not self._attached:
                            self._raise(self._exchange(
                                "attach", {"name": self._shm.name, "size": self._shm.size},
                                until))
                            self._attached = True
                        for k, a in inputs.items():
                            dst = np.ndarray(a.shape, a.dtype, buffer=arena, offset=layout[k])
                            np.copyto(dst, a)
                        args = dict(kwargs, off=layout)
                    reply = self._exchange(cmd, args, until)
                except _WorkerDied as exc:
                    if attempt < RESTARTS:
                        continue
                    raise WorkerError(
                        f"{exc} (it died {RESTARTS + 1} times in a row during this request; the "
                        "next call starts a fresh worker. If it keeps dying, check the device "
                        "with `cct devices` or compute on another one)") from None
                self._warm.add(cmd)
                result = self._raise(reply)
                outs = {}
                for k, (shape, dtype) in outputs.items():
                    outs[k] = np.ndarray(shape, dtype, buffer=self._arena, offset=layout[k]).copy()
                return result, outs
        raise AssertionError("unreachable")  # pragma: no cover

    def request(self, cmd: str, **kwargs):
        """A command without arrays; returns the worker's answer."""
        return self.call(cmd, **kwargs)[0]

    def _raise(self, reply):
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        where = f"OpenCL device {self.name}"
        if kind == "opencl":
            raise OpenCLError(f"{where}: {message}")
        if kind == "value":
            raise DeviceError(f"{where} rejected the request: {message}")
        raise WorkerError(f"{where}: the worker failed: {message}")


class _WorkerDied(Exception):
    pass


def _shm_free_bytes() -> Optional[int]:
    """Free bytes in /dev/shm (where POSIX shared memory lives on Linux), None if unknown."""
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


_CLIENTS: Dict[str, WorkerClient] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(name: Optional[str], env: Optional[Mapping[str, str]] = None) -> WorkerClient:
    """The shared :class:`WorkerClient` of device ``name`` (``None``: the discovery worker).

    ``env`` (when given) sets the worker's extra environment, restarting it if it changed.
    """
    key = name or ""
    spec = parse_opencl_name(name) if name else None
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = WorkerClient(spec, env, name=name)
            return client
    if env is not None:
        client.set_env(env)
    return client


def stop_all(wait: Optional[float] = None) -> None:
    """Stop every worker this process started (also run at interpreter exit, waiting at most
    ``wait`` = 2 s per device for a running request: see :meth:`WorkerClient.stop`)."""
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
    for c in clients:
        try:
            c.stop(wait=wait)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _at_exit() -> None:
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
    for c in clients:
        c._closing = True  # a request that fails now does not start a fresh worker
    stop_all(wait=2.0)


atexit.register(_at_exit)
