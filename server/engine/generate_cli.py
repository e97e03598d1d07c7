"""`pagoda generate "prompt"`: print the completion of one prompt (offline engine)."""

from __future__ import annotations

import argparse

HELP = "generate a completion for a prompt and print it (default model: embedded SmolLM2-135M-Instruct)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagoda.server.engine.config import EngineArgs

    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, help="per-request seed")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--n", type=int, default=1, help="completions to print")
    parser.add_argument("--beam-width", type=int, help="beam search with this width")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    import logging

    from pagoda.server.engine.config import EngineArgs
    from pagoda.server.engine.llm import LLM
    from pagoda.server.engine.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING)
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
        use_beam_search=args.beam_width is not None,
        best_of=args.beam_width,
    )
    try:
        params.validate()
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    try:
        llm = LLM(**vars(engine_args))  # a model that is not there, settings it cannot take
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    try:
        if args.chat:
            (result,) = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            (result,) = llm.generate(args.prompt, params)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    finally:
        llm.engine.shutdown()  # tensor-parallel workers, if any
    for output in result.outputs:
        print(output.text)
    return 0
