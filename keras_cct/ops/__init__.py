"""Differentiable operations that cross to other devices (e.g. :func:`conv2d_on`)."""
