"""
How each arm's learning rate is chosen before its verdict (docs/comparing.md): on at least three selection seeds
(their mean), refined by the two rates at ×√3 around the coarse grid's pick, never at a grid's end or next to a
cliff (a rate that diverged or ended near the unigram loss); and which seeds may enter a verdict: none that
selected a rate in the same results folder, by this sweep or an earlier one (kept in out_root/selection_seeds.json).
"""

from __future__ import annotations

import json
import math
import os

from nanonorm.run_files import write_atomically

MIN_SELECT_SEEDS = 3  # selection seeds per arm before a decisive word: one seed's pick moved a baseline 0.17 nats
REFINE_STEP = math.sqrt(3)  # the refinement's rates: the pick times and divided by √3 (half a ×3 grid's step)
CLIFF_NATS = 0.05  # a rate whose loss ends this close to the unigram loss (or above it) learned no context
SELECTION_RECORD = "selection_seeds.json"


class HeldOutError(ValueError):
    """A held-out seed that selected a rate in the same results folder: exit 2 with its message."""


def recorded_selection_seeds(out_root: str) -> set[int]:
    """Every seed that selected a rate in out_root, by any sweep there (selection_seeds.json; none without it)."""
    path = os.path.join(out_root, SELECTION_RECORD)
    if not os.path.exists(path):
        return set()
    try:
        with open(path) as f:
            seeds = json.load(f)["seeds"]
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise HeldOutError(f"{path} cannot be read as the list of this folder's selection seeds; restore it (it "
                           "keeps seeds that picked rates out of verdicts), or use another --out_root") from None
    return set(seeds)


def check_held_out(out_root: str, held_out: list[int]) -> None:
    """Refuse held-out seeds that selected a rate in out_root before: their run at the rate they picked would
    enter a verdict as a held-out seed (the winner's curse), and a run at a rate is one folder for both."""
    if used := sorted(recorded_selection_seeds(out_root) & set(held_out)):
        seeds = ",".join(map(str, used))
        raise HeldOutError(f"seed {seeds} selected a rate in {out_root} before (kept in {SELECTION_RECORD}) and cannot "
                           "be a held-out seed there: its run at the rate it picked would enter the verdict; give "
                           "--seeds without it, or another --out_root")


def record_selection_seeds(out_root: str, seeds: list[int]) -> None:
    """Add seeds to out_root's record of selection seeds, before they train: a sweep stopped early keeps them."""
    known = recorded_selection_seeds(out_root)
    if set(seeds) <= known:
        return
    os.makedirs(out_root, exist_ok=True)
    write_atomically(os.path.join(out_root, SELECTION_RECORD),
                     json.dumps({"seeds": sorted(known | set(seeds))}).encode())


def default_select_seeds(held_out: list[int], out_root: str | None = None) -> list[int]:
    """MIN_SELECT_SEEDS selection seeds when none are given: the folder's earlier selection seeds first (their runs
    are there), then the smallest whole numbers that are not held out (0, 6, 7 beside --seeds 1,2,3,4,5)."""
    earlier = sorted(recorded_selection_seeds(out_root) - set(held_out)) if out_root else []
    fresh = (s for s in range(10**9) if s not in held_out and s not in earlier)
    return (earlier + [next(fresh) for _ in range(MIN_SELECT_SEEDS)])[:max(MIN_SELECT_SEEDS, len(earlier))]


def rate_text(x: float) -> str:
    """A refined rate as a flag value and folder name: three significant digits (0.00173)."""
    return f"{x:.3g}"


def refined_rates(pick: str, grid: list[str]) -> list[str]:
    """The two rates at ×√3 around a coarse pick, unless it lies at the grid's end (that grid is extended, not
    refined) or they are in it already; [] for a single-rate grid."""
    rates = sorted(float(r) for r in grid)
    if float(pick) in (rates[0], rates[-1]):
        return []
    return [r for r in (rate_text(float(pick) / REFINE_STEP), rate_text(float(pick) * REFINE_STEP))
            if float(r) not in rates]


def failed(losses: list[float], unigram: float | None) -> bool:
    """A rate's selection runs show it past a cliff: one diverged (or crashed), or one ended within CLIFF_NATS of
    the unigram loss (a model that learned no context) or above it."""
    return any(not math.isfinite(x) or (unigram is not None and x >= unigram - CLIFF_NATS) for x in losses)


def edge_of(by_rate: dict[float, list[float]], best: float, unigram: float | None = None) -> str | None:
    """Why the best rate is an edge of its grid (`by_rate`: each rate with a result, its selection runs' final
    losses): one rate only, the lowest or highest rate, or next to a cliff (a neighbour that failed); None if it
    lies inside, between two rates that trained."""
    rates = sorted(by_rate)
    if len(rates) == 1:
        return "the grid has one rate, its own edge: give --lr_grid at least five"
    i = rates.index(best)
    if i in (0, len(rates) - 1):
        return f"best at the {'lowest' if i == 0 else 'highest'} rate, the grid's edge: extend --lr_grid beyond it"
    cliff = [r for r in (rates[i - 1], rates[i + 1]) if failed(by_rate[r], unigram)]
    if cliff:
        return (f"best next to a cliff ({', '.join(f'{r:g}' for r in cliff)} diverged or ended near the unigram "
                "loss), an edge: the last rate that trains; rates between them tell where the best lies")
    return None


UNIGRAM_TOKENS = 2**27  # train tokens the unigram frequencies are counted over (all of a small corpus)


def unigram_loss(data_dir: str, dataset: str) -> float | None:
    """Val cross-entropy (nats per token) of the train split's token frequencies (over its first UNIGRAM_TOKENS),
    add-one smoothed: the loss of a model that ignores the context. None if the dataset is not prepared there.
    Counted in chunks, so that a corpus of billions of tokens is read, not held in memory."""
    import numpy as np

    import prepare_data

    folder = os.path.join(data_dir, dataset)
    try:
        meta = prepare_data.load_meta(folder)
    except (OSError, ValueError):
        return None

    def counts(split: str, limit: int | None = None) -> np.ndarray:
        tokens = np.memmap(os.path.join(folder, f"{split}.bin"), dtype=meta["dtype"], mode="r")[:limit]
        total = np.zeros(meta["vocab_size"], dtype=np.int64)
        for start in range(0, len(tokens), 2**24):
            total += np.bincount(tokens[start:start + 2**24], minlength=meta["vocab_size"])[:meta["vocab_size"]]
        return total

    train, val = counts("train", UNIGRAM_TOKENS), counts("val")
    p = (train + 1) / (train.sum() + len(train))
    return float(-(val * np.log(p)).sum() / val.sum())
