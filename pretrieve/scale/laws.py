"""Scaling laws as functions of log N and log D, each with its Jacobian and a grid of starting points.

Every law predicts log L (not L): the fits minimise a Huber loss on log-loss residuals (Hoffmann et al. 2022,
approach 3). A law is written in a log-sum-exp (LSE) form over unconstrained parameters, so the fit never
leaves the domain and the gradient is exact:

    chinchilla  L = E + A / N^alpha + B / D^beta                  Hoffmann et al. 2022, eq. (2) / approach 3
                log L = LSE(a - alpha log N, b - beta log D, e)   E = e^e, A = e^a, B = e^b (Besiroglu et al. 2024)
    joint       L = [(A/N)^(alpha/beta) + B/D]^beta + delta       Kaplan et al. 2020 eq. (1.5); Fang et al.
                log L = LSE(beta LSE((alpha/beta)(a - log N),     SIGIR 2024 (eq. 4) add the irreducible delta
                                     b - log D), d)               A = e^a, B = e^b, delta = e^d
    fang        L = (X_c / x)^alpha + delta                       Fang et al. 2024, single-variable laws (eq. 2, 3)
                log L = LSE(k - alpha log(x / x0), d)             X_c = x0 e^(k / alpha), delta = e^d, x0 = 1e9
    kaplan      L = (X_c / x)^alpha                               Kaplan et al. 2020, eq. (1.1) / (1.2)
                log L = k - alpha log(x / x0)                     linear in log x: a log-linear regression

`theta` is the internal (log-space) parameter vector; `natural(theta)` gives the published names.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable

import numpy as np


def log_sum_exp(*terms: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """log(sum_k exp(terms_k)), elementwise and overflow-free, and the softmax weights p_k (its derivatives)."""
    top = terms[0]
    for term in terms[1:]:
        top = np.maximum(top, term)
    exps = [np.exp(term - top) for term in terms]
    total = sum(exps)
    return top + np.log(total), [e / total for e in exps]


@dataclass(frozen=True)
class Law:
    """A law over `variables` (("N", "D"), ("N",) or ("D",)).

    log_loss(theta, X, jac) -> (log L [..., n], Jacobian [n, k] or None): theta is [..., k] (a grid of
    parameter vectors broadcasts), X is [n, len(variables)] of log N / log D. `grid(X, log_loss)` returns the
    starting points [G, k]; `bounds(X, log_loss)` the L-BFGS-B box.
    """

    name: str
    variables: tuple[str, ...]
    params: tuple[str, ...]  # internal (theta) order
    published: tuple[str, ...]  # names of natural(theta), in this order
    log_loss: Callable
    to_natural: Callable  # theta [..., k] -> natural [..., k] in `published` order
    grid: Callable
    bounds: Callable
    min_distinct: int = 3  # distinct values each variable needs before the law is identifiable

    @property
    def size(self) -> int:
        return len(self.params)

    def natural(self, theta: np.ndarray) -> dict[str, float]:
        return {name: float(v) for name, v in zip(self.published, self.to_natural(np.asarray(theta)))}


def _split(theta: np.ndarray, k: int) -> list[np.ndarray]:
    """The k parameters of theta [..., k] as arrays [..., 1] that broadcast against n points."""
    return [theta[..., i, None] for i in range(k)]


# ---- Chinchilla: Hoffmann et al. 2022, approach 3; parametrisation and grid of Besiroglu et al. 2024 --------

def _chinchilla_log_loss(theta, X, jac=False):
    a, b, e, alpha, beta = _split(np.asarray(theta, dtype=float), 5)
    log_n, log_d = X[:, 0], X[:, 1]
    value, p = log_sum_exp(a - alpha * log_n, b - beta * log_d, e)
    if not jac:
        return value, None
    return value, np.stack([p[0], p[1], p[2], -p[0] * log_n, -p[1] * log_d], axis=-1)


def _chinchilla_natural(theta):
    a, b, e, alpha, beta = np.moveaxis(theta, -1, 0)
    return np.stack([np.exp(e), np.exp(a), np.exp(b), alpha, beta], axis=-1)


def _chinchilla_grid(X, log_loss):
    """Hoffmann et al.'s grid as Besiroglu et al. ran it: a, b in {0, 5, .., 25}, e in {-1, -.5, .., 1},
    alpha, beta in {0, .5, .., 2}: 4,500 starts."""
    steps = [np.arange(0, 30, 5), np.arange(0, 30, 5), np.arange(-1, 1.5, 0.5), np.arange(0, 2.5, 0.5),
             np.arange(0, 2.5, 0.5)]
    return np.array(list(product(*steps)), dtype=float)


def _chinchilla_bounds(X, log_loss):
    return [(None, None)] * 3 + [(0.0, 10.0)] * 2  # exponents >= 0: a law that falls with N and D


CHINCHILLA = Law("chinchilla", ("N", "D"), ("a", "b", "e", "alpha", "beta"), ("E", "A", "B", "alpha", "beta"),
                 _chinchilla_log_loss, _chinchilla_natural, _chinchilla_grid, _chinchilla_bounds)


# ---- Kaplan et al. 2020 eq. (1.5) with Fang et al. 2024's irreducible term --------------------------------

def _joint_log_loss(theta, X, jac=False):
    a, b, alpha, beta, d = _split(np.asarray(theta, dtype=float), 5)
    log_n, log_d = X[:, 0], X[:, 1]
    size_gap = a - log_n  # log(A / N)
    s, p = log_sum_exp(alpha / beta * size_gap, b - log_d)  # log[(A/N)^(alpha/beta) + B/D]
    t = beta * s  # log of the reducible loss
    value, q = log_sum_exp(t, d)
    if not jac:
        return value, None
    dt = [alpha * p[0], beta * p[1], p[0] * size_gap, s - p[0] * alpha * size_gap / beta]  # d t / d(a, b, al, be)
    return value, np.stack([q[0] * g for g in dt] + [q[1]], axis=-1)


def _joint_natural(theta):
    a, b, alpha, beta, d = np.moveaxis(theta, -1, 0)
    return np.stack([np.exp(a), np.exp(b), alpha, beta, np.exp(d)], axis=-1)


def _floor_offsets(log_loss):
    """Starts for log delta: 10 %, 50 % and 90 % of the lowest observed loss."""
    return float(np.min(log_loss)) + np.log([0.1, 0.5, 0.9])


def _joint_grid(X, log_loss):
    gaps = [-5, 0, 5, 10, 15, 25]  # log A (log B) around the median log N (log D): A may be far beyond N (Kaplan)
    steps = [np.median(X[:, 0]) + np.array(gaps), np.median(X[:, 1]) + np.array(gaps), [0.1, 0.3, 0.6, 1.0],
             [0.1, 0.3, 0.6, 1.0], _floor_offsets(log_loss)]
    return np.array(list(product(*steps)), dtype=float)


def _joint_bounds(X, log_loss):
    floor = float(np.min(log_loss))
    return [(None, None)] * 2 + [(0.0, 10.0), (1e-3, 10.0), (floor - 25.0, floor + 1.0)]


JOINT = Law("joint", ("N", "D"), ("a", "b", "alpha", "beta", "d"), ("A", "B", "alpha", "beta", "delta"),
            _joint_log_loss, _joint_natural, _joint_grid, _joint_bounds)


# ---- single-variable laws: Fang et al. 2024 (with delta) and Kaplan et al. 2020 (pure power) --------------
# Fitted as L = exp(k) (x / x0)^-alpha [+ delta] with x0 = 1e9, so that the level k and the slope alpha are
# nearly independent (log(X_c / x) far from 0 couples them badly); X_c = x0 exp(k / alpha) is published.

REFERENCE = np.log(1e9)


def _fang_log_loss(theta, X, jac=False):
    k, alpha, d = _split(np.asarray(theta, dtype=float), 3)
    centred = X[:, 0] - REFERENCE
    value, q = log_sum_exp(k - alpha * centred, d)
    if not jac:
        return value, None
    return value, np.stack([q[0], -q[0] * centred, q[1]], axis=-1)


def _kaplan_log_loss(theta, X, jac=False):
    k, alpha = _split(np.asarray(theta, dtype=float), 2)
    centred = X[:, 0] - REFERENCE
    value = k - alpha * centred
    if not jac:
        return value, None
    return value, np.stack([np.ones_like(value), -np.broadcast_to(centred, value.shape)], axis=-1)


def _scale(theta):
    """X_c = x0 exp(k / alpha); infinite for alpha = 0 (a flat law)."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.exp(REFERENCE + theta[..., 0] / theta[..., 1])


