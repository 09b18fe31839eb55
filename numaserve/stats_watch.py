"""`numaserve stats --watch`: a deployment's workers as a terminal table (rich), refreshed in place.

One row per worker from `client.stats()`: NUMA node, cores, running / waiting, tokens/s (generated tokens
since the previous refresh over the seconds between them), KV use, prefix hit rate, speculation acceptance
(accepted of drafted tokens), adapters held (loaded, and the names in LoRA slots).
"""

import time
from collections.abc import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table

COLUMNS = ("worker", "NUMA node", "cores", "running / waiting", "tokens/s", "KV use", "prefix hits",
           "spec accept", "adapters")


def _cores(cpu_ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpu_ids):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def worker_row(worker_id: str, w: dict, previous: dict | None, elapsed_s: float) -> list[str]:
    """One worker's cells; previous: its stats at the last refresh (None: the first), elapsed_s after it."""
    if "num_running" not in w:
        return [worker_id, "-", "-", w.get("error", "down" if not w.get("alive", True) else "no answer"),
                *["-"] * (len(COLUMNS) - 4)]
    info = w.get("info", {})
    rate = "-"
    if previous is not None and "num_generated_tokens" in previous and elapsed_s > 0:
        rate = f"{(w['num_generated_tokens'] - previous['num_generated_tokens']) / elapsed_s:.1f}"
    drafted = w.get("spec_num_draft_tokens", 0)
    accept = ("off" if w.get("spec_method", "off") == "off"
              else f"{w['spec_num_accepted_tokens'] / drafted:.0%}" if drafted else "-")
    held = w.get("lora_slots_held", [])
    adapters = f"{w.get('num_adapters_loaded', 0)}" + (f" ({', '.join(held)})" if held else "")
    return [worker_id, str(info.get("numa_node", "-")), _cores(info.get("cpu_ids", [])),
            f"{w['num_running']} / {w['num_waiting']}", rate, f"{w['kv_usage']:.0%}",
            f"{w['prefix_hit_rate']:.0%}", accept, adapters]


def stats_table(stats: dict, previous: dict | None = None, elapsed_s: float = 0.0) -> Table:
    """The table of one refresh; previous: the stats of the refresh before (for tokens/s)."""
    table = Table(title=f"numaserve: {len(stats['workers'])} workers, "
                        f"{sum(stats.get('routed', {}).values())} requests routed")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("worker", "cores", "adapters") else "right")
    before = (previous or {}).get("workers", {})
    for worker_id, w in sorted(stats["workers"].items()):
        table.add_row(*worker_row(worker_id, w, before.get(worker_id), elapsed_s))
    return table


def watch(get_stats: Callable[[], dict], interval_s: float, count: int | None,
          console: Console | None = None) -> None:
    """Refresh the table every interval_s, count times (None: until interrupted)."""
    stats, at = get_stats(), time.monotonic()
    with Live(stats_table(stats), console=console, auto_refresh=False) as live:
        num_shown = 1
        while count is None or num_shown < count:
            time.sleep(interval_s)  # the refresh period itself, not a wait for a condition
            previous, before = stats, at
            stats, at = get_stats(), time.monotonic()
            live.update(stats_table(stats, previous, at - before), refresh=True)
            num_shown += 1
