"""
What each paper claims of a row's final val loss against the baseline's: a claims file, written and committed
before the runs, or the command line's ad hoc --claim and --row_claim. The claims of one family (one paper's) are
the family of Holm's correction (nanonorm/verdict.py: correct_family); a row no claim names gets a description.

A claims file is JSON:

    {"baseline": {"norm_scheme": "pre"},
     "claims": [{"row": {"norm_scheme": "lns", "n_layer": 8}, "claim": "lower", "delta": 0.037,
                 "paper": "Sun et al. 2025 (LNS), Table 1", "family": "lns-paper",
                 "delta_from": "ln(26.73 / 25.76) nats per BPE token at 130M, taken as nats per character"}]}

`row` names the values of one table row: its grid values and any setting of its sweep (n_layer above, for a study
with one sweep per depth); `claim` is lower, higher (by δ = delta >= 0, in nats) or on_par (within ±δ, δ > 0);
`family` defaults to `paper`. The family's size is the number of its claims in the file, whatever a table holds.
A claim about a mechanism names the diagnostic it is about (`"diagnostic": "attn_first_token_mass"`, one of MECHANISM,
its δ in that diagnostic's units) and is judged on the held-out runs' values of it (the mean over the blocks); a
row may carry one claim per diagnostic.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field

from nanonorm.run_files import write_atomically
from nanonorm.verdict import AD_HOC

CLAIM_WORDS = ("lower", "higher", "on_par")
# The mechanism diagnostics a claim can be about (nanonorm/diagnostics.py: stream_statistics), logged per block on
# a run's eval lines with log_diagnostics: the attention sink, massive activations, outlier channels.
MECHANISM = ("attn_first_token_mass", "stream_max_over_median", "stream_excess_kurtosis")
RECORD_NAME = "claims.json"  # in an out_root: the claims its runs started with


class ClaimsError(ValueError):
    """A claims file that cannot be read as one, or claims changed after the runs: exit 2 with its message."""


@dataclass(frozen=True)
class Claim:
    row: dict  # the values a table row has (grid values, sweep settings); {} matches every row (--claim)
    claim: str | None  # lower, higher, on_par; None: no claim, a description
    delta: float = 0.0
    family: str = AD_HOC
    paper: str = ""
    diagnostic: str | None = None  # what a mechanism claim is about (MECHANISM); None: the sweep's loss


@dataclass(frozen=True)
class Claims:
    claims: tuple[Claim, ...] = ()
    baseline: dict | None = None
    path: str | None = None  # the claims file; None: the command line's ad hoc claims
    sha256: str | None = None
    text: str | None = field(default=None, repr=False)

    def family_size(self, name: str) -> int | None:
        """The claims of a family as a claims file writes them; None for the ad hoc family (its claimed rows)."""
        return sum(c.family == name for c in self.claims) if self.path else None

    def for_row(self, values: dict, diagnostic: str | None = None) -> Claim | None:
        """The claim on a row about `diagnostic` (None: the loss): a claims file's one entry that names it
        (ClaimsError if two do), or the last ad hoc claim whose values it has; None: a description."""
        found = [c for c in self.claims if c.diagnostic == diagnostic
                 and all(str(values.get(k)) == str(v) for k, v in c.row.items())]
        if self.path and len(found) > 1:
            raise ClaimsError(f"{self.path}: the claims on {found[0].row} and {found[1].row} both name the row "
                              f"{values_text(values, found)}; name each row by one claim (add the key that tells "
                              "them apart)")
        return found[-1] if found else None


def values_text(values: dict, claims: list[Claim]) -> str:
    keys = dict.fromkeys(k for c in claims for k in c.row)
    return ",".join(f"{k}={values.get(k)}" for k in keys)


def read_claims(path: str) -> Claims:
    """The claims file at path, checked entry by entry; ClaimsError naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ClaimsError(f"--claims {path}: cannot be read ({e.strerror or e})") from None
    return parse_claims_text(raw.decode(errors="replace"), path)


