"""CpuPace (scheduling/disk_tier.py) on injected clocks: while busy, a thread's CPU time stays within its
share of the wall-clock time; idle, it never sleeps."""

from scheduling.disk_tier import CpuPace


class Clocks:
    def __init__(self):
        self.cpu = self.wall = 0.0
        self.slept: list[float] = []

    def work(self, seconds: float) -> None:
        self.cpu += seconds
        self.wall += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += seconds


def test_while_busy_the_cpu_time_stays_within_its_share():
    c, busy = Clocks(), [True]
    pace = CpuPace(0.05, lambda: busy[0], cpu=lambda: c.cpu, wall=lambda: c.wall, sleep=c.sleep)
    for _ in range(20):
        c.work(0.002)
        pace.pace()
        assert c.cpu <= 0.05 * c.wall + 1e-12
    assert abs(c.cpu - 0.05 * c.wall) < 1e-9  # and no more sleep than that takes
    c.wall += 1.0  # waiting for work, then restarted: the wait is no credit
    pace.restart()
    c.work(0.002)
    pace.pace()
    assert abs(c.slept[-1] - (0.002 / 0.05 - 0.002)) < 1e-9


def test_an_idle_engine_is_never_waited_for():
    c = Clocks()
    pace = CpuPace(0.05, lambda: False, cpu=lambda: c.cpu, wall=lambda: c.wall, sleep=c.sleep)
    for _ in range(20):
        c.work(0.01)
        pace.pace()
    assert c.slept == []
