"""Fitting scaling laws to a study's points: robust fits, bootstrap intervals, IsoFLOP allocation, the metric.

Parametric laws (pretrieve/scale/laws.py) follow Hoffmann et al. 2022, approach 3, as replicated by Besiroglu
et al. 2024 ("Chinchilla scaling: a replication attempt"): minimise the Huber loss (delta = 1e-3) of the
log-loss residuals log L_hat - log L, *summed* over points (the mean makes the objective so small that
L-BFGS's relative-decrease test stops it early; the tolerances below are tightened for the same reason), with
scipy's L-BFGS-B and an exact gradient, from the best `starts` points of a grid of initialisations, keeping the
best optimum. 95 % intervals are percentiles of the parameters refitted on bootstrap resamples of the points
(Besiroglu et al. 2024, sec. 3); a resample is a vector of counts, i.e. weights of the summed Huber loss, and
is started from the full fit's optimum, as Besiroglu et al. did (BOOTSTRAP_STARTS adds grid starts).

IsoFLOP profiles are Hoffmann et al.'s approach 2: at each compute budget a parabola in log N, its vertex
N_opt(C), and D_opt = C / (k N_opt) with k = C / (N D) of the budget's points (6 under C = 6 N D); the
allocation exponents a, b are the slopes of log N_opt and log D_opt on log C. The downstream metric follows
the second step of Bhagia et al. 2024 ("Establishing task scaling laws via compute-efficient model ladders",
OLMo 2): metric = s / (1 + exp(-k (L - L0))) + m, a sigmoid of the loss, so predicted loss -> predicted metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares, minimize
from threadpoolctl import threadpool_limits

from pretrieve.scale.laws import CHINCHILLA, JOINT, Law, single_laws
from pretrieve.scale.points import Points

HUBER_DELTA = 1e-3
DEFAULT_STARTS = 16  # best grid points refined by L-BFGS-B in a full fit (Besiroglu et al.'s data: 16 of the
# 4,500 find the optimum all of them find)
BOOTSTRAP_STARTS = 0  # best grid points per resample, beside the full fit's optimum (Besiroglu et al.: none)
LBFGS_OPTIONS = {"ftol": 1e-13, "gtol": 1e-10, "maxiter": 2000}
BUDGET_TOLERANCE = 0.05  # points whose C differ by less than 5 % share a compute budget


# ---- the objective ---------------------------------------------------------------------------------------

def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    small = np.abs(r) <= delta
    return np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))


def huber_slope(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    return np.clip(r, -delta, delta)


def objective(theta: np.ndarray, law: Law, X: np.ndarray, y: np.ndarray, weights: np.ndarray):
    """Summed, weighted Huber loss of the log residuals and its gradient."""
    predicted, jacobian = law.log_loss(theta, X, jac=True)
    r = predicted - y
    return float(weights @ huber(r)), jacobian.T @ (weights * huber_slope(r))


# ---- one law on one set of points ------------------------------------------------------------------------

@dataclass
class LawFit:
    law: Law
    theta: np.ndarray
    huber_sum: float
    X: np.ndarray  # log N / log D of the fitted points
    loss: np.ndarray
    samples: np.ndarray | None = None  # natural parameters of the bootstrap fits [R, k]
    failed_resamples: int = 0

    def predict(self, **variables: np.ndarray) -> np.ndarray:
        """L at the given N (and D), e.g. predict(N=[1e8], D=[2e9])."""
        X = np.log(np.stack([np.asarray(variables[v], dtype=float) for v in self.law.variables], axis=-1))
        return np.exp(self.law.log_loss(self.theta, np.atleast_2d(X))[0])

    @property
    def parameters(self) -> dict[str, float]:
        return self.law.natural(self.theta)

    def intervals(self) -> dict[str, list[float]]:
        if self.samples is None or not len(self.samples):
            return {}
        lo, hi = np.percentile(self.samples, [2.5, 97.5], axis=0)
        return {name: [float(a), float(b)] for name, a, b in zip(self.law.published, lo, hi)}

    def to_json(self) -> dict:
        fitted = np.exp(self.law.log_loss(self.theta, self.X)[0])
        residuals = np.log(fitted) - np.log(self.loss)
        total = float(np.sum((self.loss - self.loss.mean()) ** 2))
        return {**self.parameters, "ci95": self.intervals(), "huber_sum": self.huber_sum, "points": len(self.loss),
                "rmse_log": float(np.sqrt(np.mean(residuals ** 2))),
                "r2": 1 - float(np.sum((fitted - self.loss) ** 2)) / total if total > 0 else None,
                "max_abs_rel_error": float(np.max(np.abs(fitted / self.loss - 1))),
                "residuals": [float(r) for r in residuals],
                "bootstrap": {"resamples": 0 if self.samples is None else len(self.samples) + self.failed_resamples,
                              "failed": self.failed_resamples}}


def check_identifiable(law: Law, X: np.ndarray, what: str = "") -> None:
    """A clear error instead of a meaningless fit: too few points, or too few distinct N (D)."""
    where = f"{what}: " if what else ""
    if len(X) <= law.size:
        raise ValueError(f"{where}{law.name}: {len(X)} point(s) for {law.size} parameters; the fit needs at least "
                         f"{law.size + 1}")
    for i, variable in enumerate(law.variables):
        distinct = np.unique(np.round(X[:, i], 9))
        if len(distinct) < law.min_distinct:
            raise ValueError(f"{where}{law.name}: only {len(distinct)} distinct {variable} "
                             f"({', '.join(f'{v:.3g}' for v in np.exp(distinct))}); the law needs at least "
                             f"{law.min_distinct} (a study varies model size and data)")


def _refine(law: Law, X, y, weights, starts, bounds) -> tuple[np.ndarray, float]:
    best_theta, best_value = None, np.inf
    for start in starts:
        result = minimize(objective, start, args=(law, X, y, weights), jac=True, method="L-BFGS-B", bounds=bounds,
                          options=LBFGS_OPTIONS)
        if np.isfinite(result.fun) and result.fun < best_value:
            best_theta, best_value = result.x, float(result.fun)
    if best_theta is None:
        raise RuntimeError(f"{law.name}: L-BFGS-B found no finite optimum from {len(starts)} starts")
    return best_theta, best_value


def _grid_losses(law: Law, X, y) -> tuple[np.ndarray, np.ndarray]:
    """The grid of starts [G, k] and each start's Huber loss per point [G, n] (weights apply later)."""
    grid = law.grid(X, y)
    with np.errstate(over="ignore", invalid="ignore"):
        per_point = huber(law.log_loss(grid, X)[0] - y)
    return grid, np.nan_to_num(per_point, nan=np.inf)


