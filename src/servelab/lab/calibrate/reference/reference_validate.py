"""`servelab lab validate --reference [FILE]`: the lab's simulation beside published (or your own) GPU
measurements, with a calibration's constants. FILE holds points in the format of the shipped reference files
(data/reference/<source>.json: {"points": [...]}); without it, the points the shipped calibration is fitted to."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from servelab.lab.calibrate.reference.reference_fit import simulate_target
from servelab.lab.calibrate.report import fit_report, format_report
from servelab.lab.calibrate.targets import Target
from servelab.lab.catalog.calibration import DEFAULT_CALIBRATION, load_calibration
from servelab.lab.catalog.reference import load_reference_points, parse_point, read_points_file, to_simulation


def reference_file_targets(path: Path | None) -> list[Target]:
    """The targets of a points file; None: the shipped calibration's points."""
    if path is None:
        points = load_reference_points()
    else:
        try:
            points = [parse_point(entry) for entry in read_points_file(path)]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"cannot read reference points from {path}: {err}") from None
    targets = []
    for p in points:
        sim = to_simulation(p)
        targets.append(Target(p.id, p.group, sim.deployment, sim.workload, sim.metric, p.metric.value, p.source.url,
                              p.load))
    return targets


def cmd_validate_reference(args: argparse.Namespace) -> int:
    profile = load_calibration(args.calibration or DEFAULT_CALIBRATION)
    targets = reference_file_targets(None if args.reference is True else args.reference)
    fitted = {p["id"]: p for p in profile.fit.get("points", [])}
    simulated = [simulate_target(t, profile) for t in targets]
    # held-out values only where this profile's own cross-validation produced them for the same point
    held = [fitted.get(t.id, {}).get("held_out") if t.value == fitted.get(t.id, {}).get("measured") else None
            for t in targets]
    report = fit_report(targets, simulated, held)
    if args.json:
        print(json.dumps({"calibration": profile.name, **report}, indent=1))
    else:
        print(f"calibration {profile.name!r}: simulated with its constants; held-out where its cross-validation ran")
        print(format_report(report, profile.values))
    return 0
