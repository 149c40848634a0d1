"""`pretrieve scale fit`: the laws' gradients, recovery of known laws inside their bootstrap intervals (several
noise seeds), published laws and closed forms checked by hand, IsoFLOP parabolas, the metric sigmoid, clear
errors on degenerate input, and the command end to end from a CSV and from a real sqlite MLflow store."""

import csv
import json

import numpy as np
import pytest
from scipy.optimize import check_grad

from pretrieve.cli import main as cli
from pretrieve.scale.fit import (allocation_exponents, chinchilla_allocation, fit_law, fit_method, fit_metric,
                                 isoflop_profiles, objective, predict_from_json, sigmoid)
from pretrieve.scale.laws import CHINCHILLA, JOINT, single_laws
from pretrieve.scale.points import Points, read_points_csv, read_points_mlflow

# Besiroglu et al. 2024's replication of Hoffmann et al.'s approach 3 (their table 1): the law the data come from
CHINCHILLA_TRUTH = {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}
JOINT_TRUTH = {"A": 3e9, "B": 4e10, "alpha": 0.3, "beta": 0.4, "delta": 1.5}
SEEDS = (0, 1, 2)


def isoflop_design(budgets=np.logspace(17, 19.5, 5), sizes=7):
    """N and D of an IsoFLOP study: per budget C, `sizes` models around 0.6 (C/6)^0.5 parameters, D = C / 6N."""
    N, D = [], []
    for C in budgets:
        for n in 0.6 * (C / 6) ** 0.5 * np.logspace(-0.9, 0.9, sizes):
            N.append(n)
            D.append(C / (6 * n))
    return np.array(N), np.array(D)


def chinchilla_loss(N, D, E, A, B, alpha, beta):
    return E + A / N**alpha + B / D**beta


def joint_loss(N, D, A, B, alpha, beta, delta):
    return ((A / N) ** (alpha / beta) + B / D) ** beta + delta


def noisy(loss, seed, sigma=0.01):
    return loss * np.exp(np.random.default_rng(seed).normal(0.0, sigma, len(loss)))


def log_nd(N, D):
    return np.log(np.stack([N, D], axis=1))


@pytest.mark.parametrize("law", [CHINCHILLA, JOINT, *single_laws("N")], ids=lambda law: law.name)
def test_exact_gradients_of_the_summed_huber_objective(law):
    N, D = isoflop_design()
    X = log_nd(N, D)[:, : len(law.variables)]
    y = np.log(noisy(chinchilla_loss(N, D, **CHINCHILLA_TRUTH), 0, sigma=0.05))
    weights = np.random.default_rng(1).integers(0, 3, len(y)).astype(float)  # bootstrap counts
    rng = np.random.default_rng(2)
    for start in law.grid(X, y)[rng.choice(len(law.grid(X, y)), 5, replace=False)]:
        theta = start + rng.normal(0, 0.05, law.size)
        theta[[i for i, name in enumerate(law.params) if name in ("alpha", "beta")]] += 0.1  # inside the bounds
        value = lambda t: objective(t, law, X, y, weights)[0]  # noqa: E731
        gradient = lambda t: objective(t, law, X, y, weights)[1]  # noqa: E731
        scale = np.linalg.norm(gradient(theta)) + 1e-12
        assert check_grad(value, gradient, theta, epsilon=1e-7) / scale < 1e-4


