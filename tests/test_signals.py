"""Exit signals and the wall-time guard (cross-rank agreement on a stop: tests/test_dp.py, through
the real trainer on 2 gloo ranks)."""
import os
import signal

from hpcmeg.train.signals import ExitSignal, WallTimeGuard


def test_exit_signal_sets_flag_and_restores():
    before, before_term = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    with ExitSignal() as sig:
        assert not sig.flag and signal.getsignal(signal.SIGUSR2) != before
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first one as the reason
        assert sig.flag and sig.received == signal.SIGUSR2 and sig.count == 2
    assert signal.getsignal(signal.SIGUSR2) == before and signal.getsignal(signal.SIGTERM) == before_term
    # SIGUSR1 (NCCL's) is untouched by default
    assert signal.SIGUSR1 not in ExitSignal().signals


def test_wall_time_guard_margin_grows_with_save_time():
    now = 1_000_000.0
    g = WallTimeGuard(end_time_epoch=now + 100, margin_s=30)
    assert g.remaining_s(now) == 100 and not g.should_stop(now)
    assert g.should_stop(now + 71)
    g.record_step(5)
    g.record_save(40)  # a 40 s save: margin becomes 30 + 1.5*40 + 2*5 = 100 s (two steps may still run)
    assert g.effective_margin_s == 100 and g.should_stop(now + 1) and not g.should_stop(now - 1)
    assert not WallTimeGuard(None, 30).should_stop()
