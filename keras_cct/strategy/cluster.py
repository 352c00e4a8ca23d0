"""Beyond one machine: CCTStrategy inside TensorFlow's ``MultiWorkerMirroredStrategy``.

Two levels of parallelism, each done by the engine made for it:

* **across workers** (processes, usually machines): TensorFlow's
  ``tf.distribute.MultiWorkerMirroredStrategy`` (MWMS), configured by ``TF_CONFIG``. Every
  worker holds a replica of the model; each step every worker computes the gradient of its own
  part of the global batch and MWMS all-reduces (sums) the gradients.
* **inside a worker**: :class:`~keras_cct.CCTStrategy`, CcT's in-layer split of each
  HybridConv2D's batch across the worker's own devices (TF CPU/GPU, OpenCL).

The scopes nest (MWMS outside, CCTStrategy inside)::

    from keras_cct.strategy import cluster
    mwms = cluster.configure(["10.0.0.1:12345", "10.0.0.2:12345"], worker_index=I)  # first!
    cct = keras_cct.CCTStrategy(["tf:cpu:0", "opencl:0:0"])
    with cluster.scope(mwms, cct):          # == with mwms.scope(), cct.scope():
        model = build_model()               # HybridConv2D layers bind to cct
        model.compile(optimizer, loss)      # variables are MWMS mirrored variables
    shares = cluster.worker_shares(mwms, cluster.local_throughput(cct))
    model.fit(cluster.distribute(mwms, global_batches, shares), epochs=...)

``global_batches`` is a ``tf.data.Dataset`` of *global* batches, in the same order on every
worker (same files, same seed). :func:`distribute` gives each worker its contiguous slice of
every global batch, sized by ``shares``, so the workers together see exactly the global batch
and run the same number of steps (MWMS needs that: every step is a collective).

Unequal workers. TensorFlow cannot split one replica's batch unevenly itself
(``experimental_distribute_dataset`` cuts the global batch evenly), but it accepts per-worker
datasets of any batch size (``distribute_datasets_from_function``), which is what
:func:`distribute` builds. Keras then scales each replica's mean loss by ``1 / replicas``,
which is the global-batch mean only when the slices are equal; :func:`distribute` therefore
attaches sample weights ``replicas * n_local / n_global`` (1 for equal slices) so that each
worker's loss is ``sum(local losses) / n_global`` and the all-reduced gradient is exactly the
gradient of the global batch's mean loss, as in a single-process run. Shares are fixed for one
``fit`` call (TF builds the per-worker iterators once); inside each worker, CCTStrategy keeps
rebalancing its own devices every step. The shares come from each worker's calibrated
throughput (the sum of its devices' GFLOP/s, CcT's FLOPS-proportional rule), gathered with one
MWMS collective so that every worker computes the same split.

Keras 3 and MWMS. Keras 3.x's TF trainer has two bugs that stop ``model.fit`` under MWMS
(keras-team/keras#20585, tensorflow/tensorflow#72388): it all-reduces the first *data* batch
before building (fails on nested data and on unequal per-worker batches) and reduces scalar
logs with ``axis=0``. :func:`configure` installs :func:`patch_keras`, which replaces those
two steps, only for MWMS in multi-worker mode (everything else goes to Keras' own code).

One replica per worker. :func:`configure` gives MWMS one replica per worker (its CPU, or its
first GPU), not one per local GPU: the worker's devices are CCTStrategy's to split among.

Faults. A killed worker takes the running collective down: the other workers fail (or are
ended by the cluster manager); MWMS cannot continue with fewer workers. Restart every worker
with the same ``TF_CONFIG`` and ``keras.callbacks.BackupAndRestore`` (one ``backup_dir`` per
worker, see :func:`backup_dir`): training resumes from the last completed epoch with the
weights and optimizer state saved there, and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Iterator, List, Optional, Sequence, Union

import numpy as np

from keras_cct.errors import ClusterError

REDUCTIONS = ("sum_over_batch_size", "sum")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


# ------------------------------------------------------------------------------ configuration

def parse_workers(workers: Union[str, Sequence[str]]) -> List[str]:
    """``["host:port", ...]`` from a list or a comma-separated string, each address checked.

    Raises:
        ClusterError: an address is not ``host:port``, a port is out of range, an address is
            listed twice, or the list is empty.
    """
    if isinstance(workers, str):
        items = [w.strip() for w in workers.split(",") if w.strip()]
    else:
        items = [str(w).strip() for w in workers]
    if not items:
        raise ClusterError("the worker list is empty (give host:port,host:port,...)")
    for w in items:
        m = _ADDRESS.match(w)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ClusterError(f"worker address {w!r} is not host:port with a port in 1..65535 "
                               f"(e.g. 10.0.0.2:12345)")
    if len(set(items)) != len(items):
        raise ClusterError(f"a worker address is listed twice in {items}")
    return items


def tf_config(workers: Union[str, Sequence[str]], worker_index: int) -> dict:
    """The ``TF_CONFIG`` dictionary of worker ``worker_index`` in a cluster of ``workers``.

    Every worker gets the same list (in the same order) and its own index; worker 0 is the
    chief (it writes summaries and checkpoints in Keras' conventions).
    """
    items = parse_workers(workers)
    if isinstance(worker_index, bool) or not isinstance(worker_index, (int, np.integer)) or \
            not 0 <= int(worker_index) < len(items):
        raise ClusterError(f"worker index {worker_index!r} is not in 0..{len(items) - 1} "
                           f"(the cluster has {len(items)} workers: {items})")
    return {"cluster": {"worker": items}, "task": {"type": "worker", "index": int(worker_index)}}


def configure(workers: Union[str, Sequence[str], None] = None,
              worker_index: Optional[int] = None, *, replica_device: Optional[str] = None,
              timeout_seconds: Optional[float] = None, patch: bool = True):
    """Set ``TF_CONFIG`` and return the ``MultiWorkerMirroredStrategy`` of this worker.

    Call it at the very start of each worker process, before any other TensorFlow operation
    (TensorFlow configures its collective runtime once per process). Every worker must call it;
    TensorFlow's coordination service then waits for the other workers to come up.

    Args:
        workers: every worker's ``host:port`` (a list or ``"h:p,h:p"``), the same on all
            workers. None: keep the ``TF_CONFIG`` already in the environment.
        worker_index: this worker's position in ``workers``.
        replica_device: where the worker's one MWMS replica lives (its variables and the
            layers CCTStrategy does not split): ``"cpu"`` or ``"gpu"`` (the first GPU); None:
            ``"gpu"`` when TensorFlow sees a GPU. MWMS would otherwise make one replica per
            local GPU; here each worker has exactly one replica and its devices are
            CCTStrategy's (name them in ``CCTStrategy(devices=...)``). Use the same value on
            every worker (MWMS needs the same number of devices per worker).
        timeout_seconds: abort a collective (and so the step) that has not completed after
            this long; None: TensorFlow's default (no collective timeout; a dead peer is still
            detected by the coordination service's heartbeats, see docs/multiworker.md).
        patch: install :func:`patch_keras` (needed for ``model.fit`` with Keras 3).

    Raises:
        ClusterError: bad ``workers``/``worker_index``, or no ``TF_CONFIG`` to use.
        DeviceError: the Keras backend is not TensorFlow.
    """
    from keras_cct.strategy._tf import require_tensorflow as _require_tensorflow
    _require_tensorflow()
    if replica_device not in (None, "cpu", "gpu"):
        raise ClusterError(f"`replica_device` must be 'cpu', 'gpu' or None, got "
                           f"{replica_device!r}")
    if workers is not None:
        if worker_index is None:
            raise ClusterError("`worker_index` is required with `workers` (this worker's "
                               "position in the list, from 0)")
        os.environ["TF_CONFIG"] = json.dumps(tf_config(workers, worker_index))
    else:
        raw = os.environ.get("TF_CONFIG")
        if not raw:
            raise ClusterError("no cluster given: pass workers=['host:port', ...] and "
                               "worker_index, or set TF_CONFIG")
        try:
            conf = json.loads(raw)
            tf_config(conf["cluster"]["worker"], conf["task"]["index"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ClusterError(f"TF_CONFIG is not a worker cluster description ({exc}): "
                               f"{raw!r}") from None
    import tensorflow as tf
    if replica_device is None:
        replica_device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=timeout_seconds)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=_one_replica_resolver(replica_device), communication_options=options)
    if patch:
        patch_keras()
    return strategy


def _one_replica_resolver(replica_device: str):
    """TF_CONFIG's cluster resolver, reporting one GPU (or none: the CPU) to MWMS."""
    import tensorflow as tf

    class OneReplicaResolver(tf.distribute.cluster_resolver.TFConfigClusterResolver):
        def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
            return {"GPU": 1} if replica_device == "gpu" else {}

    return OneReplicaResolver()


