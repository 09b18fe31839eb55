"""python -m benchmarks.simulate: `numaserve simulate` from a source checkout (numaserve/simulate/command.py):
one simulated run, its figures as JSON (stdout, and --json OUT)."""

import argparse

from numaserve.simulate.command import add_arguments, config_from, run


def parse_config(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__)
    add_arguments(p)
    a = p.parse_args(argv)
    return config_from(a), a.json


def main(argv: list[str] | None = None) -> None:
    run(*parse_config(argv))


if __name__ == "__main__":
    main()
