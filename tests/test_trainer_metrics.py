"""Metric sinks (console, JSONL with resume truncation, TensorBoard event files), the progress
bar, the end-of-run PNG plot, and the non-finite guard."""

import io
import json
import logging
import math
import struct
import sys
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.trainer import MetricsLogger, NonFiniteError, NonFiniteGuard, plot_metrics, plot_run, read_jsonl
from jaxflow.trainer.metrics import ConsoleBackend, fmt4
from jaxflow.trainer.plot import COLORS, nice_ticks
from jaxflow.trainer.tfevents import crc32c, masked_crc32c, read_events


def _metrics(step):
    return {"critic/score/mean": 0.5 + step / 100, "critic/rewards/mean": 0.25 + step / 200,
            "actor/pg_loss": -0.0123456 * step, "actor/ppo_kl": 1.23456e-4 * step,
            "response_length/mean": 123.456, "timing_s/step": 4.56789, "perf/throughput": 12345.678,
            "actor/entropy": jnp.float32(1.5), "other/not_on_console": np.float64(7.0)}


def test_console_line_four_significant_digits():
    out = io.StringIO()
    console = ConsoleBackend(stream=out)
    console.log({k: float(v) for k, v in _metrics(3).items()}, 3)
    line = out.getvalue().strip()
    assert line == ("step 3 | score 0.53 | reward 0.265 | pg_loss -0.03704 | ppo_kl 0.0003704 | "
                    "entropy 1.5 | resp_len 123.5 | step_s 4.568 | tok/s 12346")
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


def test_tensorboard_event_file_reads_back(tmp_path):
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert masked_crc32c(b"") == ((((0 >> 15) | (0 << 17)) + 0xA282EAD8) & 0xFFFFFFFF)
    with MetricsLogger(tmp_path, backends=("tensorboard",)) as logger:
        for step in (1, 2, 3):
            logger.log(_metrics(step), step)
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    events = read_events(path)
    assert events[0]["file_version"] == "brain.Event:2"
    assert [e["step"] for e in events[1:]] == [1, 2, 3]
    assert events[3]["scalars"]["critic/score/mean"] == np.float32(0.53)
    assert events[2]["scalars"]["perf/throughput"] == np.float32(12345.678)
    assert set(events[1]["scalars"]) == set(_metrics(1))
    assert all(e["wall_time"] > 1e9 for e in events)

    # resumed from the step-2 checkpoint: a new file opens with a SessionLog START at step 3
    # (TensorBoard then drops the old file's steps >= 3)
    with MetricsLogger(tmp_path, backends=("tensorboard",), resume_step=2) as logger:
        logger.log({"a": 1.0}, 3)
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    (new,) = [f for f in files if f != path]
    events = read_events(new)
    assert events[1]["session_log"] == 1 and events[1]["step"] == 3
    assert events[2]["scalars"] == {"a": 1.0} and events[2]["step"] == 3

    data = bytearray(new.read_bytes())
    data[30] ^= 0xFF
    new.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad .*CRC"):
        read_events(new)


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


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_progress_bar_and_console_share_the_stream(tmp_path, monkeypatch, with_tqdm):
    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    out = _Terminal()
    with MetricsLogger(tmp_path, backends=("console",), total_steps=4, resume_step=1, stream=out) as logger:
        assert (logger.progress._tqdm is not None) == with_tqdm
        logger.log(_metrics(2), 2)
        logger.log(_metrics(3), 3)
        assert logger.progress.n == 3
    text = out.getvalue()
    assert "step 2 | score 0.52" in text and "step 3 | score 0.53" in text
    if with_tqdm:
        assert "3/4" in text


def _decode_png(data: bytes):
    """An independent minimal PNG reader: chunks, CRCs, zlib, filters (8-bit RGB only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    i, chunks = 8, []
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", data[i + 8 + n:i + 12 + n])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        i += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)
    img = np.zeros((h, 3 * w), np.int32)
    for y in range(h):  # undo the five PNG filters
        f, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if f == 0:
            img[y] = line
            continue
        prev = img[y - 1] if y else np.zeros(3 * w, np.int32)
        out = np.zeros(3 * w, np.int32)
        for x in range(3 * w):
            a = out[x - 3] if x >= 3 else 0
            b, c = prev[x], (prev[x - 3] if x >= 3 else 0)
            pred = [0, a, b, (a + b) // 2, 0][f]
            if f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            out[x] = (line[x] + pred) & 0xFF
        img[y] = out
    return img.reshape(h, w, 3).astype(np.uint8)


def test_png_plot_of_reward_and_kl(tmp_path):
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        for step in range(1, 41):
            m = _metrics(step)
            m["actor/ppo_kl"] = float("nan") if step == 20 else m["actor/ppo_kl"]
            logger.log(m, step)
    path = plot_run(tmp_path, width=480, panel_height=200)
    assert path == tmp_path / "metrics.png"
    data = path.read_bytes()
    img = _decode_png(data)
    assert img.shape == (400, 480, 3)  # two panels: score+rewards, and KL
    blue, orange = np.array(COLORS[0]), np.array(COLORS[1])
    top, bottom = img[:200], img[200:]
    # both series of the first panel and the KL line in the second are drawn (not just legends)
    assert (top[40:] == blue).all(axis=-1).sum() > 200
    assert (top[40:] == orange).all(axis=-1).sum() > 200
    assert (bottom[40:] == blue).all(axis=-1).sum() > 200 and not (bottom == orange).all(axis=-1).any()
    # text (tick labels, legend) is dark ink on white
    assert (img.sum(axis=-1) < 100).sum() > 500 and (img == 255).all(axis=-1).mean() > 0.5
    try:
        from PIL import Image
    except ImportError:
        pass
    else:
        with Image.open(path) as im:
            np.testing.assert_array_equal(np.asarray(im.convert("RGB")), img)

    # one panel per key, a single point, a constant series, missing keys dropped
    one = plot_metrics([{"step": 5, "k": 2.0}, {"step": 6, "c": 1.0}, {"step": 7, "c": 1.0}],
                       ["k", "c", "absent"], tmp_path / "small.png", width=300, panel_height=150)
    assert _decode_png(one.read_bytes()).shape == (300, 300, 3)
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_metrics([{"step": 1, "a": 1.0}], ["b"], tmp_path / "x.png")


def test_nice_ticks():
    assert nice_ticks(0.05, 0.83, 5) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert nice_ticks(1, 120, 8) == [0, 20, 40, 60, 80, 100, 120]
    assert nice_ticks(3.0, 3.0)[0] <= 3.0 <= nice_ticks(3.0, 3.0)[-1]


def test_guard_refuses_bad_steps_and_stops_after_k(caplog):
    guard = NonFiniteGuard(max_consecutive=3)
    assert guard.check({"actor/pg_loss": 0.1, "timing_s/step": float("nan")}, 1)  # timing not watched
    with caplog.at_level(logging.WARNING, logger="jaxflow.trainer.guard"):
        assert not guard.check({"actor/pg_loss": jnp.float32(jnp.nan), "critic/grad_norm": float("inf"),
                                "critic/vf_loss": 0.2}, 2)
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