def fit_law(law: Law, X: np.ndarray, loss: np.ndarray, bootstrap: int | np.ndarray = 0,
            starts: int = DEFAULT_STARTS, seed: int = 0, what: str = "") -> LawFit:
    """Fit `law` to points X [n, v] (log N, log D) with loss [n]; `bootstrap`: a number of resamples or a count
    matrix [R, n] (shared across laws so that their intervals come from the same resamples)."""
    with threadpool_limits(1):  # L-BFGS-B's BLAS calls on 5-vectors: threads cost 10x more than they give
        return _fit_law(law, np.asarray(X, dtype=float), np.log(np.asarray(loss, dtype=float)), bootstrap, starts,
                        seed, what)


def _fit_law(law: Law, X: np.ndarray, y: np.ndarray, bootstrap, starts: int, seed: int, what: str) -> LawFit:
    check_identifiable(law, X, what)
    bounds = law.bounds(X, y)
    grid, per_point = _grid_losses(law, X, y)
    order = np.argsort(per_point.sum(axis=1))
    theta, value = _refine(law, X, y, np.ones(len(y)), grid[order[:starts]], bounds)
    fit = LawFit(law, theta, value, X, np.exp(y))
    counts = resample_counts(len(y), bootstrap, seed) if np.isscalar(bootstrap) else np.asarray(bootstrap)
    if len(counts):
        fit.samples, fit.failed_resamples = _bootstrap(law, X, y, counts, theta, grid, per_point, bounds)
    return fit


