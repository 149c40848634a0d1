"""Method studies (`pretrieve study plan|run|report STUDY.yaml`): what a pre-training method buys after the same
fine-tuning. A study file per scale under studies/ (study_file.py); the settings and their fixing (plan.py); a
run's context (context.py), inputs (data.py, inputs.py), pre-training (pretraining.py, through the runner
`pretrieve scale run` uses too), fine-tuning and evaluation (finetuning.py), statistics and tables (stats.py,
results.py, report.py); the studies themselves: quality.py (general.py, domain.py), recipe.py and matryoshka.py
(contrastive.py), behind the command's actions in studies.py."""
