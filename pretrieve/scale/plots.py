"""The figures of a fit, one PNG each per method (matplotlib, Agg backend: files only, no display).

    <method>_loss_vs_compute.png       loss against C, coloured by model size, the Chinchilla law for a few sizes
                                       and its compute-optimal frontier (Hoffmann et al. 2022, fig. 2 / 4)
    <method>_isoflop.png               loss against N per compute budget, the parabolas and their minima
    <method>_n_opt.png                 N_opt against C: IsoFLOP minima, their power law, the Chinchilla allocation
    <method>_predicted_vs_observed.png the laws' predictions against the observed loss; held-out points apart
    <method>_metric_vs_loss.png        the downstream metric against the loss and its sigmoid (Bhagia et al. 2024)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pretrieve.scale.fit import MethodFit, MetricFit, chinchilla_allocation, isoflop_profiles


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, ax, path: Path, which: str = "major", legend: bool = True) -> Path:
    """Every plot's ending: a small legend, a light grid, then the file."""
    if legend:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which=which)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    _pyplot().close(fig)
    tmp.replace(path)
    return path


def write_plots(fit: MethodFit, out: Path) -> list[Path]:
    out = Path(out)
    name = fit.points.method
    paths = [loss_vs_compute(fit, out / f"{name}_loss_vs_compute.png"), isoflop(fit, out / f"{name}_isoflop.png"),
             n_opt(fit, out / f"{name}_n_opt.png"),
             predicted_vs_observed(fit, out / f"{name}_predicted_vs_observed.png")]
    if isinstance(fit.metric, MetricFit):
        paths.append(metric_vs_loss(fit, out / f"{name}_metric_vs_loss.png"))
    return paths


