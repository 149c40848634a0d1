"""Method studies: what a pre-training method buys after the same fine-tuning. The plan of each scale (plan.py),
the text and the labelled fine-tuning set (data.py), and the paired statistics and plots (stats.py); the runs
themselves are benchmarks/quality.py, recipe.py and matryoshka.py."""
