"""``engine generate``: run prompts through the engine once and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.server.cli._engine_args import add_engine_args, engine_config_from_args


def add_parser(commands: Any) -> None:
    """Register ``generate``."""
    parser = commands.add_parser(
        "generate", help="generate text for prompts (offline, no server)",
        description="Generate text for one or more prompts and print it.",
    )
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeatable: prompts run as one batch)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--in-process", action="store_true",
                        help="run EngineCore in this process instead of its own (debugging)")
    sampling = parser.add_argument_group("sampling options")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                          help="per-request sampling seed")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--stop", action="append", default=None, help="a stop string")
    sampling.add_argument("--min-tokens", type=int, default=0)
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    add_engine_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """``engine generate``."""
    from engine.core import LLM, SamplingParams
    from engine.core.messages import EngineDeadError
    from engine.sdk.errors import EngineSDKError

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        )
        with LLM(**config.model_dump(), in_process=args.in_process) as llm:
            if args.chat:
                outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt],
                                   params)
            else:
                outputs = llm.generate(args.prompt, params)
    except (EngineSDKError, ValueError, EngineDeadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompt, outputs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in output.outputs]}))
            continue
        for completion in output.outputs:
            print(f"{prompt}{completion.text}" if not args.chat else completion.text)
            print(f"[{len(completion.token_ids)} tokens, finish_reason="
                  f"{completion.finish_reason}]", file=sys.stderr)
    return 0