def loss_vs_compute(fit: MethodFit, path: Path) -> Path:
    plt = _pyplot()
    p = fit.points
    per_token = float(np.median(p.C / (p.N * p.D)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    norm = plt.Normalize(np.log10(p.N.min()), np.log10(p.N.max()) + 1e-9)
    cmap = plt.get_cmap("viridis")
    dots = ax.scatter(p.C, p.loss, c=np.log10(p.N), cmap=cmap, norm=norm, s=18, zorder=3)
    compute = np.logspace(np.log10(p.C.min()) - 0.3, np.log10(p.C.max()) + 0.3, 200)
    sizes = np.unique(p.N)
    for size in sizes[np.unique(np.linspace(0, len(sizes) - 1, min(6, len(sizes))).round().astype(int))]:
        ax.plot(compute, fit.chinchilla.predict(N=np.full_like(compute, size), D=compute / (per_token * size)),
                color=cmap(norm(np.log10(size))), lw=1, alpha=0.8)
    allocation = chinchilla_allocation(fit.chinchilla.parameters, per_token)
    n_best = allocation["G"] * (compute / per_token) ** allocation["a"]
    ax.plot(compute, fit.chinchilla.predict(N=n_best, D=compute / (per_token * n_best)), "k--", lw=1.5,
            label="compute-optimal (Chinchilla fit)")
    ax.set(xscale="log", xlabel="training compute C (FLOPs)", ylabel="validation loss",
           title=f"{p.method}: loss vs compute, Chinchilla law per model size")
    ax.set_ylim(p.loss.min() * 0.97, p.loss.max() * 1.03)
    fig.colorbar(dots, ax=ax, label="log10 N (parameters)")
    return _finish(fig, ax, path, which="both")


def isoflop(fit: MethodFit, path: Path) -> Path:
    plt = _pyplot()
    p = fit.points
    profiles = isoflop_profiles(p)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("plasma")(np.linspace(0, 0.85, max(1, len(profiles))))
    for profile, colour in zip(profiles, colours):
        n = p.N[profile.indices]
        ax.scatter(n, p.loss[profile.indices], color=colour, s=16, zorder=3)
        grid = np.linspace(np.log(n.min()), np.log(n.max()), 100)
        ax.plot(np.exp(grid), np.polyval(profile.coefficients, grid), color=colour, lw=1,
                label=f"C = {profile.C:.2g}")
        ax.plot(profile.N_opt, profile.loss_min, marker="*", ms=11, color=colour, mec="k", zorder=4)
    ax.set(xscale="log", xlabel="parameters N", ylabel="validation loss",
           title=f"{p.method}: IsoFLOP profiles (parabola in log N, * = minimum)")
    if not profiles:
        ax.text(0.5, 0.5, "no budget with >= 3 model sizes", transform=ax.transAxes, ha="center")
    else:
        ax.legend(fontsize="small", ncol=2)
    return _finish(fig, ax, path, which="both", legend=False)


def n_opt(fit: MethodFit, path: Path) -> Path:
    plt = _pyplot()
    p, alloc = fit.points, fit.allocation
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    compute = np.logspace(np.log10(p.C.min()) - 0.5, np.log10(p.C.max()) + 1.0, 100)
    implied = alloc["chinchilla"]
    ax.plot(compute, implied["G"] * (compute / implied["k"]) ** implied["a"], "k--", lw=1.2,
            label=f"Chinchilla law: a = {implied['a']:.3f}")
    if alloc["source"] == "isoflop":
        ax.scatter([b["C"] for b in alloc["profiles"]], [b["N_opt"] for b in alloc["profiles"]], color="C3",
                   zorder=3, label="IsoFLOP minima")
        lo, hi = alloc["ci95"].get("a", [np.nan, np.nan])
        ax.plot(compute, alloc["G"] * compute ** alloc["a"], color="C3", lw=1.5,
                label=f"IsoFLOP fit: a = {alloc['a']:.3f} [{lo:.3f}, {hi:.3f}]")
    else:
        ax.text(0.97, 0.05, "no IsoFLOP profiles: < 2 budgets with >= 3 sizes", transform=ax.transAxes,
                ha="right", fontsize="small", color="0.4")
    ax.set(xscale="log", yscale="log", xlabel="training compute C (FLOPs)", ylabel="compute-optimal N",
           title=f"{p.method}: N_opt(C) = G C^a")
    return _finish(fig, ax, path, which="both")


def predicted_vs_observed(fit: MethodFit, path: Path) -> Path:
    plt = _pyplot()
    p = fit.points
    fig, ax = plt.subplots(figsize=(5.5, 5))
    shown = [p.loss]
    for law_fit, marker, colour in ((fit.chinchilla, "o", "C0"), (fit.joint, "^", "C1")):
        shown.append(law_fit.predict(N=p.N, D=p.D))
        ax.scatter(p.loss, shown[-1], marker=marker, s=14, color=colour, alpha=0.7,
                   label=f"{law_fit.law.name} (all points)")
    if fit.holdout_fit is not None:
        held = fit.holdout_mask
        error = fit.holdout["chinchilla"]["mean_abs_rel_error"]
        shown.append(fit.holdout_fit.predict(N=p.N[held], D=p.D[held]))
        ax.scatter(p.loss[held], shown[-1], marker="s", s=30, facecolors="none", edgecolors="C3", lw=1.5,
                   label=f"held out: Chinchilla fit without them ({100 * error:.2f} % mean error)")
    lo, hi = min(map(np.min, shown)) * 0.98, max(map(np.max, shown)) * 1.02
    ax.plot([lo, hi], [lo, hi], "k:", lw=1)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="observed loss", ylabel="predicted loss",
           title=f"{p.method}: predicted vs observed")
    return _finish(fig, ax, path)


def metric_vs_loss(fit: MethodFit, path: Path) -> Path:
    plt = _pyplot()
    metric = fit.metric
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter(metric.loss, metric.metric, s=16, color="C0", zorder=3, label="observed")
    grid = np.linspace(metric.loss.min() - 0.1 * np.ptp(metric.loss), metric.loss.max() + 0.1 * np.ptp(metric.loss),
                       200)
    ax.plot(grid, metric.predict(grid), color="C1", label="sigmoid fit")
    if fit.holdout and "predictions" in fit.holdout.get("metric", {}):
        chained = fit.holdout["metric"]["predictions"]
        ax.scatter(fit.points.loss[fit.holdout_mask][np.isfinite(fit.points.metric[fit.holdout_mask])],
                   [c["predicted"] for c in chained], marker="s", facecolors="none", edgecolors="C3",
                   label="held out: metric predicted from (N, D)")
    ax.set(xlabel="validation loss", ylabel=metric.name, title=f"{fit.points.method}: {metric.name} vs loss")
    return _finish(fig, ax, path)
