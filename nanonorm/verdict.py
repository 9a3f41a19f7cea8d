"""
The comparison rule (rule v2): what the per-seed final losses of two arms say about a paper's claim, and Holm's
correction within a family of claims. sweep.py and plot.py apply it to learning-rate sweeps; docs/comparing.md
states it in words.
"""

from __future__ import annotations

import math
import statistics
import warnings

from scipy import stats

ALPHA = 0.05  # two-sided level of every test; the intervals cover 1 - ALPHA = 95%
POWER = 0.8  # the power at which the minimal detectable effect (mde) is detected
MIN_SEEDS = 5  # held-out seeds per arm before a decisive word (README, Comparing runs)
MIN_RATES = 5  # distinct rates of an --lr_grid before its table gives one (README, Comparing runs)
MAX_SEEDS = 10**6  # seeds_needed beyond this is reported as None
INCONCLUSIVE = "inconclusive at this scale"
CLAIMS = ("lower", "higher", "on_par", None)
DECISIVE = ("reproduced", "smaller than claimed", "contradicted", "lower", "higher")  # words a test has to back


def compare_arms(a: list[float], b: list[float], paired: bool = False) -> dict:
    """mean(a) - mean(b) (`diff`) with its standard error, degrees of freedom, 95% interval (`ci`), two-sided p of
    no difference, minimal detectable effect (`mde`) and the spread it came from (`sd`), from finite values, two
    or more per arm. Welch's t-test (unequal variances, Welch–Satterthwaite df); paired: the t-test of the
    per-seed differences a[i] - b[i] (both lists in the same seed order), `sd` then theirs."""
    rounding = 1e-12 * max(map(abs, [*a, *b]))  # a spread this small is the float rounding of equal values

    def spread(xs: list[float]) -> float:
        return statistics.stdev(xs) if statistics.stdev(xs) > rounding else 0.0

    if paired:
        d = [x - y for x, y in zip(a, b, strict=True)]
        diff, sd = statistics.fmean(d), spread(d)
        se, df = sd / math.sqrt(len(d)), len(d) - 1
    else:
        sd = spread(a), spread(b)
        va, vb = sd[0] ** 2 / len(a), sd[1] ** 2 / len(b)
        diff, se = statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else len(a) + len(b) - 2
    with warnings.catch_warnings():  # scipy's warning of precision loss in an arm without spread, 0 here
        warnings.simplefilter("ignore", RuntimeWarning)
        test = stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b, equal_var=False)
    p = float(test.pvalue) if se > 0 else float(diff == 0)  # no spread at all: any difference is certain
    half = float(stats.t.ppf(1 - ALPHA / 2, df)) * se
    return {"diff": diff, "se": se, "df": df, "ci": (diff - half, diff + half), "p": p, "mde": mde(se, df), "sd": sd}


def mde(se: float, df: float, power: float = POWER) -> float:
    """The smallest true difference a two-sided t-test at ALPHA detects with probability `power`, for a
    difference with standard error se on df degrees of freedom: (t_{1-α/2} + t_power) se."""
    return float(stats.t.ppf(1 - ALPHA / 2, df) + stats.t.ppf(power, df)) * se


def seeds_for(effect: float, sd: float | tuple[float, float], paired: bool, power: float = POWER) -> int | None:
    """Seeds per arm (at least MIN_SEEDS) whose mde reaches `effect`, at the spread `sd` (of the per-seed
    differences if paired, else of each arm); None for no effect or beyond MAX_SEEDS."""
    if not effect > 0:
        return None
    va, vb = (sd**2, 0.0) if paired else (sd[0] ** 2, sd[1] ** 2)
    if va + vb == 0:
        return MIN_SEEDS

    def reach(n: int) -> float:
        df = n - 1 if paired or not (va and vb) else (va + vb) ** 2 / ((va**2 + vb**2) / (n - 1))
        return mde(math.sqrt((va + vb) / n), df, power)

    z = float(stats.norm.ppf(1 - ALPHA / 2) + stats.norm.ppf(power))  # the normal approximation: a lower bound
    n = max(2, math.floor((z / effect) ** 2 * (va + vb)))
    while n <= MAX_SEEDS and reach(n) > effect:
        n += 1
    return max(n, MIN_SEEDS) if n <= MAX_SEEDS else None


def seeds_for_divergence(n: tuple[int, int], k: tuple[int, int]) -> int | None:
    """Seeds per arm (at least MIN_SEEDS) at which Fisher's exact test tells the observed divergence rates
    apart at ALPHA, were they to hold; None if they are equal or it takes more than 1000."""
    rates = (k[0] / n[0], k[1] / n[1])
    for m in range(MIN_SEEDS, 1001):
        ka, kb = (round(r * m) for r in rates)
        if ka != kb and stats.fisher_exact([[ka, m - ka], [kb, m - kb]]).pvalue < ALPHA:
            return m
    return None