def resample_counts(n: int, resamples: int, seed: int = 0) -> np.ndarray:
    """[resamples, n]: how often each point is drawn in each bootstrap resample (n draws with replacement)."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(float)


def _bootstrap(law, X, y, counts, theta, grid, per_point, bounds) -> tuple[np.ndarray, int]:
    natural, failed = [], 0
    grid_values = per_point @ counts.T if BOOTSTRAP_STARTS else None  # [G, R]: each start under each resample
    for r, weights in enumerate(counts):
        drawn = weights > 0
        try:
            check_identifiable(law, X[drawn])
        except ValueError:
            failed += 1
            continue
        starts = [theta] if grid_values is None else [theta, *grid[np.argsort(grid_values[:, r])[:BOOTSTRAP_STARTS]]]
        refit, _ = _refine(law, X, y, weights, starts, bounds)
        natural.append(law.to_natural(refit))
    return np.array(natural).reshape(-1, law.size), failed


# ---- IsoFLOP profiles and the compute-optimal allocation (Hoffmann et al. 2022, approach 2) ----------------

def budgets_of(C: np.ndarray, tolerance: float = BUDGET_TOLERANCE) -> np.ndarray:
    """A budget index per point: sorted by C, a new budget starts where C exceeds the budget's first C by more
    than `tolerance` (a planned budget is hit to within a few % once steps are rounded)."""
    order = np.argsort(C)
    labels = np.empty(len(C), dtype=int)
    label, first = -1, None
    for i in order:
        if first is None or C[i] > first * (1 + tolerance):
            label, first = label + 1, C[i]
        labels[i] = label
    return labels


@dataclass
class Profile:
    C: float  # the budget: geometric mean of its points' C
    N_opt: float
    D_opt: float
    loss_min: float
    coefficients: tuple[float, float, float]  # loss = c2 (log N)^2 + c1 log N + c0
    inside: bool  # the vertex lies within the budget's sampled N
    indices: np.ndarray  # the budget's points


def isoflop_profiles(points: Points, weights: np.ndarray | None = None) -> list[Profile]:
    """One parabola per budget with >= 3 distinct N (weighted by bootstrap counts); budgets whose parabola
    opens downwards have no minimum and are left out."""
    weights = np.ones(len(points.loss)) if weights is None else weights
    labels = budgets_of(points.C)
    profiles = []
    for label in np.unique(labels):
        members = np.flatnonzero((labels == label) & (weights > 0))
        log_n = np.log(points.N[members])
        if len(np.unique(np.round(log_n, 9))) < 3:
            continue
        c2, c1, c0 = np.polyfit(log_n, points.loss[members], 2, w=np.sqrt(weights[members]))
        if c2 <= 0:
            continue
        log_n_opt = -c1 / (2 * c2)
        C = float(np.exp(np.mean(np.log(points.C[members]))))
        per_token = float(np.median(points.C[members] / (points.N[members] * points.D[members])))  # 6 for 6ND
        n_opt = float(np.exp(log_n_opt))
        profiles.append(Profile(C, n_opt, C / (per_token * n_opt), float(c0 - c1 * c1 / (4 * c2)),
                                (float(c2), float(c1), float(c0)), bool(log_n.min() <= log_n_opt <= log_n.max()),
                                members))
    return profiles


def allocation_exponents(profiles: list[Profile]) -> dict | None:
    """N_opt = G C^a and D_opt = G' C^b by least squares in log space; None with fewer than 2 budgets."""
    if len(profiles) < 2:
        return None
    log_c = np.log([p.C for p in profiles])
    a, log_g = np.polyfit(log_c, np.log([p.N_opt for p in profiles]), 1)
    b, log_h = np.polyfit(log_c, np.log([p.D_opt for p in profiles]), 1)
    return {"a": float(a), "b": float(b), "G": float(np.exp(log_g)), "G_D": float(np.exp(log_h))}


