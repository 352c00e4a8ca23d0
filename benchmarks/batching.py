"""Benchmark of batching (CcT's RQ1): Caffe's per-image lowering against batched lowering in
``p`` batch partitions, one thread each.

What is compared, for each CaffeNet convolution (forward + backward) and for one whole
CaffeNet-shaped training iteration (the five convolutions and the three fully connected layers,
forward and backward):

* ``caffe``: Caffe's way. Each image in turn is lowered (im2col) and multiplied by the kernel in
  one GEMM, with the BLAS library using every core; the backward pass lowers the image again
  (as Caffe's ``weight_cpu_gemm`` does), accumulates the kernel gradient and lifts the input
  gradient back with col2im, still one image at a time.
* ``batch p=N``: CcT's way. The mini-batch is cut into ``N`` contiguous partitions; each
  partition runs on its own thread, lowering all of its images at once into one matrix and
  calling one GEMM per group with the BLAS library held to **one** thread
  (``threadpoolctl``). The kernel gradients of the partitions are summed at the end.
  ``N`` goes from 1 to the core count.
* ``caffe 1T``: the same with a one-thread BLAS (on a busy machine a multi-threaded BLAS
  spends much of a small per-image GEMM waiting for its threads: this row tells that cost
  apart from the cost of lowering image by image).
* ``batch whole``: the whole batch lowered at once with a multi-threaded BLAS (no partitions),
  the naive form of batching that the issue's measurements found to fall out of cache.

Why numpy + threads rather than TensorFlow: the point of RQ1 is *how* the work is cut, so the
benchmark needs exact control of who lowers what and of the number of BLAS threads in each
GEMM. TensorFlow fuses and schedules its own ops (and fixes its thread pools at start-up), so
the same graph would be timed under two different schedulers. numpy's copies, additions and
BLAS calls release the GIL, so Python threads run the partitions truly in parallel; the GEMM is
the same OpenBLAS in every configuration. Pooling, ReLU and LRN are left out of the training
iteration (memory-bound, under 5% of CaffeNet's time in CcT's profile); every layer gets a
random input of its real shape.

Writes ``batching.json``, ``batching.md`` and ``batching.png`` under ``docs/benchmarks/``.
Run: ``python -m benchmarks.batching [--quick] [--out DIR] [--batch B] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.common import DEFAULT_OUT, best_of, markdown_table, write_results

# name: (input h=w, channels, filters, kernel, stride, pad, groups) -- as in benchmarks.lowering
CAFFENET = {
    "conv1": (227, 3, 96, 11, 4, 0, 1),
    "conv2": (27, 96, 256, 5, 1, 2, 2),
    "conv3": (13, 256, 384, 3, 1, 1, 1),
    "conv4": (13, 384, 384, 3, 1, 1, 2),
    "conv5": (13, 384, 256, 3, 1, 1, 2),
}
CAFFENET_FC = {"fc6": (9216, 4096), "fc7": (4096, 4096), "fc8": (4096, 1000)}
CCT_PUBLISHED = "CcT: batching with one partition per core is 4.5x faster than Caffe at 8-16 cores"


@dataclass(frozen=True)
class ConvSpec:
    """One convolution layer: input ``hw x hw x c``, ``o`` filters of ``k x k``."""
    name: str
    hw: int
    c: int
    o: int
    k: int
    stride: int = 1
    pad: int = 0
    groups: int = 1
    need_dx: bool = True  # Caffe does not back-propagate into the data layer

    @property
    def out(self) -> int:
        return (self.hw + 2 * self.pad - self.k) // self.stride + 1

    def flops(self, images: int) -> float:
        """Forward GEMM flops."""
        return 2.0 * images * self.out ** 2 * self.k ** 2 * (self.c // self.groups) * self.o


def caffenet_convs() -> List[ConvSpec]:
    return [ConvSpec(n, *v, need_dx=(n != "conv1")) for n, v in CAFFENET.items()]


# ------------------------------------------------------------------------------ kernels

class _ConvWork:
    """Buffers and weights of one layer for one partition of ``images`` images."""

    def __init__(self, spec: ConvSpec, images: int, rng: np.random.Generator) -> None:
        s = spec
        cg, og = s.c // s.groups, s.o // s.groups
        self.spec, self.images, self.cg, self.og = s, images, cg, og
        hp = s.hw + 2 * s.pad
        self.xp = np.zeros((images, hp, hp, s.c), np.float32)  # padded input
        self.xp[:, s.pad:s.pad + s.hw, s.pad:s.pad + s.hw] = rng.standard_normal(
            (images, s.hw, s.hw, s.c), dtype=np.float32)
        self.w = [rng.standard_normal((s.k * s.k * cg, og), dtype=np.float32) * 0.01
                  for _ in range(s.groups)]
        self.dw = [np.zeros_like(w) for w in self.w]
        rows = images * s.out * s.out
        self.col = np.empty((rows, s.k * s.k * cg), np.float32)
        self.y = np.empty((s.groups, rows, og), np.float32)
        self.dy = rng.standard_normal((s.groups, rows, og), dtype=np.float32)
        self.dcol = np.empty_like(self.col)
        self.dxp = np.zeros_like(self.xp) if s.need_dx else None

    def lower(self, first: int, count: int, g: int) -> np.ndarray:
        """im2col of images [first, first+count) and group ``g`` into the head of ``col``."""
        s, cg = self.spec, self.cg
        x = self.xp[first:first + count, :, :, g * cg:(g + 1) * cg]
        win = np.lib.stride_tricks.sliding_window_view(x, (s.k, s.k), axis=(1, 2))
        win = win[:, ::s.stride, ::s.stride][:, :s.out, :s.out]  # (n, oh, ow, cg, kh, kw)
        rows = count * s.out * s.out
        col = self.col[:rows]
        np.copyto(col.reshape(count, s.out, s.out, s.k, s.k, cg),
                  win.transpose(0, 1, 2, 4, 5, 3))
        return col

    def lift_back(self, dcol: np.ndarray, first: int, count: int, g: int) -> None:
        """col2im: add ``dcol`` (rows of images [first, first+count)) into ``dxp``."""
        s, cg = self.spec, self.cg
        d6 = dcol.reshape(count, s.out, s.out, s.k, s.k, cg)
        dx = self.dxp[first:first + count, :, :, g * cg:(g + 1) * cg]
        span = s.stride * (s.out - 1) + 1
        for i in range(s.k):
            for j in range(s.k):
                dx[:, i:i + span:s.stride, j:j + span:s.stride] += d6[:, :, :, i, j]

    def run(self, first: int, count: int, training: bool = True) -> None:
        """Forward (and backward) of images [first, first+count) as one lowered block."""
        s = self.spec
        rows = count * s.out * s.out
        r0 = first * s.out * s.out
        for g in range(s.groups):
            col = self.lower(first, count, g)
            np.matmul(col, self.w[g], out=self.y[g, r0:r0 + rows])
        if not training:
            return
        for g in range(s.groups):
            dy = self.dy[g, r0:r0 + rows]
            col = self.lower(first, count, g)  # re-lowered, as Caffe's backward does
            self.dw[g] += col.T @ dy
            if s.need_dx:
                dcol = self.dcol[:rows]
                np.matmul(dy, self.w[g].T, out=dcol)
                self.lift_back(dcol, first, count, g)


class _FCWork:
    def __init__(self, n_in: int, n_out: int, images: int, rng: np.random.Generator) -> None:
        self.x = rng.standard_normal((images, n_in), dtype=np.float32)
        self.w = rng.standard_normal((n_in, n_out), dtype=np.float32) * 0.01
        self.dy = rng.standard_normal((images, n_out), dtype=np.float32)
        self.y = np.empty((images, n_out), np.float32)
        self.dx = np.empty_like(self.x)

    def run(self, first: int, count: int) -> np.ndarray:
        sl = slice(first, first + count)
        np.matmul(self.x[sl], self.w, out=self.y[sl])
        np.matmul(self.dy[sl], self.w.T, out=self.dx[sl])
        return self.x[sl].T @ self.dy[sl]  # kernel gradient of this partition


# ------------------------------------------------------------------------------ strategies

def _blas_limits(threads: int):
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=threads, user_api="blas")


def _split(batch: int, parts: int) -> List[Tuple[int, int]]:
    """Contiguous (first, count) partitions of ``batch`` images, sizes differing by at most 1."""
    parts = max(1, min(parts, batch))
    base, extra = divmod(batch, parts)
    out, first = [], 0
    for i in range(parts):
        n = base + (i < extra)
        out.append((first, n))
        first += n
    return out


def make_step(convs: Sequence[ConvSpec], fcs: Dict[str, Tuple[int, int]], batch: int,
              how: str, partitions: int = 1, cores: Optional[int] = None):
    """A no-argument callable running one forward+backward pass of ``convs`` then ``fcs``.

    Args:
        how: ``"caffe"`` (one image at a time, BLAS on ``cores`` threads), ``"whole"`` (the
            whole batch lowered at once, BLAS on ``cores`` threads) or ``"partitions"``
            (``partitions`` threads, BLAS on one thread each).
    """
    cores = cores or os.cpu_count() or 1
    rng = np.random.default_rng(0)
    if how == "partitions":
        parts = _split(batch, partitions)
        # Each partition owns its buffers (as each CcT worker does); weights are shared values.
        works = [[_ConvWork(s, n, rng) for s in convs] for _, n in parts]
        for w in works[1:]:
            for a, b in zip(w, works[0]):
                a.w = b.w
        fc = {name: _FCWork(i, o, batch, rng) for name, (i, o) in fcs.items()}
        pool = ThreadPoolExecutor(len(parts))

        def partition(idx: int) -> list:
            first, n = parts[idx]
            for work in works[idx]:
                work.run(0, n)
            return [f.run(first, n) for f in fc.values()]

        def step() -> None:
            with _blas_limits(1):
                grads = list(pool.map(partition, range(len(parts))))
            for i in range(len(fc)):  # sum the partitions' kernel gradients
                total = grads[0][i]
                for g in grads[1:]:
                    total += g[i]
            for layer in range(len(convs)):
                for g in range(convs[layer].groups):
                    total = works[0][layer].dw[g]
                    for w in works[1:]:
                        total += w[layer].dw[g]
        step.pool = pool  # kept alive with the step
        return step
    if how not in ("caffe", "whole"):
        raise ValueError(f"how={how!r}: expected 'caffe', 'whole' or 'partitions'")
    works = [_ConvWork(s, 1 if how == "caffe" else batch, rng) for s in convs]
    if how == "caffe":  # one image's buffers, re-filled per image with that image's data
        images = [rng.standard_normal((batch,) + w.xp.shape[1:], dtype=np.float32)
                  for w in works]
    fc = {name: _FCWork(i, o, batch, rng) for name, (i, o) in fcs.items()}

    def step() -> None:
        with _blas_limits(cores):
            for li, work in enumerate(works):
                if how == "caffe":
                    for b in range(batch):
                        work.xp[0] = images[li][b]
                        work.run(0, 1)
                else:
                    work.run(0, batch)
            for f in fc.values():
                f.run(0, batch)
    return step


def configurations(cores: int) -> List[Tuple[str, str, int, int]]:
    """(label, how, partitions, BLAS threads) in the order they are reported."""
    out = [("caffe", "caffe", 1, cores)]
    if cores > 1:
        out.append(("caffe 1T", "caffe", 1, 1))
    out.append(("batch whole", "whole", 1, cores))
    out += [(f"batch p={p}", "partitions", p, 1) for p in range(1, cores + 1)]
    return out


def run(batch: int, repeats: int, cores: int, convs: Sequence[ConvSpec],
        fcs: Dict[str, Tuple[int, int]], progress=None) -> dict:
    """Images/s of every configuration on every conv layer and on the whole iteration."""
    configs = configurations(cores)
    targets = [(s.name, [s], {}) for s in convs] + [("iteration", list(convs), dict(fcs))]
    results: Dict[str, Dict[str, float]] = {}
    for name, cv, fc in targets:
        results[name] = {}
        for label, how, p, threads in configs:
            step = make_step(cv, fc, batch, how, p, threads)
            seconds = best_of(step, repeats)
            if hasattr(step, "pool"):
                step.pool.shutdown()
            results[name][label] = batch / seconds
            if progress is not None:
                progress.update(1)
    best_p = f"batch p={cores}"
    speedup = {name: r[best_p] / r["caffe"] for name, r in results.items()}
    return {"batch": batch, "cores": cores, "configs": [c[0] for c in configs],
            "images_per_s": results, "speedup_p_cores_vs_caffe": speedup,
            "fwd_bwd_gflop_per_image": {
                s.name: 3 * s.flops(1) / 1e9 if s.need_dx else 2 * s.flops(1) / 1e9
                for s in convs}}


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res, configs = data["images_per_s"], data["configs"]
    names = list(res)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        a1.bar(np.arange(len(names) - 1) + (i - (len(configs) - 1) / 2) * width,
               [res[n][c] / res[n]["caffe"] for n in names[:-1]], width, label=c)
    a1.set_xticks(np.arange(len(names) - 1), names[:-1])
    a1.axhline(1.0, color="grey", lw=0.5)
    a1.set_ylabel("speed-up over Caffe's per-image lowering")
    a1.set_title(f"CaffeNet convolutions, forward+backward, batch {data['batch']}")
    a1.legend(fontsize=8)
    it = res["iteration"]
    a2.bar(range(len(configs)), [it[c] for c in configs], color=[f"C{i}" for i in
                                                                  range(len(configs))])
    a2.set_xticks(range(len(configs)), configs, rotation=35, ha="right", fontsize=8)
    a2.set_ylabel("images/s")
    a2.set_title("whole training iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(data: dict, command: str) -> str:
    configs, res = data["configs"], data["images_per_s"]
    rows = [[n] + [r[c] for c in configs] + [data["speedup_p_cores_vs_caffe"][n]]
            for n, r in res.items()]
    header = ["layer"] + [f"{c} img/s" for c in configs] + \
        [f"p={data['cores']} / caffe"]
    it = data["speedup_p_cores_vs_caffe"]["iteration"]
    return (f"# Batching benchmark (CcT RQ1)\n\nCommand: `{command}`. Batch {data['batch']}, "
            f"{data['cores']} cores, numpy + OpenBLAS; forward+backward, images/s "
            f"(best of the repeats).\n\n"
            + markdown_table(header, rows) +
            f"\nWhole iteration: batched lowering with {data['cores']} partitions is "
            f"{it:.2f}x Caffe's per-image lowering ({CCT_PUBLISHED}; this machine has "
            f"{data['cores']} cores). `caffe` uses a BLAS on all cores for each image's GEMM, "
            "`caffe 1T` a one-thread BLAS.\n")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, fewer repeats")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cores", type=int, default=None, help="default: os.cpu_count()")
    args = parser.parse_args(argv)
    from tqdm import tqdm
    from benchmarks.common import machine
    batch = args.batch or (4 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    cores = args.cores or os.cpu_count() or 1
    convs = caffenet_convs()
    total = (len(convs) + 1) * len(configurations(cores))
    with tqdm(total=total, desc="batching benchmark", unit="run") as progress:
        data = run(batch, repeats, cores, convs, CAFFENET_FC, progress)
    data["machine"] = machine()
    command = "python -m benchmarks.batching" + (" --quick" if args.quick else "")
    md = markdown(data, command)
    write_results(args.out, "batching", data, md)
    plot(data, args.out / "batching.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