@contextlib.contextmanager
def scope(mwms, cct=None) -> Iterator[None]:
    """``with mwms.scope(), cct.scope():`` -- the documented nesting (MWMS outside).

    Build and compile the model inside: its variables become MWMS mirrored variables and its
    HybridConv2D layers bind to ``cct`` (when given) for the in-worker device split.
    """
    with mwms.scope():
        if cct is None:
            yield
        else:
            with cct.scope():
                yield


def backup_dir(root: Union[str, os.PathLike], worker_index: Optional[int] = None) -> str:
    """A per-worker folder for ``keras.callbacks.BackupAndRestore`` under ``root``.

    Keras 3's BackupAndRestore writes plain files without multi-worker coordination, so two
    workers must not share one folder. ``worker_index`` defaults to TF_CONFIG's task index.
    """
    if worker_index is None:
        conf = json.loads(os.environ.get("TF_CONFIG") or "{}")
        worker_index = int(conf.get("task", {}).get("index", 0))
    return os.path.join(os.fspath(root), f"worker-{int(worker_index)}")


# ------------------------------------------------------------------------------ shares

def local_throughput(cct=None) -> float:
    """This worker's throughput for the share computation: the sum of the calibrated SGEMM
    GFLOP/s of ``cct``'s active devices (CcT's FLOPS-proportional rule), or of TensorFlow's
    first CPU when ``cct`` is None. Calibrations are cached on disk (see
    :func:`keras_cct.devices.calibrate`)."""
    from keras_cct.devices import calibrate
    if cct is None:
        return float(calibrate("tf:cpu:0"))
    return float(sum(d.gflops or calibrate(d)
                     for d, on in zip(cct.devices, cct.active) if on))


