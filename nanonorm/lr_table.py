"""
The table of a learning-rate sweep (docs/comparing.md): one row per grid point at its own best rate, picked on
the selection seeds, its mean ± std over the held-out seeds, and the verdict rule (nanonorm/verdict.py) against
the baseline at its best rate and at its second-best, Holm-corrected within each family of claims. Rows are the
run dicts sweep.py's summaries and the committed results files hold; nothing here trains or writes.
"""

from __future__ import annotations

import math
import statistics

from nanonorm.claims import MECHANISM, Claim, Claims
from nanonorm.runs import load_metrics
from nanonorm.selection import MIN_SELECT_SEEDS, edge_of
from nanonorm.verdict import (
    DECISIVE,
    INCONCLUSIVE,
    MIN_RATES,
    MIN_SEEDS,
    against_second_rate,
    correct_family,
    scale_text,
    seeds_needed,
    verdict,
    verdict_text,
)


def trained_to_end(row: dict) -> bool:
    """The run's training counts as complete: it exited with 0 (or recorded no exit code), or its metrics hold
    the evaluation at max_iters whatever exit code run.json records (killed while drawing its final sample,
    or completed by hand with --init_from=resume after a stop)."""
    return row["exit_code"] in (0, None) or bool(row.get("reached_max_iters"))


def crashed(row: dict) -> bool:
    """A run that ended with an error (a crash or a refused config) before it could train or diverge: not a result."""
    return row["diverged_at"] is None and row["exit_code"] != 3 and not trained_to_end(row)


METRICS = ("val_loss", "val_bpb")  # what a sweep can judge on (--metric), the last eval's; lower is better
MECHANISM_HEADERS = dict(zip(MECHANISM, ("attention mass on token 0", "largest / median abs activation",
                                         "excess kurtosis"), strict=True))  # as the mechanism table heads them


def final_loss(row: dict, metric: str = "val_loss") -> float:
    """The run's final val loss (or the `metric` the sweep judges on) for the verdict rule and the choice of rate:
    +inf if it diverged, crashed or ended without a finite value."""
    loss = row.get(metric)
    ok = row["diverged_at"] is None and trained_to_end(row) and loss is not None and math.isfinite(loss)
    return loss if ok else math.inf


def matches(row: dict, point: dict) -> bool:
    """Whether a run (or point) has every value of `point`, compared as text (a summary's 0.001 is "0.001")."""
    return all(str(row.get(k)) == str(v) for k, v in point.items())


def first_seed_runs(rows: list[dict], lr_key: str) -> list[dict]:
    """The runs of one grid point on its first selection seed: the seed that ran the most rates."""
    rates: dict[int, set] = {}
    for r in rows:
        rates.setdefault(r["seed"], set()).add(float(r[lr_key]))
    first = max(rates, key=lambda s: (len(rates[s]), -s), default=None)
    return [r for r in rows if r["seed"] == first]


def initial_loss(row: dict, metric: str = "val_loss") -> float | None:
    """A run's val loss (`metric`) at iteration 0: what a results file records (initial_val_loss, initial_val_bpb),
    or its metrics.jsonl."""
    if f"initial_{metric}" in row:
        return row[f"initial_{metric}"]
    if "out_dir" not in row:
        return None
    return next((r.get(metric) for r in load_metrics(row["out_dir"]) if r.get("kind") == "eval" and r["iter"] == 0),
                None)


def lr_sensitivity(rows: list[dict], lr_key: str, rates: set[float] | None = None,
                   metric: str = "val_loss") -> float | None:
    """Learning-rate sensitivity as Wortsman et al. (2023) define it, from one grid point's first-seed runs:
    the mean over the grid's (log-spaced) rates of min(final loss, initial loss) - the best final loss.
    A diverged or crashed run, or one that ends above where it started, counts at the initial loss (the
    iteration-0 val loss, one init for every rate); 0 means every rate of the grid is as good as the best.
    It depends on the grid, so points are compared over the same `rates` (default: all the point ran).
    None when no rate trained or no run logged a finite initial loss. `metric`: the loss it is measured in."""
    rows = [r for r in rows if rates is None or float(r[lr_key]) in rates]
    initial = next((x for r in rows if (x := initial_loss(r, metric)) is not None and math.isfinite(x)), None)
    finals = [final_loss(r, metric) for r in rows]
    if initial is None or not any(math.isfinite(x) for x in finals):
        return None
    capped = [min(x, initial) for x in finals]
    return statistics.fmean(capped) - min(capped)