@pytest.mark.parametrize("law,seed", [(law, seed) for law in ("chinchilla", "joint") for seed in SEEDS])
def test_fit_recovers_the_law_within_its_bootstrap_intervals(law, seed):
    """Noisy points from a known law: every true parameter inside its 95 % bootstrap interval, the fit too."""
    spec, truth, loss_of = {"chinchilla": (CHINCHILLA, CHINCHILLA_TRUTH, chinchilla_loss),
                            "joint": (JOINT, JOINT_TRUTH, joint_loss)}[law]
    N, D = isoflop_design()
    fit = fit_law(spec, log_nd(N, D), noisy(loss_of(N, D, **truth), seed), bootstrap=150, seed=seed)
    intervals = fit.intervals()
    for name, value in truth.items():
        lo, hi = intervals[name]
        assert lo <= value <= hi and lo <= fit.parameters[name] <= hi, (name, value, intervals[name])
    assert fit.failed_resamples == 0 and len(fit.samples) == 150
    if law == "joint":
        assert abs(fit.parameters["beta"] - 0.4) < 0.05 and abs(fit.parameters["delta"] - 1.5) < 0.3
        return
    assert abs(fit.parameters["alpha"] - 0.3478) < 0.05 and abs(fit.parameters["beta"] - 0.3658) < 0.03
    # the compute-optimal split the fit implies brackets the true one, beta / (alpha + beta)
    a = fit.samples[:, 4] / (fit.samples[:, 3] + fit.samples[:, 4])
    assert np.percentile(a, 2.5) <= 0.3658 / (0.3478 + 0.3658) <= np.percentile(a, 97.5)


def test_kaplan_published_law_and_its_log_linear_regression_by_hand():
    """Kaplan et al. 2020 eq. (1.1): L(N) = (8.8e13 / N)^0.076. Points on it give back N_c and alpha_N; with
    noise smaller than the Huber delta the Huber fit is least squares in log space, which is the closed form
    slope = cov(log N, log L) / var(log N)."""
    kaplan = single_laws("N")[1]
    N = np.array([1e6, 1e7, 1e8, 1e9])
    exact = (8.8e13 / N) ** 0.076
    fit = fit_law(kaplan, np.log(N)[:, None], exact)
    assert fit.parameters["A"] == pytest.approx(8.8e13, rel=1e-4)
    assert fit.parameters["alpha"] == pytest.approx(0.076, rel=1e-6)
    assert fit.huber_sum < 1e-15

    log_n = np.log(N)
    log_loss = np.log(exact) + np.array([4e-4, -3e-4, -2e-4, 3e-4])  # |residual| < delta = 1e-3
    slope = np.sum((log_n - log_n.mean()) * (log_loss - log_loss.mean())) / np.sum((log_n - log_n.mean()) ** 2)
    intercept = log_loss.mean() - slope * log_n.mean()  # log L = intercept + slope log N = alpha (log N_c - log N)
    fit = fit_law(kaplan, log_n[:, None], np.exp(log_loss))
    assert fit.parameters["alpha"] == pytest.approx(-slope, rel=1e-7)
    assert fit.parameters["A"] == pytest.approx(np.exp(intercept / -slope), rel=1e-5)


def test_fang_single_variable_law_with_irreducible_loss():
    fang = single_laws("D")[0]
    D = np.logspace(8, 11, 8)
    loss = (2e7 / D) ** 0.45 + 1.9  # Fang et al. 2024's form L(D) = (B / D)^beta + delta
    fit = fit_law(fang, np.log(D)[:, None], loss)
    assert fit.parameters["B"] == pytest.approx(2e7, rel=1e-3)
    assert fit.parameters["alpha"] == pytest.approx(0.45, rel=1e-4)
    assert fit.parameters["delta"] == pytest.approx(1.9, rel=1e-4)


