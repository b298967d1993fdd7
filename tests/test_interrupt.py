"""A Ctrl-C (or SIGTERM) that library code swallows still stops the run at the next step
boundary, and a SIGTERM is told apart (exit 143, not 130)."""

import os
import signal

import pytest

from jaxflow.trainer import interrupt


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_signal_is_raised_again_at_the_next_check(signum):
    previous = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    try:
        interrupt.install()
        interrupt.check()  # nothing yet
        try:
            os.kill(os.getpid(), signum)
            for _ in range(1000):  # the handler runs between bytecodes: give it some
                pass
        except BaseException:  # noqa: BLE001 - what careless library code does
            pass
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        assert interrupt.terminated() == (signum == signal.SIGTERM)
        interrupt.install()  # a new run starts without the old request
        interrupt.check()
        assert not interrupt.terminated()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