def chinchilla_allocation(parameters: dict, per_token: float = 6.0) -> dict:
    """The allocation implied by a Chinchilla law under C = k N D (Hoffmann et al. 2022, eq. (4)):
    N_opt = G (C/k)^a, D_opt = (C/k)^b / G, a = beta / (alpha + beta), b = alpha / (alpha + beta),
    G = (alpha A / (beta B))^(1 / (alpha + beta))."""
    alpha, beta, A, B = (parameters[k] for k in ("alpha", "beta", "A", "B"))
    total = alpha + beta
    return {"a": beta / total, "b": alpha / total, "G": (alpha * A / (beta * B)) ** (1 / total), "k": per_token}


def allocation(points: Points, counts: np.ndarray, chinchilla: LawFit) -> dict:
    """The IsoFLOP allocation with bootstrap intervals (same resamples as the laws) beside the one the
    Chinchilla law implies; `source` says which one `a`, `b` are."""
    per_token = float(np.median(points.C / (points.N * points.D)))
    implied = chinchilla_allocation(chinchilla.parameters, per_token)
    if chinchilla.samples is not None and len(chinchilla.samples):
        alpha, beta = chinchilla.samples[:, 3], chinchilla.samples[:, 4]
        shares = np.stack([beta / (alpha + beta), alpha / (alpha + beta)], axis=1)
        lo, hi = np.nanpercentile(shares, [2.5, 97.5], axis=0)
        implied["ci95"] = {"a": [float(lo[0]), float(hi[0])], "b": [float(lo[1]), float(hi[1])]}
    profiles = isoflop_profiles(points)
    found = allocation_exponents(profiles)
    if found is None:
        return {"a": implied["a"], "b": implied["b"], "ci95": implied.get("ci95", {}), "source": "chinchilla",
                "budgets": len(profiles), "chinchilla": implied,
                "note": "fewer than 2 compute budgets with >= 3 model sizes: no IsoFLOP profiles"}
    resampled = [allocation_exponents(isoflop_profiles(points, w)) for w in counts]
    exponents = np.array([[r["a"], r["b"]] for r in resampled if r is not None]).reshape(-1, 2)
    ci95 = {}
    if len(exponents):
        lo, hi = np.percentile(exponents, [2.5, 97.5], axis=0)
        ci95 = {"a": [float(lo[0]), float(hi[0])], "b": [float(lo[1]), float(hi[1])]}
    return {**found, "ci95": ci95, "source": "isoflop", "budgets": len(profiles),
            "bootstrap": {"resamples": len(counts), "failed": len(counts) - len(exponents)},
            "profiles": [{"C": p.C, "N_opt": p.N_opt, "D_opt": p.D_opt, "loss_min": p.loss_min, "inside": p.inside,
                          "points": len(p.indices)} for p in profiles],
            "chinchilla": implied}


# ---- single-variable laws on the frontier ------------------------------------------------------------------

