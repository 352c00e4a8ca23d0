"""A seeded fuzzer over Caffe files: every mutated input must load or raise a typed error.

Seeds are the real files in ``../shared/caffe-models`` (LeNet, MTCNN, cifar10_quick prototxts,
small caffemodels, BVLC solvers) plus a small caffemodel, solverstate and binaryproto written
with keras_cct's own writers in a temporary folder (``../shared`` has no binaryproto and only a
large solverstate). Mutations: byte flips, truncation, giant and zero/negative numbers (text
tokens, or protobuf fields set through the parsed message), non-UTF-8 strings, deleted and
duplicated lines (text) or top-level fields (binary).

Each input is read the way a user reads it:

* prototxt -- ``read_net``, and for every ``build_every``-th input ``import_net`` (building the
  Keras model is what runs the layer checks; it takes ~0.15 s, so the quick run builds a subset).
  Convolutions are built with ``planner="model"`` (HybridConv2D's cost model): the default
  ``planner="auto"`` times each new convolution shape on sample data when it is built, which for
  a fuzzed but valid large layer (``num_output: 99999``) takes seconds and gigabytes -- the cost
  of planning a big net, not of reading a bad file;
* caffemodel -- ``read_caffemodel`` then ``load_weights`` into the seed's net;
* solverstate -- ``read_solverstate``, its history through ``blob_to_array``, and ``restore``
  into a tiny solver (the self-written seed);
* binaryproto -- ``read_binaryproto`` then ``blob_to_array``;
* solver -- ``read_solver`` (its ``net:`` pointed at the shared train/test net), then the
  learning rate at ``max_iter``.

The runs set ``KERAS_CCT_CAFFE_MAX_BYTES`` to 768 MiB (``FUZZ_MAX_BYTES``), so that what
the validation lets through can be built within the 2 GiB the run watches for; with the
default bound (a quarter of the machine's memory) a fuzzed LeNet asking for 3 GiB of weights
is, rightly, built.

Outcomes: ``typed`` (a :class:`~keras_cct.errors.KerasCCTError`), ``loaded``, ``untyped`` (any
other exception), ``hang`` (over ``time_limit`` seconds, by ``SIGALRM``), ``alloc`` (the
resident memory, sampled every 10 ms, rose more than ``alloc_limit`` bytes above its level at
the start of the input).

Run ``python -m tests.caffe.fuzz_caffe --long`` for thousands of inputs (every prototxt built).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

KINDS = ("prototxt", "caffemodel", "solverstate", "binaryproto", "solver")
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models"
GIANT_TEXT = ["999999999", "2147483647", "4294967295", "4294967296", "99999", "1e30",
              "9223372036854775807", "1e400"]
ZERO_TEXT = ["0", "-1", "-2147483648", "0.0", "-0.5", "nan"]
_NUM = re.compile(rb"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")

BUILD_OPTIONS = {"planner": "model"}
#: the memory bound of the fuzz runs: a net's weights together (and any one blob) under it, so
#: that building one (initial values drawn, one layer's temporary) stays under 2 GiB of growth
FUZZ_MAX_BYTES = 768 << 20
TINY_IP_NET = """name: "tiny_ip"
layer { name: "feed" type: "MemoryData" top: "data" top: "target"
        memory_data_param { batch_size: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


#: prototxt inputs that parsed and went on to import_net (during the current run)
STATS = {"built": 0}


class _Timeout(BaseException):
    """Raised by SIGALRM; a BaseException so that no ``except Exception`` swallows it."""


@dataclass
class Seed:
    kind: str
    name: str
    data: bytes
    check: Callable[[str], None]  # reads the file at the given path; raises on bad input


@dataclass
class Report:
    counts: Dict[str, Dict[str, int]] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)
    seconds: float = 0.0
    max_bytes: int = 0
    built: int = 0

    def add(self, kind: str, outcome: str) -> None:
        c = self.counts.setdefault(kind, {k: 0 for k in ("typed", "loaded", "untyped", "hang",
                                                          "alloc")})
        c[outcome] += 1

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())

    def text(self) -> str:
        rows = [f"{'kind':<12} {'inputs':>7} {'typed':>7} {'loaded':>7} {'untyped':>8} "
                f"{'hangs>limit':>11} {'alloc>limit':>11}"]
        for kind, c in self.counts.items():
            rows.append(f"{kind:<12} {sum(c.values()):>7} {c['typed']:>7} {c['loaded']:>7} "
                        f"{c['untyped']:>8} {c['hang']:>11} {c['alloc']:>11}")
        n = sum(sum(c.values()) for c in self.counts.values())
        rows.append(f"{'total':<12} {n:>7} {self.total('typed'):>7} {self.total('loaded'):>7} "
                    f"{self.total('untyped'):>8} {self.total('hang'):>11} "
                    f"{self.total('alloc'):>11}")
        if self.built:
            rows.append(f"prototxt inputs that parsed and were built: {self.built}")
        rows.append(f"({self.seconds:.0f} s; KERAS_CCT_CAFFE_MAX_BYTES={self.max_bytes})")
        return "\n".join(rows + self.failures[:20])