def parse_claims_text(text: str, path: str) -> Claims:
    """Claims from the text of a claims file (as read_claims, or as a results file records it)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ClaimsError(f"--claims {path}: cannot be read as JSON ({e}); see nanonorm/claims.py for the "
                          "format") from None
    if not (isinstance(data, dict) and isinstance(data.get("claims"), list) and data["claims"]
            and isinstance(data.get("baseline"), dict) and data["baseline"]):
        raise ClaimsError(f"--claims {path}: give an object with a baseline row and a non-empty list of claims, "
                          'e.g. {"baseline": {"norm_scheme": "pre"}, "claims": [...]}')
    claims = tuple(checked_entry(entry, f"--claims {path}, claim {i + 1}") for i, entry in enumerate(data["claims"]))
    return Claims(claims, {k: str(v) for k, v in data["baseline"].items()}, path,
                  hashlib.sha256(text.encode()).hexdigest(), text)


def checked_entry(entry: object, where: str) -> Claim:
    """One claims-file entry as a Claim: row, claim, δ and paper checked."""
    if not isinstance(entry, dict) or not isinstance(entry.get("row"), dict) or not entry["row"]:
        raise ClaimsError(f"{where}: give the row it names, e.g. \"row\": {{\"norm_scheme\": \"lns\"}}")
    if entry.get("claim") not in CLAIM_WORDS:
        raise ClaimsError(f"{where}: claim {entry.get('claim')!r}; choose lower, higher or on_par (a row without a "
                          "claim is left out of the file: it gets a description)")
    delta = entry.get("delta", 0.0)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta < float("inf"):
        raise ClaimsError(f"{where}: delta {delta!r} is the paper's effect size (in nats, or in its diagnostic's "
                          "units); give a number >= 0")
    if entry["claim"] == "on_par" and delta <= 0:
        raise ClaimsError(f"{where}: on_par needs its margin, a delta > 0")
    paper = entry.get("paper")
    if not isinstance(paper, str) or not paper.strip():
        raise ClaimsError(f"{where}: name the paper that makes the claim (\"paper\": ...)")
    family = entry.get("family", paper)
    if not isinstance(family, str) or not family.strip():
        raise ClaimsError(f"{where}: family {family!r}; give a name (default: the paper)")
    diagnostic = entry.get("diagnostic")
    if diagnostic is not None and diagnostic not in MECHANISM:
        raise ClaimsError(f"{where}: diagnostic {diagnostic!r}; a mechanism claim names one of {', '.join(MECHANISM)} "
                          "(a claim on the loss names none)")
    return Claim({k: str(v) for k, v in entry["row"].items()}, entry["claim"], float(delta), family, paper,
                 diagnostic)


def committed_state(path: str) -> str:
    """Whether the claims file is committed as it is: "committed at <commit>", "edited since <commit>", or "not
    committed" (also outside a git checkout): a claim fixed before the runs is one others can see was."""
    folder = os.path.dirname(os.path.abspath(path))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("log", "-1", "--format=%h", "--", os.path.abspath(path))
        edited = git("status", "--porcelain", "--", os.path.abspath(path))
    except (OSError, subprocess.CalledProcessError):
        return "not committed"
    return "not committed" if not commit else f"edited since {commit}" if edited else f"committed at {commit}"


def check_fixed_before_runs(out_root: str, claims: Claims, has_runs: bool) -> None:
    """Keep the claims an out_root's runs started with in out_root/claims.json, and refuse other ones: claims
    are fixed before the runs, so a claims file edited since (another δ, another row), or one given first to a
    folder that already holds runs, is refused (ClaimsError) rather than judged on runs it has seen."""
    record = os.path.join(out_root, RECORD_NAME)
    if os.path.exists(record):
        try:
            with open(record) as f:
                kept = json.load(f)
        except (OSError, ValueError):
            raise ClaimsError(f"{record} cannot be read; it keeps the claims this folder's runs started with: "
                              "restore it, or use another --out_root") from None
        if kept.get("sha256") != claims.sha256:
            raise ClaimsError(f"{claims.path} differs from the claims this folder's runs started with (kept in "
                              f"{record}, from {kept.get('path')}): claims are fixed before the runs; give that "
                              "file as it was, or another --out_root for the new claims")
        return
    if has_runs:
        raise ClaimsError(f"{out_root} holds runs made without --claims: claims are fixed before the runs they "
                          "judge; give another --out_root and run the sweep with --claims from its start")
    os.makedirs(out_root, exist_ok=True)
    write_atomically(record, json.dumps({"path": claims.path, "sha256": claims.sha256, "text": claims.text},
                                        indent=1).encode())
