"""`servelab lab simulate | advise | sweep | profile | validate | web`. The deployment flags are the real engine's
names, the workload flags the load generator's (`vllm bench serve`'s)."""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from servelab.config import SCHEDULE_POLICIES
from servelab.lab.catalog import LOCAL_CPU, get_device, get_model, gpu_ids, model_ids
from servelab.lab.sim.deployment import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, ROUTERS, Deployment
from servelab.workload import DATASETS, WorkloadConfig


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
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"catalog id ({', '.join(model_ids())}) or a Hugging Face config.json path")
    p.add_argument("--gpu", default="h100", help=f"catalog id ({', '.join(gpu_ids())}) or {LOCAL_CPU}")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on GPUs), float16, float32 or fp8")


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-gpus", type=int, default=None, help="default: one instance's worth")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of each instance")
    p.add_argument("--schedule", choices=SCHEDULE_POLICIES, default="continuous")
    p.add_argument("--disaggregate", type=split_ratio, default=None, metavar="P:D",
                   help="P prefill and D decode instances instead of replicas")
    p.add_argument("--max-num-seqs", type=int, default=None, help=f"default {DEFAULT_MAX_NUM_SEQS} (vLLM's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"per-step token budget, default {DEFAULT_MAX_NUM_BATCHED_TOKENS}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--router", choices=ROUTERS, default="round-robin")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--input-len", type=int, default=None, help="random dataset, default 1024")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (random)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-target", type=duration_ms, default=None, metavar="DURATION", help="e.g. 500ms or 0.5s")
    p.add_argument("--tpot-target", type=duration_ms, default=None, metavar="DURATION", help="e.g. 50ms")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def add_lab_parser(subparsers) -> argparse.ArgumentParser:
    lab = subparsers.add_parser("lab", help="simulate serving deployments of datacenter GPUs on a virtual clock")
    _add_lab_commands(lab.add_subparsers(dest="lab_command", required=True, parser_class=LabArgumentParser))
    return lab


def _handler(name: str):
    """Import the command modules only when a lab command runs, not when `servelab` builds its parser."""
    def run(args: argparse.Namespace) -> int:
        from servelab.lab import api as commands
        return getattr(commands, name)(args)
    return run


def _add_lab_commands(sub) -> None:
    sim = sub.add_parser("simulate", help="simulate one deployment and print its meters")
    for add in (_add_model_args, _add_deployment_args, _add_workload_args):
        add(sim)
    sim.add_argument("--single-step", action="store_true", help="price every step separately (same result, slower)")
    sim.set_defaults(func=_handler("cmd_simulate"))

    adv = sub.add_parser("advise", help="find the fewest GPUs that meet the targets, and say why")
    _add_model_args(adv)
    _add_workload_args(adv)
    adv.add_argument("--max-gpus", type=int, default=64)
    adv.add_argument("--router", choices=ROUTERS, default="round-robin")
    adv.add_argument("--max-num-seqs", type=int, default=None)
    adv.add_argument("--max-num-batched-tokens", type=int, default=None)
    adv.add_argument("--block-size", type=int, default=16)
    adv.set_defaults(func=_handler("cmd_advise"), num_gpus=None, tp=1, schedule="continuous", disaggregate=None)

    swp = sub.add_parser("sweep", help="plot a meter against a workload or deployment input (PNG)")
    for add in (_add_model_args, _add_deployment_args, _add_workload_args):
        add(swp)
    swp.add_argument("--vary", required=True, help="request-rate, input-len, output-len, burstiness, num-gpus, "
                     "tp, max-num-seqs or max-num-batched-tokens")
    swp.add_argument("--values", required=True, help="comma-separated, e.g. 1,2,4,8,16")
    swp.add_argument("--meter", default="p99_ttft_ms",
                     help="a metric key (p99_ttft_ms, output_throughput, ...) or meter.field (kv_cache.peak_usage)")
    swp.add_argument("--output", type=Path, default=Path("lab-sweep.png"), help="PNG path")
    swp.set_defaults(func=_handler("cmd_sweep"))

    from servelab.lab.calibrate.profile_run import add_profile_parser
    from servelab.lab.calibrate.validate import add_validate_parser
    add_profile_parser(sub)
    add_validate_parser(sub)

    web = sub.add_parser("web", help="serve the lab page and its API alone, without loading a model")
    web.add_argument("--host", default="127.0.0.1")
    web.add_argument("--port", type=int, default=8000, help="0: any free port (the banner prints it)")
    web.set_defaults(func=_run_web)


def _run_web(args: argparse.Namespace) -> int:
    from servelab.lab.web.server import serve_lab
    return serve_lab(args.host, args.port)


def build_lab_parser(parser_class: type[argparse.ArgumentParser] = LabArgumentParser) -> argparse.ArgumentParser:
    parser = parser_class(prog="servelab lab", description=__doc__)
    _add_lab_commands(parser.add_subparsers(dest="lab_command", required=True, parser_class=parser_class))
    return parser


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    model, device = get_model(args.model), get_device(args.gpu)
    extra = {}
    if args.gpu == LOCAL_CPU:
        from servelab.lab.catalog.cpu_profile import load_cpu_profile
        profile = load_cpu_profile()
        profile.check_model(model)
        extra = dict(efficiency=profile.efficiency, kv_cache_bytes=profile.kv_cache_bytes)
        defaults = (profile.max_num_seqs, profile.max_num_batched_tokens, profile.dtype)
    else:
        defaults = (DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS, "bfloat16")
    prefill, decode = args.disaggregate or (0, 0)
    num_gpus = args.num_gpus if args.num_gpus is not None else max(1, prefill + decode) * args.tp
    return Deployment(
        model=model, device=device, num_gpus=num_gpus, tensor_parallel_size=args.tp, schedule=args.schedule,
        num_prefill_instances=prefill, num_decode_instances=decode,
        max_num_seqs=args.max_num_seqs or defaults[0], max_num_batched_tokens=args.max_num_batched_tokens or defaults[1],
        block_size=args.block_size, router=args.router, dtype=args.dtype or defaults[2], **extra,
    )


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.range_ratio, request_rate=args.request_rate,
                          burstiness=args.burstiness, seed=args.seed)


def workload_json(config: WorkloadConfig) -> dict:
    out = dict(config.__dict__)
    out["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return out


def format_json(payload: dict) -> str:
    return json.dumps(payload, indent=2) + "\n"


def print_json(payload: dict) -> None:
    sys.stdout.write(format_json(payload))


def main(argv: list[str] | None = None) -> int:
    args = build_lab_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as err:
        sys.stderr.write(f"servelab lab {args.lab_command}: error: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
