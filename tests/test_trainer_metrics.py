"""Metric sinks (console, JSONL with resume truncation, TensorBoard event files read back by
TensorBoard's own loader), the progress bar, the end-of-run PNG plot, and the non-finite guard."""

import io
import json
import logging
import math
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.trainer import MetricsLogger, NonFiniteError, NonFiniteGuard, plot_metrics, plot_run, read_jsonl
from jaxflow.trainer.metrics import ConsoleBackend, fmt4
from jaxflow.trainer.plot import COLORS, smooth
from jaxflow.trainer.summary import format_duration, run_summary


def _metrics(step):
    return {
        "critic/score/mean": 0.5 + step / 100,
        "critic/rewards/mean": 0.25 + step / 200,
        "actor/pg_loss": -0.0123456 * step,
        "actor/ppo_kl": 1.23456e-4 * step,
        "response_length/mean": 123.456,
        "timing_s/step": 4.56789,
        "perf/throughput": 12345.678,
        "actor/entropy": jnp.float32(1.5),
        "other/not_on_console": np.float64(7.0),
    }


def test_console_line_four_significant_digits():
    out = io.StringIO()
    console = ConsoleBackend(stream=out)
    console.log({k: float(v) for k, v in _metrics(3).items()}, 3)
    line = out.getvalue().strip()
    assert line == (
        "step 3 | score 0.53 | reward 0.265 | pg_loss -0.03704 | ppo_kl 0.0003704 | "
        "entropy 1.5 | resp_len 123.5 | step_s 4.568 | tok/s 12346"
    )
    assert fmt4(float("nan")) == "nan" and fmt4(12.0) == "12" and fmt4(-2.5e-7) == "-2.5e-07"
    assert fmt4(2.5e7) == "2.5e+07" and fmt4(-1234.56) == "-1235"
    assert ConsoleBackend(["a/b"]).format({"a/b": 2.0, "c": 1.0}, 1) == "step 1 | a/b 2"


