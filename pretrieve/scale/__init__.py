"""Scaling studies: plan (grid, FLOPs), fit (laws, intervals, plots); running a study's points is
pretrieve/orchestrate/scale_run.py. `pretrieve estimate` (estimate.py) prices a config before launch from the GPU
benchmarks' throughput records (records.py) with memory.py's model; `scale plan` prices its points the same way.

`pretrieve scale fit` lives in fit.py (the fitting), laws.py (the laws), points.py (reading points from CSV or
MLflow), study.py (STUDY.yaml), report.py (fit.json, summary, CSV, plots, MLflow artifacts) and plots.py.
"""
