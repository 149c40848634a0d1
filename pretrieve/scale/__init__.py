"""Scaling studies: plan (grid, FLOPs), run (points as farm-style jobs), fit (laws, intervals, plots).

`pretrieve scale fit` lives in fit.py (the fitting), laws.py (the laws), points.py (reading points from CSV or
MLflow), study.py (STUDY.yaml), report.py (fit.json, summary, CSV, plots, MLflow artifacts) and plots.py.
"""
