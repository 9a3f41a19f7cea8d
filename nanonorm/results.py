"""
Results as data: the per-run numbers behind a learning-rate sweep's table, one small JSON-lines file per sweep,
from which `sweep.py --tables` regenerates the tables (and plot.py the figures) with no run folder at hand.

The first line describes the sweep ({"kind": "sweep", ...}: its title, grid keys, rate key, selection and
held-out seeds, setup (the scale), settings, the data's unigram loss and fingerprint, the baseline, the claims
file's text, the commit); each further line is one run ({"kind": "run", ...}: its grid values, rate, seed, role
(selection or held_out), final val and train loss, the iteration of that evaluation, the iteration it diverged at,
exit code, wall time, the iteration-0 val loss and the commit that ran it, the final and iteration-0 val bpb, and,
for a run that logged diagnostics, the mechanism's per block at its last evaluation: claims.MECHANISM).
The header's metric (val_loss, or val_bpb: sweep.py --metric) is what the tables judge on; a file without one
judged on val_loss.
"""

from __future__ import annotations

import json
import math
import os
import time

from nanonorm.claims import MECHANISM, Claims, ClaimsError, parse_claims_text
from nanonorm.lr_table import (
    METRICS,
    add_verdicts,
    as_claims,
    lr_table_tests,
    matches,
    pick_best,
    point_table_text,
)
from nanonorm.run_files import write_atomically

RESULTS_NAME = "results.jsonl"  # in an out_root; a copy goes to --results DIR as <out_root's name>.jsonl
RUN_FIELDS = ("seed", "val_loss", "train_loss", "final_iter", "diverged_at", "exit_code", "reached_max_iters",
              "wall_s", "initial_val_loss", "commit")
BPB_FIELDS = ("val_bpb", "initial_val_bpb")  # written with every run; a file written before them judged on val_loss
HEADER_FIELDS = ("title", "keys", "lr_key", "points", "select_seeds", "held_out_seeds", "refined", "setup", "settings",
                 "unigram_loss", "data_fingerprint", "baseline", "claims", "ad_hoc_claims", "commit", "metric")


class ResultsError(ValueError):
    """A results file that cannot be read as sweep.py writes it: exit 2 naming it."""


