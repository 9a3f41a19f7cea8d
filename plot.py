"""
Plot train.py runs from their metrics.jsonl: one PNG, one curve per run, one panel per metric.

    python plot.py out/cpu_pre out/cpu_geonorm                        # val_loss against iter -> runs.png
    python plot.py out/sweep/* --metric loss,val_loss --smooth 5 --logy --out sweep.png
    python plot.py out/cpu_lipschitz --metric block_rms              # one curve per block (one run)
    python plot.py out/cpu_pre out/cpu_none --metric block_rms[-1]   # the last block's RMS of each run
    python plot.py --tables results/ --out tables/ --into REPRODUCING.md   # every verdict table again, from results/

Metrics are the numeric keys of the log: `loss` (train lines, the loss of one batch), `train_loss`
and `val_loss` (eval lines, averaged over eval_iters batches), task extras such as `val_xy_loss`, and
lists such as `block_rms` and `attn_logit_max`: drawn per block for a single run, as their last element
for several, or as `name[i]` or `name[max]` (the largest over the blocks). Each curve is labelled by the
flags that differ between the runs (read from the config saved in out_dir/ckpt.pt, or, for a run that
stopped before its first one, from the command line in its run.json), or by the out_dir's name when
there is neither. A diverged run ends in an x at the iteration its status line gives.

Importable: differing_flags(runs), draw(...), plot_runs(...), draw_lr_sensitivity(...); a run's files are read by
nanonorm/runs.py (load_metrics, run_config, diverged_at).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys

from nanonorm.runs import (
    IGNORED_FLAGS,
    RunFileError,
    distinct_folders,
    diverged_at,
    is_number,
    load_metrics,
    run_config,
)


class PlotError(RunFileError):
    """Input that cannot be plotted (a folder without metrics, a metric no run logged): plot.py prints it, as it
    prints a run's file that cannot be read (RunFileError), and exits with code 2."""


def differing_flags(runs: dict[str, dict | None]) -> dict[str, str]:
    """{run name: "key=value, ..."} over the keys whose values differ between the runs' configs.
    A run without a config, or runs that differ in nothing, are labelled by their name's last part."""
    configs = {name: cfg for name, cfg in runs.items() if cfg is not None}
    # keys every config has: a checkpoint from an older version lacks newer keys, which it ran at their default
    keys = [k for k in dict.fromkeys(k for cfg in configs.values() for k in cfg)
            if k not in (*IGNORED_FLAGS, "scheme") and all(k in cfg for cfg in configs.values())]
    differ = [k for k in keys if len({repr(cfg.get(k)) for cfg in configs.values()}) > 1]

    def value(cfg: dict, key: str) -> object:  # a primitive override left at None shows the scheme's value
        return cfg.get("scheme", {}).get(key) if cfg[key] is None and key in cfg.get("scheme", {}) else cfg[key]

    labels = {}
    for name, cfg in runs.items():
        short = os.path.basename(os.path.normpath(name))
        labels[name] = ", ".join(f"{k}={value(cfg, k)}" for k in differ) if cfg is not None and differ else short
    # a run without a config (no checkpoint, no run.json: a train.py run stopped early) takes the label of
    # a run that sits beside it under the same name but for its seed: its sweep sibling
    by_point = {seedless(name): labels[name] for name, cfg in runs.items() if cfg is not None}
    for name, cfg in runs.items():
        if cfg is None and differ:
            labels[name] = by_point.get(seedless(name), labels[name])
    return labels


def seedless(name: str) -> str:
    """A run's path without the seed in its last part: sweep.py's out_dirs of one grid point share it."""
    head, tail = os.path.split(os.path.normpath(name))
    return os.path.join(head, re.sub(r"(^|,)seed=\d+", "", tail))


