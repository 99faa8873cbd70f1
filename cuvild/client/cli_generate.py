"""`cuvilctl generate`: a language model's tokens as they come (docs/GENERATION.md), from a
prompt's text or token ids, or (`--chat`) from a chat's messages by the model's template."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cuvild.client import Client


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    """Tokens as they come: the text they add (with the model's tokenizer) or their ids."""
    ids = None
    if args.ids is not None:
        try:
            ids = [int(t) for t in args.ids.replace(",", " ").split()]
        except ValueError:
            print(f"cuvilctl: --ids takes token ids (integers), got {args.ids!r}",
                  file=sys.stderr)
            return 1
    if (ids is None) == (args.prompt is None):
        print("cuvilctl: give the prompt as text (PROMPT, for a model with a tokenizer) or as "
              "--ids, one of them", file=sys.stderr)
        return 1
    messages = _messages(args)
    stop = [int(t) for t in args.stop.replace(",", " ").split()] if args.stop else []
    bias, structured, kwargs = _bias(args), _structured(args), _template_kwargs(args)
    if messages is None or bias is None or structured is None or kwargs is None:
        return 1
    tokens: list[dict[str, Any]] = []
    for token in client.generate(args.name, ids, text=None if messages else args.prompt,
                                 messages=messages or None, max_tokens=args.max_tokens,
                                 temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=args.seed, stop=stop,
                                 version=args.version,
                                 frequency_penalty=args.frequency_penalty,
                                 presence_penalty=args.presence_penalty,
                                 logit_bias=bias, ignore_eos=args.ignore_eos,
                                 structured=structured or None,
                                 repetition_penalty=args.repetition_penalty,
                                 min_p=args.min_p, min_tokens=args.min_tokens,
                                 chat_template_kwargs=kwargs or None):
        tokens.append(token)
        if not args.json:
            print(token["text"] if token["text"] or args.prompt is not None
                  else f"{token['token_id']} ", end="", flush=True)
    if args.json:
        print(json.dumps({"output_ids": [t["token_id"] for t in tokens],
                          "text_output": "".join(t["text"] for t in tokens)}))
    else:
        print()
    return 0


def _bias(args: argparse.Namespace) -> dict[int, float] | None:
    """--logit-bias's {token id: bias}; None (said) where it does not read."""
    try:
        return {int(t): float(b) for t, _, b in (pair.partition(":") for pair in
                                                 args.logit_bias.replace(",", " ").split())}
    except ValueError:
        print(f"cuvilctl: --logit-bias takes ID:BIAS pairs, e.g. 2:-100,7:5, got "
              f"{args.logit_bias!r}", file=sys.stderr)
        return None


def _messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """--chat's messages ([]: not a chat); None (said) where they cannot be made."""
    if not (args.chat or args.system is not None):
        if args.template_kwargs:
            print("cuvilctl: --template-kwargs goes with --chat", file=sys.stderr)
            return None
        return []
    if args.prompt is None:
        print("cuvilctl: --chat takes the user's message as PROMPT (text), not --ids",
              file=sys.stderr)
        return None
    return [*([{"role": "system", "content": args.system}] if args.system else []),
            {"role": "user", "content": args.prompt}]


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any] | None:
    """--template-kwargs's object ({}: none); None (said) where it is not one."""
    try:
        given = json.loads(args.template_kwargs) if args.template_kwargs else {}
    except ValueError:
        given = None
    if not isinstance(given, dict):
        print("cuvilctl: --template-kwargs takes a JSON object, e.g. "
              f"'{{\"enable_thinking\": false}}', got {args.template_kwargs!r}", file=sys.stderr)
        return None
    return given


def _structured(args: argparse.Namespace) -> dict[str, Any] | None:
    """The structured output asked ({}: none); None (said) where --json-schema's file is
    not JSON."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice.split(",")}
    if args.json_schema is None:
        return {}
    try:
        with open(args.json_schema) as f:
            return {"json": json.load(f)}
    except (OSError, ValueError) as e:
        print(f"cuvilctl: --json-schema {args.json_schema}: not a JSON file ({e})",
              file=sys.stderr)
        return None


def add_generate(sub: Any) -> None:
    """The `generate` subcommand, on cuvilctl's subparsers."""
    gen = sub.add_parser("generate", help="a language model's tokens as they come "
                         "(docs/GENERATION.md)")
    gen.add_argument("name")
    gen.add_argument("prompt", nargs="?", help="text (the model's tokenizer encodes it)")
    gen.add_argument("--ids", help="the prompt as token ids instead, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="PROMPT is a user's message, put in "
                     "the model's chat template (its answer ends at the eos token)")
    gen.add_argument("--system", help="a system message before it (implies --chat)")
    gen.add_argument("--template-kwargs", metavar="JSON", default=None,
                     help="more of the chat template's variables (vLLM's "
                          "chat_template_kwargs), e.g. '{\"enable_thinking\": false}'")
    gen.add_argument("--version", default=None)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="repeatable sampling")
    gen.add_argument("--stop", help="token ids that end it, e.g. 2")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="OpenAI's, in [-2, 2]: less a token's logit per time it was generated")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="OpenAI's, in [-2, 2]: less a token's logit once it was generated")
    gen.add_argument("--logit-bias", default="", metavar="ID:BIAS,...",
                     help="OpenAI's, each bias in [-100, 100]: added to that token's logit")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="a seen token's logit divided by it (> 1: repeat less)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="never pick a token less likely than this x the likeliest's")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="no end-of-sequence or stop token before this many")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="go on past the model's end-of-sequence tokens")
    held = gen.add_mutually_exclusive_group()
    held.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid for the "
                      "schema in FILE (structured output)")
    held.add_argument("--regex", help="the answer matches this regular expression")
    held.add_argument("--choice", metavar="A,B,...", help="the answer is one of these")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(func=cmd_generate)
