"""pycaffe's batching for ``forward_all`` / ``forward_backward_all``: inputs of any length cut
into the input blob's batch size (the last batch padded with zeros), results joined and the
padding dropped."""

from __future__ import annotations

from typing import Dict, Iterator, Mapping, Tuple

import numpy as np

__all__ = ["batches_of", "Collected"]


def batches_of(kwargs: Mapping[str, np.ndarray], size: int
               ) -> Tuple[int, Iterator[Dict[str, np.ndarray]]]:
    """``(count, batches)``: the arrays in ``kwargs`` cut into batches of ``size`` (pycaffe's
    ``_batch``)."""
    n = len(next(iter(kwargs.values())))

    def gen():
        for i in range(0, n, size):
            batch = {}
            for k, v in kwargs.items():
                chunk = np.asarray(v[i:i + size], np.float32)
                if len(chunk) < size:
                    chunk = np.concatenate([chunk, np.zeros((size - len(chunk),)
                                                            + chunk.shape[1:], np.float32)])
                batch[k] = chunk
            yield batch
    return n, gen()


class Collected:
    """Results of several batches: per-sample outputs joined (the last batch's padding
    dropped), scalar outputs (a loss) one value per batch."""

    def __init__(self) -> None:
        self.rows: Dict[str, list] = {}
        self.scalars: Dict[str, list] = {}

    def add(self, res: Mapping[str, np.ndarray]) -> None:
        for o, v in res.items():
            if np.ndim(v) == 0:
                self.scalars.setdefault(o, []).append(float(v))
            else:
                self.rows.setdefault(o, []).extend(np.array(v))

    def arrays(self, n: int) -> Dict[str, np.ndarray]:
        out = {o: np.asarray(v)[:n] for o, v in self.rows.items()}
        out.update({o: np.asarray(v, np.float32) for o, v in self.scalars.items()})
        return out
