"""`servelab lab calibrate`: fit a calibration profile to measurements, with k-fold cross-validation.

    servelab lab calibrate --reference --save public-refit
    servelab lab calibrate --measurements a.json b.json --gpu h100 --model llama-3.1-8b --engine vllm --save my-h100

With --reference it fits every constant to the published points. With --measurements (vLLM `bench serve
--save-result` files or servelab bench JSON, all from one deployment given by the flags) it starts from
--calibration (default: the shipped profile) and refits only that GPU's, its link's and that engine's
constants. Prints each point's measured value, the fitted simulation and the held-out one.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model's GPU constants to measurements (k-fold cross-validated)")
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
    p.add_argument("--engine", default="vllm", help="engine key the fitted overheads are saved under")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="the server ran --enforce-eager")
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--calibration", default=None, metavar="NAME", help="profile to start from (default: public)")
    p.add_argument("--folds", type=int, default=5, help="k of k-fold cross-validation")
    p.add_argument("--iterations", type=int, default=8, help="Levenberg-Marquardt iterations of the full fit")
    p.add_argument("--fold-iterations", type=int, default=3,
                   help="iterations of each cross-validation fold's refit (from the full fit, with its Jacobian)")
    p.add_argument("--fit-num-prompts", type=int, default=600, help="cap on each target's requests while fitting")
    p.add_argument("--save", metavar="NAME", default=None, help="save the fitted profile under this name")
    p.add_argument("--output", type=Path, default=None, help="also write the profile JSON to this path")
    p.add_argument("--json", action="store_true", help="print the per-point results as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from servelab.lab.calibrate.excluded import EXCLUDED
    from servelab.lab.calibrate.reference_fit import (candidate_keys, cross_validate, fit, quantized_only_gpus,
                                                     simulate_target, with_gpu_defaults)
    from servelab.lab.calibrate.report import fit_report, format_report
    from servelab.lab.calibrate.targets import measurement_targets, reference_targets
    from servelab.lab.catalog.calibration import (DEFAULT_CALIBRATION, CalibrationProfile, load_calibration,
                                                  save_calibration)
    from servelab.lab.catalog.reference import DeploymentFields

    base = load_calibration(args.calibration or DEFAULT_CALIBRATION)
    if args.reference:
        targets, fixed, keys = reference_targets(EXCLUDED), {}, None
        description = "fitted to servelab's published reference points (servelab lab calibrate --reference)"
    else:
        deployment = DeploymentFields(model=args.model, gpu=args.gpu, dtype=args.dtype, num_gpus=args.tp, tp=args.tp,
                                      disaggregate=None, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens, engine=args.engine,
                                      num_scheduler_steps=args.num_scheduler_steps, cuda_graphs=args.cuda_graphs)
        targets = [t for path in args.measurements for t in measurement_targets(path, deployment)]
        keys = [k for k in candidate_keys(targets) if not k.startswith("constants.")]
        fixed = {k: v for k, v in base.values.items() if k not in keys}
        description = (f"{base.name} refitted to {len(targets)} measurements of {args.model} on {args.gpu} "
                       f"(TP {args.tp}, engine {args.engine})")
    used = [t for t in targets if not t.excluded]
    if not used:
        raise ValueError("no measurements to fit")
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    log(f"fitting {len(keys or candidate_keys(used))} constants to {len(used)} points")
    full = fit(used, start=base.values, keys=keys, iterations=args.iterations, num_prompts=args.fit_num_prompts,
               fixed=fixed, progress=log)
    values = with_gpu_defaults(full.values, quantized_only_gpus(used + reference_targets(EXCLUDED)))
    log("full fit: " + json.dumps(values))
    k = max(2, min(args.folds, len(used)))
    held_out = cross_validate(targets, full, k=k, iterations=args.fold_iterations, num_prompts=args.fit_num_prompts,
                              fixed=fixed, progress=log)
    profile = CalibrationProfile(args.save or "unsaved", values, description)
    fitted = [simulate_target(t, profile) for t in targets]
    report = fit_report(targets, fitted, held_out, k)
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
