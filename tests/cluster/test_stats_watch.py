"""`numaserve stats --watch`: the table rendered from a recorded stats dict, and its flags' bad input."""

import pytest
from rich.console import Console

from numaserve.cli import main
from numaserve.stats_watch import stats_table

WORKER = {"alive": True, "num_running": 3, "num_waiting": 1, "kv_usage": 0.25, "prefix_hit_rate": 0.5,
          "num_generated_tokens": 120, "spec_method": "ngram", "spec_num_draft_tokens": 40,
          "spec_num_accepted_tokens": 10, "num_adapters_loaded": 1, "lora_slots_held": ["tests"],
          "info": {"numa_node": 1, "cpu_ids": [4, 5, 6, 9]}}


def render(table) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def test_the_table_shows_each_workers_figures_and_tokens_per_second_between_refreshes():
    before = {"workers": {"w0": WORKER | {"num_generated_tokens": 100}, "w1": {"alive": False}}}
    now = {"workers": {"w0": WORKER, "w1": {"alive": False}}, "routed": {"w0": 7}}
    text = render(stats_table(now, before, elapsed_s=2.0))
    row = next(line for line in text.splitlines() if "w0" in line).split("│")
    cells = [c.strip() for c in row if c.strip()]
    assert cells == ["w0", "1", "4-6,9", "3 / 1", "10.0", "25%", "50%", "25%", "1 (tests)"]
    assert "down" in next(line for line in text.splitlines() if "w1" in line)
    assert "7 requests routed" in text


@pytest.mark.parametrize("args, message", [
    (["--watch", "--count", "0"], "give --count a whole number of refreshes above 0"),
    (["--watch", "--interval", "-1"], "give --interval seconds above 0"),
    (["--watch", "--interval", "soon"], "give --interval seconds above 0"),
    (["--count", "2"], "add --watch"),
])
def test_bad_watch_flags_exit_2_naming_the_fix(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["stats", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