def results_by_rate(rows: list[dict], lr_key: str, metric: str = "val_loss") -> dict[float, list[float]]:
    """{rate: final losses (`metric`) of its runs that gave a result}: a crashed run is none (a diverged one is:
    +inf)."""
    out: dict[float, list[float]] = {}
    for r in rows:
        if not crashed(r):
            out.setdefault(float(r[lr_key]), []).append(final_loss(r, metric))
    return out


def cliff_loss(unigram: float | None, metric: str) -> float | None:
    """The unigram loss a cliff is measured against (selection.edge_of), in nats per token: none for a sweep judged
    on another metric (bits per byte), whose losses it cannot be compared with."""
    return unigram if metric == "val_loss" else None


def pick_best(rows: list[dict], lr_key: str, lr_values: list[str] | None = None, unigram: float | None = None,
              metric: str = "val_loss") -> dict:
    """The best rate of one grid point from its selection runs (every rate on each selection seed): the lowest mean
    final val loss (`metric`) over those seeds, a rate with a diverged or crashed run ranking last; the second-best
    likewise (the baseline's is checked too); the diverged and crashed rates, and the edge warning
    (selection.edge_of: the grid's end, or next to a cliff). `lr_values` is unused: the rates are those the runs
    ran."""
    by_rate: dict[str, list[float]] = {}
    for r in rows:
        by_rate.setdefault(r[lr_key], []).append(final_loss(r, metric))
    trained = {lr: statistics.fmean(losses) for lr, losses in by_rate.items() if all(map(math.isfinite, losses))}
    ranked = sorted(trained, key=trained.get)
    best = ranked[0] if ranked else None
    edge = edge_of(results_by_rate(rows, lr_key, metric), float(best), cliff_loss(unigram, metric)) \
        if best is not None else None
    diverged = list(dict.fromkeys(r[lr_key] for r in rows if r["diverged_at"] is not None))
    failed = list(dict.fromkeys(r[lr_key] for r in rows if crashed(r)))
    return {"best_lr": best, "second_lr": ranked[1] if len(ranked) > 1 else None, "diverged_lrs": diverged,
            "crashed_lrs": failed, "edge_warning": edge,
            "lr_sensitivity": lr_sensitivity(first_seed_runs(rows, lr_key), lr_key, metric=metric)}


def point_warnings(edge: str | None, losses: dict[int, float]) -> str | None:
    """The edge warning, and a warning when the best rate (picked on the selection seeds) diverged or crashed on
    a held-out seed: that pick is fragile, and the mean over the seeds that trained flatters it."""
    failed = sorted(int(s) for s, x in losses.items() if not math.isfinite(x))
    fragile = f"diverged or crashed at its best rate on seed {','.join(map(str, failed))}" if failed else None
    return "; ".join(w for w in (edge, fragile) if w) or None