def test_allocation_of_the_published_chinchilla_fit():
    """Hoffmann et al. 2022, approach 3 (unrounded, as Besiroglu et al. 2024 recover them from the paper):
    E = 1.69, A = 406.4, B = 410.7, alpha = 0.3392, beta = 0.2849 -> table 2's a = 0.46, b = 0.54."""
    allocation = chinchilla_allocation({"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.33917, "beta": 0.28491})
    assert round(allocation["a"], 2) == 0.46 and round(allocation["b"], 2) == 0.54
    # N_opt minimises the law along C = 6 N D (checked on a dense grid of N)
    C = 1e22
    sizes = np.logspace(8, 12, 20001)
    law = chinchilla_loss(sizes, C / (6 * sizes), 1.69, 406.4, 410.7, 0.33917, 0.28491)
    assert sizes[np.argmin(law)] == pytest.approx(allocation["G"] * (C / 6) ** allocation["a"], rel=2e-3)


def test_isoflop_parabolas_by_hand():
    """Losses exactly on loss = 0.1 (log N - log N*)^2 + L* per budget, N* = 1e8 (C / 1e18)^0.5:
    the vertices are N*, and the allocation exponents a = 0.5, b = 1 - a (D_opt = C / 6 N_opt)."""
    rows = []
    for C in (1e18, 1e19, 1e20):
        best = 1e8 * (C / 1e18) ** 0.5
        for n in best * np.array([0.25, 0.5, 1.0, 2.0, 4.0]):
            rows.append((n, C / (6 * n), C, 0.1 * np.log(n / best) ** 2 + 3.0 - 0.1 * np.log10(C)))
    N, D, C, loss = map(np.array, zip(*rows))
    profiles = isoflop_profiles(Points("all", N, D, C, loss))
    assert [p.N_opt for p in profiles] == pytest.approx([1e8, 1e8 * 10**0.5, 1e9], rel=1e-9)
    assert [p.loss_min for p in profiles] == pytest.approx([1.2, 1.1, 1.0], rel=1e-9)
    found = allocation_exponents(profiles)
    assert found["a"] == pytest.approx(0.5, abs=1e-9) and found["b"] == pytest.approx(0.5, abs=1e-9)


def test_metric_sigmoid_and_holdout_of_the_largest_budget():
    N, D = isoflop_design()
    C = 6 * N * D
    loss = noisy(chinchilla_loss(N, D, **CHINCHILLA_TRUTH), 5, sigma=0.003)
    truth = {"s": 0.5, "k": -4.0, "L0": 2.9, "m": 0.1}
    metric = sigmoid(loss, **truth) + np.random.default_rng(6).normal(0, 0.002, len(loss))
    fit = fit_metric("ndcg_at_10", loss, metric)
    assert fit.params["k"] == pytest.approx(-4.0, rel=0.1) and fit.params["L0"] == pytest.approx(2.9, abs=0.05)

    points = Points("retromae", N, D, C, loss, metric, "ndcg_at_10", [str(i) for i in range(len(N))])
    method = fit_method(points, bootstrap=20, holdout="largest")
    holdout = method.holdout
    assert holdout["held_out"] == 7 and holdout["fitted_on"] == 28
    assert holdout["chinchilla"]["mean_abs_rel_error"] < 0.01  # an honest extrapolation of a true law
    assert holdout["metric"]["mean_abs_error"] < 0.02
    assert np.all(method.holdout_mask == (C > 0.9 * C.max()))


def test_degenerate_inputs_are_clear_errors_not_fits():
    N, D = isoflop_design()
    loss = chinchilla_loss(N, D, **CHINCHILLA_TRUTH)
    with pytest.raises(ValueError, match=r"chinchilla: 4 point\(s\) for 5 parameters; the fit needs at least 6"):
        fit_law(CHINCHILLA, log_nd(N[:4], D[:4]), loss[:4])
    one_size = np.full(10, 1e8)
    tokens = np.logspace(9, 11, 10)
    with pytest.raises(ValueError, match=r"joint: only 1 distinct N \(1e\+08\); the law needs at least 3"):
        fit_law(JOINT, log_nd(one_size, tokens), chinchilla_loss(one_size, tokens, **CHINCHILLA_TRUTH))
    with pytest.raises(ValueError, match="method all: chinchilla: only 1 distinct N"):
        fit_method(Points("all", one_size, tokens, 6 * one_size * tokens,
                          chinchilla_loss(one_size, tokens, **CHINCHILLA_TRUTH)), bootstrap=0)


def write_points(path, columns, rows):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)


def test_cli_from_csv_writes_fit_json_summary_csv_and_plots(tmp_path):
    N, D = isoflop_design(budgets=np.logspace(17, 19, 4), sizes=5)
    rows = []
    for method, shift in (("retromae", 0.0), ("mlm", 0.15)):
        loss = noisy(chinchilla_loss(N, D, **{**CHINCHILLA_TRUTH, "E": 1.82 + shift}), 3, sigma=0.005)
        metric = sigmoid(loss, 0.5, -4.0, 3.0, 0.1)
        rows += [[method, n, d, 6 * n * d, l, m] for n, d, l, m in zip(N, D, loss, metric)]
    points = tmp_path / "points.csv"
    write_points(points, ["method", "N", "D", "C", "loss", "metric"], rows)
    out = tmp_path / "fit"
    assert cli(["scale", "fit", "--csv", str(points), "--out", str(out), "--bootstrap", "30",
                "--holdout", "largest"]) == 0
    fit = json.loads((out / "fit.json").read_text())
    assert sorted(fit) == ["mlm", "retromae"]
    for method in fit.values():
        chinchilla = method["chinchilla"]
        assert set(chinchilla) >= {"E", "A", "B", "alpha", "beta", "ci95", "huber_sum", "points", "residuals"}
        assert chinchilla["points"] == 20 and len(chinchilla["residuals"]) == 20
        assert all(lo <= chinchilla[k] <= hi for k, (lo, hi) in chinchilla["ci95"].items())
        assert set(method["joint"]["ci95"]) == {"A", "B", "alpha", "beta", "delta"}
        allocation = method["allocation"]
        assert allocation["source"] == "isoflop" and allocation["budgets"] == 4
        assert set(allocation["ci95"]) == {"a", "b"} and 0.4 < allocation["a"] < 0.6
        assert method["holdout"]["held_out"] == 5 and method["holdout"]["chinchilla"]["mean_abs_rel_error"] < 0.02
        assert method["metric"]["name"] == "metric" and method["metric"]["rmse"] < 0.01
    assert fit["mlm"]["chinchilla"]["E"] > fit["retromae"]["chinchilla"]["E"]
    with (out / "points.csv").open() as f:  # fit.json alone predicts a run: the loss law, then the sigmoid
        row = next(r for r in csv.DictReader(f) if r["method"] == "retromae")
    predicted = predict_from_json(fit["retromae"], N=[float(row["N"])], D=[float(row["D"])])
    assert predicted["loss"][0] == pytest.approx(float(row["chinchilla"]), rel=1e-9)
    assert predicted["metric"][0] == pytest.approx(float(row["metric_predicted"]), rel=1e-9)
    assert "## retromae (20 points)" in (out / "fit.md").read_text()
    assert len((out / "points.csv").read_text().splitlines()) == 41
    for method in ("mlm", "retromae"):
        for plot in ("loss_vs_compute", "isoflop", "n_opt", "predicted_vs_observed", "metric_vs_loss"):
            png = (out / f"{method}_{plot}.png").read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # no method column: one method named `all`; no C: 6 N D; no metric column: no metric
    plain = tmp_path / "plain.csv"
    write_points(plain, ["N", "D", "loss"], [r[1:3] + [r[4]] for r in rows[:20]])
    points = read_points_csv(plain)
    assert list(points) == ["all"] and points["all"].metric is None
    assert points["all"].C == pytest.approx(6 * N * D) and points["all"].labels[0].endswith("plain.csv:2")
    assert fit_method(points["all"], bootstrap=0).to_json()["chinchilla"]["ci95"] == {}


def test_points_csv_errors_name_the_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    write_points(bad, ["N", "loss"], [[1e8, 3.0]])
    with pytest.raises(ValueError, match=r"bad.csv: no column 'D'"):
        read_points_csv(bad)
    write_points(bad, ["N", "D", "loss"], [[1e8, 1e9, 3.0], [1e8, "many", 3.0]])
    with pytest.raises(ValueError, match=r"bad.csv:3: D = 'many' is not a number"):
        read_points_csv(bad)
    write_points(bad, ["N", "D", "loss"], [[1e8, 1e9, 3.0], [2e8, 1e9, 2.9]])
    assert cli(["scale", "fit", "--csv", str(bad), "--out", str(tmp_path / "x")]) == 1
    assert "chinchilla: 2 point(s) for 5 parameters" in capsys.readouterr().err


def test_study_from_mlflow_reads_child_runs_and_logs_artifacts_on_the_parent(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("scale", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment, run_name="ladder",
                               tags={"pretrieve.study": "ladder", "pretrieve.scale": "study"}).info.run_id
    N, D = isoflop_design(budgets=np.logspace(17, 19, 3), sizes=4)
    loss = noisy(chinchilla_loss(N, D, **CHINCHILLA_TRUTH), 4, sigma=0.005)
    ndcg = sigmoid(loss, 0.5, -4.0, 3.0, 0.1)
    for i, (n, d, l, m) in enumerate(zip(N, D, loss, ndcg)):
        tags = {"mlflow.parentRunId": parent, "N": str(n), "N_total": str(n * 1.2), "D": str(d), "C": str(6 * n * d),
                "method": "retromae", "seed": "0", "size": f"s{i % 4}"}
        run = client.create_run(experiment, run_name=f"point-{i}", tags=tags).info.run_id
        client.log_metric(run, "val_loss", l + 1.0, step=0)
        client.log_metric(run, "val_loss", l, step=100)  # the final value is the one that counts
        if i % 6:
            client.log_metric(run, "ndcg_at_10", m)
        else:  # evaluated by the farm: eval runs nested under the point, one per dataset
            for dataset, value in (("scifact", m - 0.01), ("nfcorpus", m + 0.01)):
                evaluated = client.create_run(experiment, run_name=f"eval-{i}-{dataset}", tags={
                    "mlflow.parentRunId": run, "pretrieve.farm": "eval", "dataset": dataset, "stage": "zero-shot"})
                client.log_metric(evaluated.info.run_id, "ndcg_at_10", value)
                client.set_terminated(evaluated.info.run_id)
        client.set_terminated(run)
    crashed = client.create_run(experiment, run_name="crashed", tags={"mlflow.parentRunId": parent, "N": "1e8",
                                                                      "D": "1e9"}).info.run_id
    client.set_terminated(crashed, status="FAILED")
    unfinished = client.create_run(experiment, tags={"mlflow.parentRunId": parent, "N": "1e8", "D": "1e9"})
    client.set_terminated(unfinished.info.run_id)  # finished, but never logged val_loss

    by_method, skipped = read_points_mlflow(uri, parent, "ndcg@10")
    points = by_method["retromae"]
    assert skipped == {"status FAILED": 1, "no val_loss": 1}
    order = np.argsort([int(label.split("-")[1]) for label in points.labels])
    assert points.loss[order] == pytest.approx(loss) and points.N[order] == pytest.approx(N)
    assert points.metric[order] == pytest.approx(ndcg)  # own metric, or the mean over the farm's datasets
    assert points.metric_name == "ndcg_at_10"
    only_scifact, _ = read_points_mlflow(uri, parent, "ndcg@10", dataset="scifact")
    assert only_scifact["retromae"].metric[order][0] == pytest.approx(ndcg[0] - 0.01)

    study = tmp_path / "study.yaml"
    study.write_text(f"name: ladder\ntracking: {{uri: '{uri}', experiment: scale}}\nfit: {{metric: ndcg@10}}\n"
                     "grid: {sizes: [s0, s1]}  # plan's keys: left to plan\n")
    out = tmp_path / "fit"
    assert cli(["scale", "fit", str(study), "--out", str(out), "--bootstrap", "20"]) == 0
    fit = json.loads((out / "fit.json").read_text())
    assert fit["retromae"]["chinchilla"]["points"] == 12 and fit["retromae"]["metric"]["name"] == "ndcg_at_10"
    logged = {a.path for a in client.list_artifacts(parent, "scale_fit")}
    assert {"scale_fit/fit.json", "scale_fit/fit.md", "scale_fit/retromae_isoflop.png"} <= logged

    study.write_text(f"name: other\ntracking: {{uri: '{uri}', experiment: scale}}\n")
    with pytest.raises(ValueError, match="no top-level run tagged pretrieve.study = 'other'"):
        from pretrieve.scale.report import run_fit
        run_fit(tmp_path / "x", study=str(study))
