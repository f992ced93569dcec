"""The handlers behind `servelab lab simulate | advise | sweep` (argparse Namespace in, exit code out)."""
from __future__ import annotations

import argparse

from servelab.lab.analysis.advisor import Advice, advise
from servelab.lab.cli import deployment_from_args, print_json, workload_from_args, workload_json
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.lab.analysis.report import format_evaluation
from servelab.lab.analysis.sweep import parse_values, plot_sweep, run_sweep
from servelab.workload import WorkloadConfig, describe, generate_workload

DOES_NOT_FIT = 1


def _targets(args: argparse.Namespace) -> Targets:
    return Targets(ttft_ms=args.ttft_target, tpot_ms=args.tpot_target)


def run_simulate(args: argparse.Namespace) -> tuple[Evaluation, WorkloadConfig]:
    """`lab simulate` for parsed flags; the lab web page calls this too, so page and command agree."""
    deployment = deployment_from_args(args)
    config = workload_from_args(args)
    return evaluate(deployment, generate_workload(config), _targets(args), multi_step=not args.single_step), config


def simulate_json(e: Evaluation, config: WorkloadConfig) -> dict:
    return {**e.to_json(), "workload": workload_json(config)}


def cmd_simulate(args: argparse.Namespace) -> int:
    e, config = run_simulate(args)
    if args.json:
        print_json(simulate_json(e, config))
    else:
        print(format_evaluation(e, describe(config)))
    return 0 if e.fits else DOES_NOT_FIT


def run_advise(args: argparse.Namespace) -> tuple[Advice, WorkloadConfig]:
    """`lab advise` for parsed flags (shared with the lab web page)."""
    targets = _targets(args)
    if targets.ttft_ms is None:
        raise ValueError("advise needs --ttft-target (and optionally --tpot-target)")
    if args.max_gpus < 1:
        raise ValueError(f"--max-gpus must be >= 1, got {args.max_gpus}")
    base = deployment_from_args(args)
    config = workload_from_args(args)
    return advise(base.model, base.device, generate_workload(config), targets, base=base,
                  max_gpus=args.max_gpus), config


def advise_json(advice: Advice, config: WorkloadConfig) -> dict:
    return {**advice.to_json(), "workload": workload_json(config)}


def cmd_advise(args: argparse.Namespace) -> int:
    advice, config = run_advise(args)
    targets = _targets(args)
    if args.json:
        print_json(advise_json(advice, config))
        return 0 if advice.recommendation else DOES_NOT_FIT
    print(f"workload: {describe(config)}; targets: p99 TTFT <= {targets.ttft_ms:g} ms"
          + (f", p99 TPOT <= {targets.tpot_ms:g} ms" if targets.tpot_ms else ""))
    rec = advice.recommendation
    if rec is None:
        print(f"no deployment of up to {args.max_gpus} {args.gpu} GPUs meets the targets "
              f"({len(advice.candidates)} shapes simulated)")
        return DOES_NOT_FIT
    m = rec.metrics
    print(f"recommended: {rec.deployment.describe()}")
    print(f"  p99 TTFT {m['p99_ttft_ms']:,.1f} ms, p99 TPOT {m['p99_tpot_ms']:.1f} ms, "
          f"{m['output_throughput']:,.0f} output tok/s ({len(advice.candidates)} shapes simulated)")
    width = max(len(d["decision"]) for d in advice.decisions)
    for d in advice.decisions:
        print(f"  {d['decision']:<{width}}  {'taken    ' if d['taken'] else 'not taken'}  {d['why']}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    values = parse_values(args.vary, args.values)
    deployment = deployment_from_args(args)
    config = workload_from_args(args)
    points = run_sweep(deployment, config, _targets(args), args.vary, values, args.meter)
    title = f"{deployment.describe()}\n{describe(config)}"
    path = plot_sweep(points, args.vary, args.meter, args.output, title)
    if args.json:
        for p in points:  # JSON has no inf
            p[args.vary] = "inf" if p[args.vary] == float("inf") else p[args.vary]
        print_json({"vary": args.vary, "meter": args.meter, "points": points, "plot": str(path)})
        return 0
    print(title)
    for p in points:
        value = p[args.meter]
        shown = "does not fit" if value is None else f"{value:,.3f}"
        print(f"  {args.vary} {p[args.vary]:<10g} {args.meter} {shown}")
    print(f"plot: {path}")
    return 0


