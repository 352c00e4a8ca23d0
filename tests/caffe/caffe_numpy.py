"""Numpy float64 transcriptions of Caffe's solver code (sgd_solver.cpp, nesterov_solver.cpp,
adagrad_solver.cpp, rmsprop_solver.cpp, adadelta_solver.cpp, adam_solver.cpp) and of its LRN
layer's CPU loops (lrn_layer.cpp, ACROSS_CHANNELS forward and backward) for the tests.

Written from Caffe's C++ source, sharing no code with keras_cct.
"""

from __future__ import annotations

import math

import numpy as np


def caffe_rate(policy, it, base_lr, gamma=0.0, power=0.0, stepsize=0, stepvalue=(),
               max_iter=0):
    """SGDSolver::GetLearningRate."""
    if policy == "fixed":
        return base_lr
    if policy == "step":
        return base_lr * gamma ** (it // stepsize)
    if policy == "exp":
        return base_lr * gamma ** it
    if policy == "inv":
        return base_lr * (1 + gamma * it) ** (-power)
    if policy == "multistep":
        current_step = 0
        while current_step < len(stepvalue) and it >= stepvalue[current_step]:
            current_step += 1
        return base_lr * gamma ** current_step
    if policy == "poly":
        return base_lr * (1.0 - it / max_iter) ** power
    if policy == "sigmoid":
        return base_lr * (1.0 / (1.0 + math.exp(-gamma * (it - stepsize))))
    raise ValueError(policy)


class NumpyCaffeSolver:
    """Caffe's ApplyUpdate on a list of float64 arrays."""

    def __init__(self, params, solver_type, *, momentum=0.0, momentum2=0.999, delta=1e-8,
                 rms_decay=0.99, weight_decay=0.0, regularization_type="L2",
                 clip_gradients=-1.0, iter_size=1, lr_mults=None, decay_mults=None):
        self.w = [np.array(p, np.float64) for p in params]
        self.type = solver_type
        self.momentum, self.momentum2, self.delta = momentum, momentum2, delta
        self.rms_decay, self.weight_decay = rms_decay, weight_decay
        self.reg, self.clip, self.iter_size = regularization_type, clip_gradients, iter_size
        n = len(self.w)
        self.lr_mults = lr_mults or [1.0] * n
        self.decay_mults = decay_mults or [1.0] * n
        self.history = [np.zeros_like(p) for p in self.w]
        self.update_history = [np.zeros_like(p) for p in self.w]
        self.iter = 0

    def apply_update(self, diffs, rate):
        """``diffs``: the gradients summed over iter_size mini-batches."""
        diffs = [np.array(d, np.float64) for d in diffs]
        # ClipGradients
        if self.clip >= 0:
            norm = math.sqrt(sum(float(np.sum(d * d)) for d in diffs))
            if norm > self.clip:
                diffs = [d * (self.clip / norm) for d in diffs]
        for i, (w, d) in enumerate(zip(self.w, diffs)):
            # Normalize
            d = d / self.iter_size
            # Regularize
            local_decay = self.weight_decay * self.decay_mults[i]
            if local_decay:
                d = d + local_decay * (w if self.reg == "L2" else np.sign(w))
            local_rate = rate * self.lr_mults[i]
            h, u = self.history[i], self.update_history[i]
            m = self.momentum
            if self.type == "SGD":
                h = m * h + local_rate * d
                upd = h.copy()
            elif self.type == "Nesterov":
                prev = h.copy()
                h = m * h + local_rate * d
                upd = (1 + m) * h - m * prev
            elif self.type == "AdaGrad":
                h = h + d * d
                upd = local_rate * d / (np.sqrt(h) + self.delta)
            elif self.type == "RMSProp":
                h = self.rms_decay * h + (1 - self.rms_decay) * d * d
                upd = local_rate * d / (np.sqrt(h) + self.delta)
            elif self.type == "AdaDelta":
                h = m * h + (1 - m) * d * d
                step = d * np.sqrt((u + self.delta) / (h + self.delta))
                u = m * u + (1 - m) * step * step
                upd = local_rate * step
            elif self.type == "Adam":
                b1, b2 = m, self.momentum2
                t = self.iter + 1
                corr = math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                h = b1 * h + (1 - b1) * d
                u = b2 * u + (1 - b2) * d * d
                upd = local_rate * corr * h / (np.sqrt(u) + self.delta)
            else:
                raise ValueError(self.type)
            self.history[i], self.update_history[i] = h, u
            self.w[i] = w - upd
        self.iter += 1


def caffe_lrn_across(x, size, alpha, beta, k):
    """LRNLayer::CrossChannelForward_cpu (NCHW, float64): Caffe's running window sum of the
    zero-padded squares. Returns ``(top, scale)``."""
    x = np.asarray(x, np.float64)
    num, channels = x.shape[:2]
    pre_pad = (size - 1) // 2
    alpha_over_size = alpha / size
    padded = np.zeros((channels + size - 1,) + x.shape[2:])
    scale = np.full(x.shape, float(k))
    for n in range(num):
        padded[pre_pad:pre_pad + channels] = x[n] ** 2
        for c in range(size):
            scale[n, 0] += alpha_over_size * padded[c]
        for c in range(1, channels):
            scale[n, c] = scale[n, c - 1]
            scale[n, c] += alpha_over_size * padded[c + size - 1]
            scale[n, c] -= alpha_over_size * padded[c - 1]
    return scale ** -beta * x, scale


def caffe_lrn_across_backward(x, top_diff, size, alpha, beta, k):
    """LRNLayer::CrossChannelBackward_cpu (NCHW, float64): the bottom diff."""
    x = np.asarray(x, np.float64)
    top_diff = np.asarray(top_diff, np.float64)
    top, scale = caffe_lrn_across(x, size, alpha, beta, k)
    num, channels = x.shape[:2]
    cache_ratio_value = 2.0 * alpha * beta / size
    bottom_diff = scale ** -beta * top_diff
    inverse_pre_pad = size - (size + 1) // 2
    padded_ratio = np.zeros((channels + size - 1,) + x.shape[2:])
    for n in range(num):
        padded_ratio[inverse_pre_pad:inverse_pre_pad + channels] = \
            top_diff[n] * top[n] / scale[n]
        accum_ratio = np.zeros(x.shape[2:])
        for c in range(size - 1):
            accum_ratio += padded_ratio[c]
        for c in range(channels):
            accum_ratio += padded_ratio[c + size - 1]
            bottom_diff[n, c] -= cache_ratio_value * x[n, c] * accum_ratio
            accum_ratio -= padded_ratio[c]
    return bottom_diff