def grid_shortfall(runs: list[dict], lr_key: str, best_lr: str | None, unigram: float | None = None,
                   metric: str = "val_loss") -> str | None:
    """Why one point's rate cannot back a verdict (docs/comparing.md), from its selection runs; None if it can: at
    least MIN_RATES rates with a result, the best inside them (not at the grid's end, not next to a cliff) and
    picked on MIN_SELECT_SEEDS selection seeds. A rate whose run crashed gave no result (a diverged one did), so it
    counts neither as a rate nor as an edge."""
    if best_lr is None:
        return "no rate trained: every rate of the grid diverged or crashed"
    by_rate = results_by_rate(runs, lr_key, metric)
    failed = sorted({float(r[lr_key]) for r in runs if crashed(r)} - set(by_rate))
    why = []
    if len(by_rate) < MIN_RATES:
        crash = f" ({', '.join(f'{x:g}' for x in failed)} crashed: run the sweep again)" if failed else ""
        why.append(f"{len(by_rate)} rate{'s' * (len(by_rate) != 1)} in the grid with a result{crash}; the rule needs "
                   f"{MIN_RATES}")
    elif edge := edge_of(by_rate, float(best_lr), cliff_loss(unigram, metric)):
        why.append(edge)
    picked_on = len({r["seed"] for r in runs if str(r[lr_key]) == str(best_lr)})
    if picked_on < MIN_SELECT_SEEDS:
        why.append(f"rate picked on {picked_on} selection seed{'s' * (picked_on != 1)}; a verdict needs "
                   f"{MIN_SELECT_SEEDS}")
    return "; ".join(why) or None


def lr_verdict(losses: dict, base_losses: dict, claim: str | None, delta: float, shortfalls: list[str | None]) -> dict:
    """The verdict rule on two points' per-seed losses at their rates, over held-out seeds: paired on the seeds both
    share when they share MIN_SEEDS or more (an arm's seeds 1-5 against a baseline's 1-12 are five pairs), Welch's
    test over all of each arm's otherwise; a decisive word becomes "inconclusive at this scale" when either grid
    falls short (a description stays, the shortfall said beside it)."""
    shared = sorted(set(losses) & set(base_losses))
    paired = len(shared) >= MIN_SEEDS
    a, b = (shared, shared) if paired else (sorted(losses), sorted(base_losses))
    v = verdict([losses[s] for s in a], [base_losses[s] for s in b], claim, delta, paired)
    reason = "; ".join(dict.fromkeys(r for r in shortfalls if r))
    if reason:
        downgrade = claim is not None and v["verdict"] in DECISIVE
        v = {**v, "verdict": INCONCLUSIVE if downgrade else v["verdict"],
             "reason": "; ".join(r for r in (v["reason"], reason) if r)}
        if downgrade:
            v["seeds_needed"] = seeds_needed(v)
    return v


def as_claims(claims: Claims | list | None) -> Claims:
    """Claims as nanonorm.claims holds them; a list [(point values, claim, δ), ...] is the command line's ad hoc
    claims (the last whose values a row has wins; {} matches every row)."""
    if isinstance(claims, Claims):
        return claims
    return Claims(tuple(Claim(dict(values), claim, float(delta)) for values, claim, delta in claims or []))


def verdict_columns(v: dict, scale: str | None = None) -> dict:
    """The columns a table prints of one comparison: the verdict (the word at its scale, and why), claim, δ, Δ with
    its 95% interval, mde, n (seeds per arm), p, the word against the baseline's second-best rate, its family, and
    what an inconclusive one would take."""
    if "claim" not in v:  # no verdict: trained at no rate, or another setup
        return {"verdict": v["verdict"]}
    return {"verdict": verdict_text(v, scale), "claim": v["claim"] or "none",
            "delta": v["delta"] if v["claim"] else None, "diff": v["diff"], "ci": v["ci"], "mde": v["mde"],
            "n_seeds": v["n"], "p": v["p"], "p_holm": v.get("p_holm"), "seeds_needed": v["seeds_needed"],
            "diverged_runs": v["diverged"], "verdict_second": v.get("verdict_second"), "family": v.get("family")}


