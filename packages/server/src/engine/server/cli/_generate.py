"""``engine generate``: run prompts through the engine once and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from engine.server.cli._engine_args import add_engine_args, engine_config_from_args
from engine.server.cli._help import HelpFormatter
from engine.server.cli._logging_args import add_log_level

if TYPE_CHECKING:
    from engine.core.model_loader import GenerationDefaults
    from engine.sdk.sampling_params import SamplingParams

#: ``engine generate``'s own defaults where they differ from ``SamplingParams``'; the
#: model's generation_config.json (``--generation-config``) wins over them.
GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}
_FROM_MODEL = "the model's generation_config.json, else"


def add_parser(commands: Any) -> None:
    """Register ``generate``."""
    parser = commands.add_parser(
        "generate", help="generate text for prompts (offline, no server)",
        description="Generate text for one or more prompts and print it.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeatable: prompts run as one batch)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--in-process", action="store_true",
                        help="run EngineCore in this process instead of its own (debugging)")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="read options from a YAML file of option names (without the "
                        "dashes) and values; options on the command line win over the file's "
                        "(default: none)")
    add_log_level(parser, default_text="WARNING")
    sampling = parser.add_argument_group(
        "sampling options", "Unset ones take the model's generation_config.json values "
        "(--generation-config), else the defaults shown.")
    sampling.add_argument("--max-tokens", type=int, default=None,
                          help=f"tokens to generate at most (default: {_FROM_MODEL} 64)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help=f"0 = greedy (default: {_FROM_MODEL} 0)")
    sampling.add_argument("--top-p", type=float, default=None,
                          help=f"nucleus mass (default: {_FROM_MODEL} 1 = off)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help=f"most likely tokens kept (default: {_FROM_MODEL} 0 = off)")
    sampling.add_argument("--min-p", type=float, default=None,
                          help=f"relative probability floor (default: {_FROM_MODEL} 0)")
    sampling.add_argument("--repetition-penalty", type=float, default=None,
                          help=f"(default: {_FROM_MODEL} 1 = off)")
    sampling.add_argument("--presence-penalty", type=float, default=0.0,
                          help="in [-2, 2], once per token already generated")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="in [-2, 2], per occurrence in the generated tokens")
    sampling.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                          help="per-request sampling seed (default: none)")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--stop", action="append", default=None,
                          help="a stop string (repeatable)")
    sampling.add_argument("--min-tokens", type=int, default=0,
                          help="tokens generated before EOS may end a completion")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past EOS, up to --max-tokens")
    sampling.add_argument("--logprobs", type=int, default=None,
                          help="top logprobs per token (default: none)")
    add_engine_args(parser)
    parser.set_defaults(handler=run)


def sampling_params_of(args: argparse.Namespace,
                       defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The run's ``SamplingParams``: the flags given, over the model's, over ours.

    ``defaults`` are the model's ``GenerationDefaults`` (None: none); ours are
    :data:`GENERATE_DEFAULTS`.
    """
    from engine.core.model_loader import GenerationDefaults as Defaults

    given = dict(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    return (defaults or Defaults()).sampling_params(given, GENERATE_DEFAULTS)


def run(args: argparse.Namespace) -> int:
    """``engine generate``."""
    from engine.core import LLM
    from engine.core.messages import EngineDeadError
    from engine.sdk.errors import EngineSDKError

    try:
        config = engine_config_from_args(args)
        sampling_params_of(args)  # a bad sampling flag is reported before the model loads
        with LLM(**config.model_dump(), in_process=args.in_process) as llm:
            params = sampling_params_of(args, llm.llm_engine.setup.generation_defaults)
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
