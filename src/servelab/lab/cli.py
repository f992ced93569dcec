"""`servelab lab simulate | advise | sweep | profile | validate | web`: flags -> the typed lab API (lab/api.py).
The deployment flags are the real engine's names, the workload flags the load generator's (`vllm bench serve`'s);
defaults come from the API's request values, so the command and the web page agree."""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from servelab.config import SCHEDULE_POLICIES
from servelab.executor.efficiency import ENGINES
from servelab.errors import FieldError
from servelab.lab.api import DeploymentRequest, TargetsRequest
from servelab.lab.catalog import LOCAL_CPU, gpu_ids, model_ids
from servelab.lab.sim.deployment import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, ROUTERS
from servelab.specs import KV_CACHE_DTYPES
from servelab.trace_formats import add_trace_args, trace_fields
from servelab.workload import DATASETS, WorkloadConfig

# API field -> flag, where the flag is not the field with dashes
_FLAGS = {"ttft_target_ms": "--ttft-target", "tpot_target_ms": "--tpot-target", "startup_s": "--startup-time",
          "cooldown_s": "--cooldown", "interval_s": "--scale-interval"}


def flag_name(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


class LabArgumentParser(argparse.ArgumentParser):
    """Bad input: one line naming the problem, exit code 2."""

    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def duration_ms(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)?\s*", text.lower())
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration like 500ms or 0.5s, got {text!r}")
    return float(match[1]) * (1000.0 if match[2] == "s" else 1.0)


def split_ratio(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise argparse.ArgumentTypeError(f"expected P:D with P, D >= 1 (e.g. 1:3), got {text!r}")
    return int(match[1]), int(match[2])


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DeploymentRequest.model,
                   help=f"catalog id ({', '.join(model_ids())}) or a Hugging Face config.json path")
    p.add_argument("--gpu", default=DeploymentRequest.gpu, help=f"catalog id ({', '.join(gpu_ids())}) or {LOCAL_CPU}")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 (default on GPUs), float16, float32, fp8 (W8A8 checkpoint: fp8 GEMMs where the GPU "
                        "has them) or fp4 (NVFP4: fp4 GEMMs on Blackwell)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the activations' dtype (on local-cpu: the profiled engine's); fp8 halves a bf16 "
                        "cache (vLLM --kv-cache-dtype); int8: servelab's int8 rows, an fp32 scale each")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", default=None, metavar="NAME",
                   help="fitted GPU constants (`servelab lab calibrate --save NAME`); default: the shipped 'public'")
    p.add_argument("--engine", default=DeploymentRequest.engine, choices=ENGINES,
                   help="serving stack and version whose overheads apply: vllm (V1, the default), vllm-v0, sglang, "
                        "tensorrt-llm (1.x), lmdeploy")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="launch every kernel of every step (vLLM --enforce-eager)")
    p.add_argument("--num-scheduler-steps", type=int, default=DeploymentRequest.num_scheduler_steps,
                   help="decode steps per scheduling pass (vLLM multi-step scheduling)")
    p.add_argument("--no-mixed-batches", dest="mixed_batches", action="store_false",
                   help="prefills run in steps of their own while decodes wait (vLLM V0 without chunked prefill, "
                        "SGLang without --enable-mixed-chunk)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as the engine\'s flag: {"method": "ngram", "num_speculative_tokens": K}')
    p.add_argument("--spec-acceptance-rate", type=float, default=None, metavar="A",
                   help="probability each draft is accepted (up to the first rejected); `servelab lab profile` "
                        "measures it on this machine's engine")


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-gpus", type=int, default=None, help="default: one instance's worth")
    p.add_argument("--tp", type=int, default=DeploymentRequest.tp, help="tensor-parallel degree of each instance")
    p.add_argument("--schedule", choices=SCHEDULE_POLICIES, default=DeploymentRequest.schedule)
    p.add_argument("--disaggregate", type=split_ratio, default=None, metavar="P:D",
                   help="P prefill and D decode instances instead of replicas")
    p.add_argument("--max-num-seqs", type=int, default=None, help=f"default {DEFAULT_MAX_NUM_SEQS} (vLLM's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"per-step token budget, default {DEFAULT_MAX_NUM_BATCHED_TOKENS}")
    p.add_argument("--block-size", type=int, default=DeploymentRequest.block_size)
    p.add_argument("--router", choices=ROUTERS, default=DeploymentRequest.router)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=DeploymentRequest.enable_prefix_caching,
                   help="share cached KV blocks between requests of the prefix-shared dataset (the engine's default)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=DATASETS, default=WorkloadConfig.dataset)
    p.add_argument("--input-len", type=int, default=None,
                   help="random dataset, default 1024; prefix-shared: each request's own suffix, default 256")
    p.add_argument("--prefix-len", type=int, default=None, help="prefix-shared dataset: shared prefix, default 256")
    p.add_argument("--num-prefixes", type=int, default=None, help="prefix-shared dataset: distinct prefixes, default 10")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (random)")
    p.add_argument("--range-ratio", type=float, default=WorkloadConfig.range_ratio, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--request-rate", type=float, default=WorkloadConfig.request_rate, help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=WorkloadConfig.burstiness, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--num-prompts", type=int, default=WorkloadConfig.num_prompts)
    p.add_argument("--rate-schedule", default=None, metavar="KIND:SPEC",
                   help="a rate that changes over time, replacing --request-rate and --num-prompts: "
                        "steps:0=2,600=8,1200=2,1800=2 | ramp:0=1,900=20,1800=1 | "
                        "diurnal:mean=10,peak=18,hours=24 | trace:FILE (arrival seconds, one per line)")
    p.add_argument("--seed", type=int, default=WorkloadConfig.seed)
    add_trace_args(p)
    p.add_argument("--ttft-target", type=duration_ms, default=None, metavar="DURATION", help="e.g. 500ms or 0.5s")
    p.add_argument("--tpot-target", type=duration_ms, default=None, metavar="DURATION", help="e.g. 50ms")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def add_lab_parser(subparsers):
    """`servelab lab ...`; returns the lab's subcommands, where the entry point adds `web` (a sibling front-end)."""
    lab = subparsers.add_parser("lab", help="simulate serving deployments of datacenter GPUs on a virtual clock")
    commands = lab.add_subparsers(dest="lab_command", required=True, parser_class=LabArgumentParser)
    _add_lab_commands(commands)
    return commands


def _handler(name: str):
    """The command modules load only when a lab command runs, not when `servelab` builds its parser."""
    def run(args: argparse.Namespace) -> int:
        return globals()[name](args)
    return run


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    from servelab.lab.api import AutoscaleRequest
    a = AutoscaleRequest
    p.add_argument("--autoscale", choices=("keda", "dynamo"), default=None,
                   help="scale replicas (or prefill and decode pools) over time: keda = the HPA formula on vLLM's "
                        "metrics, dynamo = Dynamo's load-based planner; compared with a fixed --max-replicas")
    p.add_argument("--min-replicas", type=int, default=a.min_replicas)
    p.add_argument("--max-replicas", type=int, default=a.max_replicas)
    p.add_argument("--startup-time", type=float, default=a.startup_s, metavar="SECONDS",
                   help="a new replica's start-up before it serves (the scale-up delay)")
    p.add_argument("--cooldown", type=float, default=a.cooldown_s, metavar="SECONDS",
                   help="scale-down waits this long (HPA stabilization window)")
    p.add_argument("--scale-interval", type=float, default=a.interval_s, metavar="SECONDS",
                   help="between metric scrapes and decisions")
    p.add_argument("--target-waiting", type=float, default=a.target_waiting,
                   help="num_requests_waiting per replica the autoscaler aims at")
    p.add_argument("--target-kv-usage", type=float, default=a.target_kv_usage,
                   help="kv_cache_usage_perc the autoscaler aims at (0-1)")


def autoscale_request(args: argparse.Namespace):
    from servelab.lab.api import AutoscaleRequest
    if args.autoscale is None:
        return None
    return AutoscaleRequest(policy=args.autoscale, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                            startup_s=args.startup_time, cooldown_s=args.cooldown, interval_s=args.scale_interval,
                            target_waiting=args.target_waiting, target_kv_usage=args.target_kv_usage)


def _add_frontier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost frontier", "search GPU type x GPU count x TP x P:D split x max batch and price it")
    g.add_argument("--pareto", action="store_true",
                   help="print the cheapest configuration meeting the targets and the Pareto frontiers "
                        "(tokens/s per GPU vs latency; $ per million tokens vs SLO attainment)")
    g.add_argument("--gpus", default="h100,h200,a100-80gb,mi300x", help="comma-separated catalog GPU ids")
    g.add_argument("--price", action="append", default=[], metavar="GPU=USD",
                   help="override a GPU's $/GPU-hour (repeatable), e.g. h100=2.49")
    g.add_argument("--prices", type=Path, default=None, metavar="FILE",
                   help="a JSON price list like lab/catalog/data/prices.json, replacing the shipped one")
    g.add_argument("--max-num-seqs-grid", default="64,256", metavar="N,N", help="max batch sizes searched")
    g.add_argument("--latency-metric", default="p99_ttft_ms",
                   help="the throughput frontier's latency axis: p99_ttft_ms, p99_tpot_ms, median_ttft_ms, ...")
    g.add_argument("--frontier-max-gpus", type=int, default=16, metavar="N",
                   help="largest deployment searched (GPU counts 1, 2, 4, ... up to N)")
    g.add_argument("--plot", type=Path, default=None, metavar="PNG", help="draw both frontiers to this file")


def _add_lab_commands(sub) -> None:
    sim = sub.add_parser("simulate", help="simulate one deployment and print its meters")
    for add in (_add_model_args, _add_deployment_args, _add_engine_args, _add_workload_args):
        add(sim)
    sim.add_argument("--single-step", action="store_true", help="price every step separately (same result, slower)")
    _add_autoscale_args(sim)
    sim.add_argument("--slo-attribution", action="store_true",
                     help="for requests missing --ttft-target/--tpot-target: share of latency queued, in prefill, "
                          "in KV transfer, in decode slowed by others' prefills")
    sim.set_defaults(func=_handler("cmd_simulate"))

    adv = sub.add_parser("advise", help="find the fewest GPUs that meet the targets, and say why")
    _add_model_args(adv)
    _add_engine_args(adv)
    _add_workload_args(adv)
    adv.add_argument("--max-gpus", type=int, default=64)
    adv.add_argument("--router", choices=ROUTERS, default="round-robin")
    adv.add_argument("--max-num-seqs", type=int, default=None)
    adv.add_argument("--max-num-batched-tokens", type=int, default=None)
    adv.add_argument("--block-size", type=int, default=16)
    _add_autoscale_args(adv)
    _add_frontier_args(adv)
    adv.set_defaults(func=_handler("cmd_advise"), num_gpus=None, tp=1, schedule="continuous", disaggregate=None)

    swp = sub.add_parser("sweep", help="plot a meter against a workload or deployment input (PNG)")
    for add in (_add_model_args, _add_deployment_args, _add_engine_args, _add_workload_args):
        add(swp)
    swp.add_argument("--vary", default=None, help="request-rate, input-len, output-len, burstiness, num-gpus, "
                     "tp, max-num-seqs or max-num-batched-tokens")
    swp.add_argument("--values", default=None, help="comma-separated, e.g. 1,2,4,8,16")
    swp.add_argument("--meter", default="p99_ttft_ms",
                     help="a metric key (p99_ttft_ms, output_throughput, ...) or meter.field (kv_cache.peak_usage)")
    swp.add_argument("--output", type=Path, default=Path("lab-sweep.png"), help="PNG path")
    _add_frontier_args(swp)
    swp.set_defaults(func=_handler("cmd_sweep"))

    from servelab.lab.calibrate.profile_run import add_profile_parser
    from servelab.lab.calibrate.calibrate_cmd import add_calibrate_parser
    from servelab.lab.calibrate.validate import add_validate_parser
    add_profile_parser(sub)
    add_validate_parser(sub)
    add_calibrate_parser(sub)


def build_lab_parser(parser_class: type[argparse.ArgumentParser] = LabArgumentParser) -> argparse.ArgumentParser:
    parser = parser_class(prog="servelab lab", description=__doc__)
    _add_lab_commands(parser.add_subparsers(dest="lab_command", required=True, parser_class=parser_class))
    return parser


def deployment_request(args: argparse.Namespace) -> DeploymentRequest:
    return DeploymentRequest(
        model=args.model, gpu=args.gpu, dtype=args.dtype, num_gpus=args.num_gpus, tp=args.tp, schedule=args.schedule,
        disaggregate=args.disaggregate, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, router=args.router,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        calibration=args.calibration, engine=args.engine, cuda_graphs=args.cuda_graphs,
        num_scheduler_steps=args.num_scheduler_steps, mixed_batches=args.mixed_batches,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        speculative_config=args.speculative_config, spec_acceptance_rate=args.spec_acceptance_rate)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.range_ratio, request_rate=args.request_rate,
                          burstiness=args.burstiness, seed=args.seed, rate_schedule=args.rate_schedule,
                          prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, **trace_fields(args))


def targets_request(args: argparse.Namespace) -> TargetsRequest:
    return TargetsRequest(ttft_target_ms=args.ttft_target, tpot_target_ms=args.tpot_target)


def cmd_simulate(args: argparse.Namespace) -> int:
    from servelab.lab import api
    from servelab.lab.analysis.report import format_evaluation
    from servelab.workload import describe

    result = api.simulate(api.SimulateRequest(deployment_request(args), workload_config(args), targets_request(args),
                                              multi_step=not args.single_step, autoscale=autoscale_request(args),
                                              slo_attribution=args.slo_attribution))
    if args.json:
        sys.stdout.write(api.format_json(result.to_json()))
    else:
        text = format_evaluation(result.evaluation, describe(result.workload))
        if result.profiled_mode is not None:  # under the deployment's line: the mode the profile measured
            head, _, rest = text.partition("\n")
            text = f"{head}\nmode: {result.profiled_mode['flags']} (the local-cpu profile's engine)\n{rest}"
        print(text)
        for line in format_extras(result):
            print(line)
    return 0 if result.evaluation.fits else api.DOES_NOT_FIT


BANDED = (("TTFT p50", "median_ttft_ms", "ms"), ("TPOT p50", "median_tpot_ms", "ms"),
          ("output throughput", "output_throughput", "tok/s"))


def format_error_bands(engine: str, bands: dict | None) -> list[str]:
    """`TTFT p50 182 ms (±20%: FP8, TP1, low load; 14 points)` for the headline figures."""
    if bands is None:
        return []
    lines = [f"engine {engine}; error bands from the calibration's leave-one-source-out errors, nearest regime:"]
    for label, key, unit in BANDED:
        b = bands["metrics"].get(key)
        if b is not None:
            lines.append(f"  {label} {bands['values'][key]:,.{0 if unit == 'tok/s' else 1}f} {unit} ({b['text']})")
    return lines


def format_extras(result) -> list[str]:
    lines = format_error_bands(result.engine, result.error_bands and {
        **result.error_bands, "values": result.evaluation.metrics})
    if result.autoscaling is not None:
        a = result.autoscaling.to_json()
        lines.append(f"autoscaling: {a['decision']}")
        lines.append(f"  GPU-hours saved vs fixed: {a['gpu_hours_saved_share']:.1%}; "
                     f"peak {a['autoscaled']['num_replicas_peak']} replicas, "
                     f"{a['autoscaled']['num_instances_started']} instances started in all")
    if result.slo_misses is not None:
        m = result.slo_misses
        parts = ", ".join(f"{k} {v:.0%}" for k, v in m["share"].items())
        lines.append(f"SLO misses: {m['num_missed']} of {m['num_requests']} requests "
                     f"({m['num_missed_ttft']} TTFT, {m['num_missed_tpot']} TPOT); their latency: {parts}")
    return lines


def frontier_request(args: argparse.Namespace):
    from servelab.lab import api
    from servelab.lab.catalog.prices import parse_price_overrides
    try:
        seqs = tuple(int(v) for v in args.max_num_seqs_grid.split(",") if v.strip())
    except ValueError:
        raise FieldError(f"{{max_num_seqs}} must be comma-separated integers, got {args.max_num_seqs_grid!r}",
                         "max_num_seqs") from None
    return api.FrontierRequest(
        gpus=tuple(g.strip() for g in args.gpus.split(",") if g.strip()), deployment=deployment_request(args),
        workload=workload_config(args), targets=targets_request(args), max_gpus=args.frontier_max_gpus,
        max_num_seqs=seqs, latency_metric=args.latency_metric, prices_file=args.prices,
        prices=tuple(parse_price_overrides(args.price).items()))


def cmd_frontier(args: argparse.Namespace, all_points: bool) -> int:
    from servelab.lab import api
    from servelab.lab.analysis.frontier_report import format_frontier, plot_frontier
    from servelab.workload import describe

    request = frontier_request(args)
    answer = api.frontier(request)
    result = answer.frontier
    plot = None
    if args.plot is not None:
        plot = plot_frontier(result, args.plot, f"{request.deployment.model}: {describe(request.workload)}")
    if args.json:
        sys.stdout.write(api.format_json({**answer.to_json(), **({"plot": str(plot)} if plot else {})}))
    else:
        t = request.targets
        print(f"{request.deployment.model}, workload: {describe(request.workload)}; targets: p99 TTFT <= "
              f"{t.ttft_target_ms:g} ms" + (f", p99 TPOT <= {t.tpot_target_ms:g} ms" if t.tpot_target_ms else ""))
        for line in format_frontier(result, all_points):
            print(line)
        if plot:
            print(f"plot: {plot}")
    return 0 if result.cheapest else api.DOES_NOT_FIT


def cmd_advise(args: argparse.Namespace) -> int:
    from servelab.lab import api
    from servelab.workload import describe

    if args.pareto:
        return cmd_frontier(args, all_points=False)

    result = api.advise(api.AdviseRequest(deployment_request(args), workload_config(args), targets_request(args),
                                          max_gpus=args.max_gpus, autoscale=autoscale_request(args)))
    advice, targets = result.advice, result.targets
    if args.json:
        sys.stdout.write(api.format_json(result.to_json()))
        return 0 if advice.recommendation else api.DOES_NOT_FIT
    print(f"workload: {describe(result.workload)}; targets: p99 TTFT <= {targets.ttft_ms:g} ms"
          + (f", p99 TPOT <= {targets.tpot_ms:g} ms" if targets.tpot_ms else ""))
    rec = advice.recommendation
    if rec is None:
        print(f"no deployment of up to {args.max_gpus} {args.gpu} GPUs meets the targets "
              f"({len(advice.candidates)} shapes simulated)")
        return api.DOES_NOT_FIT
    m = rec.metrics
    print(f"recommended: {rec.deployment.describe()}")
    print(f"  p99 TTFT {m['p99_ttft_ms']:,.1f} ms, p99 TPOT {m['p99_tpot_ms']:.1f} ms, "
          f"{m['output_throughput']:,.0f} output tok/s ({len(advice.candidates)} shapes simulated)")
    for line in format_error_bands(result.engine, result.error_bands and {**result.error_bands, "values": m}):
        print(f"  {line}")
    width = max(len(d["decision"]) for d in advice.decisions)
    for d in advice.decisions:
        print(f"  {d['decision']:<{width}}  {'taken    ' if d['taken'] else 'not taken'}  {d['why']}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from servelab.lab import api

    if args.pareto:
        return cmd_frontier(args, all_points=True)
    if args.vary is None or args.values is None:
        raise ValueError("sweep needs --vary and --values, or --pareto")

    result = api.sweep(api.SweepRequest(args.vary, args.values, deployment_request(args), workload_config(args),
                                        targets_request(args), meter=args.meter, output=args.output))
    points = result.points
    if args.json:
        for p in points:  # JSON has no inf
            p[args.vary] = "inf" if p[args.vary] == math.inf else p[args.vary]
        sys.stdout.write(api.format_json({"vary": args.vary, "meter": args.meter, "points": points,
                                          "plot": str(result.plot)}))
        return 0
    print(result.title)
    for p in points:
        value = p[args.meter]
        shown = "does not fit" if value is None else f"{value:,.3f}"
        print(f"  {args.vary} {p[args.vary]:<10g} {args.meter} {shown}")
    print(f"plot: {result.plot}")
    return 0


def error_message(err: ValueError) -> str:
    """A FieldError names the fields as flags; any other ValueError says what it says."""
    return err.render(flag_name) if isinstance(err, FieldError) else str(err)


def main(argv: list[str] | None = None) -> int:
    args = build_lab_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as err:
        sys.stderr.write(f"servelab lab {args.lab_command}: error: {error_message(err)}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