def worker_shares(mwms, throughput: float) -> np.ndarray:
    """Every worker's share of the global batch, proportional to its ``throughput``.

    A collective: every worker must call it at the same point, each with its own figure (for
    example :func:`local_throughput` or its measured images/s); all get the same array.
    """
    import tensorflow as tf
    _check_one_replica(mwms)
    rate = float(throughput)
    if not np.isfinite(rate) or rate <= 0:
        raise ClusterError(f"worker throughput must be a positive number, got {throughput!r}")
    n = mwms.num_replicas_in_sync
    index = mwms.cluster_resolver.task_id if mwms.cluster_resolver else 0
    if n == 1:
        return np.ones(1)
    mine = np.zeros(n, np.float64)
    mine[index] = rate

    @tf.function(autograph=False)
    def exchange():
        return mwms.run(tf.constant, args=(mine,))

    per_replica = exchange()
    rates = np.asarray(mwms.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None),
                       np.float64)
    return rates / rates.sum()


def _check_one_replica(mwms) -> int:
    """The number of workers, checking that each has exactly one replica."""
    replicas = mwms.num_replicas_in_sync
    resolver = getattr(mwms, "cluster_resolver", None)
    spec = resolver.cluster_spec() if resolver is not None else None
    workers = len(spec.as_dict().get("worker", [])) if spec is not None else 0
    if replicas != max(workers, 1):
        raise ClusterError(f"the strategy has {replicas} replicas for {workers} workers; "
                           f"keras_cct's cluster needs one replica per worker (create it with "
                           f"keras_cct.strategy.cluster.configure, and give a worker's other "
                           f"devices to its CCTStrategy)")
    return replicas


def split_sizes(batch: int, shares: Sequence[float]) -> np.ndarray:
    """Integer slice sizes of a global batch of ``batch`` examples, one per worker, summing to
    ``batch`` (rounded cumulative shares, as CCTStrategy splits a layer's batch). A worker whose
    share rounds to zero gets an empty slice for that step: with Keras' own loss reduction its
    loss and gradient are zero, but a local mean (:func:`mean_loss_factor`) or batch statistics
    of an empty slice are NaN, so keep every worker's share above ``1 / batch``."""
    f = _check_shares(shares)
    bounds = np.round(np.cumsum(f) * int(batch)).astype(np.int64)
    bounds[-1] = int(batch)
    return np.diff(np.concatenate([[0], bounds]))