# --------------------------------------------------------------------------------------------
# Mutations


def _mutate_text(data: bytes, rng: random.Random) -> bytes:
    op = rng.choice(("flip", "truncate", "giant", "giant", "zero", "zero", "delete",
                     "duplicate"))
    if op in ("giant", "zero"):
        nums = list(_NUM.finditer(data))
        if nums:
            m = rng.choice(nums)
            new = rng.choice(GIANT_TEXT if op == "giant" else ZERO_TEXT).encode()
            return data[:m.start()] + new + data[m.end():]
        op = "flip"
    if op in ("delete", "duplicate"):
        lines = data.split(b"\n")
        i = rng.randrange(len(lines))
        if op == "delete":
            del lines[i]
        else:
            lines.insert(i, lines[i])
        return b"\n".join(lines)
    return _mutate_bytes(data, rng, op)


def _mutate_bytes(data: bytes, rng: random.Random, op: str) -> bytes:
    if not data:
        return data
    if op == "truncate":
        return data[:rng.randrange(len(data))]
    buf = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
    return bytes(buf)


def _scalar_fields(msg, out, depth=0):
    """(message, field descriptor, index or None) of the numeric and string fields."""
    from keras_cct.caffe.io.validate import _repeated
    for fd, value in msg.ListFields():
        if fd.message_type is not None:
            subs = value if _repeated(fd) else [value]
            for sub in list(subs)[:64]:
                _scalar_fields(sub, out, depth + 1)
        elif _repeated(fd):
            n = len(value)
            for i in ({0, n - 1, n // 2} if n > 8 else range(n)):
                out.append((msg, fd, i))
        else:
            out.append((msg, fd, None))
    return out


def _giant_or_zero(fd, rng: random.Random):
    from google.protobuf.descriptor import FieldDescriptor as FD
    t = fd.type
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return rng.choice([0.0, -1.0, 1e30, float("inf"), float("nan"), 3.4e38])
    if t == FD.TYPE_BOOL:
        return rng.choice([True, False])
    if t == FD.TYPE_ENUM:
        return rng.choice([v.number for v in fd.enum_type.values])
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return rng.choice([0, 1, 2 ** 32 - 1, 999999999, 65536])
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return rng.choice([0, 2 ** 64 - 1, 999999999, 2 ** 40])
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return rng.choice([0, -1, 2 ** 63 - 1, -2 ** 63, 999999999, 2 ** 40])
    return rng.choice([0, -1, 2 ** 31 - 1, -2 ** 31, 999999999, 65536])


def _mutate_binary(data: bytes, message_class, rng: random.Random) -> bytes:
    op = rng.choice(("flip", "truncate", "field", "field", "field", "string", "delete",
                     "duplicate"))
    if op in ("field", "string"):
        msg = message_class()
        try:
            msg.ParseFromString(data)
        except Exception:
            return _mutate_bytes(data, rng, "flip")
        from google.protobuf.descriptor import FieldDescriptor as FD
        fields = _scalar_fields(msg, [])
        strings = [f for f in fields if f[1].type == FD.TYPE_STRING]
        if op == "string" and strings:
            m, fd, i = rng.choice(strings)
            value = getattr(m, fd.name)[i] if i is not None else getattr(m, fd.name)
            raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
            if len(raw) >= 2 and raw in data:
                bad = b"\xc3\x28" + raw[2:]
                return data.replace(raw, bad, 1)
        numbers = [f for f in fields if f[1].type not in (FD.TYPE_STRING, FD.TYPE_BYTES)]
        if numbers:
            m, fd, i = rng.choice(numbers)
            v = _giant_or_zero(fd, rng)
            try:
                if i is None:
                    setattr(m, fd.name, v)
                else:
                    getattr(m, fd.name)[i] = v
                return msg.SerializeToString()
            except (ValueError, TypeError):
                pass
        return _mutate_bytes(data, rng, "flip")
    if op in ("delete", "duplicate"):
        try:
            spans = list(_top_spans(data))
        except (ValueError, IndexError):
            spans = []
        if spans:
            s0, e = rng.choice(spans)
            chunk = data[s0:e]
            return data[:s0] + data[e:] if op == "delete" else data[:e] + chunk + data[e:]
        op = "flip"
    return _mutate_bytes(data, rng, op)


def _top_spans(data: bytes):
    """(start, end) byte spans of each top-level field, key included."""
    from keras_cct.caffe.net.weights import _fields
    pos = 0
    for _, _, _, end in _fields(data, 0, len(data)):
        yield pos, end
        pos = end


# --------------------------------------------------------------------------------------------
# Seeds


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def make_seeds(work: Path, *, long: bool = False, kinds=KINDS) -> List[Seed]:
    """The seed files and how each kind is read. Shared files are read, never copied into
    the project (mutated copies go to ``work``, a temporary folder)."""
    import keras
    from keras_cct.caffe import import_net, load_weights, save_weights
    from keras_cct.caffe.io.binary import (blob_to_array, read_binaryproto, read_caffemodel,
                                           read_solverstate, write_binaryproto)
    from keras_cct.caffe.io.text import read_net
    from keras_cct.caffe.train.config import read_solver
    from keras_cct.caffe.train.solver import load_solver
    seeds: List[Seed] = []
    counter = {"n": 0}
    have_shared = SHARED.is_dir()

    if "prototxt" in kinds and have_shared:
        names = ["lenet_mnist/lenet.prototxt", "mtcnn/det1.prototxt",
                 "cifar10_quick_v1/cifar10_quick.prototxt"]
        if long:
            names += ["mtcnn/det2.prototxt", "resnet50_stem/test.prototxt",
                      "prototxt-only/bvlc_mnist_examples/lenet_train_test.prototxt",
                      "prototxt-only/squeezenet_v1.1/deploy.prototxt"]

        def check_prototxt(path: str, build_every: int = 1) -> None:
            counter["n"] += 1
            read_net(path)
            if counter["n"] % build_every == 0:
                if counter["n"] % 50 == 0:
                    keras.backend.clear_session()
                STATS["built"] += 1
                import_net(path, conv_options=BUILD_OPTIONS)
        for n in names:
            seeds.append(Seed("prototxt", n, (SHARED / n).read_bytes(), check_prototxt))

    if "caffemodel" in kinds and have_shared:
        pairs = [("mtcnn/det1.prototxt", "mtcnn/det1.caffemodel"),
                 ("resnet50_stem/test.prototxt", "resnet50_stem/test.caffemodel")]
        if long:
            pairs += [("lenet_mnist/lenet.prototxt", "lenet_mnist/lenet_iter_10000.caffemodel"),
                      ("cifar10_quick_v1/cifar10_quick.prototxt",
                       "cifar10_quick_v1/cifar10_quick_iter_5000.caffemodel")]
        for proto_name, model_name in pairs:
            net = import_net(SHARED / proto_name)

            def check_caffemodel(path: str, net=net) -> None:
                read_caffemodel(path)
                load_weights(net, path)
            seeds.append(Seed("caffemodel", model_name, (SHARED / model_name).read_bytes(),
                              check_caffemodel))

    if "solverstate" in kinds or "caffemodel" in kinds:
        _write(work / "ip.prototxt", TINY_IP_NET)
        solver_path = _write(work / "ip_solver.prototxt", f"""net: "ip.prototxt"
base_lr: 0.1 momentum: 0.9 max_iter: 2 snapshot_prefix: "{work}/seed" random_seed: 1""")
        rng = np.random.default_rng(0)
        arrays = {"data": rng.normal(size=(8, 4)).astype(np.float32),
                  "target": rng.normal(size=(8, 3)).astype(np.float32)}
        solver = load_solver(str(solver_path), arrays=arrays, log=lambda line: None)
        solver.step(1)
        _, state_file = solver.snapshot()
        if "solverstate" in kinds:
            def check_state(path: str, solver=solver) -> None:
                state = read_solverstate(path)
                for b in state.history:
                    blob_to_array(b)
                solver.restore(path)
            seeds.append(Seed("solverstate", "own tiny SGD", Path(state_file).read_bytes(),
                              check_state))
            if long and have_shared:
                def check_state_only(path: str) -> None:
                    for b in read_solverstate(path).history:
                        blob_to_array(b)
                n = "cifar10_quick_v1/cifar10_quick_iter_5000.solverstate"
                seeds.append(Seed("solverstate", n, (SHARED / n).read_bytes(),
                                  check_state_only))
        if "caffemodel" in kinds:
            net = import_net(work / "ip.prototxt", input_shape={"data": (4, 4)})
            model_file = work / "own.caffemodel"
            save_weights(net, model_file)

            def check_own(path: str, net=net) -> None:
                read_caffemodel(path)
                load_weights(net, path)
            seeds.append(Seed("caffemodel", "own tiny", model_file.read_bytes(), check_own))
            h5_file = work / "own.caffemodel.h5"  # Caffe's snapshot_format: HDF5
            save_weights(net, h5_file)

            def check_h5(path: str, net=net) -> None:
                os.replace(path, path + ".h5")
                load_weights(net, path + ".h5")
            seeds.append(Seed("caffemodel", "own tiny (HDF5)", h5_file.read_bytes(), check_h5))

    if "binaryproto" in kinds:
        def check_blob(path: str) -> None:
            blob_to_array(read_binaryproto(path))
        for legacy in (False, True):
            p = work / f"mean_{legacy}.binaryproto"
            write_binaryproto(str(p), np.arange(3 * 8 * 8, dtype=np.float32)
                              .reshape(1, 3, 8, 8), legacy_shape=legacy)
            seeds.append(Seed("binaryproto", f"own mean (legacy={legacy})", p.read_bytes(),
                              check_blob))

    if "solver" in kinds and have_shared:
        solvers = {"prototxt-only/bvlc_mnist_examples/lenet_solver.prototxt":
                   "prototxt-only/bvlc_mnist_examples/lenet_train_test.prototxt",
                   "prototxt-only/bvlc_mnist_examples/lenet_solver_adam.prototxt":
                   "prototxt-only/bvlc_mnist_examples/lenet_train_test.prototxt",
                   "cifar10_quick_v1/cifar10_quick_solver.prototxt":
                   "cifar10_quick_v1/cifar10_quick_train_test.prototxt"}
        if long:
            solvers["prototxt-only/bvlc_mnist_examples/lenet_solver_rmsprop.prototxt"] = \
                "prototxt-only/bvlc_mnist_examples/lenet_train_test.prototxt"
            solvers["prototxt-only/bvlc_mnist_examples/lenet_adadelta_solver.prototxt"] = \
                "prototxt-only/bvlc_mnist_examples/lenet_train_test.prototxt"

        def check_solver(path: str) -> None:
            cfg = read_solver(path)
            cfg.schedule().rate(max(int(cfg.param.max_iter), 0))
        for n, net_name in solvers.items():
            text = (SHARED / n).read_text()
            text = re.sub(r'(?m)^(\s*net:\s*)".*"', lambda m: f'{m.group(1)}"'
                          f'{SHARED / net_name}"', text)
            seeds.append(Seed("solver", n, text.encode(), check_solver))
    return seeds


# --------------------------------------------------------------------------------------------
# Running


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _RSSWatch:
    """The peak resident memory while a case runs, sampled every 10 ms by a thread (the
    process's ``ru_maxrss`` when /proc is absent: it only shows a new all-time peak)."""

    def __init__(self) -> None:
        import threading
        self.start = _rss()
        self.peak = self.start or 0
        self._stop = threading.Event()
        self._thread = None
        if self.start is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            self._maxrss0 = _maxrss()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss() or 0)

    def growth(self) -> int:
        self._stop.set()
        if self._thread is None:
            return _maxrss() - self._maxrss0
        self._thread.join()
        self.peak = max(self.peak, _rss() or 0)
        return self.peak - self.start


def _on_alarm(signum, frame):
    raise _Timeout()


def run_one(seed: Seed, data: bytes, path: Path, *, time_limit: float, alloc_limit: int,
            **kw) -> tuple:
    """(outcome, detail) of reading ``data`` the way ``seed`` says."""
    from keras_cct.errors import KerasCCTError
    path.write_bytes(data)
    watch = _RSSWatch()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    outcome, detail = "loaded", ""
    try:
        seed.check(str(path), **kw)
    except _Timeout:
        outcome, detail = "hang", f"over {time_limit} s"
    except KerasCCTError:
        outcome = "typed"
    except Exception as exc:  # noqa: BLE001 - counting what escapes is the point
        outcome = "untyped"
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f"{type(exc).__name__}: {exc} ({tb.filename}:{tb.lineno})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    grew = watch.growth()
    if grew > alloc_limit:
        outcome, detail = "alloc", f"peak memory grew by {grew / (1 << 30):.2f} GiB"
    return outcome, detail


def fuzz(per_kind: int = 200, *, seed: int = 0, long: bool = False, build_every: int = 4,
         kinds=KINDS, time_limit: float = 10.0, alloc_limit: int = 2 << 30,
         work: Optional[Path] = None, max_bytes: int = FUZZ_MAX_BYTES,
         log: Callable[[str], None] = lambda s: None) -> Report:
    """Run ``per_kind`` mutated inputs of each file kind (spread over its seeds), with
    ``KERAS_CCT_CAFFE_MAX_BYTES`` set to ``max_bytes`` meanwhile."""
    old = os.environ.get("KERAS_CCT_CAFFE_MAX_BYTES")
    os.environ["KERAS_CCT_CAFFE_MAX_BYTES"] = str(int(max_bytes))
    STATS["built"] = 0
    try:
        report = _fuzz(per_kind, seed=seed, long=long, build_every=build_every, kinds=kinds,
                       time_limit=time_limit, alloc_limit=alloc_limit, work=work, log=log)
        report.max_bytes = int(max_bytes)
        report.built = STATS["built"]
        return report
    finally:
        if old is None:
            os.environ.pop("KERAS_CCT_CAFFE_MAX_BYTES", None)
        else:
            os.environ["KERAS_CCT_CAFFE_MAX_BYTES"] = old


def _fuzz(per_kind, *, seed, long, build_every, kinds, time_limit, alloc_limit, work, log
          ) -> Report:
    from keras_cct.caffe.io import proto
    classes = {"caffemodel": proto.NetParameter, "solverstate": proto.SolverState,
               "binaryproto": proto.BlobProto}
    report = Report()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(work or tmp)
        seeds = make_seeds(work, long=long, kinds=kinds)
        rng = random.Random(seed)
        for kind in kinds:
            ks = [s for s in seeds if s.kind == kind]
            for i in range(per_kind if ks else 0):
                s = ks[i % len(ks)]
                if kind in classes:
                    data = _mutate_binary(s.data, classes[kind], rng)
                else:
                    data = _mutate_text(s.data, rng)
                ext = {"solver": "prototxt"}.get(kind, kind)
                kw = {"build_every": build_every} if kind == "prototxt" else {}
                outcome, detail = run_one(s, data, work / f"fuzz_{i}.{ext}",
                                          time_limit=time_limit, alloc_limit=alloc_limit, **kw)
                report.add(kind, outcome)
                if outcome in ("untyped", "hang", "alloc"):
                    bad = work.parent / f"keras_cct_fuzz_{kind}_{seed}_{i}.{ext}"
                    try:
                        bad.write_bytes(data)
                    except OSError:
                        bad = None
                    report.failures.append(f"{kind} #{i} ({s.name}): {outcome}: {detail}"
                                           f" [input kept at {bad}]")
                    log(report.failures[-1])
    report.seconds = time.perf_counter() - t0
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.caffe.fuzz_caffe", description=__doc__
                                 .split("\n")[0])
    ap.add_argument("--long", action="store_true",
                    help="thousands of inputs, more seeds, every prototxt built")
    ap.add_argument("--per-kind", type=int, default=None,
                    help="inputs per file kind (default 200, --long 3000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per input")
    ap.add_argument("--max-bytes", type=int, default=FUZZ_MAX_BYTES,
                    help="KERAS_CCT_CAFFE_MAX_BYTES for the run (default 768 MiB)")
    args = ap.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    per_kind = args.per_kind or (3000 if args.long else 200)
    report = fuzz(per_kind, seed=args.seed, long=args.long,
                  build_every=1 if args.long else 4, time_limit=args.time_limit,
                  max_bytes=args.max_bytes,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.text())
    bad = report.total("untyped") + report.total("hang") + report.total("alloc")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