def test_jsonl_appends_and_truncates_on_resume(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",), config={"lr": 1e-6}) as logger:
        for step in range(1, 6):
            logger.log(_metrics(step), step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "critic/score/me')  # a crash cut the last line short
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-6}
    # resumed from the step-3 checkpoint: steps 4, 5 (and the torn line) go
    with MetricsLogger(tmp_path, backends=("jsonl",), resume_step=3) as logger:
        logger.log(_metrics(4), 4)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[-1]["actor/pg_loss"] == pytest.approx(-0.0123456 * 4)
    assert recs[0]["actor/entropy"] == 1.5 and isinstance(recs[0]["time"], float)
    # every line is one complete JSON object
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    # a fresh run (no resume) starts the file over
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        logger.log({"x": float("nan")}, 1)
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec["step"] == 1 and math.isnan(rec["x"])


def _tensorboard_scalars(logdir):
    """tag -> [(step, value)] as TensorBoard shows them (purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), purge_orphaned_data=True)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_file_reads_back(tmp_path):
    with MetricsLogger(tmp_path, backends=("tensorboard",)) as logger:
        for step in (1, 2, 3):
            logger.log(_metrics(step), step)
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == set(_metrics(1))
    assert scalars["critic/score/mean"] == [(1, np.float32(0.51)), (2, np.float32(0.52)), (3, np.float32(0.53))]
    assert scalars["perf/throughput"][1] == (2, np.float32(12345.678))

    # resumed from the step-2 checkpoint: a new file hides the old file's steps >= 3
    with MetricsLogger(tmp_path, backends=("tensorboard",), resume_step=2) as logger:
        logger.log({"critic/score/mean": 9.0}, 3)
        logger.log({"critic/score/mean": 10.0}, 4)
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2 and path in files
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["critic/score/mean"] == [(1, np.float32(0.51)), (2, np.float32(0.52)), (3, 9.0), (4, 10.0)]
    assert [s for s, _ in scalars["actor/pg_loss"]] == [1, 2]

    # a fresh run (no resume) starts over
    with MetricsLogger(tmp_path, backends=("tensorboard",)) as logger:
        logger.log({"a": 1.0}, 1)
    assert _tensorboard_scalars(tmp_path / "tensorboard") == {"a": [(1, 1.0)]}


def test_wandb_missing_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.warns(UserWarning, match="wandb backend requested but the wandb package is not installed"):
        logger = MetricsLogger(tmp_path, backends=("jsonl", "wandb"))
    logger.log({"a": 1.0}, 1)
    logger.close()
    assert list(logger.backends) == []
    with pytest.raises(ValueError, match="unknown metrics backends"):
        MetricsLogger(tmp_path, backends=("mlflow",))


def test_non_scalar_metrics_are_skipped_with_a_warning(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        with pytest.warns(UserWarning, match="'hist' is not a scalar"):
            logger.log({"a": np.array([2.0]), "hist": np.arange(3)}, 1)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["a"] == 2.0


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_no_progress_bar_when_the_stream_is_not_a_terminal(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, backends=("console",), total_steps=4, stream=out) as logger:
        logger.log(_metrics(1), 1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 1 | score 0.51")
    assert "1/4" not in out.getvalue() and "\r" not in out.getvalue()


def test_progress_bar_and_console_share_the_stream(tmp_path):
    out = _Terminal()
    with MetricsLogger(tmp_path, backends=("console",), total_steps=4, resume_step=1, stream=out) as logger:
        assert logger.progress._tqdm is not None
        logger.log(_metrics(2), 2)
        logger.log(_metrics(3), 3)
        assert logger.progress.n == 3
    text = out.getvalue()
    assert "step 2 | score 0.52" in text and "step 3 | score 0.53" in text
    assert "3/4" in text and ("step/s" in text or "s/step" in text)  # i/N and the rate


def _read_png(path):
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def _count(img, color):
    return (img == np.array(color)).all(axis=-1).sum()


def test_png_plot_of_reward_and_kl(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(1, 41):
            m = _metrics(step)
            m["actor/ppo_kl"] = float("nan") if step == 20 else m["actor/ppo_kl"]
            logger.log(m, step)
    path = plot_run(tmp_path, width=480, panel_height=200)
    assert path == tmp_path / "metrics.png"
    img = _read_png(path)
    assert img.shape == (400, 480, 3)  # two panels: score+rewards, and KL
    blue, orange = COLORS[0], COLORS[1]
    top, bottom = img[:200], img[200:]
    # both series of the first panel and the KL line in the second are drawn (not just legends)
    assert _count(top, blue) > 200 and _count(top, orange) > 200
    assert _count(bottom, blue) > 200 and _count(bottom, orange) == 0
    # text (tick labels, legend) is dark ink on a white background
    assert (img.sum(axis=-1) < 100).sum() > 500 and (img == 255).all(axis=-1).mean() > 0.5

    # one panel per key, a single point, a constant series, missing keys dropped
    one = plot_metrics(
        [{"step": 5, "k": 2.0}, {"step": 6, "c": 1.0}, {"step": 7, "c": 1.0}],
        ["k", "c", "absent"],
        tmp_path / "small.png",
        width=300,
        panel_height=150,
    )
    assert _read_png(one).shape == (300, 300, 3)
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_metrics([{"step": 1, "a": 1.0}], ["b"], tmp_path / "x.png")


def test_smoothing_is_a_debiased_moving_average():
    x = np.array([1.0, np.nan, 3.0, 2.0])
    a = 0.6
    s1 = 1.0
    s3 = (a * 0.4 * 1.0 + 0.4 * 3.0) / (a * 0.4 + 0.4)
    s4 = (a * (a * 0.4 * 1.0 + 0.4 * 3.0) + 0.4 * 2.0) / (a * (a * 0.4 + 0.4) + 0.4)
    out = smooth(x, a)
    np.testing.assert_allclose(out[[0, 2, 3]], [s1, s3, s4])
    assert np.isnan(out[1])
    np.testing.assert_allclose(smooth(np.full(5, 7.0), 0.9), 7.0)


def test_guard_refuses_bad_steps_and_stops_after_k(caplog):
    guard = NonFiniteGuard(max_consecutive=3)
    assert guard.check({"actor/pg_loss": 0.1, "timing_s/step": float("nan")}, 1)  # timing not watched
    with caplog.at_level(logging.WARNING, logger="jaxflow.trainer.guard"):
        assert not guard.check(
            {"actor/pg_loss": jnp.float32(jnp.nan), "critic/grad_norm": float("inf"), "critic/vf_loss": 0.2}, 2
        )
    msg = caplog.records[-1].getMessage()
    assert msg.startswith("step 2: non-finite ") and "not saving checkpoints" in msg
    assert "actor/pg_loss=nan" in msg and "critic/grad_norm=inf" in msg and "vf_loss" not in msg
    assert "unchanged" not in msg  # no update_skipped metric: nothing is claimed about the params
    assert not guard.healthy and guard.consecutive == 1
    assert guard.check({"actor/pg_loss": 0.1, "actor/update_skipped": 0.0}, 3)  # recovers: count resets
    assert guard.healthy
    # one of four mini-batch updates refused: the message must not claim the params are unchanged
    assert not guard.check({"actor/update_skipped": np.array([0.0, 1.0, 0.0, 0.0])}, 4)
    assert "actor refused 25% of its optimizer steps (the others applied)" in caplog.records[-1].getMessage()
    assert guard.check({"actor/update_skipped": 0.0}, 4)
    assert not guard.check({"actor/update_skipped": 1.0, "critic/score/mean": 0.3}, 4)
    assert "actor refused every optimizer step, its params unchanged" in caplog.records[-1].getMessage()
    assert not guard.check({"critic/score/mean": float("-inf")}, 5)
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps \(\[4, 5, 6\]\).*last good checkpoint"):
        guard.check({"critic/rewards/mean": float("nan")}, 6)
    assert guard.total_bad == 5
    with pytest.raises(ValueError):
        NonFiniteGuard(0)


def test_end_of_run_summary():
    history = [{"step": 0, "val/score/mean": 0.16}]
    history += [{"step": s, "critic/score/mean": 0.1 + s / 400} for s in range(1, 301)]
    history[250]["val/score/mean"] = 0.914
    history[300]["val/score/mean"] = 0.902
    history[120]["val/score/mean"] = 0.914  # a tie: the earlier step is the best
    text = run_summary(
        history,
        wall_s=412.4,
        outputs={
            "metrics": "run/metrics.jsonl",
            "plot": "run/metrics.png",
            "checkpoints": None,
            "HF export": "run/hf_actor",
        },
    )
    assert text.splitlines() == [
        "done in 6m52s: 300 steps (1 -> 300)",
        "  training score (critic/score/mean): 0.103 (first) -> 0.850 (last)",
        (
            "  held-out score (val/score/mean):    0.160 (first, step 0) -> 0.914 (best, step 120) -> "
            "0.902 (last, step 300)"
        ),
        "  metrics    run/metrics.jsonl",
        "  plot       run/metrics.png",
        "  HF export  run/hf_actor",
    ]
    assert run_summary([], wall_s=3).splitlines() == ["done in 3s: no training steps"]
    # An SFT run: its loss and held-out greedy accuracy.
    sft = [{"step": s, "sft/loss": 2.0 / s} for s in range(1, 5)]
    sft[1]["sft/val_accuracy"], sft[3]["sft/val_accuracy"] = 0.25, 0.5
    assert run_summary(
        sft,
        wall_s=75,
        outputs={"HF export": "out"},
        train=("training loss", "sft/loss"),
        val=("held-out accuracy", "sft/val_accuracy"),
    ).splitlines() == [
        "done in 1m15s: 4 steps (1 -> 4)",
        "  training loss (sft/loss):             2.000 (first) -> 0.500 (last)",
        "  held-out accuracy (sft/val_accuracy): 0.250 (first, step 2) -> 0.500 (best, step 4) -> 0.500 (last, step 4)",
        "  HF export  out",
    ]
    assert format_duration(3725) == "1h02m"


def test_the_summary_sets_the_predicted_step_time_beside_the_measured_median():
    """When the auto-mapper chose the placement, its predicted step time (analytic) stands
    beside the median of the logged step times (validation steps without timing skipped)."""
    seconds = [9.0, 1.2, 0.8, 1.0, 1.1]  # the first step compiles: the median ignores it
    history = [{"step": 0, "val/score/mean": 0.1}] + [
        {"step": i + 1, "timing_s/step": s} for i, s in enumerate(seconds)
    ]
    text = run_summary(history, wall_s=20, predicted=("auto-mapper, cpu profile", 0.5))
    assert (
        "  step time: median 1.100 s (measured, 5 steps) vs 0.500 s predicted (auto-mapper, cpu profile; analytic)"
        in (text.splitlines())
    )
    assert "step time" not in run_summary(history, wall_s=20)  # a placement chosen by hand: no prediction