def curves(records: list[dict], metric: str, x: str, per_block: bool) -> dict[str, tuple[list, list]]:
    """{curve name: (xs, ys)} of one run: a single curve "" for a number, one per block for a list."""
    match = re.fullmatch(r"(\w+)(?:\[(-?\d+|max)\])?", metric)
    if match is None:
        raise PlotError(f"cannot read metric {metric!r}; write a key such as val_loss, block_rms[-1] "
                         "or attn_logit_max[max]")
    name, index = match.groups()
    out: dict[str, tuple[list, list]] = {}
    for r in records:
        if r.get("kind") == "status" or name not in r or not isinstance(r.get(x), (int, float)):
            continue
        value = r[name]
        if isinstance(value, list) and index is None and per_block:
            points = {f"block {i}": v for i, v in enumerate(value)}
        elif isinstance(value, list) and index == "max":  # the largest over the blocks
            points = {"": max((v for v in value if is_number(v)), default=None)}
        elif isinstance(value, list):
            i = int(index or -1)
            if not -len(value) <= i < len(value):
                raise PlotError(f"{metric}: the run logged {name} for {len(value)} blocks; give an index from "
                                f"{-len(value)} to {len(value) - 1}, or {name}[max]")
            points = {"": value[i]}
        else:
            points = {"": value}
        for key, v in points.items():
            if isinstance(v, (int, float)):
                out.setdefault(key, ([], []))[0].append(r[x])
                out[key][1].append(v)
    return out