def interval_word(lo: float, hi: float, claim: str | None, delta: float) -> tuple[str, list[float], str | None]:
    """The word for an interval [lo, hi] of mean(a) - mean(b), the values of the difference it excludes to say
    so (the nulls its p-value tests) and why, where the word needs saying why."""
    if claim is None:
        return ("higher" if lo > 0 else "lower" if hi < 0 else "not distinguishable"), [0.0], None
    if claim == "on_par":
        if -delta < lo and hi < delta:
            return "reproduced", [delta, -delta], f"the interval lies inside ±{delta:g}"
        if lo > delta or hi < -delta:
            return "contradicted", [delta if lo > delta else -delta], f"the interval lies outside ±{delta:g}"
        return INCONCLUSIVE, [delta, -delta], f"the interval reaches past ±{delta:g}"
    s = -1.0 if claim == "lower" else 1.0  # the claimed sign of mean(a) - mean(b)
    low, high = sorted((s * lo, s * hi))  # the interval of the claimed effect
    if low > 0 and high < delta:
        return "smaller than claimed", [0.0, s * delta], f"the interval lies below δ = {delta:g}"
    if low > 0:
        return "reproduced", [0.0], None
    if high < 0:
        return "contradicted", [0.0], "the interval lies on the other side of 0"
    if high < delta:
        return "contradicted", [s * delta], f"the interval contains 0 and lies below δ = {delta:g}"
    return INCONCLUSIVE, [0.0], "the interval contains 0" + (f" and reaches δ = {delta:g}" if delta else "")


def p_at(v: dict, null: float) -> float:
    """Two-sided p of the t-test of mean(a) - mean(b) = null: below ALPHA exactly where the interval excludes null."""
    if v["se"] == 0:
        return float(v["diff"] == null)
    return float(2 * stats.t.sf(abs(v["diff"] - null) / v["se"], v["df"]))


def verdict(a: list[float], b: list[float], claim: str | None, delta: float = 0.0, paired: bool = False) -> dict:
    """The one comparison rule (README, Comparing runs): what the per-seed values of arm a say against those of
    arm b about a paper's claim.

    a, b: one value per held-out seed, of a metric where lower is better (a final loss); a non-finite value is a
    run that diverged (or crashed): the worst outcome, an infinite loss. For a metric where higher is better, pass
    its negation. paired: both lists in the same seed order, compared seed by seed.

    claim (Δ = mean(a) - mean(b), over the runs that finished):
      "lower"  - the paper says a's loss is lower than b's by δ = delta >= 0 (its effect size, in the metric's
                 units): Δ = -δ. "higher": Δ = +δ.
                 reproduced: the 95% interval of Δ excludes 0 on the claimed side and does not lie entirely below
                 δ in magnitude; smaller than claimed: it excludes 0 on the claimed side but lies below δ;
                 contradicted: it lies entirely on the other side of 0, or contains 0 and lies below δ;
                 otherwise inconclusive at this scale, with `seeds_needed`: the seeds per arm whose mde
                 reaches δ (the observed |Δ| when δ is 0).
      "on_par" - a and b are equivalent within the margin δ > 0 (TOST read off the 95% interval, each side at
                 2.5%): reproduced when the interval lies inside ±δ, contradicted when it lies entirely outside,
                 otherwise inconclusive (seeds_needed: where the interval's reach, at 80% power with no true
                 difference, fits inside ±δ).
      None     - no claim against b: a description only, "lower", "higher" (the interval excludes 0) or "not
                 distinguishable", never a verdict word.
    The interval is paired t (paired) or Welch's; `mde` is the smallest Δ these seeds detect with 80% power at
    α = 0.05, two-sided; `p` the t-test's p of no difference.

    Divergence is decided first: k of n runs per arm (`diverged`), compared by Fisher's exact test at α = 0.05
    (`p_diverged`; 3 of 3 against 0 of 3 is p = 0.10, nothing; 5 of 5 against 0 of 5 is p = 0.008). Where it
    tells the arms apart, the arm that diverged more often has the higher loss, by more than any δ, and that is
    the word. Otherwise the losses are compared over the runs that finished (paired: the seeds where both
    did), and the divergence counts stand beside them in `reason`.

    A decisive word needs MIN_SEEDS (5) held-out seeds in each arm, and one from the losses 5 runs that finished
    in each arm (as pairs, when paired); with fewer it is inconclusive (a description stays). `p_word` is the
    p-value the word rests on (the largest of the tests it needs): what Holm's correction (`correct_family`)
    adjusts within a family of claims."""
    if claim not in CLAIMS:
        raise ValueError(f"claim={claim!r}: choose lower, higher, on_par or None")
    if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta={delta!r}: the claimed effect is a finite number >= 0 in the metric's units")
    if claim == "on_par" and delta == 0:
        raise ValueError("claim='on_par' needs its margin: a delta > 0")
    a, b = [float(x) for x in a], [float(x) for x in b]
    if paired and len(a) != len(b):
        raise ValueError(f"paired arms hold one value per seed each: {len(a)} and {len(b)} values")
    n, k = (len(a), len(b)), (sum(not math.isfinite(x) for x in a), sum(not math.isfinite(x) for x in b))
    v = {"claim": claim, "delta": float(delta), "n": n, "diverged": k, "paired": paired,
         "test": "paired t" if paired else "Welch's t", "diff": None, "se": None, "df": None, "ci": None, "p": None,
         "mde": None, "sd": None, "p_diverged": None, "p_word": None, "seeds_needed": None, "reason": None}
    if paired:
        pairs = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
        finished = [x for x, _ in pairs], [y for _, y in pairs]
    else:
        finished = [x for x in a if math.isfinite(x)], [y for y in b if math.isfinite(y)]
    if min(map(len, finished)) >= 2:
        v.update(compare_arms(*finished, paired))
    notes = []
    if any(k):
        v["p_diverged"] = float(stats.fisher_exact([[k[0], n[0] - k[0]], [k[1], n[1] - k[1]]]).pvalue)
        notes.append(f"diverged on {k[0]} of {n[0]} seeds against {k[1]} of {n[1]} (Fisher's exact p = "
                     f"{v['p_diverged']:.2g})")
    if v["p_diverged"] is not None and v["p_diverged"] < ALPHA:  # the arm that diverged more often: infinite loss
        side = math.inf if k[0] / n[0] > k[1] / n[1] else -math.inf
        word, _, _ = interval_word(side, side, claim, delta)
        v.update(test="Fisher's exact", p_word=v["p_diverged"])
    elif v["diff"] is None:
        word = "not distinguishable" if claim is None else INCONCLUSIVE
        notes.append("fewer than 2 finished runs in an arm" + (" (as pairs)" if paired else "")
                     + ": no spread to compare losses by")
    else:
        word, nulls, why = interval_word(*v["ci"], claim, delta)
        v["p_word"] = max(p_at(v, null) for null in nulls)
        notes = [*([why] if why else []), *(["losses of the finished runs"] if any(k) else []), *notes]
    if claim is not None and word in DECISIVE and (short := too_few_runs(v, tuple(map(len, finished)))):
        word = INCONCLUSIVE
        notes.append(short)
    v.update(verdict=word, reason="; ".join(notes) or None)
    if word == INCONCLUSIVE:
        v["seeds_needed"] = seeds_needed(v)
    return v