def add_verdicts(tests: list[dict], claims: Claims) -> None:
    """Fill each test of a table ({"row", "v": against the baseline's best rate, "second": against its second-best
    or None, "family", "rates", "scale"}) with its columns: the claims Holm-corrected within each family (its size
    as the claims file writes it), at the baseline's best rate and, apart, at its second-best; a word that differs
    between the two is DEPENDS."""
    families = dict.fromkeys(t["family"] for t in tests if t["family"] is not None)
    for name in families:
        mine = [t for t in tests if t["family"] == name]
        size = claims.family_size(name)
        for key in ("v", "second"):
            tested = [t for t in mine if t[key] is not None and "claim" in t[key]]
            for t, v in zip(tested, correct_family([t[key] for t in tested], name=name, size=size), strict=True):
                t[key] = v
    for t in tests:
        v = t["v"] if t["family"] is None else against_second_rate(t["v"], t["second"], t["rates"])
        t["row"].update(verdict_columns(v, t["scale"]))


def compared(point: dict, base: dict, claim: str | None, delta: float = 0.0, rate: str = "best_lr",
             losses: str = "seed_losses") -> dict:
    """The verdict of one point against the baseline point at its `rate` (best_lr, or second_lr with its held-out
    `losses`), each a row of an lr table (best_lr, seed_losses at it over held-out seeds, grid_shortfall), or
    {"verdict": "no verdict: ..."} for a point that trained at no rate."""
    if point["best_lr"] is None:
        return {"verdict": "no verdict: trained at no rate (every rate diverged or crashed on the selection seeds)"}
    if base["best_lr"] is None:
        return {"verdict": "no verdict: the baseline trained at no rate"}
    return lr_verdict(point["seed_losses"], base[losses], claim, delta,
                      [point["grid_shortfall"], base["grid_shortfall"]])


def comparison(row: dict, base: dict, claim: Claim | None, scale: str | None) -> dict:
    """One test of a table (add_verdicts): the row against the baseline at its best rate, and at its second-best
    where the baseline has held-out runs there."""
    kind, delta = (claim.claim, claim.delta) if claim else (None, 0.0)
    second = compared(row, base, kind, delta, losses="second_seed_losses") if base.get("second_seed_losses") else None
    return {"row": row, "v": compared(row, base, kind, delta), "second": second,
            "family": claim.family if claim and claim.claim else None,
            "rates": (base["best_lr"], base.get("second_lr")), "scale": scale}


def held_out_losses(runs: list[dict], lr_key: str, rate: str | None, select_seeds,
                    metric: str = "val_loss") -> dict[int, float]:
    """{seed: final loss (`metric`)} of the held-out runs at a rate (a selection seed's run never enters a
    verdict)."""
    return {r["seed"]: final_loss(r, metric) for r in runs if rate is not None and str(r[lr_key]) == str(rate)
            and r["seed"] not in select_seeds}


def held_out_mechanism(runs: list[dict], lr_key: str, rate: str | None, select_seeds,
                       metric: str = "val_loss") -> dict[str, dict[int, float]]:
    """{diagnostic: {seed: its mean over the blocks}} of the held-out runs at a rate that trained to a finite `metric`
    (MECHANISM: what a run logged with log_diagnostics at its last evaluation that logged them); a run with a
    non-finite block value gives none, and a diagnostic no run logged is left out."""
    held = [r for r in runs if rate is not None and str(r[lr_key]) == str(rate) and r["seed"] not in select_seeds
            and math.isfinite(final_loss(r, metric))]
    values = {key: {r["seed"]: statistics.fmean(r[key]) for r in held
                    if r.get(key) and all(x is not None and math.isfinite(x) for x in r[key])} for key in MECHANISM}
    return {key: v for key, v in values.items() if v}


def mean_std_text(losses: dict[int, float]) -> str:
    """mean ± std (n=k) of the finite losses, as the tables print it; "-" without any."""
    finite = [x for x in losses.values() if math.isfinite(x)]
    return "-" if not finite else f"{statistics.fmean(finite):.4f}" + (
        f" ± {statistics.stdev(finite):.4f}" if len(finite) > 1 else "") + f" (n={len(finite)})"