def _single_grid(X, log_loss, floor=True):
    steps = [float(np.min(log_loss)) + np.array([-3.0, -1.5, 0.0, 1.0]), [0.05, 0.1, 0.3, 0.6, 1.0]]
    if floor:
        steps.append(_floor_offsets(log_loss))
    return np.array(list(product(*steps)), dtype=float)


def _fang_bounds(X, log_loss):
    floor = float(np.min(log_loss))
    return [(None, None), (0.0, 10.0), (floor - 25.0, floor + 1.0)]


def single_laws(variable: str) -> tuple[Law, Law]:
    """(fang, kaplan) in one variable, "N" or "D"; X_c is published as A (in N) or B (in D)."""
    scale = "A" if variable == "N" else "B"
    fang = Law(f"fang_{variable}", (variable,), ("k", "alpha", "d"), (scale, "alpha", "delta"), _fang_log_loss,
               lambda t: np.stack([_scale(t), t[..., 1], np.exp(t[..., 2])], axis=-1),
               _single_grid, _fang_bounds)
    kaplan = Law(f"kaplan_{variable}", (variable,), ("k", "alpha"), (scale, "alpha"), _kaplan_log_loss,
                 lambda t: np.stack([_scale(t), t[..., 1]], axis=-1),
                 lambda X, y: _single_grid(X, y, floor=False), lambda X, y: [(None, None), (0.0, 10.0)],
                 min_distinct=2)
    return fang, kaplan