def frontier(x: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Indices of the points that beat every point with smaller or equal x: the best loss reachable with at
    most x parameters (tokens). With a fixed-D size scan (Fang et al.'s setup) this is the scan itself."""
    order = np.lexsort((loss, x))
    kept, best = [], np.inf
    for i in order:
        if loss[i] < best and (not kept or x[i] > x[kept[-1]]):
            kept.append(i)
            best = loss[i]
    return np.array(kept, dtype=int)


def single_variable_fits(points: Points, resamples: int, seed: int) -> dict[str, dict[str, LawFit | str]]:
    """{"N": {"fang": fit, "kaplan": fit}, "D": {...}}; a law with too few frontier points holds the reason."""
    out: dict[str, dict] = {}
    for variable, values in (("N", points.N), ("D", points.D)):
        kept = frontier(values, points.loss)
        out[variable] = {}
        for law in single_laws(variable):
            try:
                out[variable][law.name.split("_")[0]] = fit_law(
                    law, np.log(values[kept])[:, None], points.loss[kept], resamples, starts=8, seed=seed)
            except ValueError as reason:
                out[variable][law.name.split("_")[0]] = str(reason)
    return out


# ---- the downstream metric as a sigmoid of the loss (Bhagia et al. 2024, step 2) ---------------------------

@dataclass
class MetricFit:
    name: str
    params: dict[str, float]  # s, k, L0, m
    loss: np.ndarray
    metric: np.ndarray

    def predict(self, loss: np.ndarray) -> np.ndarray:
        return sigmoid(np.asarray(loss, dtype=float), **self.params)

    def to_json(self) -> dict:
        residuals = self.predict(self.loss) - self.metric
        return {"name": self.name, "form": "metric = s / (1 + exp(-k (L - L0))) + m", **self.params,
                "points": len(self.loss), "rmse": float(np.sqrt(np.mean(residuals ** 2))),
                "residuals": [float(r) for r in residuals]}


def sigmoid(loss, s, k, L0, m):
    return s / (1 + np.exp(-k * (loss - L0))) + m


def fit_metric(name: str, loss: np.ndarray, metric: np.ndarray) -> MetricFit:
    """Least squares from a few starts (the sigmoid's plateau and slope are poorly determined by few points)."""
    keep = np.isfinite(metric)
    loss, metric = loss[keep], metric[keep]
    if len(loss) < 5:
        raise ValueError(f"metric {name}: {len(loss)} point(s) with a value; the sigmoid's 4 parameters need >= 5")
    spread = float(np.ptp(metric)) or 1e-3
    width = float(np.ptp(loss)) or 1e-3
    best = None
    for s_scale, slope, centre in np.array(np.meshgrid([1.0, 2.0], [-6.0, -2.0, 2.0, 6.0],
                                                       np.quantile(loss, [0.25, 0.5, 0.75]))).reshape(3, -1).T:
        s0 = s_scale * spread
        start = [s0, slope / width, centre, float(metric.min()) - (s0 - spread) / 2]
        result = least_squares(lambda p: sigmoid(loss, *p) - metric, start, method="trf",
                               bounds=([0, -1e4, loss.min() - 10 * width, -10], [10, 1e4, loss.max() + 10 * width, 10]))
        if best is None or result.cost < best.cost:
            best = result
    return MetricFit(name, dict(zip(("s", "k", "L0", "m"), map(float, best.x))), loss, metric)


# ---- everything for one method -----------------------------------------------------------------------------

@dataclass
class MethodFit:
    points: Points
    chinchilla: LawFit
    joint: LawFit
    single: dict
    allocation: dict
    metric: MetricFit | str | None = None
    holdout: dict | None = None
    holdout_mask: np.ndarray | None = None
    holdout_fit: LawFit | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        single = {v: {form: f.to_json() if isinstance(f, LawFit) else {"skipped": f} for form, f in fits.items()}
                  for v, fits in self.single.items()}
        metric = self.metric.to_json() if isinstance(self.metric, MetricFit) else \
            {"skipped": self.metric} if self.metric else None
        out = {"chinchilla": self.chinchilla.to_json(), "joint": self.joint.to_json(), "single": single,
               "allocation": self.allocation}
        if metric is not None:
            out["metric"] = metric
        if self.holdout is not None:
            out["holdout"] = self.holdout
        return out


def log_variables(points: Points) -> np.ndarray:
    return np.log(np.stack([points.N, points.D], axis=1))


def fit_method(points: Points, bootstrap: int = 1000, holdout: str | None = None, seed: int = 0,
               starts: int = DEFAULT_STARTS) -> MethodFit:
    """Every law of section 5 on one method's points (fit.json's entry for the method)."""
    with threadpool_limits(1):  # L-BFGS-B's BLAS calls on 5-vectors: threads cost 10x more than they give
        return _fit_method(points, bootstrap, holdout, seed, starts)


def _fit_method(points: Points, bootstrap: int, holdout: str | None, seed: int, starts: int) -> MethodFit:
    what = f"method {points.method}"
    X = log_variables(points)
    for law in (CHINCHILLA, JOINT):
        check_identifiable(law, X, what)
    counts = resample_counts(len(points.loss), bootstrap, seed)
    chinchilla = fit_law(CHINCHILLA, X, points.loss, counts, starts, what=what)
    joint = fit_law(JOINT, X, points.loss, counts, starts, what=what)
    fit = MethodFit(points, chinchilla, joint, single_variable_fits(points, bootstrap, seed),
                    allocation(points, counts, chinchilla))
    if points.metric is not None:
        try:
            fit.metric = fit_metric(points.metric_name, points.loss, points.metric)
        except ValueError as reason:
            fit.metric = str(reason)
    if holdout == "largest":
        fit.holdout, fit.holdout_mask, fit.holdout_fit = holdout_largest(points, starts)
    elif holdout is not None:
        raise ValueError(f"--holdout {holdout}: unknown (known: largest)")
    return fit


def holdout_largest(points: Points, starts: int = DEFAULT_STARTS) -> tuple[dict, np.ndarray, LawFit]:
    """Fit without the largest compute budget's points and report the error of predicting them."""
    labels = budgets_of(points.C)
    held = labels == labels.max()
    what = f"method {points.method}, --holdout largest"
    if held.all():
        raise ValueError(f"{what}: all points share one compute budget; nothing is left to fit")
    train, test = points.subset(~held), points.subset(held)
    report = {"held_out": int(held.sum()), "C": float(np.exp(np.mean(np.log(test.C)))), "fitted_on": int((~held).sum())}
    chinchilla_fit = None
    for law in (CHINCHILLA, JOINT):
        fitted = fit_law(law, log_variables(train), train.loss, 0, starts, what=what)
        predicted = fitted.predict(N=test.N, D=test.D)
        relative = predicted / test.loss - 1
        report[law.name] = {**fitted.parameters, "mean_abs_rel_error": float(np.mean(np.abs(relative))),
                            "max_abs_rel_error": float(np.max(np.abs(relative))),
                            "predictions": [{"N": float(n), "D": float(d), "C": float(c), "loss": float(o),
                                             "predicted": float(p)}
                                            for n, d, c, o, p in zip(test.N, test.D, test.C, test.loss, predicted)]}
        chinchilla_fit = chinchilla_fit or fitted
    if train.metric is not None and test.metric is not None and np.isfinite(test.metric).any():
        try:
            metric_fit = fit_metric(train.metric_name, train.loss, train.metric)
        except ValueError as reason:
            report["metric"] = {"skipped": str(reason)}
        else:
            predicted = metric_fit.predict(chinchilla_fit.predict(N=test.N, D=test.D))  # loss law -> sigmoid
            known = np.isfinite(test.metric)
            report["metric"] = {"name": train.metric_name,
                                "mean_abs_error": float(np.mean(np.abs(predicted[known] - test.metric[known]))),
                                "predictions": [{"observed": float(o), "predicted": float(p)}
                                                for o, p in zip(test.metric[known], predicted[known])]}
    return report, held, chinchilla_fit


def predict_from_json(entry: dict, N, D) -> dict[str, np.ndarray]:
    """A bigger run's loss (Chinchilla law) and, when fitted, its metric (the sigmoid of that loss), from one
    method's entry of fit.json, without refitting: predict_from_json(fit["retromae"], N=[3e8], D=[6e9])."""
    c = entry["chinchilla"]
    N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
    out = {"loss": chinchilla_loss(N, D, c["E"], c["A"], c["B"], c["alpha"], c["beta"])}
    metric = entry.get("metric") or {}
    if "k" in metric:
        out[metric["name"]] = sigmoid(out["loss"], metric["s"], metric["k"], metric["L0"], metric["m"])
    return out


def chinchilla_loss(N, D, E, A, B, alpha, beta):
    return E + A / N**alpha + B / D**beta