def lr_table(rows: list[dict], choice: list[dict], keys: list[str], lr_key: str, baseline: dict | None,
             claims: Claims | list | None = None, select_seeds: list[int] = (), unigram: float | None = None,
             settings: dict | None = None, setup: dict | None = None, metric: str = "val_loss") -> list[dict]:
    """lr_table_tests' table, its verdicts Holm-corrected within each family of its claims (add_verdicts)."""
    table, tests = lr_table_tests(rows, choice, keys, lr_key, baseline, claims, select_seeds, unigram, settings, setup,
                                  metric)
    add_verdicts(tests, as_claims(claims))
    return table


def lr_table_tests(rows: list[dict], choice: list[dict], keys: list[str], lr_key: str, baseline: dict | None,
                   claims: Claims | list | None = None, select_seeds: list[int] = (), unigram: float | None = None,
                   settings: dict | None = None, setup: dict | None = None,
                   metric: str = "val_loss") -> tuple[list[dict], list[dict]]:
    """One row per grid point: best rate, mean ± std (n) of the final val loss (`metric`: val_loss or val_bpb, which
    every rate pick, mean and verdict is then made on) at it over the held-out seeds
    (every seed but `select_seeds`), and, given a baseline point, the verdict rule against it for each row's claim
    (claims.for_row of its values over the sweep's `settings`; lr_verdict: inconclusive when a grid is too short,
    its best on an edge or a cliff (`unigram`: the data's unigram loss), or picked on too few selection seeds),
    at the baseline's best rate and its second-best, each word at its scale (`setup`); the tests are returned
    beside the table for Holm's correction (add_verdicts), here or over several tables of one study. A point that
    trained at no rate says so in place of a verdict."""
    claims = as_claims(claims)

    def runs_of(c: dict) -> list[dict]:
        return [r for r in rows if matches(r, {k: c[k] for k in keys})]

    def point_row(c: dict) -> dict:
        runs = runs_of(c)
        losses = held_out_losses(runs, lr_key, c["best_lr"], select_seeds, metric)
        finite = [x for x in losses.values() if math.isfinite(x)]
        return {**{k: c[k] for k in keys}, "best_lr": c["best_lr"], "val_loss_mean_std": mean_std_text(losses),
                "val_loss_mean": statistics.fmean(finite) if finite else None, "seed_losses": losses,
                "second_lr": c.get("second_lr"),
                "diverged_lrs": ",".join(c["diverged_lrs"]) or None, "crashed_lrs": ",".join(c["crashed_lrs"]) or None,
                "lr_sensitivity": c["lr_sensitivity"], "edge_warning": point_warnings(c["edge_warning"], losses),
                "seed_mechanism": held_out_mechanism(runs, lr_key, c["best_lr"], select_seeds, metric),
                "grid_shortfall": grid_shortfall([r for r in runs if r["seed"] in select_seeds], lr_key, c["best_lr"],
                                                 unigram, metric)}

    table = [point_row(c) for c in choice]
    base = next((row for row, c in zip(table, choice, strict=True) if baseline and matches(c, baseline)), None)
    if base is not None:
        base["is_baseline"] = True
        base["second_seed_losses"] = held_out_losses(runs_of(base), lr_key, base["second_lr"], select_seeds, metric)
        base["second_seed_mechanism"] = held_out_mechanism(runs_of(base), lr_key, base["second_lr"], select_seeds,
                                                           metric)
    others = [row for row in table if base is not None and row is not base]
    tests = [comparison(row, base, claims.for_row({**(settings or {}), **row}),
                        scale_text({**setup, **row}) if setup else None) for row in others]
    tests += [test for row in others for test in mechanism_tests(row, base, claims, settings,
                                                                 scale_text({**setup, **row}) if setup else None)]
    return table, tests


