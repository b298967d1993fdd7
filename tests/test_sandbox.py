"""The code reward's sandbox (`jaxflow.rewards.sandbox`): scores against hand-counted passes,
and code that loops forever, allocates without bound, forks repeatedly, writes outside its
directory or opens a socket scores 0 and leaves nothing behind (no process, no file)."""

import json
import os
import socket
import textwrap

import pytest

from jaxflow.rewards import sandbox
from jaxflow.rewards.sandbox import SandboxLimits, SandboxUnavailable, parse_tests, run_python, score_code

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]  # the third fails any adder
FAST = SandboxLimits(cpu_s=2, wall_s=6.0, memory_bytes=256 << 20, processes=8)


def _fenced(code: str) -> str:
    return f"Here it is:\n```python\n{textwrap.dedent(code)}```\nDone."


def _processes_of(uid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    out.append(int(pid))
            except OSError:
                continue
    return out


def _sandbox_uid() -> int:
    return sandbox.NOBODY if os.geteuid() == 0 else os.geteuid()


def test_the_machine_isolates_runs():
    """The sandbox's namespaces work here (CI runs everything below isolated): the program is
    PID 1 of its namespace without capabilities, in a tmpfs ``/tmp``, with no network."""
    assert sandbox.isolation_available(), sandbox._probed()[1]
    probe = (
        "import os\nprint(os.getpid(), os.getcwd(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
    )
    r = run_python(probe, FAST)
    assert r.returncode == 0 and r.isolated, r.stderr
    assert r.stdout.split() == ["1", "/tmp", "0000000000000000"]


def test_scores_are_the_fraction_of_tests_passed():
    right = _fenced("def add(a, b):\n    return a + b\n")
    assert score_code(right, TESTS, limits=FAST)["score"] == pytest.approx(2 / 3)
    assert score_code(right, TESTS[:2], limits=FAST)["score"] == 1.0
    constant = _fenced("def add(a, b):\n    return 3\n")  # passes the first test alone
    assert score_code(constant, TESTS, limits=FAST)["score"] == pytest.approx(1 / 3)
    assert score_code("no code at all", TESTS, limits=FAST)["score"] == 0.0  # the text is not Python
    # The solution cannot fake a pass by printing: the harness's token is new in every run.
    faker = _fenced("for i in range(3):\n    print('passed', i)\ndef add(a, b):\n    return None\n")
    assert score_code(faker, TESTS, limits=FAST)["score"] == 0.0
    # Ground truths as verl's code datasets hold them.
    assert parse_tests('{"tests": ["assert 1", "assert 2"]}') == ["assert 1", "assert 2"]
    assert parse_tests({"test_list": ["assert 1"]}) == ["assert 1"]
    assert parse_tests("assert 1\n\nassert 2\n") == ["assert 1", "assert 2"]
    with pytest.raises(ValueError, match="non-empty list of test statements"):
        parse_tests([])


BAD = {
    "loops forever": "while True:\n    pass\n",
    "allocates without bound": "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n",
    "forks repeatedly": "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_runaway_code_scores_zero_and_leaves_no_process(name):
    before = set(_processes_of(_sandbox_uid()))
    code = BAD[name] + "def add(a, b):\n    return a + b\n"
    out = score_code(_fenced(code), TESTS[:2], limits=FAST)
    assert out["score"] == 0.0, out
    assert not set(_processes_of(_sandbox_uid())) - before


def test_writes_outside_its_directory_fail_and_leave_no_file(tmp_path):
    """A world-writable directory of the host and the home directory: the code's writes there
    fail (so does the solution), and nothing appears on the host; what it writes in its own
    /tmp vanishes with the run."""
    target = tmp_path / "open"
    target.mkdir()
    os.chmod(target, 0o777)
    marker = f"jaxflow_sandbox_escape_{os.getpid()}"
    for path in (str(target / "escaped"), os.path.join(os.path.expanduser("~"), marker)):
        code = f"open({path!r}, 'w').write('x')\ndef add(a, b):\n    return a + b\n"
        assert score_code(_fenced(code), TESTS[:2], limits=FAST)["score"] == 0.0
        assert not os.path.exists(path)
    inside = f"open('/tmp/{marker}', 'w').write('x')\ndef add(a, b):\n    return a + b\n"
    assert score_code(_fenced(inside), TESTS[:2], limits=FAST)["score"] == 1.0  # its own scratch space
    assert not os.path.exists(f"/tmp/{marker}")


def test_a_socket_reaches_nothing():
    """A server listening on the host's loopback: the sandboxed code cannot connect (its
    network namespace has no route), so it fails, and the server never sees a connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n"
        code += "def add(a, b):\n    return a + b\n"
        assert score_code(_fenced(code), TESTS[:2], limits=FAST)["score"] == 0.0
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_a_machine_without_isolation_refuses_untrusted_code(monkeypatch):
    monkeypatch.setattr(sandbox, "_PROBED", [(None, "user namespaces are not available (test)")])
    with pytest.raises(SandboxUnavailable, match="user namespaces are not available"):
        score_code(_fenced("def add(a, b):\n    return a + b\n"), TESTS, limits=FAST)
    # The opt-out keeps the limits and the timeout (trusted code only).
    r = run_python("print(6 * 7)", FAST, isolated=False)
    assert (r.returncode, r.stdout.strip(), r.isolated) == (0, "42", False)


def test_a_batch_scores_in_parallel_as_one_by_one():
    right = _fenced("def add(a, b):\n    return a + b\n")
    wrong = _fenced("def add(a, b):\n    return a * b\n")
    samples = [(right, TESTS), (wrong, TESTS), (right, TESTS[:1]), (wrong, TESTS[1:])]
    batch = sandbox.score_code_batch(samples, limits=FAST, workers=2)
    assert [b["score"] for b in batch] == [score_code(s, t, limits=FAST)["score"] for s, t in samples]


def test_the_code_reward_is_registered_for_its_data_source():
    from jaxflow.rewards import default_compute_score

    right = _fenced("def add(a, b):\n    return a + b\n")
    out = default_compute_score(sandbox.CODE_DATA_SOURCE, right, json.dumps({"tests": TESTS}))
    assert out["score"] == pytest.approx(2 / 3) and out["tests"] == 3.0


def test_the_scorer_runs_code_samples_in_parallel_sandboxes_and_the_opt_out(monkeypatch):
    """`RewardScorer` scores a batch's ``jaxflow/code`` samples (isolated, several at a time)
    as `score_code` does one by one, beside another data source's; where the machine cannot
    isolate, it refuses the batch in one line naming the key that opts out, and with
    ``sandbox="off"`` it scores the same without isolation."""
    from jaxflow.rewards import RewardScorer, default_compute_score

    right = _fenced("def add(a, b):\n    return a + b\n")
    wrong = _fenced("def add(a, b):\n    return a * b\n")
    code = sandbox.CODE_DATA_SOURCE
    sources = [code, code, "openai/gsm8k", code]
    solutions = [right, wrong, "so #### 5", right]
    truths = [json.dumps({"tests": TESTS}), json.dumps({"tests": TESTS}), "5", json.dumps({"tests": TESTS[:2]})]
    # a * b passes none of the three; the GSM8K sample is scored by its own function
    want = [2 / 3, 0.0, default_compute_score("openai/gsm8k", "so #### 5", "5"), 1.0]
    assert want[2] == 1.0
    scorer = RewardScorer(sandbox_workers=3)
    assert list(scorer.score(sources, solutions, truths).scores) == pytest.approx(want)
    monkeypatch.setattr(sandbox, "_PROBED", [(None, "user namespaces are not available (test)")])
    with pytest.raises(SandboxUnavailable, match="jaxflow.reward.sandbox=off"):
        scorer.score(sources, solutions, truths)
    assert list(RewardScorer(sandbox="off").score(sources, solutions, truths).scores) == pytest.approx(want)
    with pytest.raises(ValueError, match="sandbox must be one of"):
        RewardScorer(sandbox="maybe")


def test_the_code_task_demonstrations_pass_their_hidden_tests():
    """The built-in code task (`jaxflow.data.tasks.CodeTask`): every demonstration passes all
    five of its hidden tests in the sandbox; another function passes fewer."""
    from jaxflow.data.tasks import get_task

    rows = get_task("code").make_sft_examples(6)
    for row in rows:
        tests = row["reward_model"]["ground_truth"]
        assert score_code(row["response"], tests, limits=FAST)["score"] == 1.0
        assert score_code("def f(x):\n    return x", tests, limits=FAST)["score"] < 1.0


def test_the_code_task_runs_through_the_trainer_in_the_sandbox(tmp_path):
    """Two GRPO steps of ``grpo_code_tiny`` (a random policy): every sample is run against its
    five hidden tests in the sandbox and the outcomes reach the step's metrics."""
    from tests.test_placement_invariance import SMALL, run_steps

    for m in run_steps("grpo_code_tiny", SMALL, 2, tmp_path):
        assert m["reward/extra/tests/mean"] == 5.0 and m["reward/num_errors"] == 0
        assert m["reward/extra/crashed/mean"] + m["reward/extra/passed/mean"] > 0  # each sample ran
        assert m["reward/source/jaxflow/code/mean"] == m["critic/score/mean"]