def too_few_runs(v: dict, finished: tuple[int, int]) -> str | None:
    """Why a decisive word lacks the runs it needs, or None: MIN_SEEDS held-out seeds per arm for a word that
    Fisher's test of divergence gave, MIN_SEEDS runs that finished per arm (as pairs, when paired) for a word
    from the losses: the survivors of an arm that diverged on most seeds are not a sample of it."""
    n = v["n"]
    if v["test"] == "Fisher's exact":
        return None if min(n) >= MIN_SEEDS else \
            f"{n[0]} and {n[1]} seeds: a verdict needs {MIN_SEEDS} held-out seeds in each arm"
    if min(finished) >= MIN_SEEDS:
        return None
    if finished == n:
        return f"{n[0]} and {n[1]} seeds: a verdict needs {MIN_SEEDS} held-out seeds in each arm"
    return (f"{finished[0]} and {finished[1]} runs that finished{' (as pairs)' if v['paired'] else ''}: a verdict "
            f"from the losses needs {MIN_SEEDS} held-out runs that finished in each arm (divergence is judged "
            "by Fisher's test)")


def seeds_needed(v: dict) -> int | None:
    """For an inconclusive verdict: the seeds per arm its spread says would detect δ (the observed |Δ| when δ is
    0; for "on_par", fit the interval inside ±δ), or tell its divergence rates apart; None when nothing says."""
    if v["sd"] is None:
        return seeds_for_divergence(v["n"], v["diverged"]) if any(v["diverged"]) else None
    if v["claim"] == "on_par":
        return seeds_for(v["delta"], v["sd"], v["paired"], power=(1 + POWER) / 2)
    return seeds_for(v["delta"] or abs(v["diff"]), v["sd"], v["paired"])


