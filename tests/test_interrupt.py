"""A Ctrl-C that library code swallows still stops the run at the next step boundary."""

import os
import signal

import pytest

from jaxflow.trainer import interrupt


def test_a_swallowed_ctrl_c_is_raised_again_at_the_next_check():
    previous = signal.getsignal(signal.SIGINT)
    try:
        interrupt.install()
        interrupt.check()  # nothing yet
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes: give it some
                pass
        except BaseException:  # noqa: BLE001 - what careless library code does
            pass
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        interrupt.install()  # a new run starts without the old request
        interrupt.check()
    finally:
        signal.signal(signal.SIGINT, previous)