def smooth(ys: list[float], n: int) -> list[float]:
    """Trailing moving average over n points (fewer at the start)."""
    return [sum(ys[max(0, i - n + 1): i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(ys))]


def draw_panel(ax, runs: dict[str, list[dict]], labels: dict[str, str], metric: str, x: str, smooth_n: int) -> int:
    """Draw one metric of every run on ax; returns the number of curves drawn."""
    drawn = 0
    for i, (d, records) in enumerate(runs.items()):
        stop = diverged_at(records)
        for j, (part, (xs, ys)) in enumerate(curves(records, metric, x, per_block=len(runs) == 1).items()):
            ys = smooth(ys, smooth_n) if smooth_n > 1 else ys
            color = f"C{(j if part else i) % 10}"
            marker = "o" if len(xs) < 30 else None  # a short curve's points, even a single one, show
            ax.plot(xs, ys, color=color, label=literal(part or labels[d]), linewidth=1.5, marker=marker, markersize=3)
            if stop is not None:
                ax.plot(stop if x == "iter" else xs[-1], ys[-1], "x", color=color, markersize=10, mew=2)
            drawn += 1
    return drawn


def draw_seed_means(ax, runs: dict[str, list[dict]], labels: dict[str, str], metric: str, x: str) -> int:
    """One curve per group of runs that differ only in their seed: the mean over seeds at the x values every
    run of the group logged, with the min-max band shaded; a diverged seed stays out of the mean, drawn on
    its own and counted in the label. Returns the number of curves drawn."""
    groups: dict[str, list[str]] = {}
    for d in runs:
        groups.setdefault(labels[d], []).append(d)
    for i, (label, dirs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        points = {d: dict(zip(*curves(runs[d], metric, x, per_block=False).get("", ([], [])), strict=True))
                  for d in dirs}
        trained = [d for d in dirs if diverged_at(runs[d]) is None]
        for d in [d for d in dirs if d not in trained]:  # out of the mean, drawn alone: dashed, ending in an x
            finite = [(u, y) for u, y in points[d].items() if math.isfinite(y)]
            if finite:
                ax.plot(*zip(*finite, strict=True), color=color, linestyle="--", linewidth=1)
                ax.plot(diverged_at(runs[d]) if x == "iter" else finite[-1][0], finite[-1][1], "x", color=color,
                        markersize=10, mew=2)
        if not trained:
            ax.plot([], [], color=color, linestyle="--",
                    label=f"{literal(label)} (every one of {len(dirs)} seeds diverged)")
            continue
        series = [points[d] for d in trained]
        xs = sorted(set.intersection(*(set(c) for c in series)))
        if not xs:
            continue
        diverged = f"; {len(dirs) - len(trained)} diverged: dashed, x" if len(trained) < len(dirs) else ""
        mean = [sum(c[v] for c in series) / len(series) for v in xs]
        ax.plot(xs, mean, color=color, marker="o", markersize=3,
                label=f"{literal(label)} (mean of {len(trained)} seed{'s' if len(trained) > 1 else ''}{diverged})")
        ax.fill_between(xs, [min(c[v] for c in series) for v in xs], [max(c[v] for c in series) for v in xs],
                        color=color, alpha=0.25, linewidth=0)
    return len(groups)


def draw(out_dirs: list[str], metrics: list[str], x: str = "iter", logy: bool = False, smooth_n: int = 1,
         seed_means: bool = False, references: dict[str, float] | None = None, title: str | None = None):
    """A matplotlib Figure with one panel per metric and one curve per run (or per block); with seed_means, one
    curve per group of runs that differ only in the seed (mean, min-max band); reference lines; a title."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, rendered by Agg on save

    runs = {d: load_metrics(d) for d in out_dirs}
    for d, records in runs.items():
        if not records:
            raise PlotError(f"{d} has no metrics.jsonl, or no readable line in it; pass the out_dir of a train.py run")
    configs = {d: run_config(d) for d in out_dirs}
    if seed_means:
        configs = {d: {k: v for k, v in cfg.items() if k != "seed"} if cfg else cfg for d, cfg in configs.items()}
    labels = differing_flags(configs)
    long_labels = len(runs) > 1 and max(len(label) for label in labels.values()) > 40
    ncols = min(len(metrics), 3)
    nrows = math.ceil(len(metrics) / ncols)
    wide = long_labels or title is not None  # room for a long legend or title
    fig = Figure(figsize=(max(5.5 * ncols, 10.0 if wide else 0.0), 3.8 * nrows + (0.6 if wide else 0.0)),
                 layout="constrained")
    for k, metric in enumerate(metrics):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        drawn = draw_seed_means(ax, runs, labels, metric, x) if seed_means else \
            draw_panel(ax, runs, labels, metric, x, smooth_n)
        for name, value in (references or {}).items():
            ax.axhline(value, color="0.4", linestyle="--", linewidth=1)
            ax.annotate(f"{literal(name)} {value:.4f}", (0.01, value), xycoords=("axes fraction", "data"),
                        fontsize="small", color="0.3", va="bottom")
        if not drawn:
            logged = sorted({key for records in runs.values() for r in records if r.get("kind") != "status"
                             for key, v in r.items() if isinstance(v, (int, float, list)) and key != "iter"})
            raise PlotError(f"no run logged '{metric}' against '{x}'; logged: {', '.join(logged)}")
        ax.set(xlabel=x, ylabel=metric, title=metric if len(runs) > 1 else f"{metric}: {literal(labels[out_dirs[0]])}")
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if not long_labels:
            ax.legend(fontsize="small")
    if long_labels:  # one legend for all panels, under them
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", fontsize="small")
    notes = [title] if title else []
    if any(diverged_at(records) is not None for records in runs.values()) and not seed_means:
        notes.append("x: where the run diverged (its status line)")
    if notes:
        fig.suptitle("\n".join(notes), fontsize="small")
    return fig


# ----------------------------------------------------------------------------- learning-rate sensitivity


def unigram_loss(data_dir: str, dataset: str, trained_on: dict | None = None) -> float | None:
    """The unigram loss of a dataset (nanonorm.selection.unigram_loss: the loss of a model that ignores the
    context). None if the dataset is not prepared, or (with `trained_on`, the data fingerprint a sweep recorded)
    prepared again since from other data, which a note on stdout says."""
    import prepare_data
    from nanonorm.resume import data_fingerprint, fingerprint_changes
    from nanonorm.selection import unigram_loss as loss_of_frequencies

    folder = os.path.join(data_dir, dataset)
    try:
        meta = prepare_data.load_meta(folder)
    except (OSError, ValueError):
        return None
    if trained_on and (changed := fingerprint_changes(trained_on, data_fingerprint(meta))):
        print(f"note: no unigram line: {folder} was prepared again since the sweep trained on it "
              f"({', '.join(changed)})")
        return None
    return loss_of_frequencies(data_dir, dataset)


def read_lr_sweep(root: str) -> dict:
    """The summary.json of one `sweep.py --lr_grid` out_root; PlotError when it is missing or unreadable."""
    import sweep

    try:
        return sweep.read_lr_summary(root)
    except sweep.SweepError as e:
        raise PlotError(str(e)) from None


def read_same_data(roots: list[str]) -> list[tuple[str, dict]]:
    """(root, summary) of `sweep.py --lr_grid` out_roots, refused (PlotError) when they trained on different data
    (their recorded data fingerprints differ) or were judged on different metrics (val_loss, val_bpb): their losses
    do not belong in one figure."""
    import sweep

    summaries = [(root, read_lr_sweep(root)) for root in roots]
    try:
        sweep.check_recorded_data(summaries)
    except sweep.SweepError as e:
        raise PlotError(str(e)) from None
    metrics = {root: sweep.summary_metric(summary) for root, summary in summaries}
    if len(set(metrics.values())) > 1:
        raise PlotError("the sweeps were judged on different metrics (" + ", ".join(f"{r}: {m}" for r, m in
                        metrics.items()) + "): draw sweeps of one --metric together")
    return summaries


def load_lr_sweeps(roots: list[str]) -> dict:
    """The runs, per-point table and setup of one or more `sweep.py --lr_grid` out_roots (summary.json), trained on
    the same data and judged on the same metric (val_loss or val_bpb, `metric`)."""
    import sweep

    merged: dict = {"runs": [], "lr_points": [], "setup": None, "lr_key": None, "keys": [], "metric": "val_loss"}
    counts = set()
    for root, summary in read_same_data(roots):
        merged["metric"] = sweep.summary_metric(summary)
        merged["runs"] += [{**r, "root": root} for r in summary["runs"]]
        merged["lr_points"] += [{**p, "root": root} for p in summary["lr_points"]]
        merged["setup"] = merged["setup"] or summary.get("setup")
        merged["data"] = merged.get("data") or summary.get("data_fingerprint")  # one for all (read_same_data)
        merged["lr_key"] = merged["lr_key"] or summary["lr_key"]
        merged["keys"] += [k for k in summary["keys"] if k not in merged["keys"]]
        counts.add((summary.get("setup") or {}).get("seeds"))
    counts.discard(None)
    if merged["setup"] and len(counts) > 1:  # arms held out on different numbers of seeds: say the range
        merged["setup"] = {**merged["setup"], "seeds": f"{min(counts)}–{max(counts)}"}
    return merged


def point_label(point: dict, keys: list[str]) -> str:
    values = [f"{k}={point[k]}" for k in keys if point.get(k) is not None]
    return values[0].split("=", 1)[1] if len(values) == 1 else ", ".join(values) or "run"


def hidden_curves(curves: dict[str, dict[float, float]], tol: float = 2e-3) -> list[tuple[str, str]]:
    """Pairs of curves that coincide within tol at every rate they share (one is drawn over the other)."""
    names = list(curves)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if (shared := set(curves[a]) & set(curves[b]))
            and all(abs(curves[a][x] - curves[b][x]) < tol for x in shared)]


def verdict_label(point: dict) -> str:
    """A sweep point's comparison with the baseline as a second legend line (empty for the baseline): the claim
    and δ, the word, Δ with its 95% interval, the mde and n, as the sweep's table gives them."""
    if "verdict" not in point:
        return ""
    if point.get("claim") is None:  # no verdict (trained at no rate, another setup), or a summary without claims
        return f"\n  {point['verdict']}"
    claim, delta = point["claim"], point.get("delta") or 0
    stated = {"none": "no claim", "on_par": f"on par within ±{delta:g}"}.get(claim, f"{claim} by δ={delta:g}")
    word = point["verdict"].split(" (")[0]
    numbers = [f"Δ {point['diff']:+.4f}" if point.get("diff") is not None else None,
               "[{:+.4f}, {:+.4f}]".format(*point["ci"]) if point.get("ci") else None,
               f"mde {point['mde']:.4f}" if point.get("mde") is not None else None,
               "n {} vs {}".format(*point["n_seeds"]) if point.get("n_seeds") else None]
    return f"\n  vs baseline, {stated}: {word}; " + " ".join(filter(None, numbers))


def draw_lr_sensitivity(roots: list[str], references: dict[str, float] | None = None, heading: str | None = None):
    """Final val loss against learning rate (log axis), one curve per grid point from its first-seed runs;
    diverged or crashed runs as x on a band at the top; mean ± std over seeds at each point's best rate;
    horizontal reference lines (the unigram loss of a language-model sweep, or those given); `heading` (--title)
    goes above the setup line the sweeps' summaries give."""
    sweep = load_lr_sweeps(roots)
    setup = sweep["setup"] or {}
    refs = dict(references or {})
    if setup.get("task") == "lm" and "unigram" not in refs and sweep["metric"] == "val_loss":  # the unigram's in nats
        uni = unigram_loss(setup.get("data_dir", "data"), setup.get("dataset", ""),
                           (sweep.get("data") or {}).get(setup.get("dataset", "")))
        if uni is not None:
            refs["unigram (context ignored)"] = uni
    return draw_lr_figure(sweep, refs, heading)


def draw_lr_figure(sweep: dict, refs: dict[str, float], heading: str | None = None):
    """draw_lr_sensitivity's figure of sweeps already read ({"runs", "lr_points", "setup", "lr_key", "keys",
    "metric"}: what load_lr_sweeps returns, or sweep.py --tables builds from the results files), with the reference
    lines `refs`; the curves and the axis are of the metric the sweeps judged on (val_loss when none is given)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    from nanonorm.lr_table import first_seed_runs, matches

    keys, lr_key, setup = sweep["keys"], sweep["lr_key"], sweep["setup"] or {}
    metric = sweep.get("metric", "val_loss")
    labels = [point_label(p, keys) for p in sweep["lr_points"]]
    for point, label in zip(sweep["lr_points"], labels, strict=True):  # one setting in two sweeps: name the sweep
        point["label"] = label + (f" ({os.path.basename(os.path.normpath(point['root']))})"
                                  if labels.count(label) > 1 else "")
    curves: dict[str, dict[float, float]] = {}
    failed: dict[str, list[float]] = {}
    for point in sweep["lr_points"]:
        label = point["label"]
        runs = [r for r in sweep["runs"] if r["root"] == point["root"] and matches(r, {k: point.get(k) for k in keys})]
        for r in first_seed_runs(runs, lr_key):  # the seed that ran every rate, as sweep.py picks it
            loss = r.get(metric)
            ok = r.get("diverged_at") is None and r.get("exit_code") in (0, None) and isinstance(loss, (int, float)) \
                and math.isfinite(loss)
            if ok:
                curves.setdefault(label, {})[float(r[lr_key])] = loss
            else:
                failed.setdefault(label, []).append(float(r[lr_key]))
    order = sorted(sweep["lr_points"], key=lambda p: (p.get("val_loss_mean") is None, p.get("val_loss_mean") or 0))
    losses = sorted(v for c in curves.values() for v in c.values())
    if losses:  # a finite loss far above the rest (a blown-up run) is marked like a divergence, not plotted
        cap = 3 * losses[len(losses) // 2]
        for label, c in curves.items():
            for lr in [lr for lr, v in c.items() if v > cap]:
                del c[lr]
                failed.setdefault(label, []).append(lr)
    finite = [v for c in curves.values() for v in c.values()] + list(refs.values())
    if not finite:
        raise PlotError("no run of these sweeps finished with a finite loss: nothing to draw")
    low, high = min(finite), max(finite)
    top = high + 0.08 * (high - low or 1.0)  # the band where diverged runs are marked
    fig = Figure(figsize=(11, 5.0), layout="constrained")
    ax = fig.add_subplot()
    palette = [f"C{i}" for i in range(10)] if len(order) <= 10 else list(colormaps["tab20"].colors)
    for i, point in enumerate(order):
        label = point["label"]
        color = palette[i % len(palette)]
        xs = sorted(curves.get(label, {}))
        best = point.get("best_lr")
        mean_std = point.get("val_loss_mean_std") or "-"
        ax.plot(xs, [curves[label][x] for x in xs], "o-", color=color, markersize=4,
                label=literal((f"{label}: {mean_std} at lr {best}" if best is not None
                               else f"{label}: every rate failed") + verdict_label(point)))
        if failed.get(label):  # each curve's x a little lower than the last, so that none hides another
            y = top - 0.012 * i * (high - low or 1.0)
            ax.plot(failed[label], [y] * len(failed[label]), "x", color=color, markersize=8, mew=2)
        losses = [x for x in point.get("seed_losses", {}).values() if math.isfinite(x)]
        if best is not None and len(losses) > 1:
            ax.errorbar([float(best)], [point["val_loss_mean"]], yerr=[statistics.stdev(losses)], color=color,
                        capsize=5, marker="s", markersize=7, markerfacecolor="none")
    for name, value in refs.items():
        ax.axhline(value, color="0.4", linestyle="--", linewidth=1)
        ax.annotate(f"{literal(name)} {value:.4f}", (0.01, value), xycoords=("axes fraction", "data"), fontsize="small",
                    color="0.3", va="bottom")
    if failed:
        ax.annotate("x: diverged, crashed, or ended above 3x the median loss", (0.01, top),
                    xycoords=("axes fraction", "data"), fontsize="small", va="bottom", color="0.3")
    ax.set_xscale("log")
    ax.set(xlabel=lr_key, ylabel=f"final {metric.replace('_', ' ')} (first seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", title="sorted by mean loss at the best rate (mean ± std, n)",
              title_fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    swept = {k for key in keys for k in key.split("+")}  # a grid key has a value per curve, none for the title

    def fixed(text: str, *names: str) -> str | None:  # the setup's value, unless the grid sweeps what sets it
        return None if swept & set(names) else text.format(**setup)

    size = " ".join(filter(None, [fixed("L{n_layer}", "n_layer"), fixed("d{n_embd}", "n_embd"),
                                  fixed("T{block_size}", "block_size", "icl_pairs")]))
    facts = [size, fixed("{data}", "dataset", "icl_pairs"), fixed("{max_iters} steps", "max_iters"),
             fixed("{optimizer}", "optimizer")] if setup else []
    title = (", ".join(filter(None, facts))
             + f"; {setup.get('seeds')} seeds held out at each best rate (squares: mean ± std)"
             if setup else "learning-rate sweep")
    hidden = hidden_curves(curves)
    if hidden:
        title += "\nhidden under another curve: " + "; ".join(f"{a} under {b}" for a, b in hidden)
    fig.suptitle(f"{heading}\n{literal(title)}" if heading else literal(title), fontsize="small")
    return fig


def write_tables(results: str, out: str, into: str | None = None) -> str:
    """--tables: every study's verdict tables (markdown, as `sweep.py --tables` prints them) and a learning-rate
    figure per sweep, from the results files under `results` alone (nanonorm.results.study_tables), written to the
    folder `out` as <study>.md and <study>_<sweep>.png; with `into` (a markdown file such as REPRODUCING.md), also
    put each study's tables and figures in that file's block for it (embed_tables); returns `out`."""
    from nanonorm.results import ResultsError, metric_of, study_tables
    from nanonorm.run_files import write_atomically

    try:
        studies = study_tables(results)
    except ResultsError as e:
        raise PlotError(str(e)) from None
    document = read_document(into, [study for study, _, _ in studies]) if into else None
    os.makedirs(out, exist_ok=True)
    for study, text, tables in studies:
        write_atomically(os.path.join(out, f"{study}.md"), text.encode())
        for name, data, table in tables:
            drawn = {"runs": [{**r, "root": name} for r in data["runs"]],
                     "lr_points": [{**p, "root": name} for p in table],
                     "setup": data.get("setup"), "lr_key": data["lr_key"], "keys": data["keys"],
                     "metric": metric_of(data)}
            nats = data.get("unigram_loss") is not None and metric_of(data) == "val_loss"  # the unigram's in nats
            refs = {"unigram (context ignored)": data["unigram_loss"]} if nats else {}
            save(draw_lr_figure(drawn, refs, f"{study}: {name}"), os.path.join(out, f"{study}_{name}.png"), dpi=110)
        if document is not None:
            figures = [os.path.relpath(os.path.join(out, f"{study}_{name}.png"), os.path.dirname(into) or ".")
                       for name, _, _ in tables]
            document = embed_tables(document, study, text, figures)
    if document is not None:
        write_atomically(into, document.encode())
    return out


def table_block(study: str) -> tuple[str, str]:
    """The two lines that mark where a study's tables go in a markdown file (plot.py --tables --into)."""
    return f"<!-- tables:{study} (python plot.py --tables) -->", f"<!-- /tables:{study} -->"


def read_document(path: str, studies: list[str]) -> str:
    """The text of the markdown file --into names, checked to hold one block per study before anything is drawn."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"--into {path}: cannot read it ({e}); name a markdown file") from None
    for study in studies:
        begin, end = table_block(study)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise PlotError(f"--into {path} has no block for the study {study!r}: put the lines {begin} and {end} "
                            "where its tables go")
    return text


def embed_tables(document: str, study: str, text: str, figures: list[str]) -> str:
    """`document` with the block of `study` replaced by its tables (their headings two levels down, to sit under
    a section) and a link to each sweep's figure; the rest of the document is left as it was."""
    begin, end = table_block(study)
    body = "\n".join("##" + line if line.startswith("#") else line for line in text.splitlines())
    links = "\n\n".join(f"![{study}: {os.path.splitext(os.path.basename(f))[0]}]({f})" for f in figures)
    head, rest = document.split(begin, 1)
    return f"{head}{begin}\n{body}\n\n{links}\n{end}{rest.split(end, 1)[1]}"


def draw_depth(roots: list[str], heading: str | None = None):
    """Against the depth n_layer, one line per arm: its held-out mean ± std at that depth's best rate (left) and
    its learning-rate sensitivity on the selection seed (right), from sweep.py --lr_grid out_roots at several
    depths (their summary.json). Sweeps from different machines belong in different figures."""
    from matplotlib.figure import Figure

    import sweep

    series: dict[str, dict[int, dict]] = {}
    metric = "val_loss"
    for root, summary in read_same_data(roots):
        metric = sweep.summary_metric(summary)
        keys = [k for k in summary["keys"] if k != "n_layer"]
        for point in summary["lr_points"]:
            depth = point.get("n_layer", (summary.get("setup") or {}).get("n_layer"))
            if depth is None:
                raise PlotError(f"{root}: its summary.json gives no n_layer; --depth needs sweeps at known depths")
            label = point_label(point, keys)
            if int(depth) in series.get(label, {}):
                raise PlotError(f"two sweeps give {label} at n_layer {depth}: pass one folder per arm and depth")
            series.setdefault(label, {})[int(depth)] = point
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    loss_ax, sens_ax = fig.subplots(1, 2)
    depths = sorted({d for by_depth in series.values() for d in by_depth})
    for i, (label, by_depth) in enumerate(sorted(series.items())):
        trained = [d for d in sorted(by_depth) if by_depth[d].get("val_loss_mean") is not None]
        losses = [[x for x in by_depth[d]["seed_losses"].values() if math.isfinite(x)] for d in trained]
        loss_ax.errorbar(trained, [by_depth[d]["val_loss_mean"] for d in trained], capsize=4, marker="o",
                         yerr=[statistics.stdev(x) if len(x) > 1 else 0.0 for x in losses], color=f"C{i % 10}",
                         label=literal(label))
        sensitive = [d for d in sorted(by_depth) if by_depth[d].get("lr_sensitivity") is not None]
        sens_ax.plot(sensitive, [by_depth[d]["lr_sensitivity"] for d in sensitive], "o-", color=f"C{i % 10}")
    for ax, ylabel in ((loss_ax, f"final {metric.replace('_', ' ')}, held-out mean ± std at the best rate"),
                       (sens_ax, "learning-rate sensitivity (selection seed)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set(xlabel="n_layer", ylabel=ylabel)
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize="small")
    if heading:
        fig.suptitle(heading, fontsize="small")
    return fig


def plot_runs(out_dirs: list[str], metrics: list[str], out_path: str = "runs.png", x: str = "iter",
              logy: bool = False, smooth_n: int = 1, **options) -> str:
    """Draw the runs' metrics into an image at out_path and return its path (options: see `draw`)."""
    return save(draw(out_dirs, metrics, x=x, logy=logy, smooth_n=smooth_n, **options), out_path, dpi=100)


def save(fig, path: str, dpi: int) -> str:
    """Write fig to path, in the format its extension names (a PNG, with .png added, when it has none, as
    matplotlib would add it), making its folder; returns the path written."""
    if not os.path.splitext(path)[1]:
        path += ".png"
    extension, known = os.path.splitext(path)[1][1:].lower(), fig.canvas.get_supported_filetypes()
    if extension not in known:
        raise PlotError(f"--out {path}: matplotlib writes no .{extension} files; end it in "
                        f"{', '.join('.' + e for e in sorted(known))}")
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dirs", nargs="+", help="train.py out_dirs (each with a metrics.jsonl), or with "
                        "--lr_sweep the --out_root of sweep.py --lr_grid runs")
    parser.add_argument("--lr_sweep", action="store_true", help="draw final val loss against learning rate "
                        "from sweep.py --lr_grid out_roots (their summary.json)")
    parser.add_argument("--tables", action="store_true", help="from the results files under one folder (sweep.py "
                        "--results: a study per folder) alone, write every study's verdict tables (<study>.md) and a "
                        "learning-rate figure per sweep (<study>_<sweep>.png) to the folder --out (default: tables)")
    parser.add_argument("--into", metavar="FILE.md", help="with --tables: also replace each study's block in this "
                        "markdown file (between <!-- tables:STUDY (python plot.py --tables) --> and "
                        "<!-- /tables:STUDY -->) by its tables and figures, e.g. REPRODUCING.md")
    parser.add_argument("--depth", action="store_true", help="draw each arm's best held-out loss and its "
                        "learning-rate sensitivity against n_layer from sweep.py --lr_grid out_roots at several depths")
    parser.add_argument("--ref", action="append", default=[], metavar="NAME=VALUE",
                        help="a horizontal reference line, e.g. 'zero predictor=1.0' (repeatable)")
    parser.add_argument("--seed_means", action="store_true", help="one curve per group of runs that differ only "
                        "in their seed: the mean, with the min-max band over seeds shaded")
    parser.add_argument("--title", help="the figure's title: state the setup (model, steps, seeds); with "
                        "--lr_sweep, a heading above the setup line read from the sweeps")
    parser.add_argument("--metric", default="val_loss", help="comma-separated: loss, val_loss, block_rms[-1], ...")
    parser.add_argument("--x", default="iter", help="the key on the x axis (default: iter)")
    parser.add_argument("--out", default="runs.png", help="the image to write, in the format its extension "
                        "names (default: runs.png; .png is added to a name without one)")
    parser.add_argument("--logy", action="store_true", help="logarithmic y axis")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving average over N points")
    args = parser.parse_args(argv)
    args.out_dirs = distinct_folders([d for d in args.out_dirs if not os.path.isfile(d)])  # * lists summary.md
    try:
        print(f"wrote {plot_from_args(args)}")
    except RunFileError as e:  # PlotError, or a run's file that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out in a folder that cannot be made or written
        print(f"error: cannot write {e.filename or args.out}: {e.strerror}; give --out a writable path",
              file=sys.stderr)
        return 2
    return 0


def literal(text: str) -> str:
    """text as matplotlib should draw it, $ signs and all: a run's name or a setting is not math."""
    return text.replace("$", r"\$")


def check_title(title: str) -> None:
    """Raise PlotError if matplotlib cannot draw title: text between two $ is parsed as mathtext."""
    from matplotlib.cbook import is_math_text
    from matplotlib.mathtext import MathTextParser

    if not is_math_text(title):
        return
    try:
        MathTextParser("path").parse(title)
    except ValueError as e:
        reason = str(e).strip().splitlines()[-1]
        raise PlotError(f"--title '{title}': matplotlib reads the text between $ signs as math and cannot "
                        f"parse it ({reason}); write \\$ for a literal $, or fix the math") from None


def plot_from_args(args: argparse.Namespace) -> str:
    """Draw what the command line asks for; returns the path of the image written."""
    if not args.out_dirs:
        raise PlotError("every path given is a file; pass train.py out_dirs (folders with a metrics.jsonl)")
    if args.smooth < 1:
        raise PlotError(f"--smooth {args.smooth} must be at least 1 (1: no smoothing)")
    refs = {}
    for item in args.ref:
        name, _, value = item.rpartition("=")
        if name in refs:
            raise PlotError(f"--ref {name} is given twice ({refs[name]:g} and {value}); give each line once")
        try:
            refs[name] = float(value)
        except ValueError:
            raise PlotError(f"--ref {item!r}: write NAME=VALUE with a number") from None
        if not math.isfinite(refs[name]):
            raise PlotError(f"--ref {item!r}: a reference line needs a finite value")
    if args.title is not None:
        check_title(args.title)
    if args.depth and args.lr_sweep:
        raise PlotError("--depth and --lr_sweep draw different figures: give one")
    if args.tables and (args.depth or args.lr_sweep):
        raise PlotError("--tables draws every sweep's own figure; give it without --depth and --lr_sweep")
    if args.tables:
        if len(args.out_dirs) != 1:
            raise PlotError("--tables reads one results folder (its subfolders are the studies); give one")
        return write_tables(args.out_dirs[0], args.out if args.out != "runs.png" else "tables", args.into)
    if args.into:
        raise PlotError("--into puts --tables' tables in a markdown file; give it with --tables")
    if args.depth:
        return save(draw_depth(args.out_dirs, heading=args.title), args.out if args.out != "runs.png" else "depth.png",
                    dpi=110)
    if args.lr_sweep:
        fig = draw_lr_sensitivity(args.out_dirs, refs, heading=args.title)
        return save(fig, args.out if args.out != "runs.png" else "lr_sensitivity.png", dpi=110)
    return plot_runs(args.out_dirs, args.metric.split(","), args.out, x=args.x, logy=args.logy, smooth_n=args.smooth,
                     seed_means=args.seed_means, references=refs, title=args.title)


if __name__ == "__main__":
    sys.exit(main())
