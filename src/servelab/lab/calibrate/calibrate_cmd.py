"""`servelab lab calibrate`: fit a calibration profile to measurements, cross-validated by source.

    servelab lab calibrate --reference --save public-refit
    servelab lab calibrate --measurements a.json b.json --gpu h100 --model llama-3.1-8b --engine vllm --save my-h100

With --reference it fits every constant to the published points, from the priors. With --measurements
(vLLM `bench serve --save-result` files or servelab bench JSON, all from one deployment given by the flags)
it starts from --calibration (default: the shipped profile) and refits only that GPU's, its link's and that
engine's constants. Each source (a published document; a measurement file) is held out in turn and
predicted by a fit to the others that starts where the full fit starts (cross_validation.py). Prints each
point's measured value, the fitted simulation and the held-out one.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from servelab.executor.efficiency import ENGINES


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model's GPU constants to measurements (cross-validated by source)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--reference", action="store_true", help="the published reference points shipped with servelab")
    source.add_argument("--measurements", nargs="+", type=Path, metavar="FILE",
                        help="vllm bench serve --save-result JSON or servelab bench JSON files, all of one deployment")
    p.add_argument("--model", default="llama-3.1-8b", help="the measured deployment's model (catalog id)")
    p.add_argument("--gpu", default="h100", help="the measured deployment's GPU (catalog id)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--engine", default="vllm", choices=ENGINES, help="engine key the fitted overheads are saved under")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="the server ran --enforce-eager")
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--calibration", default=None, metavar="NAME", help="profile to start from (default: public)")
    p.add_argument("--iterations", type=int, default=8, help="Levenberg-Marquardt iterations of the full fit")
    p.add_argument("--fold-iterations", type=int, default=4,
                   help="iterations of each leave-one-source-out fold's fit (from the priors' Jacobian, Broyden-updated)")
    p.add_argument("--fit-num-prompts", type=int, default=600, help="cap on each target's requests while fitting")
    p.add_argument("--predict-other-sources", action="store_true",
                   help="with --reference: also predict the reference set's sources the fit leaves out (not in "
                        "FIT_SOURCES) with the fitted constants, reported apart as held out")
    p.add_argument("--save", metavar="NAME", default=None, help="save the fitted profile under this name")
    p.add_argument("--output", type=Path, default=None, help="also write the profile JSON to this path")
    p.add_argument("--json", action="store_true", help="print the per-point results as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from servelab.lab.calibrate.reference.cross_validation import PriorJacobian, cross_validate
    from servelab.lab.calibrate.reference.reference_fit import candidate_keys, fit, simulate_target
    from servelab.lab.calibrate.report import fit_report, format_report
    from servelab.lab.calibrate.targets import measurement_targets, other_source_targets, reference_targets
    from servelab.lab.catalog.calibration import (DEFAULT_CALIBRATION, CalibrationProfile, load_calibration,
                                                  save_calibration, with_family_defaults)
    from servelab.lab.catalog.reference import DeploymentFields

    if args.reference:
        targets, fixed, start = reference_targets(), {}, {}
        keys = candidate_keys(targets)
        description = "fitted to servelab's published reference points (servelab lab calibrate --reference)"
    else:
        base = load_calibration(args.calibration or DEFAULT_CALIBRATION)
        deployment = DeploymentFields(model=args.model, gpu=args.gpu, dtype=args.dtype, num_gpus=args.tp, tp=args.tp,
                                      disaggregate=None, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens, engine=args.engine,
                                      num_scheduler_steps=args.num_scheduler_steps, cuda_graphs=args.cuda_graphs)
        targets = [t for path in args.measurements for t in measurement_targets(path, deployment)]
        keys = [k for k in candidate_keys(targets) if not k.startswith("constants.")]
        fixed = {k: v for k, v in base.values.items() if k not in keys}
        start = base.values
        description = (f"{base.name} refitted to {len(targets)} measurements of {args.model} on {args.gpu} "
                       f"(TP {args.tp}, engine {args.engine})")
    if not targets:
        raise ValueError("no measurements to fit")
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    log(f"fitting {len(keys)} constants to {len(targets)} points; Jacobian at the start")
    # one Jacobian at the start serves the full fit and every fold (each row is its own point's)
    jac = PriorJacobian(targets, keys, start, fixed, args.fit_num_prompts)
    full = fit(targets, start=start, keys=keys, iterations=args.iterations, num_prompts=args.fit_num_prompts,
               fixed=fixed, progress=log, jacobian=jac.rows(targets, keys), caps=jac.caps)
    values = with_family_defaults(full.values, targets + (reference_targets() if not args.reference else []))
    log("full fit: " + json.dumps(values))
    held_out = cross_validate(targets, start=start, keys=keys, iterations=args.fold_iterations,
                              num_prompts=args.fit_num_prompts, fixed=fixed, progress=log, prior_jacobian=jac)
    profile = CalibrationProfile(args.save or "unsaved", values, description)
    fitted = [simulate_target(t, profile) for t in targets]
    others = other_source_targets() if args.reference and args.predict_other_sources else []
    log(f"predicting {len(others)} points of the sources the fit leaves out")
    predicted = [simulate_target(t, profile) for t in others]
    report = fit_report(targets + others, fitted + predicted, held_out + predicted,
                        [True] * len(targets) + [False] * len(others))
    profile = CalibrationProfile(profile.name, values, description, fit=report)
    if args.save:
        log(f"saved {save_calibration(profile)}")
    if args.output:
        args.output.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report, values))
    s = report["summary"]
    return 0 if math.isfinite(s["held_out_mean_abs_error"]) else 1
