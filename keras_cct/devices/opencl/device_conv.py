"""The lowered convolution on an OpenCL device (:class:`Conv`): lowering, SGEMM and lifting
kernels, forward and backward. Imported by ``worker.py`` only, in the worker process."""

from __future__ import annotations

import numpy as np

if __package__:  # imported through the package (documentation, tests)
    from keras_cct.devices.opencl.engine import Engine, check
else:  # in the worker process, next to worker.py (sys.path[0])
    from engine import Engine, check

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
            check(isinstance(g.get(key), int) and g[key] >= 1,
                   f"geometry field {key!r} must be a positive int, got {g.get(key)!r}")
        check(g["C"] % g["groups"] == 0 and g["F"] % g["groups"] == 0,
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