def holm_adjusted(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values of one family of tests, in the order given: the k-th smallest p times
    (m - k + 1), never below the one before it, at most 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [1.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def holm(ps: list[float], alpha: float = ALPHA) -> list[bool]:
    """Which tests of one family (one paper's claims) Holm's correction rejects, keeping the chance of any false
    rejection in the family at most alpha."""
    return [p < alpha for p in holm_adjusted(ps)]


AD_HOC = "ad hoc"  # the family of the claims a command line states (--claim, --row_claim): its own claimed rows


def correct_family(verdicts: list[dict | None], alpha: float = ALPHA, name: str = AD_HOC,
                   size: int | None = None) -> list[dict | None]:
    """The verdicts of one family of claims, each claim with its Holm-adjusted p (`p_holm`, of `p_word`), the
    family's name and size; a decisive word whose adjusted p is not below alpha becomes inconclusive at this scale.
    The family is the claims, never the descriptions (a verdict without a claim stays as it is, its own p beside
    it), and its size is `size`, the claims it holds as written before the runs (default: the claims given here):
    a claim of it that is not tested here (its row in another table, or no test: trained at no rate) counts at
    p = 1, so that which rows a table happens to hold makes no word easier to get. None entries stay."""
    claimed = [i for i, v in enumerate(verdicts) if v is not None and v.get("claim") is not None]
    tested = [i for i in claimed if verdicts[i].get("p_word") is not None]
    size = max(size or 0, len(claimed))
    adjusted = dict(zip(tested, holm_adjusted([verdicts[i]["p_word"] for i in tested] + [1.0] * (size - len(tested))),
                        strict=False))
    out = list(verdicts)
    for i in claimed:
        p = adjusted.get(i)
        v = {**verdicts[i], "p_holm": p, "family": name, "family_size": size, "family_here": len(claimed)}
        if p is not None and v["verdict"] in DECISIVE and p >= alpha:
            why = f"not significant after Holm's correction over the {size} claims of family {name}"
            v.update(verdict=INCONCLUSIVE, reason="; ".join(filter(None, [v["reason"], why])))
            v["seeds_needed"] = seeds_needed(v)
        out[i] = v
    return out


DEPENDS = "depends on the baseline's rate"


def against_second_rate(v: dict, second: dict | None, rates: tuple[str, str]) -> dict:
    """A verdict against the baseline at its best rate, with the word against the baseline at its second-best rate
    (`second`: the same comparison there, None when the baseline has no held-out runs at it) beside it
    (`verdict_second`): where the two words differ, the verdict is DEPENDS, both words said in its reason."""
    if v.get("claim") is None:
        return v
    if second is None or "claim" not in second:
        return {**v, "verdict_second": None,
                "reason": "; ".join(filter(None, [v["reason"], "not checked against the baseline's second-best "
                                                               "rate (no held-out runs there)"]))}
    out = {**v, "verdict_second": second["verdict"]}
    if second["verdict"] != v["verdict"]:
        both = (f"{v['verdict']} against the baseline at its best rate {rates[0]}, {second['verdict']} at its "
                f"second-best {rates[1]}")
        out.update(verdict=DEPENDS, reason="; ".join(filter(None, [both, v["reason"]])))
    return out


def scale_text(setup: dict) -> str:
    """The scale a word was measured at, from a sweep's setup: data, depth, width and tokens trained on, e.g.
    "shakespeare_char, L 8, d 64, 1.2M tokens": a word at this scale says nothing of a paper's 125M-1B models."""
    tokens = setup.get("tokens")
    amount = "" if not tokens else next(f", {tokens / unit:.3g}{name} tokens" for unit, name in
                                        ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, "")) if tokens >= unit or unit == 1)
    return f"{setup.get('data', '?')}, L {setup.get('n_layer', '?')}, d {setup.get('n_embd', '?')}{amount}"


def verdict_text(v: dict, scale: str | None = None) -> str:
    """A verdict as the tables print it: the word (a claim's with the `scale` it was measured at), then why, the
    seeds an inconclusive one would take, and its p: a claim's Holm-adjusted within its family, named with its
    size (and how many of its claims this table tests, where fewer), a description's its own."""
    notes = [v["reason"]] if v.get("reason") else []
    if v["verdict"] == INCONCLUSIVE and v["claim"] is not None:
        target = "fit the interval inside ±δ" if v["claim"] == "on_par" else \
            "detect δ" if v["delta"] else "detect the observed Δ"
        notes.append(f"about {v['seeds_needed']} seeds per arm would {target}" if v["seeds_needed"] else
                     f"no number of seeds found to {target}")
    if "family" in v:
        size, here = v["family_size"], v["family_here"]
        named = f"family {v['family']}: {size} claim{'s' * (size != 1)}" + (f", {here} in this table" if here < size
                                                                             else "")
        p = "" if v["p_holm"] is None else f"; {'Holm-adjusted ' if size > 1 else ''}p={v['p_holm']:.2g}"
        notes.append(named + p)
    elif v.get("p_word") is not None:
        notes.append(f"p={v['p_word']:.2g}")
    word = v["verdict"] + (f" at {scale}" if scale and v["claim"] is not None else "")
    return word + (f" ({'; '.join(notes)})" if notes else "")
