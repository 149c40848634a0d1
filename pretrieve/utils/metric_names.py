"""Metric names as MLflow takes them: one spelling for the trainer, the evaluator, the tracker and the reports."""


def metric_name(name: str) -> str:
    return name.replace("@", "_at_")  # MLflow rejects "@" (ndcg@10 -> ndcg_at_10)
