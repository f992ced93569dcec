"""`servelab lab validate`: does the lab agree with the real engine on this machine?

One seeded workload runs per stage (1 serial, 2 static batching, 3 continuous + paged, 4 the same
over -tp 3 worker processes, priced with the profile's measured all-reduce, 5 prefill/decode
disaggregated 1:1, priced with the profile's measured KV transfer): through
`servelab serve` and the load generator (as `servelab bench stages` runs it), and in the simulator with
the `local-cpu` profile (`servelab lab profile`). The same seed gives both the same arrivals and
lengths. A shared machine's speed drifts between minutes, so the real engine runs --repeats times,
each repeat after a fresh `servelab lab profile` (unless --no-refresh-profile), and the simulation of
each repeat's profile is compared by medians: simulated median vs real median, with the real runs'
own spread (max / min - 1) beside each error. Exit code 1 when a checked metric (output tokens/s,
median TTFT, median TPOT) is off by more than --tolerance.

Stage 5's simulation: one prefill and one decode instance, KV handoffs priced with the profile's measured
send (latency + bytes/s), and each instance on its share of the cores (`servelab serve --disaggregate`
gives each engine core cores / instances torch threads): its measured compute curves stretched by the
number of instances, a first-order model of two processes splitting the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


CHECKED = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
SHOWN = CHECKED + ("p99_ttft_ms", "median_e2el_ms", "request_throughput", "prefix_cache_hit_rate")
LABELS = {"output_throughput": "output tok/s", "median_ttft_ms": "TTFT p50 ms", "median_tpot_ms": "TPOT p50 ms",
          "p99_ttft_ms": "TTFT p99 ms", "median_e2el_ms": "E2E p50 ms", "request_throughput": "req/s",
          "prefix_cache_hit_rate": "prefix hit rate"}


def add_validate_parser(sub) -> None:
    from servelab.bench.serve import add_output_args, add_request_args, add_workload_args
    from servelab.bench.stages import ALL_STAGES, STAGES

    p = sub.add_parser("validate", help="run one workload on the real engine and in the lab (local-cpu), compare")
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct); "
                   "the one `servelab lab profile` measured")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated, from " + ",".join(ALL_STAGES))
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch slots of the static and continuous stages")
    p.add_argument("--server-args", default="", help="more `servelab serve` flags for every stage")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--tolerance", type=float, default=0.15, help="largest relative error accepted (0.15 = 15%%)")
    p.add_argument("--repeats", type=int, default=3, help="real runs of every stage, compared by their median")
    p.add_argument("--no-refresh-profile", dest="refresh_profile", action="store_false",
                   help="keep the saved profile instead of re-measuring it before each repeat after the first")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--reference", nargs="?", type=Path, const=True, default=None, metavar="FILE",
                   help="instead of the local engine: GPU measurements (default: the published reference points) "
                   "beside their simulation")
    p.add_argument("--calibration", default=None, metavar="NAME", help="with --reference: the constants to use")
    add_workload_args(p, num_prompts=48)
    add_request_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_validate, ignore_eos=True, input_len=64, output_len=64, range_ratio=0.5,
                   request_rate=1.0)


def shared_cores(efficiency, num_instances: int):
    """The profile's efficiency for one of num_instances engine processes splitting this CPU's cores:
    what the measured curves and fitted rates price takes num_instances times as long."""
    from dataclasses import replace

    from servelab.executor.curve import PiecewiseLinear

    def stretch(curve):
        return None if curve is None else PiecewiseLinear(curve.xs, tuple(y * num_instances for y in curve.ys))

    e = efficiency
    return replace(e, matmul=e.matmul / num_instances, attention=e.attention / num_instances,
                   memory=e.memory / num_instances, kv_memory=e.kv_memory / num_instances,
                   layers_curve=stretch(e.layers_curve), lm_head_curve=stretch(e.lm_head_curve))


def simulated_metrics(profile, spec, stage: str, max_num_seqs: int, config) -> dict:
    from servelab.lab.sim.deployment import Deployment
    from servelab.lab.analysis.evaluate import evaluate
    from servelab.workload import generate_workload

    from servelab.bench.stages import STAGE4_TENSOR_PARALLEL_SIZE

    # Stage 4 is stage 3 over tp processes, each holding 1/tp of the KV heads of the same number of blocks.
    tp = STAGE4_TENSOR_PARALLEL_SIZE if stage == "tp" else 1
    shape = dict(num_gpus=tp, tensor_parallel_size=tp, schedule="continuous" if stage == "tp" else stage,
                 efficiency=profile.efficiency, kv_cache_bytes=profile.kv_cache_bytes // tp)
    if stage == "disaggregated":
        shape = dict(num_gpus=2, schedule="continuous", num_prefill_instances=1, num_decode_instances=1,
                     router="least-loaded", efficiency=shared_cores(profile.efficiency, 2),
                     kv_transfer_link=profile.kv_transfer_link, kv_cache_bytes=profile.kv_cache_bytes)
    if stage in ("dp", "prefix"):  # stage 6: two replicas (each on half the cores) behind the API server's router
        shape = dict(num_gpus=2, schedule="continuous", router="prefix" if stage == "prefix" else "least-loaded",
                     efficiency=shared_cores(profile.efficiency, 2), kv_cache_bytes=profile.kv_cache_bytes)
    deployment = Deployment(model=spec, device=profile.device, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=profile.max_num_batched_tokens,
                            block_size=profile.block_size, dtype=profile.dtype,
                            kv_cache_dtype=profile.kv_cache_dtype, **shape)
    e = evaluate(deployment, generate_workload(config))
    if not e.fits:
        raise ValueError(f"the workload does not fit the profiled engine: {e.reason}")
    prefix = e.meters.get("prefix_cache")
    return {**e.metrics, **({"prefix_cache_hit_rate": prefix["hit_rate"]} if prefix else {})}


def profile_server_args(profile, spec) -> str:
    """Serve with the settings the profile was measured with (its mode: weights and KV cache dtype, and
    its KV pool included), so both sides run the same engine."""
    return (f"{profile.mode} --max-num-batched-tokens {profile.max_num_batched_tokens} "
            f"--block-size {profile.block_size} --num-kv-blocks {profile.num_kv_blocks(spec)}")


def compare(stage: str, real: dict, simulated: dict) -> dict:
    error = {k: simulated[k] / real[k] - 1 if real.get(k) and simulated.get(k) is not None else None for k in SHOWN}
    return {"stage": stage, "real": {k: real.get(k) for k in SHOWN}, "simulated": {k: simulated.get(k) for k in SHOWN},
            "error": error}


def median_compare(stage: str, reals: list[dict], simulations: list[dict]) -> dict:
    """compare() of the medians over repeats, plus the real runs' spread (max / min - 1) and each run."""
    real, simulated, spread = {}, {}, {}
    for key in SHOWN:
        values = [r[key] for r in reals if r.get(key)]
        real[key] = statistics.median(values) if values else None
        spread[key] = max(values) / min(values) - 1 if values else None
        sims = [s[key] for s in simulations if s.get(key) is not None]
        simulated[key] = statistics.median(sims) if sims else None
    return {**compare(stage, real, simulated), "spread": spread,
            "runs": [{k: r.get(k) for k in SHOWN} for r in reals],
            "simulated_runs": [{k: s.get(k) for k in SHOWN} for s in simulations]}