def _check_shares(shares: Sequence[float]) -> np.ndarray:
    f = np.asarray(list(shares), np.float64)
    if f.ndim != 1 or f.size == 0 or np.any(~np.isfinite(f)) or np.any(f < 0) or f.sum() <= 0:
        raise ClusterError(f"`shares` must be non-negative numbers, one per worker, not all "
                           f"zero; got {list(shares)!r}")
    return f / f.sum()


def local_slice(batch, shares: Sequence[float], worker_index: int, *,
                loss_reduction: str = "sum_over_batch_size"):
    """This worker's part of one global batch, for loops that call ``train_on_batch``.

    Args:
        batch: ``(x, y)``, ``(x, y, sample_weight)``, or ``x`` alone (e.g. a Caffe net's dict
            of input blobs, labels included) of numpy arrays or nested structures of them: the
            global batch, the same on every worker.
        shares: every worker's share (:func:`worker_shares`).
        worker_index: this worker.
        loss_reduction: the reduction of the compiled loss (see :func:`distribute`).

    Returns:
        ``(x_local, y_local, sample_weight_local)`` (``y_local`` None for an ``x``-only batch):
        pass them to ``train_on_batch`` so that the all-reduced gradient is the global batch's
        (a ``compute_loss`` override applies :func:`mean_loss_factor` to the weights).
    """
    import keras
    f = _check_shares(shares)
    if loss_reduction not in REDUCTIONS:
        raise ClusterError(f"`loss_reduction` must be one of {REDUCTIONS}, got "
                           f"{loss_reduction!r}")
    if not 0 <= int(worker_index) < f.size:
        raise ClusterError(f"worker index {worker_index} is not in 0..{f.size - 1}")
    x, y, w = _unpack(batch) if isinstance(batch, tuple) else (batch, None, None)
    n = int(np.shape(keras.tree.flatten(x)[0])[0])
    sizes = split_sizes(n, f)
    lo = int(sizes[:int(worker_index)].sum())
    hi = lo + int(sizes[int(worker_index)])

    def cut(a):
        return a[lo:hi]

    weight = np.full(hi - lo, _weights_for(hi - lo, n, f.size, loss_reduction), np.float32)
    if w is not None:
        weight = weight * np.asarray(w, np.float32)[lo:hi]
    return (keras.tree.map_structure(cut, x),
            None if y is None else keras.tree.map_structure(cut, y), weight)


def mean_loss_factor(sample_weight):
    """Factor for a loss that is a mean over the local batch and does not use Keras' loss
    reduction (e.g. a ``compute_loss`` override such as Caffe's loss layers, which Keras
    neither weights nor scales by ``1 / replicas``).

    With the weights of :func:`local_slice` or :func:`distribute` (``replicas * n_local /
    n_global``), the factor is ``n_local / n_global``: multiply the local mean loss by it and
    the all-reduced (summed) gradient is the global batch's mean gradient. Returns 1 when
    ``sample_weight`` is None. Call it inside the train step (replica context). A mean over
    an empty slice is NaN: choose shares that give every worker at least one example of every
    batch (see :func:`split_sizes`).
    """
    if sample_weight is None:
        return 1.0
    from keras import ops
    replicas = 1
    import keras
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
    w = ops.convert_to_tensor(sample_weight, "float32")
    return ops.divide_no_nan(ops.sum(w), ops.cast(ops.size(w), "float32")) / replicas


def _unpack(element):
    if isinstance(element, tuple) and len(element) in (2, 3):
        return element[0], element[1], (element[2] if len(element) == 3 else None)
    raise ClusterError("a global batch must be a tuple (x, y) or (x, y, sample_weight); got "
                       f"{type(element).__name__}"
                       + (f" of length {len(element)}" if isinstance(element, tuple) else ""))


def _weights_for(n_local, n_global, replicas: int, reduction: str):
    """The per-example weight that makes a replica's loss a share of the global mean."""
    if reduction == "sum":
        return 1.0
    return replicas * n_local / n_global


# ------------------------------------------------------------------------------ data

