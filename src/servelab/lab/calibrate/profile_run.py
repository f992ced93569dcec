"""`servelab lab profile`: build the engine `servelab serve` would build with the same flags, time its
steps, fit the `local-cpu` profile and save it (see step_timing.py, fit.py and serving_overhead.py), with
this machine's KV-transfer cost between two processes (kv_transfer_timing.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from servelab.engine_args import EngineArgs

DEFAULT_MODEL_ID = "smollm2-135m"  # the catalog entry of the default model


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="time the real engine's steps on this machine and fit --gpu local-cpu")
    EngineArgs.add_cli_args(p)
    p.add_argument("--repeats", type=int, default=3, help="runs per step shape; their median counts")
    p.add_argument("--quick", action="store_true", help="a smaller grid (a rough profile in a fraction of the time)")
    p.add_argument("--json", action="store_true", help="print the saved profile as JSON")
    p.add_argument("--kv-transfer-only", action="store_true",
                   help="only (re)measure the KV-transfer cost and add it to the saved profile")
    p.add_argument("--spec-acceptance-only", action="store_true",
                   help="only measure how often --speculative-config's drafts are accepted on code-edit prompts "
                        "and add it to the saved profile (`lab simulate --spec-acceptance-rate`'s default here)")
    p.set_defaults(func=cmd_profile)


def profiled_model_spec(model: str | None):
    """The lab's ModelSpec of the model being profiled: the catalog entry for the default model,
    else one read from the folder's config.json (its id is the path, as `--model PATH` gives it)."""
    from servelab.lab.catalog import get_model
    from servelab.model.loader import resolve_model_path

    if model is None:
        return get_model(DEFAULT_MODEL_ID)
    return get_model(str(resolve_model_path(model)))


def profiled_engine_args(args: EngineArgs) -> EngineArgs:
    """The engine args with --quantization auto resolved as `servelab serve` resolves it (int8 weights and
    KV cache for the default model where servelab's kernels are built), so the profile times the mode the
    engine runs; an explicit --quantization / --kv-cache-dtype is kept."""
    from servelab.model.quant.auto_quantization import resolve_quantization

    choice = resolve_quantization(args)
    return dataclasses.replace(args, quantization=choice.mode, kv_cache_dtype=choice.kv_cache_dtype)


def measure_kv_transfer_of(spec, kv_dtype: str, block_size: int, repeats: int, log) -> dict:
    from servelab.lab.calibrate.kv_transfer_timing import measure_kv_transfer

    bytes_per_block = block_size * spec.kv_bytes_per_token(kv_dtype)
    log(f"timing KV transfers between two processes (gloo send/recv, 1-64 blocks of {bytes_per_block} bytes)")
    fit = measure_kv_transfer(bytes_per_block, repeats=repeats)
    return {"latency_s": fit.latency_s, "bytes_per_s": fit.bytes_per_s, "bytes_per_block": bytes_per_block,
            "samples": [list(s) for s in fit.samples]}


def _kv_line(kv: dict) -> str:
    return (f"  KV transfer between two processes: {kv['latency_s'] * 1e3:.2f} ms + {kv['bytes_per_s'] / 1e9:.2f} GB/s "
            f"(one block of {kv['bytes_per_block']} bytes: "
            f"{(kv['latency_s'] + kv['bytes_per_block'] / kv['bytes_per_s']) * 1e3:.2f} ms)")


def cmd_profile_kv_transfer(args: argparse.Namespace) -> int:
    """Add the KV-transfer figures to the saved profile (measured for its model, dtype and block size)."""
    from servelab.lab.catalog.cpu_profile import load_cpu_profile, save_cpu_profile

    profile = load_cpu_profile()
    spec = profiled_model_spec(args.model)
    profile.check_model(spec)
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    kv = measure_kv_transfer_of(spec, profile.kv_dtype, profile.block_size, args.repeats, log)
    path = save_cpu_profile(dataclasses.replace(profile, kv_transfer=kv))
    print(f"saved {path}")
    print(_kv_line(kv))
    return 0


def measure_spec_acceptance_of(engine_args: EngineArgs, log) -> dict:
    from servelab.engine.llm_engine import LLMEngine
    from servelab.lab.calibrate.spec_acceptance import measure_acceptance

    config = engine_args.speculative()
    assert config is not None  # the callers check
    log(f"measuring speculative acceptance ({config.method}, {config.num_speculative_tokens} tokens) on code edits")
    return measure_acceptance(LLMEngine.from_engine_args(engine_args), config)


def _spec_line(spec: dict) -> str:
    return (f"  speculative decoding: vLLM acceptance rate {spec['acceptance_rate']:.2f}, mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f}, {spec['tokens_per_decode_step']:.2f} tokens per decode step "
            f"-> --spec-acceptance-rate {spec['fitted_acceptance_rate']:.3f}")


