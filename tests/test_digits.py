"""The train-digits experiment: configuration checks and a short real run over gloo."""

import pytest
import torch

from bitcomm.comm import run_local
from bitcomm.experiments import digits


def test_split_is_fixed_by_seed_and_standardised():
    a, b = digits.load_digits_split(0), digits.load_digits_split(0)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    xtr, ytr, xte, yte = a
    assert xtr.shape[1] == 64 and xtr.shape[0] + xte.shape[0] == 1797
    assert set(ytr.tolist()) == set(range(10)) == set(yte.tolist())
    assert abs(float(xtr.mean())) < 1e-4
    c = digits.load_digits_split(1)
    assert not torch.equal(a[1], c[1])


def test_config_is_checked(tmp_path):
    good = tmp_path / "t.yaml"
    good.write_text("kind: train\nname: t\nmethods: [dense-sgd]\nsteps: 5\n")
    assert digits.load_config(good).steps == 5
    for text, match in [("kind: train\nmethods: [sgd2]\n", "unknown methods"),
                        ("kind: train\nsteps: 0\n", "steps"),
                        ("kind: train\nworkers: 2\ncolour: red\n", "unknown keys"),
                        ("kind: train\ntransports: [nccl]\n", "transports"),
                        ("name: x\n", "kind: train")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            digits.load_config(bad)


def test_bytes_per_step_match_the_collectives():
    # dense-sgd sends the fp32 allreduce's 4 * params * (N - 1) bytes per step: ratio 1
    cfg = digits.TrainConfig(methods=["dense-sgd"], steps=3, eval_every=3)
    data = digits.load_digits_split(0)
    rows = run_local(lambda c: digits.train(c, "dense-sgd", cfg, data), 2, timeout=60)
    assert rows[0].bytes_per_step == 4 * rows[0].params * 1
    assert rows[0].compression == 1.0
    assert rows[0].digest == rows[1].digest


@pytest.mark.timeout(300)
def test_short_digits_run_over_gloo_meets_the_accuracy_target():
    cfg = digits.TrainConfig(methods=["dense-sgd", "qsgd-4bit", "signum-ring", "sparcml-topk"],
                             steps=150, eval_every=50, workers=4, transports=["gloo"])
    rows = digits.summarise(digits.launch(cfg, "gloo", progress=lambda line: None,
                                          timeout=240))
    by = {r.method: r for r in rows}
    assert all(r.identical_on_ranks for r in rows)
    assert by["dense-sgd"].accuracy > 0.9
    for m in ("qsgd-4bit", "signum-ring", "sparcml-topk"):
        assert by[m].gap_points <= 3.0, by[m]
        assert by[m].compression > 5, by[m]


def test_threshold_selecting_methods_train_a_wider_model_and_report_their_counts():
    """Ok-Topk and SIDCo at 1% on a 64-256-10 MLP, 2 thread ranks: identical parameters on
    every rank, accuracy near dense SGD's, and a selected/k figure for each."""
    data = digits.load_digits_split(0)
    cfg = digits.TrainConfig(steps=100, eval_every=50, hidden=256)
    rows = {m: run_local(lambda c, m=m: digits.train(c, m, cfg, data), 2, timeout=120)
            for m in ("dense-sgd", "oktopk-sgd", "sidco-sgd")}
    assert rows["dense-sgd"][0].params == 64 * 256 + 256 + 256 * 10 + 10
    assert rows["dense-sgd"][0].selected_ratio is None
    for m in ("oktopk-sgd", "sidco-sgd"):
        a, b = rows[m]
        assert a.digest == b.digest
        assert a.accuracy >= rows["dense-sgd"][0].accuracy - 0.03, m
        assert a.compression > 10, m
        assert 0.5 < a.selected_ratio < 2 and a.selected_deviation < 1, m


def _rows():
    from bitcomm.experiments.digits.results import MethodResult

    rows = []
    for t in ("gloo", "mpi"):
        for method, end, per_step in (("dense-sgd", 0.96, 8000.0), ("signum-ring", 0.93, 300.0),
                                      ("qsgd-4bit", 0.95, 1100.0)):
            curve = [(0, 0.1), (50, 0.7), (100, end - 0.02), (150, end - 0.01), (200, end)]
            rows.append(MethodResult(t, method, 4, 200, curve, end, per_step, 8000 / per_step,
                                     1.0, 100, 0.0))
    return rows


def test_the_plot_shows_accuracy_against_steps_and_bytes(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the plots extra")
    import matplotlib

    matplotlib.use("Agg")
    from bitcomm.experiments.digits.report import plot, write_report

    fig = plot(_rows())
    axes = fig.axes
    assert len(axes) == 4  # per transport: against steps, against bytes
    for ax in axes:
        lo, hi = ax.get_ylim()
        # the late accuracies lie in 0.91..0.96: the axis spans them, not 0.5..1
        assert 0.85 <= lo <= 0.91 and 0.96 <= hi <= 1.0, (lo, hi)
        assert ax.get_legend() is None  # the one legend sits beside the panels
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert len(lines) == 3
    by_step, by_bytes = axes[0], axes[1]
    styles = {ln.get_label(): (ln.get_linestyle(), ln.get_marker(), ln.get_color())
              for ln in by_step.get_lines()}
    assert styles["dense-sgd (dense)"][0] == "--" and styles["dense-sgd (dense)"][1] == "None"
    assert styles["signum-ring"][0] == styles["qsgd-4bit"][0] == "-"
    assert styles["signum-ring"][1] != styles["qsgd-4bit"][1]
    assert styles["signum-ring"][2] != styles["qsgd-4bit"][2]
    assert by_bytes.get_xscale() == "log"
    qsgd = [ln for ln in by_bytes.get_lines() if ln.get_color() == styles["qsgd-4bit"][2]][0]
    assert list(qsgd.get_xdata()) == [1100.0, 50 * 1100.0, 100 * 1100.0, 150 * 1100.0,
                                      200 * 1100.0]
    assert len(fig.legends) == 1
    paths = write_report(_rows(), {}, tmp_path)
    assert (tmp_path / "accuracy.png").stat().st_size > 0 and len(paths) == 4