def mechanism_tests(row: dict, base: dict, claims: Claims, settings: dict | None, scale: str | None) -> list[dict]:
    """The tests (add_verdicts) of a row's mechanism claims (claims.for_row of each diagnostic its held-out runs
    logged): its values at its best rate against the baseline's at its best rate and at its second-best, on the
    seeds both share, each verdict filled into row["mechanism_verdicts"][diagnostic]. A claim whose diagnostic the
    baseline did not log is not tested, and its cell says so (its family still counts it)."""
    tests = []
    for key, values in row["seed_mechanism"].items():
        claim = claims.for_row({**(settings or {}), **row}, key)
        if claim is None or claim.claim is None:
            continue
        if key not in base["seed_mechanism"]:
            row.setdefault("mechanism_verdicts", {})[key] = {"verdict": "no verdict: the baseline logged no value"}
            continue
        shortfalls = [row["grid_shortfall"], base["grid_shortfall"]]
        second = base["second_seed_mechanism"].get(key)
        tests.append({"row": row.setdefault("mechanism_verdicts", {}).setdefault(key, {}),
                      "v": lr_verdict(values, base["seed_mechanism"][key], claim.claim, claim.delta, shortfalls),
                      "second": lr_verdict(values, second, claim.claim, claim.delta, shortfalls) if second else None,
                      "family": claim.family, "rates": (base["best_lr"], base.get("second_lr")), "scale": scale})
    return tests


# ----------------------------------------------------------------------------- as the tables print them

COLUMNS = {"train_loss": ("final train loss", "{:.4f}"), "val_loss": ("final val loss", "{:.4f}"),  # (header, format)
           "val_bpb": ("final val bpb", "{:.4f}"),
           "diverged_at": ("diverged", "diverged at iteration {}"), "exit_code": ("exit", "{}"),
           "wall_s": ("wall (s)", "{:.1f}"), "ms_per_iter": ("ms/iter", "{:.1f}"),
           "val_loss_mean_std": ("final val loss (mean ± std)", "{}"),
           "ms_vs_baseline": ("ms/iter vs baseline", "{:.2f}x"), "best_lr": ("best lr", "{}"),
           "diverged_lrs": ("diverged at lr", "{}"), "verdict": ("verdict vs baseline", "{}"),
           "edge_warning": ("warning", "{}"), "label": ("arm", "{}"), "diff": ("Δ vs baseline", "{:+.4f}"),
           "run_minutes": ("run time (min)", "{:.1f}"), "lr_sensitivity": ("lr sensitivity", "{:.3f}"),
           "claim": ("claim", "{}"), "delta": ("δ", "{:g}"), "ci": ("95% interval of Δ", "[{0[0]:+.4f}, {0[1]:+.4f}]"),
           "mde": ("mde (80% power)", "{:.4f}"), "n_seeds": ("n", "{0[0]} vs {0[1]}"),
           "verdict_second": ("vs the baseline's second-best rate", "{}"),
           **{key: (header, "{}") for key, header in MECHANISM_HEADERS.items()}}
VERDICT_COLUMNS = ["claim", "delta", "diff", "ci", "mde", "n_seeds", "verdict"]  # each comparison, as tables print it


