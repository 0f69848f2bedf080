"""The ``tpuserve`` command: ``generate`` (offline batch, JSONL in/out), ``serve`` (HTTP API) and
``router`` (a prefill/decode proxy over several servers)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tpuserve.server.api_server import add_serve_parser
from tpuserve.server.engine_args import add_engine_args, engine_kwargs
from tpuserve.server.router import add_router_parser
from tpuserve.server.sampling_params import SamplingParams


def _read_prompts(args) -> list[dict]:
    items: list[dict] = []
    for p in args.prompt or []:
        items.append({"prompt": p})
    if args.input:
        stream = sys.stdin if args.input == "-" else open(args.input)
        with stream:
            for n, line in enumerate(stream, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{args.input}:{n}: not valid JSON ({e})") from None
                if isinstance(obj, str):
                    obj = {"prompt": obj}
                if not isinstance(obj, dict) or not ({"prompt", "prompt_token_ids", "messages"} & obj.keys()):
                    raise SystemExit(
                        f"{args.input}:{n}: need an object with 'prompt', 'prompt_token_ids' or 'messages'"
                    )
                items.append(obj)
    if not items:
        raise SystemExit("no prompts: give --prompt TEXT (repeatable) or --input FILE.jsonl")
    return items


def cmd_generate(args: argparse.Namespace) -> int:
    # Here, not at the top: the engine (and jax) loads for generate only; router needs none.
    from tpuserve.server.llm import LLM

    items = _read_prompts(args)
    llm = LLM(args.model, **engine_kwargs(args))
    base = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    prompts: list[Any] = []
    params: list[SamplingParams | None] = []  # None: the item's own error
    for item in items:
        try:
            params.append(SamplingParams(**{**base, **item.get("sampling_params", {})}))
        except (TypeError, ValueError) as e:
            params.append(None)
            item["_error"] = str(e)
        if "messages" in item:
            try:
                prompts.append(
                    {
                        "prompt_token_ids": llm.apply_chat_template(
                            item["messages"], add_generation_prompt=True
                        )
                    }
                )
            except Exception as e:  # a bad conversation fails its own line only
                prompts.append({"prompt_token_ids": []})
                item["_error"] = f"messages: {e}"
        elif "prompt_token_ids" in item:
            prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
        else:
            prompts.append(item["prompt"])
    good = [i for i, it in enumerate(items) if "_error" not in it]
    good_params = [p for i in good if (p := params[i]) is not None]  # (every good item has its params)
    outs = llm.generate([prompts[i] for i in good], good_params, use_tqdm=not args.quiet)
    by_index = dict(zip(good, outs))
    out_stream = sys.stdout if args.output in (None, "-") else open(args.output, "w")
    with out_stream:
        for i, item in enumerate(items):
            rec: dict[str, Any] = {"index": i}
            if "prompt" in item:
                rec["prompt"] = item["prompt"]
            o = by_index.get(i)
            error = item.get("_error") or (o.error if o else None)
            if error:
                rec["error"] = error
            else:
                assert o is not None  # every item without an error was generated
                rec["outputs"] = [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in o.outputs
                ]
            out_stream.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpuserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline batch generation (JSONL in, JSONL out)")
    gen.add_argument("model", nargs="?", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument(
        "--input",
        help="JSONL file of {prompt | prompt_token_ids | messages, sampling_params?} objects; '-' for stdin",
    )
    gen.add_argument("--output", help="JSONL output file (default: stdout)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    add_serve_parser(sub)
    add_router_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"tpuserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
