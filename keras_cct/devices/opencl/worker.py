"""The OpenCL device worker: a child process that owns one OpenCL device and runs the kernels.

PoCL's LLVM and TensorFlow's LLVM clash in one process (``cl.get_platforms()`` after
``import tensorflow`` segfaults), so every pyopencl call happens here. This file is run as a
*script* (``python worker.py FD [DEVICE]``), never imported through the ``keras_cct`` package:
its imports are the standard library, numpy and pyopencl only (``keras_cct/__init__.py`` imports
keras, which may import TensorFlow). Requests and small answers are pickled over a socket;
arrays live in a shared-memory arena created by the parent, which this process maps and wraps
in one OpenCL buffer (zero-copy ``USE_HOST_PTR`` on CPU devices, a mirrored device buffer with
explicit copies elsewhere).

Protocol: the parent sends ``(command, args)``; the worker answers ``("ok", result)`` or
``("err", kind, message)`` with ``kind`` in ``{"opencl", "value", "internal"}`` and keeps serving.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import numpy as np

KERNEL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cl")
BUILD_OPTIONS = ""
RM = 8   # rows of C per work-item in the GEMM (see kernels.cl)
RN = 32  # columns of C per work-item


class RequestError(ValueError):
    """A request the kernels cannot take (bad shape, dtype, offsets): answered, not fatal."""


def _cl():
    import pyopencl as cl  # imported lazily so that `python worker.py --help` stays cheap
    return cl


def _parse_device(spec: str):
    """'P:D' or 'P:D.S' -> (P, D, S or None)."""
    p, rest = spec.split(":")
    if "." in rest:
        d, s = rest.split(".")
        return int(p), int(d), int(s)
    return int(p), int(rest), None


def _kind(cl, dtype) -> str:
    if dtype & cl.device_type.GPU:
        return "gpu"
    if dtype & cl.device_type.CPU:
        return "cpu"
    if dtype & cl.device_type.ACCELERATOR:
        return "accelerator"
    return "other"


def _probe_build(cl, device) -> str:
    """'' if a tiny kernel builds and runs on ``device``, else the error."""
    try:
        ctx = cl.Context([device])
        queue = cl.CommandQueue(ctx)
        prg = cl.Program(ctx, "__kernel void k(__global float *a) { a[0] = 1.0f; }").build()
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
        cl.Kernel(prg, "k")(queue, (1,), None, buf)
        out = np.zeros(1, np.float32)
        cl.enqueue_copy(queue, out, buf)
        queue.finish()
        return "" if out[0] == 1.0 else "probe kernel computed a wrong value"
    except Exception as exc:  # noqa: BLE001 - reported to the parent as text
        return f"{type(exc).__name__}: {exc}"


def list_platforms(probe: bool = True):
    """Every OpenCL platform and device, as plain dicts (no pyopencl objects)."""
    try:
        cl = _cl()
    except ImportError as exc:
        return {"platforms": [], "error": f"pyopencl is not installed ({exc}); "
                                          "pip install 'keras_cct[opencl]'"}
    out = []
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:  # e.g. PLATFORM_NOT_FOUND_KHR: no ICD installed
        return {"platforms": [], "error": str(exc)}
    for pi, plat in enumerate(platforms):
        devs = []
        try:
            devices = plat.get_devices()
        except cl.Error:
            devices = []
        for di, dev in enumerate(devices):
            try:
                subs = len(dev.create_sub_devices(
                    [cl.device_partition_property.EQUALLY, 1]))
            except Exception:  # noqa: BLE001 - fission is optional
                subs = 0
            devs.append({
                "index": di, "name": dev.name.strip(), "vendor": dev.vendor.strip(),
                "kind": _kind(cl, dev.type), "compute_units": int(dev.max_compute_units),
                "memory": int(dev.global_mem_size), "max_alloc": int(dev.max_mem_alloc_size),
                "version": dev.version, "driver": dev.driver_version, "sub_devices": subs,
                "build_error": _probe_build(cl, dev) if probe else None,
            })
        out.append({"index": pi, "name": plat.name.strip(), "vendor": plat.vendor.strip(),
                     "version": plat.version, "devices": devs})
    return {"platforms": out, "error": ""}


class Engine:
    """One OpenCL device: context, queue, the kernel program, the arena and scratch buffers."""

    def __init__(self, spec: str) -> None:
        cl = self.cl = _cl()
        p, d, s = _parse_device(spec)
        platforms = cl.get_platforms()
        if p >= len(platforms):
            raise RequestError(f"no OpenCL platform {p} (there are {len(platforms)})")
        devices = platforms[p].get_devices()
        if d >= len(devices):
            raise RequestError(f"platform {p} has no device {d} (it has {len(devices)})")
        dev = devices[d]
        if s is not None and int(dev.max_compute_units) == 1:
            # PoCL's fission does not limit its threads, so a sub-device's worker runs with
            # POCL_MAX_PTHREAD_COUNT=1, which already makes the whole device one compute unit:
            # that unit is the sub-device (the parent checked S against the full device).
            pass
        elif s is not None:
            subs = dev.create_sub_devices([cl.device_partition_property.EQUALLY, 1])
            if s >= len(subs):
                raise RequestError(f"device {p}:{d} has no sub-device {s} (it has {len(subs)})")
            dev = subs[s]
        self.device = dev
        self.ctx = cl.Context([dev])
        self.queue = cl.CommandQueue(self.ctx)
        self.is_cpu = bool(dev.type & cl.device_type.CPU)
        try:
            unified = bool(dev.host_unified_memory)  # deprecated since OpenCL 2.0
        except Exception:  # noqa: BLE001
            unified = False
        self.unified = unified or self.is_cpu
        if os.environ.get("KERAS_CCT_OPENCL_COPY") == "1":  # force the discrete-GPU path
            self.unified = False
        self._program = None
        self._kernels = {}
        self.shm = None
        self.arena = None   # numpy uint8 view of the shared memory
        self.abuf = None    # OpenCL buffer over (or mirroring) the arena
        self._scratch = {}
        self._gemm_library = None
        self.gemm_timings = {}

    # -- program and buffers -------------------------------------------------------------------
    def kernel(self, name: str):
        if self._program is None:
            with open(KERNEL_FILE) as f:
                source = f.read()
            self._program = self.build(source, f"{BUILD_OPTIONS} -DRM={RM}")
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self.cl.Kernel(self._program, name)
        return k

    def launch(self, name: str, global_size, *args):
        """Enqueue kernel ``name``. On CPU devices each work-group is one work-item: the
        kernels loop inside a work-item, and PoCL compiles one variant per local size, so a
        fixed size also avoids a compilation per new shape."""
        local = (1,) * len(global_size) if self.is_cpu else None
        return self.kernel(name)(self.queue, tuple(int(v) for v in global_size), local, *args)

    def build(self, source: str, options: str = ""):
        cl = self.cl
        prg = cl.Program(self.ctx, source)
        try:
            return prg.build(options=options)
        except cl.Error as exc:
            try:
                log = prg.get_build_info(self.device, cl.program_build_info.LOG)
            except Exception:  # noqa: BLE001
                log = ""
            msg = str(exc)
            if log and log.strip() not in msg:
                msg += "\nBuild log:\n" + log
            raise cl.RuntimeError(msg) from None

    def attach(self, name: str, size: int) -> None:
        self.detach()
        try:
            shm = shared_memory.SharedMemory(name=name, create=False, track=False)
        except TypeError:  # Python < 3.13: no `track`. The parent owns and unlinks the segment;
            # registering it here would start a resource-tracker process that unlinks it when
            # this worker exits, so registration is switched off while attaching.
            from multiprocessing import resource_tracker
            register = resource_tracker.register
            resource_tracker.register = lambda *args, **kwargs: None
            try:
                shm = shared_memory.SharedMemory(name=name, create=False)
            finally:
                resource_tracker.register = register
        self.shm = shm
        self.arena = np.ndarray((size,), np.uint8, buffer=shm.buf)
        mf = self.cl.mem_flags
        if self.unified:
            self.abuf = self.cl.Buffer(self.ctx, mf.READ_WRITE | mf.USE_HOST_PTR,
                                       hostbuf=self.arena)
        else:
            self.abuf = self.cl.Buffer(self.ctx, mf.READ_WRITE, size)

    def detach(self) -> None:
        if self.abuf is not None:
            self.queue.finish()
            self.abuf.release()
            self.abuf = None
        self.arena = None
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:
                pass
            self.shm = None

    def scratch(self, key: str, nbytes: int):
        nbytes = max(int(nbytes), 4)
        buf = self._scratch.get(key)
        if buf is None or buf.size < nbytes:
            if buf is not None:
                self.queue.finish()
                buf.release()
            buf = self._scratch[key] = self.cl.Buffer(self.ctx, self.cl.mem_flags.READ_WRITE,
                                                      nbytes)
        return buf

    def upload(self, off: int, nbytes: int) -> None:
        if not self.unified and nbytes:
            self.cl.enqueue_copy(self.queue, self.abuf, self.arena[off:off + nbytes],
                                 device_offset=off)

    def download(self, off: int, nbytes: int) -> None:
        if not self.unified and nbytes:
            self.cl.enqueue_copy(self.queue, self.arena[off:off + nbytes], self.abuf,
                                 device_offset=off)

    def view(self, off: int, shape) -> np.ndarray:
        n = int(np.prod(shape))
        return np.ndarray(shape, np.float32, buffer=self.arena, offset=off) if n else \
            np.zeros(shape, np.float32)

    def to_scratch(self, key: str, array: np.ndarray):
        array = np.ascontiguousarray(array, np.float32)
        buf = self.scratch(key, array.nbytes)
        self.cl.enqueue_copy(self.queue, buf, array)
        return buf

    # -- kernels ---------------------------------------------------------------------------------
    def gemm(self, M, N, K, A, offA, lda, sAg, B, offB, ldb, sBg, C, offC, ldc, sCg, *,
             groups=1, trans_a=False, bias=None, offBias=0, sBiasg=0, beta=0,
             library=None) -> None:
        """C[g] = op(A[g]) B[g] (+ C[g]) (+ bias[g]); offsets and strides in floats.

        ``library``: ``"own"``, ``"clblast"`` or None (this device's choice,
        :attr:`gemm_library`)."""
        if M <= 0 or N <= 0:
            return
        if (library or self.gemm_library) == "clblast":
            return self._gemm_clblast(M, N, K, A, offA, lda, sAg, B, offB, ldb, sBg, C, offC,
                                      ldc, sCg, groups, trans_a, bias, offBias, sBiasg, beta)
        i64, i32 = np.int64, np.int32
        k = self.kernel("gemm_tn" if trans_a else "gemm_nn")
        use_bias = bias is not None
        # CPU devices: one work-item per work-group (no implicit vectorization across
        # work-items of a kernel that is already explicitly vectorized); GPUs choose.
        local = (1, 1, 1) if self.is_cpu else None
        k(self.queue, (-(-M // RM), -(-N // RN), groups), local,
          i32(M), i32(N), i32(K), A, i64(offA), i32(lda), i64(sAg),
          B, i64(offB), i32(ldb), i64(sBg), C, i64(offC), i32(ldc), i64(sCg),
          bias if use_bias else B, i64(offBias), i64(sBiasg), i32(use_bias), i32(beta))

    # -- GEMM library choice ----------------------------------------------------------------------
    @property
    def gemm_library(self) -> str:
        """``"own"`` (kernels.cl) or ``"clblast"``, chosen once per worker.

        ``KERAS_CCT_OPENCL_GEMM`` = ``own`` | ``clblast`` | ``measure`` | ``auto`` (default).
        ``auto``: the own kernel on CPU devices (on PoCL CLBlast measured 10-20x slower), and on
        other devices whichever of the two is faster on a conv-shaped GEMM when pyclblast is
        installed. ``measure`` measures on CPU devices too.
        """
        if self._gemm_library is None:
            want = os.environ.get("KERAS_CCT_OPENCL_GEMM", "auto")
            if want not in ("own", "clblast", "measure", "auto"):
                raise RequestError(f"KERAS_CCT_OPENCL_GEMM={want!r}: use own, clblast, measure "
                                   "or auto")
            if want in ("auto", "measure") and (want == "measure" or not self.is_cpu):
                try:
                    import pyclblast  # noqa: F401
                except ImportError:
                    want = "own"
                else:
                    own = self._time_gemm("own")
                    try:
                        clb = self._time_gemm("clblast")
                    except Exception:  # noqa: BLE001 - a failing library is not chosen
                        clb = float("inf")
                    want = "clblast" if clb < own else "own"
                    self.gemm_timings = {"own": own, "clblast": clb}
            elif want == "auto":
                want = "own"
            if want == "clblast":
                import pyclblast  # noqa: F401 - fails clearly here if missing
            self._gemm_library = want
        return self._gemm_library

    def _time_gemm(self, library: str, M: int = 1024, N: int = 256, K: int = 1152) -> float:
        a = self.to_scratch("sel_a", np.ones((M, K), np.float32))
        b = self.to_scratch("sel_b", np.ones((K, N), np.float32))
        c = self.scratch("sel_c", 4 * M * N)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            self.gemm(M, N, K, a, 0, K, 0, b, 0, N, 0, c, 0, N, 0, library=library)
            self.queue.finish()
            best = min(best, time.perf_counter() - t0)
        return best

    def _array(self, buf):
        """A 2-D (n x 1) float32 pyopencl Array over ``buf`` (pyclblast wants 2-D arrays; the
        real shape goes in the offsets and leading dimensions)."""
        import pyopencl.array as cla
        return cla.Array(self.queue, (buf.size // 4, 1), np.float32, data=buf)

    def _gemm_clblast(self, M, N, K, A, offA, lda, sAg, B, offB, ldb, sBg, C, offC, ldc, sCg,
                      groups, trans_a, bias, offBias, sBiasg, beta):
        import pyclblast
        i64, i32 = np.int64, np.int32
        a, b, c = self._array(A), self._array(B), self._array(C)
        for g in range(groups):
            cbeta = float(beta)
            if bias is not None:
                # C = bias (+ C), then C += A B
                self.launch(
                    "add_bias_rows", (M,), C, i64(offC + g * sCg), i32(ldc), i32(N), bias,
                    i64(offBias + g * sBiasg), i32(beta))
                cbeta = 1.0
            pyclblast.gemm(self.queue, M, N, K, a, b, c, a_ld=lda, b_ld=ldb, c_ld=ldc,
                           beta=cbeta, a_transp=bool(trans_a), a_offset=int(offA + g * sAg),
                           b_offset=int(offB + g * sBg), c_offset=int(offC + g * sCg))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RequestError(message)


class Conv:
    """The lowered convolution, forward and backward, on one :class:`Engine`.

    ``g`` is a dict of plain ints: N, H, W, C, F (filters), kh, kw, groups, sh, sw, dh, dw, pt,
    pl, oh, ow; offsets (bytes) of the arrays in the arena are in ``off``.
    """

    def __init__(self, eng: Engine, g: dict, chunk_bytes: int) -> None:
        self.e = eng
        self.g = g
        for key in ("N", "H", "W", "C", "F", "kh", "kw", "groups", "sh", "sw", "dh", "dw",
                    "oh", "ow"):
            _check(isinstance(g.get(key), int) and g[key] >= 1,
                   f"geometry field {key!r} must be a positive int, got {g.get(key)!r}")
        _check(g["C"] % g["groups"] == 0 and g["F"] % g["groups"] == 0,
               "groups must divide the input channels and the filters")
        self.cg = g["C"] // g["groups"]
        self.og = g["F"] // g["groups"]
        self.kk = g["kh"] * g["kw"]
        self.chunk_bytes = max(int(chunk_bytes), 1)

    def _conv_args(self, **override):
        """Kernel arguments (H, W) and (groups, kh, kw, sh, sw, dh, dw, pt, pl, oh, ow); Type 2
        reuses the Type 1 and Type 3 kernels on one axis by overriding some of them."""
        g = dict(self.g, **override)
        i32 = np.int32
        return [i32(g[k]) for k in ("H", "W")], [i32(g[k]) for k in (
            "groups", "kh", "kw", "sh", "sw", "dh", "dw", "pt", "pl", "oh", "ow")]

    #: Fewest GEMM rows (output pixels) per batch partition in the backward pass: its kernel
    #: gradient GEMM sums over them and accumulates into dW once per partition, so tiny
    #: partitions spend their time re-reading and re-writing dW.
    min_rows_backward = 1024

    def _chunk(self, per_image_floats: int, min_rows: int = 0, rows_img: int = 1) -> int:
        n = self.chunk_bytes // max(4 * per_image_floats, 1)
        n = max(n, -(-min_rows // max(rows_img, 1)))
        return max(1, min(self.g["N"], n))

    # Type 1 ------------------------------------------------------------------------------------
    def _im2col(self, n0, nb, col, offX):
        g, e = self.g, self.e
        hw, rest = self._conv_args()
        e.launch("im2col", (g["kh"], nb * g["oh"]),
                           e.abuf, np.int64(offX + n0 * g["H"] * g["W"] * g["C"]), col,
                           np.int64(0), *hw, np.int32(g["C"]), *rest)

    def forward1(self, off):
        g, e = self.g, self.e
        G, cg, og, kk = g["groups"], self.cg, self.og, self.kk
        K = kk * cg
        rows_img = g["oh"] * g["ow"]
        nbc = self._chunk(rows_img * G * K)
        col = e.scratch("col", nbc * rows_img * G * K * 4)
        for n0 in range(0, g["N"], nbc):
            nb = min(nbc, g["N"] - n0)
            self._im2col(n0, nb, col, off["x"] // 4)
            e.gemm(nb * rows_img, og, K, col, 0, G * K, K,
                   e.abuf, off["w"] // 4, g["F"], og,
                   e.abuf, off["y"] // 4 + n0 * rows_img * g["F"], g["F"], og,
                   groups=G, bias=e.abuf if off.get("b") is not None else None,
                   offBias=(off.get("b") or 0) // 4, sBiasg=og)

    def backward1(self, off):
        g, e = self.g, self.e
        G, cg, og, kk, F = g["groups"], self.cg, self.og, self.kk, g["F"]
        K = kk * cg
        rows_img = g["oh"] * g["ow"]
        w = e.view(off["w"], (K, G, og))
        wt = e.to_scratch("wt", np.transpose(w, (1, 2, 0)))  # (G, og, K)
        nbc = self._chunk(2 * rows_img * G * K, self.min_rows_backward, rows_img)
        colT = e.scratch("col", nbc * rows_img * G * K * 4)
        dcol = e.scratch("dcol", nbc * rows_img * G * K * 4)
        hw, rest = self._conv_args()
        for n0 in range(0, g["N"], nbc):
            nb = min(nbc, g["N"] - n0)
            rows = nb * rows_img
            offdy = off["dy"] // 4 + n0 * rows_img * F
            if off.get("dx") is not None:  # dcol = dy * W^T, then col2im -> dx
                e.gemm(rows, K, og, e.abuf, offdy, F, og, wt, 0, K, og * K,
                       dcol, 0, G * K, K, groups=G)
                e.launch("col2im", (nb * g["H"],), dcol, np.int64(0), e.abuf,
                                   np.int64(off["dx"] // 4 + n0 * g["H"] * g["W"] * g["C"]),
                                   *hw, np.int32(g["C"]), *rest)
            # dW (+)= col^T * dy, with col^T lowered directly
            e.launch("im2colT", (g["kh"], nb * g["oh"]), e.abuf,
                                np.int64(off["x"] // 4 + n0 * g["H"] * g["W"] * g["C"]), colT,
                                np.int64(0), np.int64(rows), *hw, np.int32(g["C"]), *rest)
            e.gemm(K, og, rows, colT, 0, rows, K * rows, e.abuf, offdy, F, og,
                   e.abuf, off["dw"] // 4, F, og, groups=G, beta=int(n0 > 0))
            if off.get("db") is not None:
                e.launch("colsum", (F,), e.abuf, np.int64(offdy),
                                   np.int64(rows), np.int32(F), e.abuf,
                                   np.int64(off["db"] // 4), np.int32(n0 > 0))

    # Type 2 ------------------------------------------------------------------------------------
    # Lower along the height only: D2[(n, oy, x), (g, i, c)] (im2col with a 1-wide kernel over
    # every input column), GEMM with W2[g] = (kh*cg, kw*og) into T2[(n, oy, x), (g, j, o)], then
    # a kw-way lifting along the width (lift3 with a 1-high kernel over the oh output rows).
    def _lower2(self):
        return self._conv_args(kw=1, sw=1, dw=1, pl=0, ow=self.g["W"])

    def _lift2(self):
        return self._conv_args(H=self.g["oh"], kh=1, sh=1, dh=1, pt=0)

    def _w2(self, off):
        g = self.g
        w = self.e.view(off["w"], (g["kh"], g["kw"], self.cg, g["groups"], self.og))
        return np.transpose(w, (3, 0, 2, 1, 4))  # (G, kh, cg, kw, og)

    def forward2(self, off):
        g, e = self.g, self.e
        G, cg, og, F, W = g["groups"], self.cg, self.og, g["F"], g["W"]
        K, L = g["kh"] * cg, g["kw"] * og
        rows_img = g["oh"] * W
        w2 = e.to_scratch("w2", self._w2(off))
        nbc = self._chunk(rows_img * G * (K + L))
        D = e.scratch("col", nbc * rows_img * G * K * 4)
        T = e.scratch("t2", nbc * rows_img * G * L * 4)
        (lhw, lrest), (fhw, frest) = self._lower2(), self._lift2()
        has_b = off.get("b") is not None
        for n0 in range(0, g["N"], nbc):
            nb = min(nbc, g["N"] - n0)
            e.launch("im2col", (g["kh"], nb * g["oh"]), e.abuf,
                               np.int64(off["x"] // 4 + n0 * g["H"] * W * g["C"]), D,
                               np.int64(0), *lhw, np.int32(g["C"]), *lrest)
            e.gemm(nb * rows_img, L, K, D, 0, G * K, K, w2, 0, L, K * L, T, 0, G * L, L,
                   groups=G)
            e.launch("lift3", (nb * g["oh"] * g["ow"],), T, np.int64(0), e.abuf,
                              np.int64(off["y"] // 4 + n0 * g["oh"] * g["ow"] * F),
                              e.abuf, np.int64((off.get("b") or 0) // 4), np.int32(has_b),
                              *fhw, np.int32(F), *frest)

    def backward2(self, off):
        g, e = self.g, self.e
        G, cg, og, F, W = g["groups"], self.cg, self.og, g["F"], g["W"]
        K, L = g["kh"] * cg, g["kw"] * og
        rows_img = g["oh"] * W
        w2 = self._w2(off).reshape(G, K, L)
        w2t = e.to_scratch("w2t", np.transpose(w2, (0, 2, 1)))  # (G, L, K)
        dw2 = e.scratch("dw2", G * K * L * 4)
        nbc = self._chunk(rows_img * G * (2 * K + L), self.min_rows_backward, rows_img)
        D = e.scratch("col", nbc * rows_img * G * K * 4)
        dD = e.scratch("dcol", nbc * rows_img * G * K * 4)
        dT = e.scratch("t2", nbc * rows_img * G * L * 4)
        (lhw, lrest), (fhw, frest) = self._lower2(), self._lift2()
        for n0 in range(0, g["N"], nbc):
            nb = min(nbc, g["N"] - n0)
            rows = nb * rows_img
            offx = off["x"] // 4 + n0 * g["H"] * W * g["C"]
            offdy = off["dy"] // 4 + n0 * g["oh"] * g["ow"] * F
            e.launch("im2col", (g["kh"], nb * g["oh"]), e.abuf, np.int64(offx),
                               D, np.int64(0), *lhw, np.int32(g["C"]), *lrest)
            e.launch("unlift3", (g["kw"], rows), e.abuf, np.int64(offdy), dT,
                                np.int64(0), *fhw, np.int32(F), *frest)
            if off.get("dx") is not None:
                e.gemm(rows, K, L, dT, 0, G * L, L, w2t, 0, K, L * K, dD, 0, G * K, K,
                       groups=G)
                e.launch("col2im", (nb * g["H"],), dD, np.int64(0), e.abuf,
                                   np.int64(off["dx"] // 4 + n0 * g["H"] * W * g["C"]),
                                   *lhw, np.int32(g["C"]), *lrest)
            e.gemm(K, L, rows, D, 0, G * K, K, dT, 0, G * L, L, dw2, 0, L, K * L, groups=G,
                   trans_a=True, beta=int(n0 > 0))
            if off.get("db") is not None:
                e.launch("colsum", (F,), e.abuf, np.int64(offdy),
                                   np.int64(nb * g["oh"] * g["ow"]), np.int32(F), e.abuf,
                                   np.int64(off["db"] // 4), np.int32(n0 > 0))
        host = np.empty((G, g["kh"], cg, g["kw"], og), np.float32)
        e.cl.enqueue_copy(e.queue, host, dw2)
        e.queue.finish()
        dw = e.view(off["dw"], (g["kh"], g["kw"], cg, G, og))
        dw[...] = np.transpose(host, (1, 3, 2, 0, 4))
        e.upload(off["dw"], dw.nbytes)  # non-unified devices download it from the mirror

    # Type 3 ------------------------------------------------------------------------------------
    def _w3(self, off):
        g = self.g
        w = self.e.view(off["w"], (g["kh"], g["kw"], self.cg, g["groups"], self.og))
        return np.transpose(w, (3, 2, 0, 1, 4))  # (G, cg, kh, kw, og)

    def forward3(self, off):
        g, e = self.g, self.e
        G, cg, og, kk, F = g["groups"], self.cg, self.og, self.kk, g["F"]
        L = kk * og
        pix = g["H"] * g["W"]
        w3 = e.to_scratch("w3", self._w3(off))
        nbc = self._chunk(pix * G * L)
        T = e.scratch("t3", nbc * pix * G * L * 4)
        hw, rest = self._conv_args()
        has_b = off.get("b") is not None
        for n0 in range(0, g["N"], nbc):
            nb = min(nbc, g["N"] - n0)
            e.gemm(nb * pix, L, cg, e.abuf, off["x"] // 4 + n0 * pix * g["C"], g["C"], cg,
                   w3, 0, L, cg * L, T, 0, G * L, L, groups=G)
            e.launch("lift3", (nb * g["oh"] * g["ow"],), T, np.int64(0), e.abuf,
                              np.int64(off["y"] // 4 + n0 * g["oh"] * g["ow"] * F),
                              e.abuf, np.int64((off.get("b") or 0) // 4), np.int32(has_b),
                              *hw, np.int32(F), *rest)

    def backward3(self, off):
        g, e = self.g, self.e
        G, cg, og, kk, F = g["groups"], self.cg, self.og, self.kk, g["F"]
        L = kk * og
        pix = g["H"] * g["W"]
        w3 = self._w3(off)
        w3t = e.to_scratch("w3t", np.transpose(w3.reshape(G, cg, L), (0, 2, 1)))  # (G, L, cg)
        dw3 = e.scratch("dw3", G * cg * L * 4)
        nbc = self._chunk(pix * G * L, self.min_rows_backward, pix)
        dT = e.scratch("t3", nbc * pix * G * L * 4)
        hw, rest = self._conv_args()
        for n0 in range(0, g["N"], nbc):
            nb = min(nbc, g["N"] - n0)
            offdy = off["dy"] // 4 + n0 * g["oh"] * g["ow"] * F
            offx = off["x"] // 4 + n0 * pix * g["C"]
            e.launch("unlift3", (kk, nb * pix), e.abuf, np.int64(offdy), dT,
                                np.int64(0), *hw, np.int32(F), *rest)
            if off.get("dx") is not None:
                e.gemm(nb * pix, cg, L, dT, 0, G * L, L, w3t, 0, cg, L * cg,
                       e.abuf, off["dx"] // 4 + n0 * pix * g["C"], g["C"], cg, groups=G)
            e.gemm(cg, L, nb * pix, e.abuf, offx, g["C"], cg, dT, 0, G * L, L,
                   dw3, 0, L, cg * L, groups=G, trans_a=True, beta=int(n0 > 0))
            if off.get("db") is not None:
                rows = nb * g["oh"] * g["ow"]
                e.launch("colsum", (F,), e.abuf, np.int64(offdy),
                                   np.int64(rows), np.int32(F), e.abuf,
                                   np.int64(off["db"] // 4), np.int32(n0 > 0))
        host = np.empty((G, cg, g["kh"], g["kw"], og), np.float32)
        e.cl.enqueue_copy(e.queue, host, dw3)
        e.queue.finish()
        dw = e.view(off["dw"], (g["kh"], g["kw"], cg, G, og))
        dw[...] = np.transpose(host, (2, 3, 1, 0, 4))
        e.upload(off["dw"], dw.nbytes)  # non-unified devices download it from the mirror


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
        _check(e.arena is not None, "no shared-memory arena attached")
        for name, nbytes in sizes.items():
            o = off.get(name)
            if o is None:
                continue
            _check(o % 4 == 0 and 0 <= o and o + nbytes <= e.arena.size,
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
        _check("y" in off, "no output offset")
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
            _check(k in off, f"no offset for {k!r}")
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