def table_rows(comparisons: list[dict]) -> list[dict]:
    rows = []
    for c in comparisons:
        for key in SHOWN:
            if key == "prefix_cache_hit_rate" and c["real"][key] is None and c["simulated"][key] is None:
                continue  # a workload without shared prefixes
            err, spread = c["error"][key], c.get("spread", {}).get(key)
            rows.append({"stage": c["stage"], "metric": LABELS[key] + (" *" if key in CHECKED else ""),
                         "real (median)": c["real"][key], "simulated": c["simulated"][key],
                         "error": "-" if err is None else f"{err:+.1%}",
                         "real spread": "-" if spread is None else f"{spread:.0%}"})
    return rows


def refresh_profile(args: argparse.Namespace, profile, spec) -> None:
    """`servelab lab profile` for the model under test, in its own process (it builds its own engine),
    with the engine settings the current profile was measured with (its KV pool included)."""
    command = [sys.executable, "-m", "servelab.entrypoints.cli", "lab", "profile",
               *shlex.split(profile_server_args(profile, spec)), "--max-num-seqs", str(profile.max_num_seqs)]
    if args.model:
        command += ["--model", args.model]
    if profile.fit.get("quick"):
        command += ["--quick"]
    if "repeats" in profile.fit:
        command += ["--repeats", str(profile.fit["repeats"])]
    subprocess.run(command, check=True, stdout=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from servelab.bench.datasets import load_tokenizer
    from servelab.bench.results import markdown_table, write_results
    from servelab.bench.serve import requests_from_args, workload_from_args
    from servelab.bench.stages import STAGE_LABELS, parse_stages, run_stage
    from servelab.lab.catalog.cpu_profile import load_cpu_profile, profile_path
    from servelab.lab.calibrate.profile_run import profiled_model_spec

    if args.reference is not None:
        from servelab.lab.calibrate.reference.reference_validate import cmd_validate_reference
        return cmd_validate_reference(args)
    if not 0 < args.tolerance < 1:
        raise ValueError(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    stages = parse_stages(args.stages)
    spec = profiled_model_spec(args.model)
    config = workload_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    requests = requests_from_args(args, tokenizer)
    user_server_args = args.server_args
    if args.json:
        args.disable_tqdm = True
    reals = {stage: [] for stage in stages}
    simulations = {stage: [] for stage in stages}
    profile_fits = []
    profile = load_cpu_profile()
    with tempfile.TemporaryDirectory(prefix="servelab-validate-") as log_dir:
        for repeat in range(args.repeats):
            # progress lines go to stderr when stdout carries the JSON
            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                if repeat and args.refresh_profile:
                    refresh_profile(args, profile, spec)
                profile = load_cpu_profile()
                profile.check_model(spec)
                profile_fits.append({k: v for k, v in profile.fit.items() if k != "steps"})
                args.server_args = f"{profile_server_args(profile, spec)} {user_server_args}".strip()
                for stage in stages:
                    simulations[stage].append(simulated_metrics(profile, spec, stage, args.max_num_seqs, config))
                    real = run_stage(args, stage, requests, tokenizer, {}, Path(log_dir))
                    if real["failed"]:
                        raise ValueError(f"{real['failed']} requests failed in stage {stage}: "
                                         f"{real.get('error_counts')}")
                    reals[stage].append(real)
    comparisons = [median_compare(STAGE_LABELS[stage], reals[stage], simulations[stage]) for stage in stages]
    worst = max(abs(c["error"][k]) for c in comparisons for k in CHECKED if c["error"][k] is not None)
    ok = worst <= args.tolerance
    name = args.name or f"lab-validate-{time.strftime('%Y%m%d-%H%M%S')}"
    flags = sys.argv[sys.argv.index("validate") + 1:] if "validate" in sys.argv else []
    command = "servelab lab validate " + shlex.join(flags)
    payload = {"command": command, "workload": {**config.__dict__, "request_rate": str(config.request_rate)},
               "max_num_seqs": args.max_num_seqs, "server_args": args.server_args, "profile": str(profile_path()),
               "mode": {"dtype": profile.dtype, "quantization": profile.quantization,
                        "kv_cache_dtype": profile.kv_cache_dtype},
               "repeats": args.repeats, "refresh_profile": args.refresh_profile, "profile_fits": profile_fits,
               "tolerance": args.tolerance,
               "max_abs_error": worst, "within_tolerance": ok, "stages": comparisons}
    rows = table_rows(comparisons)
    write_results(name, payload, rows, out_dir=args.result_dir / name)
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(markdown_table(rows))
        print(f"mode (both sides): {profile.mode}")
        print(f"medians of {args.repeats} real runs; real spread = max / min - 1 over those runs")
        print(f"largest error of the checked (*) metrics: {worst:.1%} "
              f"({'within' if ok else 'OVER'} the {args.tolerance:.0%} tolerance)")
        print(f"results: {args.result_dir / name}")
    return 0 if ok else 1