def format_table(rows: list[dict], columns: list[str] | None = None, metric: str = "val_loss") -> str:
    """A Markdown table with aligned columns; None and NaN show as "-". The mean ± std column is headed by the
    `metric` it holds."""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    headers = {"val_loss_mean_std": f"final {metric.replace('_', ' ')} (mean ± std)"}

    def cell(key: str, value: object) -> str:
        if value is None or isinstance(value, float) and math.isnan(value):
            return "-"
        default = "{:.4g}" if isinstance(value, float) else "{}"  # extra metrics
        return COLUMNS.get(key, (key, default))[1].format(value)

    table = [[headers.get(c, COLUMNS.get(c, (c,))[0]) for c in columns]] + [[cell(c, row.get(c)) for c in columns]
                                                                             for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["| " + " | ".join(text.ljust(w) for text, w in zip(line, widths, strict=True)) + " |" for line in table]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


def point_columns(table: list[dict], keys: list[str]) -> list[str]:
    """The columns of a sweep's per-point table: the grid values, best rate, mean ± std, the rates that failed,
    sensitivity and, with a baseline, the comparison's (VERDICT_COLUMNS) and the word at the baseline's
    second-best rate."""
    judged = any("verdict" in r for r in table)
    return [*keys, "best_lr", "val_loss_mean_std", "diverged_lrs", "crashed_lrs", "lr_sensitivity",
            *(VERDICT_COLUMNS if judged else []), *(["verdict_second"] if judged else []), "edge_warning"]


def point_table_text(table: list[dict], keys: list[str], setup: dict | None, metric: str = "val_loss") -> str:
    """A sweep's per-point table under a line that states its scale: every word in it was measured there; its mean
    ± std column headed by the `metric` it holds."""
    scale = f"Scale: {scale_text(setup)}.\n\n" if setup else ""
    mechanism = mechanism_table_text(table, keys, setup)
    return scale + format_table(table, point_columns(table, keys), metric) + (f"\n\n{mechanism}" if mechanism else "")


def uniform_head_mass(block_size: int) -> float:
    """The attention mass on token 0 of a head that weighs every earlier key alike, over queries t = 1 .. T - 1:
    the mean of 1 / (t + 1). A sink is a mass well above it."""
    return statistics.fmean(1 / (t + 1) for t in range(1, block_size)) if block_size > 1 else math.nan


def mechanism_cell(values: dict[int, float], base: dict[int, float] | None, judged: dict | None = None) -> str:
    """mean ± std (n) of a diagnostic over the held-out seeds and, against the baseline's, Δ with its 95% interval
    (paired on the seeds both share, as lr_verdict pairs the losses) and the word: a mechanism claim's verdict
    (`judged`: mechanism_tests' columns), else the rule's description, never a verdict word."""
    xs = list(values.values())
    text = f"{statistics.fmean(xs):.4g}" + (f" ± {statistics.stdev(xs):.2g}" if len(xs) > 1 else "") + \
        f" (n={len(xs)})"
    if judged and "claim" not in judged:  # a claim that could not be tested, and why
        return f"{text}; {judged['verdict']}"
    v = judged or (lr_verdict(values, base, None, 0.0, []) if base else None)
    if v is None:
        return text
    interval = "" if v["diff"] is None else f"Δ {v['diff']:+.3g} [{v['ci'][0]:+.3g}, {v['ci'][1]:+.3g}], "
    claim = f"claim {judged['claim']}, δ {judged['delta']:g}: " if judged else ""
    return f"{text}; {interval}{claim}{v['verdict']}"


def mechanism_table_text(table: list[dict], keys: list[str], setup: dict | None) -> str | None:
    """The mechanism diagnostics of a sweep's per-point table (held_out_mechanism: each point at its best rate, the
    last evaluation that logged them, the mean over the blocks), each against the baseline's where the table has
    one; None when no run logged them."""
    logged = [key for key in MECHANISM if any(key in row.get("seed_mechanism", {}) for row in table)]
    if not logged:
        return None
    base = next((row.get("seed_mechanism", {}) for row in table if row.get("is_baseline")), None)
    rows = [{**{k: row[k] for k in keys}, "best_lr": row["best_lr"],
             **{key: mechanism_cell(row["seed_mechanism"][key], None if row.get("is_baseline") or base is None
                                    else base.get(key), row.get("mechanism_verdicts", {}).get(key))
                for key in logged if key in row.get("seed_mechanism", {})}} for row in table]
    references = {"attn_first_token_mass": f"a head that weighs every key alike gives token 0 "
                  f"{uniform_head_mass(setup['block_size']):.4f}" if setup and setup.get("block_size") else None,
                  "stream_excess_kurtosis": "a Gaussian stream's excess kurtosis is 0"}
    said = [text for key, text in references.items() if key in logged and text]
    caption = "; ".join(["the last evaluation that logged it, each the mean over the blocks", *said])
    return (f"Mechanism, at each point's best rate on the held-out seeds ({caption}):\n\n"
            + format_table(rows, [*keys, "best_lr", *logged]))
