"""python -m benchmarks.simulate: `numaserve simulate` from a source checkout (numaserve/simulate/command.py):
one simulated run, its figures as JSON (stdout, and --json OUT)."""

import argparse

from numaserve.simulate.command import add_arguments
from numaserve.simulate.command import main as simulate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__)
    add_arguments(p)
    simulate(p.parse_args(argv))


if __name__ == "__main__":
    main()
