"""The OpenCL side of a device worker: the device, its program and buffers (:class:`Engine`),
the platform list, and the request error. Imported by ``worker.py`` only, in the worker
process: the standard library, numpy and pyopencl (lazily), nothing of keras_cct."""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory

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


def check(cond: bool, message: str) -> None:
    if not cond:
        raise RequestError(message)