def finite_or_none(x: object) -> object:
    """JSON has no infinity: a non-finite loss is written as null (the run's divergence says why)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def results_text(header: dict, rows: list[dict], keys: list[str], lr_key: str, select: list[int]) -> str:
    """The lines of a sweep's results file: the header, then one line per run in a fixed order (grid values,
    rate, seed), so that the same runs always give the same file."""
    head = {"kind": "sweep", **{k: header[k] for k in HEADER_FIELDS if k in header}}
    runs = [{"kind": "run", **{k: r.get(k) for k in (*keys, lr_key)},
             "role": "selection" if r["seed"] in select else "held_out",
             **{k: finite_or_none(r.get(k)) for k in (*RUN_FIELDS, *BPB_FIELDS)},
             **{k: [finite_or_none(x) for x in r[k]] for k in MECHANISM if r.get(k) is not None}} for r in rows]
    runs.sort(key=lambda r: ([str(r[k]) for k in keys], float(r[lr_key]), r["seed"]))
    return "".join(json.dumps(line, sort_keys=False) + "\n" for line in [head, *runs])


def write_results(out_root: str, folder: str | None, header: dict, rows: list[dict], keys: list[str],
                  lr_key: str) -> list[str]:
    """Write out_root/results.jsonl and, given `folder` (a study's folder in the repository), a copy there named
    after out_root; a file there of another sweep (another title) is first kept as <name>_<its time>.jsonl, not
    lost. Returns the paths written."""
    text = results_text(header, rows, keys, lr_key, header["select_seeds"]).encode()
    name = os.path.basename(os.path.normpath(out_root)) + ".jsonl"
    paths = [os.path.join(out_root, RESULTS_NAME), *([os.path.join(folder, name)] if folder else [])]
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path) and first_line(path).get("title") != header["title"]:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
            kept = f"{os.path.splitext(path)[0]}_{stamp}.jsonl"
            os.replace(path, kept)
            print(f"the results of another sweep in {path} are kept as {kept}")
        write_atomically(path, text)
    return paths


def first_line(path: str) -> dict:
    """The header of a results file ({} if it cannot be read as one)."""
    try:
        with open(path) as f:
            head = json.loads(f.readline() or "{}")
    except (OSError, ValueError):
        return {}
    return head if isinstance(head, dict) else {}


def read_results(path: str) -> dict:
    """A results file as {**its header, "runs": [...]}, each run's missing loss read back as +inf where it diverged
    or crashed; ResultsError naming the file and line when a line is cut off or lacks what the tables need."""
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except ValueError as e:
        raise ResultsError(f"{path}: a line cannot be read as JSON ({e}); restore the file from git") from None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("kind") != "sweep":
        raise ResultsError(f"{path}: its first line is not a sweep's header; restore the file from git")
    head = lines[0]
    missing = [k for k in ("title", "keys", "lr_key", "select_seeds", "held_out_seeds") if k not in head]
    if missing:
        raise ResultsError(f"{path}: the header lacks {', '.join(missing)}; restore the file from git")
    if metric_of(head) not in METRICS:
        raise ResultsError(f"{path}: metric {head['metric']!r} is none of {', '.join(METRICS)}; restore the file "
                           "from git")
    need = (*head["keys"], head["lr_key"], "role", *RUN_FIELDS, *(BPB_FIELDS if metric_of(head) == "val_bpb" else ()))
    for i, line in enumerate(lines[1:], start=2):
        if not (isinstance(line, dict) and line.get("kind") == "run" and all(k in line for k in need)):
            raise ResultsError(f"{path}, line {i}: not a run as sweep.py writes it (it needs {', '.join(need)}); "
                               "restore the file from git")
    return {**head, "runs": [{k: v for k, v in line.items() if k != "kind"} for line in lines[1:]]}


def metric_of(data: dict) -> str:
    """The metric a results file's sweep judged on: val_loss for a file written before they recorded one."""
    return data.get("metric", "val_loss")


def check_one_metric(study: str, files: list[tuple[str, dict]]) -> None:
    """Refuse a study whose sweeps were judged on different metrics: their tables and Holm families cannot mix."""
    metrics = {name: metric_of(data) for name, data in files}
    if len(set(metrics.values())) > 1:
        raise ResultsError(f"{study}: the sweeps were judged on different metrics ("
                           + ", ".join(f"{n}: {m}" for n, m in metrics.items())
                           + "): keep the results of one --metric in a study's folder")


def study_files(folder: str) -> dict[str, list[str]]:
    """{study: its results files} under a results folder: the *.jsonl files in it (a study named after the folder)
    and in each of its subfolders (a study each), sorted by name."""
    def jsonl(path: str) -> list[str]:
        return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".jsonl"))

    if not os.path.isdir(folder):
        raise ResultsError(f"--tables {folder}: no such folder; give the folder the sweeps' --results wrote to")
    studies = {os.path.basename(os.path.normpath(folder)): jsonl(folder)}
    studies.update({name: jsonl(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
                    if os.path.isdir(os.path.join(folder, name))})
    studies = {name: files for name, files in studies.items() if files}
    if not studies:
        raise ResultsError(f"--tables {folder}: no results files (*.jsonl) in it or its subfolders")
    return studies


# ----------------------------------------------------------------------------- the tables, from the results alone


def study_tables(folder: str) -> list[tuple[str, str, list[tuple[str, dict, list[dict]]]]]:
    """(study, its markdown, [(sweep, its results, its per-point table)]) of every study under a results folder
    (study_files: its *.jsonl, and each subfolder's), from those files alone: each sweep's table as the sweep printed
    it, its claims Holm-corrected within each family over the whole study (a claims file's families span its
    sweeps; ad hoc claims are a family of one sweep's rows)."""
    out = []
    for study, files in study_files(folder).items():
        families: dict[str, tuple[Claims, list[dict]]] = {}
        tables = []
        read = [(os.path.splitext(os.path.basename(path))[0], read_results(path)) for path in files]
        check_one_metric(study, read)
        for name, data in read:
            claims = recorded_claims(data, name)
            table, tests = table_of_results(data, claims)
            families.setdefault(claims.sha256 or f"ad hoc claims of {name}", (claims, []))[1].extend(tests)
            tables.append((name, data, table))
        for claims, tests in families.values():
            add_verdicts(tests, claims)
        out.append((study, study_text(study, tables), tables))
    return out


def recorded_claims(data: dict, name: str) -> Claims:
    """The claims a results file recorded: its claims file's text, or its ad hoc claims."""
    if data.get("claims"):
        try:
            return parse_claims_text(data["claims"]["text"], data["claims"]["path"])
        except (ClaimsError, KeyError, TypeError) as e:
            raise ResultsError(f"{name}: the claims it records cannot be read ({e}); restore the file from git") \
                from None
    return as_claims([tuple(c) for c in data.get("ad_hoc_claims") or []])


def table_of_results(data: dict, claims: Claims) -> tuple[list[dict], list[dict]]:
    """A results file's per-point table and its tests (lr_table_tests), each point's rate picked on its selection
    runs as the sweep picked it."""
    keys, lr_key, select, metric = data["keys"], data["lr_key"], data["select_seeds"], metric_of(data)
    rows = data["runs"]
    points = data.get("points") or list({tuple(str(r[k]) for k in keys): {k: r[k] for k in keys} for r in rows}
                                        .values())
    choice = [{**p, **pick_best([r for r in rows if matches(r, p) and r["seed"] in select], lr_key,
                                unigram=data.get("unigram_loss"), metric=metric)} for p in points]
    return lr_table_tests(rows, choice, keys, lr_key, data.get("baseline"), claims, select, data.get("unigram_loss"),
                          data.get("settings"), data.get("setup"), metric)


def study_text(study: str, tables: list[tuple[str, dict, list[dict]]]) -> str:
    """A study's tables in markdown: per sweep its title, its seeds and claims, and its per-point table under the
    scale its words were measured at."""
    parts = [f"# {study}"]
    for name, data, table in tables:
        claims = data.get("claims")
        said = f"claims: {claims['path']} ({claims['state']})" if claims else "claims: ad hoc, on the command line" \
            if data.get("ad_hoc_claims") else "no claims: rows described"
        parts += [f"## {name}", data["title"] + ".",
                  f"Rates picked on seeds {data['select_seeds']}, held-out seeds {data['held_out_seeds']}; {said}.",
                  point_table_text(table, data["keys"], data.get("setup"), metric_of(data))]
    return "\n\n".join(parts) + "\n"
