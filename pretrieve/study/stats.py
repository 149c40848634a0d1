"""Statistics and pictures of the method studies (quality.py, recipe.py).

Each arm is run with several seeds (pre-training and fine-tuning seed together); each run's evaluation gives
NDCG@10 per test query (per_query.jsonl). Per dataset, an arm's per-query NDCG@10 is first averaged over its
seeds (the seeds of two arms are not paired with each other: `none` seed 1 shares nothing with `retromae` seed 1
but the fine-tuning seed), then a paired bootstrap over the queries (the same resampled queries on both sides)
gives the 95 % percentile interval of the mean difference to a reference arm, and a two-sided p (twice the
smaller tail of the resampled means around 0). The average over datasets resamples each dataset's queries on
its own (a stratified bootstrap) and averages the datasets' means, so every dataset weighs the same, as
BEIR averages do. An arm's own interval is the same bootstrap of its seed-averaged mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

AVERAGE = "average"  # the name of the across-datasets row


def per_query(path: Path, metric: str = "ndcg@10") -> dict[str, float]:
    """{query id: metric} from an evaluation's per_query.jsonl."""
    with open(path / "per_query.jsonl") as f:
        return {r["query_id"]: float(r[metric]) for r in map(json.loads, f)}


def seed_mean(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per query, the mean over the runs (seeds); every run must have scored the same queries."""
    queries = set(runs[0])
    for i, run in enumerate(runs[1:], 1):
        if set(run) != queries:
            raise ValueError(f"seed run {i} scored other queries than seed run 0 ({len(set(run) ^ queries)} differ)")
    return {q: float(np.mean([run[q] for run in runs])) for q in sorted(queries)}


def _resampled_means(values: dict[str, np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """[resamples] bootstrap means: each dataset's queries resampled on their own, the datasets' means averaged."""
    rng = np.random.default_rng(seed)
    means = [v[rng.integers(0, len(v), size=(resamples, len(v)))].mean(axis=1) for v in values.values()]
    return np.mean(means, axis=0)


def interval(values: dict[str, np.ndarray], resamples: int, seed: int) -> dict:
    """Mean (of the datasets' means) and its 95 % bootstrap interval."""
    means = _resampled_means(values, resamples, seed)
    return {"mean": round(float(np.mean([v.mean() for v in values.values()])), 5),
            "ci95": [round(float(x), 5) for x in np.percentile(means, [2.5, 97.5])]}


def paired(arm: dict[str, dict[str, float]], reference: dict[str, dict[str, float]], resamples: int,
           seed: int) -> dict:
    """Paired bootstrap of mean(arm - reference) over queries, per dataset {name: {query: score}} pooled as above:
    the difference, its 95 % interval and a two-sided p."""
    diffs = {}
    for name, scores in arm.items():
        if set(scores) != set(reference[name]):
            raise ValueError(f"{name}: the two arms scored different queries")
        queries = sorted(scores)
        diffs[name] = np.array([scores[q] - reference[name][q] for q in queries])
    means = _resampled_means(diffs, resamples, seed)
    p = min(1.0, 2 * min(float((means <= 0).mean()), float((means >= 0).mean())))
    spread = interval(diffs, resamples, seed)
    return {"diff": spread["mean"], "ci95": spread["ci95"], "p": round(p, 4),
            "queries": sum(len(d) for d in diffs.values())}


def summarize(scores: dict[str, dict[str, list[dict[str, float]]]], references: tuple[str, ...], resamples: int,
              seed: int) -> dict:
    """{arm: {dataset | "average": {ndcg@10 per seed, mean, ci95, vs_<reference>: paired(...)}}} from
    {arm: {dataset: [per-query scores of each seed]}} ("average" where there are several datasets)."""
    averaged = {arm: {name: seed_mean(runs) for name, runs in per.items()} for arm, per in scores.items()}
    out = {}
    for arm, per in averaged.items():
        out[arm] = {}
        for name in [*per, AVERAGE] if len(per) > 1 else list(per):
            subset = per if name == AVERAGE else {name: per[name]}
            entry = interval({n: np.array(list(s.values())) for n, s in subset.items()}, resamples, seed)
            if name != AVERAGE:
                entry["ndcg@10"] = [round(float(np.mean(list(run.values()))), 5) for run in scores[arm][name]]
            for ref in references:
                if ref != arm and ref in averaged:
                    entry[f"vs_{ref}"] = paired(subset, {n: averaged[ref][n] for n in subset}, resamples, seed)
            out[arm][name] = entry
    return out


def _pyplot():
    """pyplot, or None where matplotlib is not installed (a GPU node's offline install without the `plots`
    extra): the study's numbers do not need it, its figures are left out."""
    from pretrieve.optional import MATPLOTLIB, available

    if not available(MATPLOTLIB, "the study's figures"):
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_arms(summary: dict, path: Path, title: str) -> Path | None:
    """NDCG@10 by arm with its 95 % interval, one panel per dataset (the average last); None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    arms = list(summary)
    names = list(next(iter(summary.values())))
    fig, axes = plt.subplots(1, len(names), figsize=(max(6.4, 3.2 * len(names)), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        means = [summary[a][name]["mean"] for a in arms]
        low = [m - summary[a][name]["ci95"][0] for a, m in zip(arms, means)]
        high = [summary[a][name]["ci95"][1] - m for a, m in zip(arms, means)]
        ax.errorbar(range(len(arms)), means, yerr=[low, high], fmt="o", capsize=3)
        ax.set_xticks(range(len(arms)), arms, rotation=45, ha="right")
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("NDCG@10 (95 % bootstrap interval)")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_curve(points: list[dict], path: Path, title: str) -> Path | None:
    """NDCG@10 after the same fine-tuning against pre-training steps, one line per dataset; None without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name in points[0]["ndcg@10"]:
        ax.plot([p["step"] for p in points], [p["ndcg@10"][name] for p in points], marker="o", label=name)
    ax.set_xlabel("pre-training steps (0: the base)")
    ax.set_ylabel("NDCG@10 after fine-tuning")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _cell(entry: dict, key: str = "mean") -> str:
    low, high = entry["ci95"]
    return f"{entry[key]:+.4f} [{low:+.4f}, {high:+.4f}]" if key == "diff" else \
        f"{entry[key]:.4f} [{low:.4f}, {high:.4f}]"


def arm_tables(summary: dict, seeds: dict, flops: dict) -> list[str]:
    """Markdown: NDCG@10 by arm (95 % interval), then the difference to `none` and to `mlm` (interval, p)."""
    names = list(next(iter(summary.values())))
    lines = ["| arm | seeds | pre-training FLOPs | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for arm, per in summary.items():
        cost = f"{flops[arm]:.2e}" if arm in flops else "–"
        lines.append(f"| {arm} | {seeds[arm]} | {cost} | " + " | ".join(_cell(per[n]) for n in names) + " |")
    references = dict.fromkeys(key[3:] for per in summary.values() for key in per[names[0]] if key.startswith("vs_"))
    for ref in references:
        rows = [(arm, per) for arm, per in summary.items() if f"vs_{ref}" in per[names[0]]]
        lines += ["", f"Difference to `{ref}` (paired bootstrap over queries; p two-sided):", "",
                  "| arm | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for arm, per in rows:
            lines.append(f"| {arm} | " + " | ".join(
                f"{_cell(per[n][f'vs_{ref}'], 'diff')} p {per[n][f'vs_{ref}']['p']:.3f}" for n in names) + " |")
    return lines



def tables(results: dict) -> str:
    """The markdown tables of a quality result file (studies/quality/README.md): each part by arm, the differences,
    the curve."""
    lines = [f"protocol {results['protocol']}, scale {results['scale']}{' (smoke)' if results['smoke'] else ''}"]
    general = results.get("general")
    if general:
        seeds = results["settings"]["settings"]["general"]["arms"]
        flops = {arm: b["flops"] for arm, b in general["budget"].items()}
        lines += ["", "### General pre-training", "", *arm_tables(general["arms"], seeds, flops), "",
                  "Steps curve (NDCG@10 after the same fine-tuning):", "",
                  "| step | " + " | ".join(general["curve"][0]["ndcg@10"]) + " |",
                  "|---|" + "---|" * len(general["curve"][0]["ndcg@10"])]
        lines += [f"| {p['step']} | " + " | ".join(f"{v:.4f}" for v in p["ndcg@10"].values()) + " |"
                  for p in general["curve"]]
    for base, entry in (results.get("domain") or {}).items():
        flops = {arm: sum(b["flops"] for key, b in entry["budget"].items() if key.startswith(f"{arm}/"))
                 for arm in entry["seeds"] if arm != "none"}
        lines += ["", f"### Domain adaptation from {base}", "", *arm_tables(entry["arms"], entry["seeds"], flops)]
    return "\n".join(lines)