def cmd_profile_spec_acceptance(args: argparse.Namespace) -> int:
    """Add the speculative acceptance figures to the saved profile."""
    from servelab.lab.catalog.cpu_profile import load_cpu_profile, save_cpu_profile

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.speculative() is None:
        raise ValueError("--spec-acceptance-only needs --speculative-config")
    profile = load_cpu_profile()
    profile.check_model(profiled_model_spec(args.model))
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    spec = measure_spec_acceptance_of(engine_args, log)
    path = save_cpu_profile(dataclasses.replace(profile, spec_decode=spec))
    if args.json:
        print(json.dumps(spec, indent=2))
        return 0
    print(f"saved {path}")
    print(_spec_line(spec))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import gc
    import json

    from dataclasses import replace

    from servelab.lab.calibrate.all_reduce import measure_all_reduce
    from servelab.lab.calibrate.fit import fit_steps, fitted_cost_model
    from servelab.lab.catalog.cpu_profile import save_cpu_profile
    from servelab.lab.calibrate.step_timing import build_profile, measure_steps
    from servelab.lab.calibrate.serving_overhead import measure_serving_overhead
    from servelab.engine.llm_engine import LLMEngine

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.kv_transfer_only:
        return cmd_profile_kv_transfer(args)
    if args.spec_acceptance_only:
        return cmd_profile_spec_acceptance(args)
    # the steps are timed without speculation (the lab prices verify steps by their rows); its acceptance
    # is measured at the end
    spec_args = EngineArgs.from_cli_args(args)
    engine_args = profiled_engine_args(dataclasses.replace(spec_args, speculative_config=None))
    if engine_args.schedule != "continuous":
        raise ValueError("profile the engine with --schedule continuous; the lab selects stages itself")
    spec = profiled_model_spec(args.model)
    engine = LLMEngine.from_engine_args(engine_args)
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    log(f"profiling {spec.name} (--quantization {engine_args.quantization} --kv-cache-dtype "
        f"{engine_args.kv_cache_dtype}, {engine.config.dtype}, max-num-seqs {engine_args.max_num_seqs}, "
        f"max-num-batched-tokens {engine_args.max_num_batched_tokens}, {engine.executor.num_blocks} KV blocks)")
    samples = measure_steps(engine, repeats=args.repeats, quick=args.quick, progress=log)
    fit = fit_steps(samples, spec, engine.config.dtype, engine_args.kv_cache_dtype)
    log(f"step fit over {len(samples)} shapes: mean error {fit.mean_abs_rel_error:.1%}, "
        f"max {fit.max_abs_rel_error:.1%}")
    # The server phase builds its own engine in another process: give this one's memory back first.
    config, num_blocks = engine.config, engine.executor.num_blocks
    del engine
    gc.collect()
    overhead = measure_serving_overhead(engine_args, fitted_cost_model(fit, spec, config.dtype,
                                                                       engine_args.kv_cache_dtype), progress=log)
    profile = build_profile(config, num_blocks, spec, samples, fit, overhead)
    # how it was measured, so `lab validate` can measure it again the same way
    profile = replace(profile, fit={**profile.fit, "quick": bool(args.quick), "repeats": args.repeats})
    kv = measure_kv_transfer_of(spec, profile.kv_dtype, config.cache.block_size, args.repeats, log)
    profile = replace(profile, kv_transfer=kv)
    profile = replace(profile, efficiency=replace(profile.efficiency, all_reduce=measure_all_reduce(progress=log)))
    if spec_args.speculative() is not None:
        profile = replace(profile, spec_decode=measure_spec_acceptance_of(spec_args, log))
    path = save_cpu_profile(profile)
    if args.json:
        print(json.dumps(profile.to_json(), indent=2))
        return 0
    d, e = profile.device, profile.efficiency
    print(f"saved {path}")
    print(f"  mode: {profile.mode}")
    print(f"  {d.name}: effective {d.flops / 1e9:.1f} GFLOP/s (large batches), weight streaming "
          f"{d.memory_bandwidth / 1e9:.1f} GB/s (one token)")
    print(f"  step fit over {len(samples)} shapes: mean error {fit.mean_abs_rel_error:.1%}, "
          f"max {fit.max_abs_rel_error:.1%}")
    curve = e.overhead_curve
    print("  serving overhead per step: " + ", ".join(f"{y * 1e3:.1f} ms at {x:g} streams"
                                                     for x, y in zip(curve.xs, curve.ys)))
    print(f"  arrival overhead per new request: {e.arrival_overhead_s * 1e3:.1f} ms")
    print(_kv_line(kv))
    if profile.spec_decode:
        print(_spec_line(profile.spec_decode))
    for a in e.all_reduce:
        print(f"  all-reduce over {a.world_size} processes: {a.latency_s * 1e6:.0f} us + bytes / "
              f"{a.bytes_per_s / 1e9:.2f} GB/s")
    print(f"  now: servelab lab simulate --gpu local-cpu --model {profile.fit['model']} ...")
    return 0
