"""
A table's runs packed on one device within a time budget (sweep.py --budget SECONDS, with --jobs N runs at a
time): a call starts runs while its budget lasts, stops the running ones with a save when it ends (they resume
from it), and the same command continues in the next call. This module says how far a budget goes; sweep.py
runs the processes.
"""

from __future__ import annotations

import math
import statistics

BUDGET_EXIT = 4  # the exit code of a call whose budget ran out: the same command continues (as train.py's stop)


def plan_text(phases: dict[str, tuple[int, int | None]], wall_times: list[float], workers: int,
              budget: float | None) -> str:
    """A sweep's plan in a few lines: each phase's runs ({name: (runs, left or None where the earlier phases'
    results decide it)}), and from the wall times of the runs finished so far, the time left at `workers` runs at a
    time and the calls of `budget` seconds it takes."""
    runs = "; ".join(f"{name}: {n} runs" + (f" ({left} left)" if left is not None else "")
                     for name, (n, left) in phases.items())
    left = sum(n if left is None else left for n, left in phases.values())
    lines = [f"plan: {runs}; at most {left} runs left"]
    if not left:
        lines.append("nothing left to run: the same command writes the summary and the results")
        return "\n".join(lines)
    if not wall_times:
        lines.append("time: no run has finished here yet, so the time a run takes is not known: a first call with "
                     "--budget measures it")
        return "\n".join(lines)
    per_run = statistics.median(wall_times)
    seconds = per_run * math.ceil(left / max(1, workers))
    line = (f"time: {per_run:.1f} s a run (the median of the {len(wall_times)} finished here), {workers} at a "
            f"time: about {seconds:.0f} s left")
    if budget:
        line += f", {max(1, math.ceil(seconds / budget))} call{'s' * (seconds > budget)} of --budget {budget:g}"
    lines.append(line)
    return "\n".join(lines)
