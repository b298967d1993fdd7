"""Rule rewards (GSM8K, MATH, registry), user reward functions and the host scorer."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxflow.rewards import (
    RewardFunctionError,
    RewardScorer,
    UnknownDataSourceError,
    default_compute_score,
    get_reward_fn,
    gsm8k,
    known_data_sources,
    load_reward_fn,
    register_reward,
    token_level_scores,
    unregister_reward,
)
from jaxflow.rewards import (
    math as math_reward,
)
from jaxflow.rewards.scorer import ERROR, OK, TIMEOUT
from jaxflow.workers import reward as _rule_scorer  # noqa: F401  (registers the built-in tasks' reward)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- GSM8K

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "response, truth, method, expected",
    [
        (GSM8K_SOLUTION, "72", "strict", 1.0),  # the dataset's own solution format
        (GSM8K_SOLUTION, "73", "strict", 0.0),
        ("The total is 1,234 dollars.\n#### 1,234", "1234", "strict", 1.0),  # commas dropped
        ("#### -3", "-3", "strict", 1.0),
        ("#### 5\nwait, recheck\n#### 72", "72", "strict", 1.0),  # the last #### counts
        ("#### 72\nwait, recheck\n#### 5", "72", "strict", 0.0),
        ("So she sold 72 clips.", "72", "strict", 0.0),  # no #### format: strict fails
        ("First 48, then 24, so 72 in all", "72", "flexible", 1.0),  # last number
        ("48 and 24 make 72 .", "72", "flexible", 1.0),  # a lone "." is skipped
        ("48 and 24 make 71", "72", "flexible", 0.0),
        ("no numbers here", "72", "flexible", 0.0),
    ],
)
def test_gsm8k_extraction_and_score(response, truth, method, expected):
    assert gsm8k.compute_score(response, truth, method=method) == expected


def test_gsm8k_format_score_and_clip():
    # Extracted but wrong earns format_score; nothing extracted earns 0.
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("I don't know", "72", format_score=0.1) == 0.0
    # Only the last 300 characters are searched (verl's clip).
    assert gsm8k.extract_solution("#### 72" + " filler" * 60) is None
    assert gsm8k.extract_solution(" filler" * 60 + "#### 72") == "72"
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_solution("#### 1", method="loose")


# --------------------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    "response, truth",
    [
        ("So $x = \\boxed{\\frac{1}{2}}$.", "\\frac12"),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{\\tfrac34}", "\\frac{3}{4}"),
        ("\\boxed{3/4}", "\\frac{3}{4}"),
        ("\\boxed{10\\text{ cm}}", "10"),
        ("\\boxed{10\\text{cm}}", "10"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
        ("\\boxed{90^\\circ}", "90"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{5.}", "5"),
        ("\\boxed{.5}", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),  # verl's one numeric special case
        ("\\boxed{\\$18.90}", "18.90"),
        ("\\boxed{\\text{(A)}}", "(A)"),
        ("first \\boxed{1}, then finally \\boxed{2}", "2"),
        ("The answer is $\\boxed 7$.", "7"),
        ("\\fbox{7}", "7"),
        ("\\boxed{7}", "\\boxed{7}"),  # a boxed ground truth is unboxed
        ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}"),
    ],
)
def test_math_correct(response, truth):
    assert math_reward.compute_score(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{3}", "4"),
        ("the answer is 4", "4"),  # no box
        ("\\boxed{4", "4"),  # box never closed
        ("first \\boxed{1}, then finally \\boxed{2}", "1"),  # only the last box counts
        ("\\boxed{0.25}", "\\frac{1}{4}"),  # no general numeric equivalence
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        ("\\boxed{(3, \\pi)}", "(3,\\frac{\\pi}{2})"),
        ("\\boxed{}", "0"),
    ],
)
def test_math_incorrect(response, truth):
    assert math_reward.compute_score(response, truth) == 0.0


def test_math_strip_string_normal_forms():
    s = math_reward.strip_string
    assert s("\\frac12") == "\\frac{1}{2}"
    assert s("\\frac1{72}") == "\\frac{1}{72}"
    assert s("\\sqrt3") == "\\sqrt{3}"
    assert s("\\dfrac{a}{b}") == "\\frac{a}{b}"
    assert s(" \\left[ 1, 2 \\right] ") == "[1,2]"
    assert s("k = 7") == "7"
    assert s("\\frac") == "\\frac"  # odd input is kept, never raises
    assert math_reward.last_boxed_only_string("a \\boxed{b{c}} d") == "\\boxed{b{c}}"
    assert math_reward.remove_boxed("\\boxed{b{c}}") == "b{c}"


# --------------------------------------------------------------------------- registry


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{\\frac12}", "\\frac{1}{2}") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{2}", "3") == 0.0
    assert default_compute_score("jaxflow/addition", "357", "357") == 1.0
    for source in ("openai/gsm8k", "lighteval/MATH", "jaxflow/addition", "jaxflow/sort", "jaxflow/reverse"):
        assert source in known_data_sources()


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(UnknownDataSourceError) as info:
        get_reward_fn("my/unknown")
    message = str(info.value)
    assert "'my/unknown'" in message and "openai/gsm8k" in message and "jaxflow/addition" in message
    assert isinstance(info.value, KeyError)


def test_register_reward_decorator():
    try:

        @register_reward("test/len")
        def length_reward(solution_str, ground_truth, extra_info=None):
            return {"score": float(len(solution_str) == int(ground_truth)), "length": len(solution_str)}

        assert get_reward_fn("test/len") is length_reward
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test/len")(lambda s, g, e=None: 0.0)
        replacement = register_reward("test/len", override=True)(lambda s, g, e=None: 0.5)
        assert get_reward_fn("test/len") is replacement
    finally:
        unregister_reward("test/len")
    with pytest.raises(KeyError):
        get_reward_fn("test/len")


# --------------------------------------------------------------------------- user functions

USER_REWARD = textwrap.dedent(
    """
    import os

    CALLS = 0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        if solution_str == "raise":
            raise ValueError("user function exploded")
        if solution_str == "loop":
            while True:
                pass
        if solution_str == "die":
            os._exit(7)
        if solution_str == "dict":
            return {"score": 0.5, "acc": 1.0, "pred": "not numeric"}
        if solution_str == "nan":
            return float("nan")
        if solution_str == "nodict":
            return {"acc": 1.0}
        if solution_str == "str":
            return "1.0"
        return float(solution_str == ground_truth) + bonus

    not_a_function = 3
    """
)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(USER_REWARD)
    return str(path)


def test_load_reward_fn(user_file):
    fn = load_reward_fn(user_file, "compute_score")
    assert fn("s", "1", "1") == 1.0
    assert fn(data_source="s", solution_str="dict", ground_truth="1")["score"] == 0.5


def test_load_reward_fn_errors(user_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_fn(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("import math\nx = 1 / 0\n")
    with pytest.raises(ImportError, match=r"broken\.py.*ZeroDivisionError") as info:
        load_reward_fn(broken)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match=r"syntax\.py.*SyntaxError"):
        load_reward_fn(syntax)
    with pytest.raises(AttributeError, match=r"'score_fn' not found.*compute_score"):
        load_reward_fn(user_file, "score_fn")
    with pytest.raises(TypeError, match="not callable"):
        load_reward_fn(user_file, "not_a_function")
    with pytest.raises(FileNotFoundError):
        RewardScorer(custom_reward_path=str(tmp_path / "nope.py"))


@pytest.fixture(scope="module")
def user_scorer(user_file):
    scorer = RewardScorer(custom_reward_path=user_file, timeout_s=1.0, reward_kwargs={"bonus": 0.25})
    yield scorer
    scorer.close()


def test_user_function_failures_score_zero_and_are_counted(user_scorer, caplog):
    responses = ["1", "2", "raise", "loop", "dict", "die", "nan", "nodict", "str", "1"]
    caplog.set_level(logging.INFO, logger="jaxflow.rewards.scorer")
    start = time.monotonic()
    result = user_scorer.score("my/source", responses, ["1"] * len(responses))
    elapsed = time.monotonic() - start
    np.testing.assert_array_equal(result.scores, np.array([1.25, 0.25, 0, 0, 0.5, 0, 0, 0, 0, 1.25], np.float32))
    assert result.scores.dtype == np.float32
    np.testing.assert_array_equal(result.status, [OK, OK, ERROR, TIMEOUT, OK, ERROR, ERROR, ERROR, ERROR, OK])
    assert result.metrics["reward/num_errors"] == 5
    assert result.metrics["reward/num_timeouts"] == 1
    assert result.metrics["reward/extra/acc/mean"] == 1.0
    assert np.isnan(result.extra["acc"][0]) and result.extra["acc"][4] == 1.0
    assert result.metrics["reward/mean"] == pytest.approx(3.25 / 10)
    # The infinite loop was cut off, not waited for (bound: limit + worker restarts).
    assert elapsed < 1.0 + 15.0
    # Only the first failure of each kind is logged: one console line (WARNING) naming the
    # exception, its traceback at INFO (the run's log file, not the console).
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("failed on sample" in m for m in warnings) == 1
    assert sum("timed out on sample" in m for m in warnings) == 1
    assert "user function exploded" in warnings[0] and all("\n" not in m for m in warnings), warnings
    (traceback,) = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "failed on sample" in r.getMessage()
    ]
    assert "Traceback" in traceback and "user function exploded" in traceback
    # The scorer keeps working afterwards, with the same worker pool.
    again = user_scorer.score("my/source", ["1", "0"], ["1", "1"])
    np.testing.assert_array_equal(again.scores, [1.25, 0.25])


def test_scoring_is_deterministic_across_worker_counts(user_file):
    responses = ["1", "loop", "3", "dict", "raise"] + [str(i % 3) for i in range(40)]
    truths = ["1"] * len(responses)
    results = []
    for workers in (1, 2):
        with RewardScorer(custom_reward_path=user_file, timeout_s=0.5, num_workers=workers) as scorer:
            results.append(scorer.score("s", responses, truths))
    np.testing.assert_array_equal(results[0].scores, results[1].scores)
    np.testing.assert_array_equal(results[0].status, results[1].status)
    assert results[0].metrics == results[1].metrics
    assert results[0].scores[5:].sum() == sum(i % 3 == 1 for i in range(40))


def test_builtin_scorer_dispatches_and_counts_errors(caplog):
    try:

        @register_reward("test/raises")
        def raises(solution_str, ground_truth, extra_info=None):
            raise RuntimeError("builtin failure")

        scorer = RewardScorer()
        result = scorer.score(
            ["openai/gsm8k", "lighteval/MATH", "jaxflow/addition", "jaxflow/reverse", "test/raises", "test/raises"],
            ["#### 72", "\\boxed{\\frac12}", "357", "cba", "x", "y"],
            ["72", "\\frac{1}{2}", "358", "cba", "x", "y"],
            [None, None, {"index": 0}, None, None, None],
        )
        np.testing.assert_array_equal(result.scores, [1, 1, 0, 1, 0, 0])
        assert result.metrics["reward/num_errors"] == 2
        assert result.metrics["reward/source/jaxflow/addition/mean"] == 0.0
        assert result.metrics["reward/source/openai/gsm8k/mean"] == 1.0
        # One warning line for the first failure (its traceback only at INFO, for the log file).
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert sum("builtin failure" in r.getMessage() for r in warnings) == 1
        with pytest.raises(UnknownDataSourceError, match="nowhere/data"):
            scorer.score(["openai/gsm8k", "nowhere/data"], ["a", "b"], ["a", "b"])
        with pytest.raises(ValueError, match="different lengths"):
            scorer.score(["openai/gsm8k"], ["a", "b"], ["a", "b"])
    finally:
        unregister_reward("test/raises")


def test_inline_callable_and_pickling_check():
    scorer = RewardScorer(
        compute_score=lambda data_source, solution_str, ground_truth, extra_info=None: {"score": True, "n": 2},
        isolation="inline",
    )
    result = scorer.score("s", ["a", "b"], ["a", "c"])
    np.testing.assert_array_equal(result.scores, [1.0, 1.0])
    assert result.metrics["reward/extra/n/mean"] == 2.0
    with pytest.raises(TypeError, match="isolation='inline'"):
        RewardScorer(compute_score=lambda **kw: 0.0)


def test_token_level_scores_matches_reference_loop():
    rng = np.random.default_rng(0)
    lengths = np.array([5, 1, 0, 8, 3])
    mask = (np.arange(8)[None, :] < lengths[:, None]).astype(np.int32)
    mask[4, 6] = 1  # a non-contiguous mask: the last valid token is still the one scored
    scores = rng.normal(size=5).astype(np.float32)
    expected = np.zeros((5, 8), np.float32)
    for b in range(5):
        valid = np.nonzero(mask[b])[0]
        if len(valid):
            expected[b, valid[-1]] = scores[b]
    out = token_level_scores(scores, mask)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_allclose(out.sum(1), np.where(mask.any(1), scores, 0))
    with pytest.raises(ValueError, match="response_mask"):
        token_level_scores(scores[:3], mask)


# --------------------------------------------------------------------------- broken reward functions


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_verl_per_dataset_signature_is_refused_when_loading(tmp_path):
    path = _write(
        tmp_path,
        "two_args.py",
        """
        def compute_score(solution_str, ground_truth):
            return float(solution_str == ground_truth)
    """,
    )
    for isolation in ("process", "inline"):
        with pytest.raises(
            RewardFunctionError if isolation == "process" else TypeError,
            match=r"compute_score\(solution_str, ground_truth\) in .*two_args.py cannot be called as "
            r"compute_score\(data_source=\.\.\..*unexpected keyword argument 'data_source'",
        ) as e:
            RewardScorer(custom_reward_path=path, isolation=isolation)
        assert "\n" not in str(e.value)


def _raises_key_error(**kw):
    raise KeyError("answer")


def _exits(**kw):
    import sys

    sys.exit(0)


@pytest.mark.parametrize(
    "fn",
    [lambda **kw: None, lambda **kw: float("nan"), lambda **kw: "1.0", _raises_key_error, _exits],
    ids=["None", "nan", "str", "raises", "sys.exit"],
)
def test_a_function_that_fails_on_every_sample_raises(fn):
    scorer = RewardScorer(compute_score=fn, isolation="inline")
    with pytest.raises(
        RewardFunctionError,
        match=r"failed on every sample of a batch \(3: 3 errors, 0 timeouts\); "
        r"the first: \w+",
    ):
        scorer.score("s", ["a", "b", "c"], ["a", "b", "c"])


def test_a_function_that_fails_on_most_samples_over_several_batches_raises():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str != "ok":
            raise ValueError("cannot parse")
        return 1.0

    scorer = RewardScorer(compute_score=fn, isolation="inline", max_failure_fraction=0.5, failure_window=3)
    batch = ["ok", "x", "y", "z"]  # 3 of 4 fail
    scorer.score("s", batch, ["1"] * 4)
    scorer.score("s", batch, ["1"] * 4)  # a full window is needed before judging
    with pytest.raises(
        RewardFunctionError,
        match=r"failed on 9 of the 12 samples of the last 3 batches, more than "
        r"max_failure_fraction=0.5",
    ):
        scorer.score("s", batch, ["1"] * 4)
    tolerant = RewardScorer(compute_score=fn, isolation="inline", max_failure_fraction=0.8, failure_window=3)
    for _ in range(5):
        tolerant.score("s", batch, ["1"] * 4)


def test_a_file_that_hangs_at_import_is_cut_off(tmp_path):
    path = _write(
        tmp_path,
        "hangs.py",
        """
        import time
        time.sleep(1000)
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0
    """,
    )
    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"hangs.py\) did not finish within 2 s .*load_timeout_s"):
        RewardScorer(custom_reward_path=path, load_timeout_s=2.0)
    assert time.monotonic() - start < 2.0 + 30.0  # the limit plus starting a worker process


def test_a_hanging_function_ends_at_the_batch_deadline_and_logs_the_first_timeout_at_once(tmp_path, caplog):
    path = _write(
        tmp_path,
        "slow.py",
        """
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(1000)
    """,
    )
    caplog.set_level(logging.WARNING, logger="jaxflow.rewards.scorer")
    with RewardScorer(custom_reward_path=path, timeout_s=0.5, batch_timeout_s=2.0) as scorer:
        start = time.monotonic()
        with pytest.raises(RewardFunctionError, match=r"every sample of a batch \(20: 0 errors, 20 timeouts\)"):
            scorer.score("s", ["1"] * 20, ["1"] * 20)
        elapsed = time.monotonic() - start
    first = next(r for r in caplog.records if "timed out on sample 0" in r.getMessage())
    deadline = next(r for r in caplog.records if "batch deadline of 2 s passed" in r.getMessage())
    assert first.created < deadline.created
    # 20 samples x (0.5 s + a worker restart) without the deadline; with it: 2 s plus one restart.
    assert elapsed < 2.0 + 15.0


_DRIVER = textwrap.dedent("""
    import sys
    from jaxflow.rewards import RewardScorer

    scorer = RewardScorer(custom_reward_path=sys.argv[1], timeout_s=600, batch_timeout_s=None)
    scorer.score("s", ["1"], ["1"])  # hangs in the user function
""")


def _children(pid):
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


def _dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return True


def test_workers_die_with_a_sigkilled_driver(tmp_path):
    marker = tmp_path / "called"
    path = _write(
        tmp_path,
        "hang.py",
        f"""
        import pathlib, time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            pathlib.Path({str(marker)!r}).touch()
            time.sleep(1000)
    """,
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, path], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the reward function was never called"
        children = _children(driver.pid)  # the worker and multiprocessing's resource tracker
        assert children
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while not all(_dead(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_dead(p) for p in children), [p for p in children if not _dead(p)]
    finally:
        if driver.poll() is None:
            driver.kill()