def distribute(mwms, dataset, shares: Optional[Sequence[float]] = None, *,
               loss_reduction: str = "sum_over_batch_size"):
    """A distributed dataset whose replica on each worker gets its slice of each global batch.

    Args:
        mwms: the strategy from :func:`configure`.
        dataset: a ``tf.data.Dataset`` of global batches ``(x, y)`` or ``(x, y, sample_weight)``
            (``x``/``y`` may be nested), identical and in the same order on every worker.
        shares: each worker's share of a global batch (:func:`worker_shares`); None: equal.
        loss_reduction: the compiled loss's reduction: ``"sum_over_batch_size"`` (Keras'
            default; each worker's examples are weighted ``replicas * n_local / n_global`` so
            the summed gradient is the global mean's) or ``"sum"`` (weights 1).

    Returns:
        A ``tf.distribute`` distributed dataset for ``model.fit`` / ``model.evaluate``.

    Raises:
        ClusterError: bad shares (one per worker) or an unsupported ``loss_reduction``.
    """
    import tensorflow as tf
    replicas = _check_one_replica(mwms)
    if shares is None:
        shares = np.ones(replicas)
    f = _check_shares(shares)
    if f.size != replicas:
        raise ClusterError(f"`shares` has {f.size} entries but the cluster has {replicas} "
                           f"replicas (one per worker)")
    if loss_reduction not in REDUCTIONS:
        raise ClusterError(f"`loss_reduction` must be one of {REDUCTIONS} (the exact global "
                           f"gradient needs a loss that is a sum of per-example terms); got "
                           f"{loss_reduction!r}")
    cum = tf.constant(np.cumsum(f), tf.float64)

    def part(element, index):
        x, y, w = _unpack(element)
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        bounds = tf.cast(tf.round(cum * tf.cast(n, tf.float64)), tf.int32)
        bounds = tf.concat([[0], bounds[:-1], [n]], axis=0)
        lo, hi = bounds[index], bounds[index + 1]

        def cut(t):
            return t[lo:hi]

        scale = tf.cast(_weights_for(tf.cast(hi - lo, tf.float64), tf.cast(n, tf.float64),
                                     replicas, loss_reduction), tf.float32)
        weight = tf.fill([hi - lo], scale)
        if w is not None:
            weight = tf.cast(cut(w), tf.float32) * scale
        return tf.nest.map_structure(cut, x), tf.nest.map_structure(cut, y), weight

    def dataset_fn(context):
        index = context.input_pipeline_id
        return dataset.map(lambda *e: part(e if len(e) > 1 else e[0], index))

    options = tf.distribute.InputOptions(experimental_replication_mode=(
        tf.distribute.InputReplicationMode.PER_WORKER))
    return mwms.distribute_datasets_from_function(dataset_fn, options)


# ------------------------------------------------------------------------------ Keras fixes

_PATCHED = False


def patch_keras() -> None:
    """Make Keras 3's TF trainer work under ``MultiWorkerMirroredStrategy`` (idempotent).

    Replaces two steps of ``keras.src.backend.tensorflow.trainer``, and only when the
    strategy is MWMS in multi-worker mode:

    * ``_maybe_symbolic_build``: Keras all-reduces the first data batch across workers to get
      example shapes, which fails on nested data and on unequal per-worker batches; the patch
      takes this worker's own batch (only shapes are used).
    * ``reduce_per_replica`` with ``"auto"``/``"mean"``: Keras reduces with ``axis=0``, which
      fails on scalar logs; the patch averages across workers element-wise.
    """
    global _PATCHED
    if _PATCHED:
        return
    import warnings

    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer

    needed = ("_collective_all_reduce_multi_worker", "reduce_per_replica", "TensorFlowTrainer")
    if not all(hasattr(tf_trainer, name) for name in needed) or not hasattr(
            tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build"):
        warnings.warn("keras_cct.strategy.cluster.patch_keras: this Keras version's TF trainer "
                      "has changed; it is left as it is (model.fit under MWMS may fail as in "
                      "keras-team/keras#20585)", RuntimeWarning, stacklevel=2)
        return
    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = tf_trainer.reduce_per_replica
    multi_worker = tf_trainer._collective_all_reduce_multi_worker

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or not multi_worker(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = next(it)
                break

        def local(v):
            if isinstance(v, tf.distribute.DistributedValues):
                return strategy.experimental_local_results(v)[0]
            return v

        data_batch = tf.nest.map_structure(local, data_batch)
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and multi_worker(strategy):
            return tf.nest.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original_reduce(values, strategy, reduction)

    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    _PATCHED = True
