"""The OpenCL device worker: a child process that owns one OpenCL device and runs the kernels.

PoCL's LLVM and TensorFlow's LLVM clash in one process (``cl.get_platforms()`` after
``import tensorflow`` segfaults), so every pyopencl call happens here. This file is run as a
*script* (``python worker.py FD [DEVICE]``), never imported through the ``keras_cct`` package:
its imports are the standard library, numpy, pyopencl and its two neighbours, ``engine.py`` (the
device, program and buffers) and ``device_conv.py`` (the lowered convolution's kernels), never
``keras_cct`` (whose ``__init__.py`` imports keras, which may import TensorFlow). Requests and
small answers are pickled over a socket; arrays live in a shared-memory arena created by the
parent, which this process maps and wraps in one OpenCL buffer (zero-copy ``USE_HOST_PTR`` on
CPU devices, a mirrored device buffer with explicit copies elsewhere).

Protocol: the parent sends ``(command, args)``; the worker answers ``("ok", result)`` or
``("err", kind, message)`` with ``kind`` in ``{"opencl", "value", "internal"}`` and keeps serving.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection

import numpy as np


if __package__:  # imported through keras_cct (the client reads parse_cpus)
    from keras_cct.devices.opencl.device_conv import Conv
    from keras_cct.devices.opencl.engine import (Engine, RequestError, _cl, _kind, check,
                                                 list_platforms)
else:  # run as a script (``python worker.py FD``): its folder is sys.path[0], and nothing of
    # keras_cct (whose root imports keras, which may import TensorFlow) is imported
    from device_conv import Conv
    from engine import Engine, RequestError, _cl, _kind, check, list_platforms


class Worker:
    """Serves requests on a connection until told to exit or the parent goes away."""

    def __init__(self, conn: Connection, spec: str | None) -> None:
        self.conn = conn
        self.spec = spec
        self._engine = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            if self.spec is None:
                raise RequestError("this worker only lists devices (started without a device)")
            self._engine = Engine(self.spec)
        return self._engine

    def _arrays(self, off, sizes, upload=None):
        """Check that the arrays lie inside the arena, then (``upload`` True / False) copy them
        to / from a non-unified device's mirror of it."""
        e = self.engine
        check(e.arena is not None, "no shared-memory arena attached")
        for name, nbytes in sizes.items():
            o = off.get(name)
            if o is None:
                continue
            check(o % 4 == 0 and 0 <= o and o + nbytes <= e.arena.size,
                   f"array {name!r} ({nbytes} bytes at {o}) lies outside the arena "
                   f"({e.arena.size} bytes)")
            if upload is None:
                continue
            if upload:
                e.upload(o, nbytes)
            else:
                e.download(o, nbytes)

    # Commands -----------------------------------------------------------------------------------
    def cmd_ping(self):
        return os.getpid()

    def cmd_modules(self):
        return sorted(sys.modules)

    def cmd_list(self, probe=True):
        return list_platforms(probe)

    def cmd_info(self):
        d = self.engine.device
        cl = self.engine.cl
        return {"name": d.name.strip(), "vendor": d.vendor.strip(), "kind": _kind(cl, d.type),
                "compute_units": int(d.max_compute_units), "memory": int(d.global_mem_size),
                "unified": self.engine.unified, "pid": os.getpid(),
                "gemm": self.engine.gemm_library, "gemm_timings": self.engine.gemm_timings,
                "platform": d.platform.name.strip()}

    def cmd_attach(self, name, size):
        self.engine.attach(name, size)
        return size

    def cmd_build(self, source, options=""):
        prg = self.engine.build(source, options)
        return [k.function_name for k in prg.all_kernels()]

    def cmd_gemm(self, M, N, K, off, trans_a=False):
        e = self.engine
        sizes = {"a": 4 * M * K, "b": 4 * K * N, "c": 4 * M * N}
        self._arrays(off, sizes)
        self._arrays(off, {k: v for k, v in sizes.items() if k != "c"}, True)
        lda = M if trans_a else K
        e.gemm(M, N, K, e.abuf, off["a"] // 4, lda, 0, e.abuf, off["b"] // 4, N, 0,
               e.abuf, off["c"] // 4, N, 0, trans_a=trans_a)
        self._arrays(off, {"c": sizes["c"]}, False)
        e.queue.finish()
        return None

    def _conv_sizes(self, g):
        cg = g["C"] // g["groups"]
        return {"x": 4 * g["N"] * g["H"] * g["W"] * g["C"],
                "w": 4 * g["kh"] * g["kw"] * cg * g["F"], "b": 4 * g["F"],
                "y": 4 * g["N"] * g["oh"] * g["ow"] * g["F"]}

    def cmd_conv_forward(self, g, off, lowering="type1", chunk_bytes=32 << 20):
        conv = Conv(self.engine, g, chunk_bytes)
        s = self._conv_sizes(g)
        check("y" in off, "no output offset")
        self._arrays(off, s)
        self._arrays(off, {k: s[k] for k in ("x", "w", "b")}, True)
        if lowering not in ("type1", "type2", "type3"):
            raise RequestError(f"lowering {lowering!r} is not available on OpenCL "
                               "(use 'type1', 'type2' or 'type3')")
        getattr(conv, "forward" + lowering[-1])(off)
        self._arrays(off, {"y": s["y"]}, False)
        self.engine.queue.finish()
        return None

    def cmd_conv_backward(self, g, off, lowering="type1", chunk_bytes=32 << 20,
                          min_rows=Conv.min_rows_backward):
        conv = Conv(self.engine, g, chunk_bytes)
        conv.min_rows_backward = int(min_rows)
        s = self._conv_sizes(g)
        ins = {"x": s["x"], "w": s["w"], "dy": s["y"]}
        outs = {"dx": s["x"], "dw": s["w"], "db": s["b"]}  # dx, db: only when asked for
        for k in ("x", "w", "dy", "dw"):
            check(k in off, f"no offset for {k!r}")
        self._arrays(off, dict(ins, **outs))
        self._arrays(off, ins, True)
        if lowering not in ("type1", "type2", "type3"):
            raise RequestError(f"lowering {lowering!r} is not available on OpenCL "
                               "(use 'type1', 'type2' or 'type3')")
        getattr(conv, "backward" + lowering[-1])(off)
        self._arrays(off, outs, False)
        self.engine.queue.finish()
        return None

    def cmd_calibrate(self, M=2048, N=256, K=1024, seconds=0.3):
        """SGEMM GFLOP/s with this device's GEMM (:attr:`Engine.gemm_library`) on worker-local
        buffers (no shared memory)."""
        return self.cmd_bench_gemm(M, N, K, seconds=seconds,
                                   library=self.engine.gemm_library)["gflops"]

    def cmd_bench_gemm(self, M, N, K, trans_a=False, seconds=0.3, library="own"):
        """Time ``C = op(A) B`` on worker-local buffers; checks the result first.

        ``library``: ``"own"`` (kernels.cl) or ``"clblast"`` (pyclblast, when installed).
        Returns ``{"gflops": float, "seconds": per GEMM}``.
        """
        e = self.engine
        cl = e.cl
        rng = np.random.default_rng(0)
        a = rng.standard_normal((K, M) if trans_a else (M, K), dtype=np.float32)
        b = rng.standard_normal((K, N), dtype=np.float32)
        if library == "own":
            A = e.to_scratch("cal_a", a)
            B = e.to_scratch("cal_b", b)
            C = e.scratch("cal_c", 4 * M * N)
            lda = M if trans_a else K
            run = lambda: e.gemm(M, N, K, A, 0, lda, 0, B, 0, N, 0, C, 0, N, 0,  # noqa: E731
                                 trans_a=trans_a, library="own")
        elif library == "clblast":
            try:
                import pyclblast
                import pyopencl.array as cla
            except ImportError as exc:
                raise RequestError(f"pyclblast is not installed: {exc}") from None
            A, B = cla.to_device(e.queue, a), cla.to_device(e.queue, b)
            Carr = cla.empty(e.queue, (M, N), np.float32)
            C = Carr.data
            run = lambda: pyclblast.gemm(e.queue, M, N, K, A, B, Carr,  # noqa: E731
                                         a_ld=M if trans_a else K, b_ld=N, c_ld=N,
                                         a_transp=bool(trans_a))
        else:
            raise RequestError(f"unknown GEMM library {library!r}")
        run()
        e.queue.finish()
        c = np.empty((M, N), np.float32)
        cl.enqueue_copy(e.queue, c, C)
        e.queue.finish()
        rows = min(M, 64)
        ref = (a.T[:rows] if trans_a else a[:rows]).astype(np.float64) @ b
        err = float(np.abs(c[:rows] - ref).max() / max(np.abs(ref).max(), 1e-30))
        if err > 1e-4:
            raise RequestError(f"SGEMM ({library}) computed wrong values (rel. error {err:.2e})")
        c0 = self.cmd_cputime()
        n, t0 = 0, time.perf_counter()
        while True:
            run()
            e.queue.finish()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= seconds and n >= 2:
                break
        cpu = (self.cmd_cputime() - c0) / n
        return {"gflops": 2.0 * M * N * K * n / dt / 1e9, "seconds": dt / n,
                "cpu_seconds": cpu, "gflop_per_cpu_s": 2.0 * M * N * K / max(cpu, 1e-9) / 1e9}

    def cmd_cputime(self):
        """CPU seconds (user + system, all threads) this worker has used so far."""
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def cmd_sleep(self, seconds=0.1):
        """Wait (for tests of concurrency between workers)."""
        time.sleep(float(seconds))
        return os.getpid()

    def cmd_crash(self):
        os._exit(3)

    def serve(self) -> None:
        cl = None
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            cmd, kwargs = msg
            if cmd == "exit":
                self.conn.send(("ok", None))
                return
            try:
                handler = getattr(self, "cmd_" + cmd, None)
                if handler is None:
                    raise RequestError(f"unknown worker command {cmd!r}")
                reply = ("ok", handler(**kwargs))
            except RequestError as exc:
                reply = ("err", "value", str(exc))
            except Exception as exc:  # noqa: BLE001 - everything goes back to the parent
                if cl is None:
                    try:
                        cl = _cl()
                    except Exception:  # noqa: BLE001
                        cl = False
                if cl and isinstance(exc, cl.Error):
                    reply = ("err", "opencl", str(exc))
                else:
                    reply = ("err", "internal",
                             f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            try:
                self.conn.send(reply)
            except (OSError, EOFError):
                return


def parse_cpus(text: str) -> set:
    """CPU numbers from a list such as ``"1"``, ``"0,2"`` or ``"2-3"`` (taskset's syntax)."""
    cpus = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"KERAS_CCT_WORKER_CPUS={text!r}: expected CPU numbers such as "
                             f"'1', '0,2' or '2-3'")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_to_cpus() -> None:
    """Confine this worker (and the threads PoCL starts later) to ``$KERAS_CCT_WORKER_CPUS``,
    before any OpenCL call: PoCL's device fission does not limit the cores it runs on."""
    text = os.environ.get("KERAS_CCT_WORKER_CPUS", "").strip()
    if text and hasattr(os, "sched_setaffinity"):
        cpus = parse_cpus(text)
        # every thread already running (numpy's BLAS starts some at import), then this one,
        # whose mask the threads started later inherit
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # a thread that has just ended
                pass
        os.sched_setaffinity(0, cpus)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    pin_to_cpus()
    fd = int(argv[0])
    spec = argv[1] if len(argv) > 1 and argv[1] != "-" else None
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(sock.fileno()))
    sock.close()
    Worker(conn, spec).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
