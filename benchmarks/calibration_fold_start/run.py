"""How much one cross-validation fold's held-out predictions depend on where its refit starts.

Refits the fold that holds out POINT (default: the MI300X default configuration) from the shipped public
constants with vLLM's step and request overheads put at the given values, for ITERATIONS iterations, and
prints that fold's held-out points, measured against predicted.

    PYTHONPATH=src python benchmarks/calibration_fold_start/run.py --request-overhead 80e-6 --step-overhead 4e-3
"""
from __future__ import annotations

import argparse
import time

from servelab.lab.calibrate.excluded import EXCLUDED
from servelab.lab.calibrate.reference_fit import candidate_keys, fit, fold_profile, folds
from servelab.lab.calibrate.target_simulation import simulate_target
from servelab.lab.calibrate.targets import reference_targets
from servelab.lab.catalog.calibration import load_calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", default="vllm062-mi300x-405b-tp8-sharegpt-qps16-default-request-throughput")
    parser.add_argument("--request-overhead", type=float, required=True, help="engines.vllm.request_overhead_s to start from")
    parser.add_argument("--step-overhead", type=float, required=True, help="engines.vllm.step_overhead_s to start from")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--fit-num-prompts", type=int, default=150)
    args = parser.parse_args()
    targets = [t for t in reference_targets(EXCLUDED) if not t.excluded]
    assignment = folds(targets, args.folds)
    fold = next(a for t, a in zip(targets, assignment) if t.id == args.point)
    train = [t for t, a in zip(targets, assignment) if a != fold]
    test = [t for t, a in zip(targets, assignment) if a == fold]
    start = {k: v for k, v in load_calibration("public").values.items() if not k.startswith("gpus.default.")}
    start.update({"engines.vllm.request_overhead_s": args.request_overhead,
                  "engines.vllm.step_overhead_s": args.step_overhead})
    keys = candidate_keys(train)
    began = time.perf_counter()
    result = fit(train, start=start, keys=keys, iterations=args.iterations, num_prompts=args.fit_num_prompts,
                 progress=lambda s: print(f"{s} [{time.perf_counter() - began:.0f} s]", flush=True))
    profile = fold_profile(result, keys, train)
    print(f"refitted: engines.vllm.request_overhead_s {result.values['engines.vllm.request_overhead_s']:.3g}, "
          f"engines.vllm.step_overhead_s {result.values['engines.vllm.step_overhead_s']:.3g}")
    for t in test:
        value = simulate_target(t, profile)
        print(f"{t.id}: measured {t.value:g}, held out {value:.4g} ({(value / t.value - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
