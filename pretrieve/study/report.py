"""`pretrieve study report STUDY.yaml`: the markdown tables of a method study's results file, as the studies'
READMEs show them: the quality study's by arm with their intervals and differences (stats.tables), the recipe's
budget curve and arms, the Matryoshka study's NDCG@10 by dimension."""

from __future__ import annotations

from pretrieve.study.stats import tables


def report(kind: str, results: dict) -> str:
    return {"quality": tables, "recipe": recipe_tables, "matryoshka": matryoshka_table}[kind](results)


def recipe_tables(results: dict) -> str:
    """The budget curve (NDCG@10 by contrastive steps, zero-shot) and the arms (zero-shot and fine-tuned, by
    pooling, each with its difference to `none` and the paired bootstrap's p on the average)."""
    lines = [f"recipe, scale {results['scale']}{' (smoke)' if results['smoke'] else ''}"]
    curve = results.get("budget") or {}
    if curve:
        steps = list(next(iter(next(iter(curve.values()))["ndcg@10"].values())))
        lines += ["", "### The budget", "", "| run | collection | " + " | ".join(steps) + " |",
                  "|---|---|" + "---|" * len(steps)]
        for name, run in curve.items():
            for i, (dataset, scores) in enumerate(run["ndcg@10"].items()):
                label = f"{name}: {run['pooling']}, lr {run['lr']:g}, warm-up {run['warmup_ratio']:g}" if i == 0 else ""
                lines.append(f"| {label} | {dataset} | " + " | ".join(f"{scores[s]:.3f}" for s in steps) + " |")
    arms = results.get("arms") or {}
    if arms:
        scores = list(arms)  # contrastive (zero-shot), finetuned
        first = next(iter(next(iter(arms[scores[0]].values())).values()))
        names = list(first)
        header = [f"{score} {name}" for score in scores for name in names]
        lines += ["", "### The arms", "", "| pooling | arm | " + " | ".join(header) + " |",
                  "|---|---|" + "---|" * len(header)]
        for pooling, by_arm in arms[scores[0]].items():
            for i, arm in enumerate(by_arm):
                cells = [_arm_cell(arms[score][pooling][arm][name]) for score in scores for name in names]
                lines.append(f"| {pooling if i == 0 else ''} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _arm_cell(entry: dict) -> str:
    versus = entry.get("vs_none")
    return f"{entry['mean']:.3f}" + (f" ({versus['diff']:+.3f}, p {versus['p']:.2f})" if versus else "")


def matryoshka_table(results: dict) -> str:
    """NDCG@10 of each run at each dimension per collection, then the mean and the share of its full width kept."""
    dims = [str(d) for d in results["settings"]["matryoshka_dims"]]
    lines = [f"matryoshka, scale {results['scale']}", "",
             "| contrastive stage | " + " | ".join(f"{d} dims" for d in dims) + " |", "|---|" + "---|" * len(dims)]
    for name, by_dataset in results["ndcg@10"].items():
        for dataset, scores in by_dataset.items():
            lines.append(f"| {name}, {dataset} | " + " | ".join(f"{scores[d]:.4f}" for d in dims) + " |")
        means, kept = results["mean_ndcg@10"][name], results["share_of_full_width"][name]
        lines.append(f"| **{name}, mean** | " + " | ".join(f"**{means[d]:.4f}** ({kept[d]:.0%})" for d in dims) + " |")
    return "\n".join(lines)

