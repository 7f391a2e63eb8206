"""The `chatd` command: serve, chat, kv-size."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pydantic import ValidationError

from chatd.config import Settings


def _serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve a chat model over websockets")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            serve.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{field.description} (default: {field.get_default(call_default_factory=True)})")
        else:
            serve.add_argument(flag, dest=name, default=None,
                               help=f"{field.description} (default: {field.get_default(call_default_factory=True)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="chatd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_parser(commands)
    chat = commands.add_parser("chat", help="chat with a running server from the terminal")
    chat.add_argument("--url", default="ws://127.0.0.1:8765/ws")
    chat.add_argument("--system", default=None, help="system prompt for a new session")
    chat.add_argument("--session-id", default=None, help="continue an existing session")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    kv_size = commands.add_parser("kv-size", help="print the KV cache size per session for a model")
    kv_size.add_argument("--model", default="smollm2-135m")
    kv_size.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    kv_size.add_argument("--dtype", nargs="+", default=["float32", "float16"],
                         choices=["float32", "float16", "bfloat16"])
    kv_size.add_argument("--budget-mb", type=float, default=None, help="also show how many sessions fit this budget")
    args = parser.parse_args(argv)

    if args.command == "serve":
        overrides = {name: value for name, value in vars(args).items()
                     if name in Settings.model_fields and value is not None}
        try:
            settings = Settings(**overrides)
        except ValidationError as error:
            parser.error("; ".join(f"--{e['loc'][0].replace('_', '-')}: {e['msg']}" for e in error.errors()))
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if settings.log_level != "debug":  # one line per connection and health probe is noise in production
            logging.getLogger("websockets").setLevel(logging.WARNING)
        from chatd.server import ModelLoadError, run

        try:
            asyncio.run(run(settings))
        except ModelLoadError as error:
            sys.exit(f"chatd: {error}")
    elif args.command == "kv-size":
        from chatd.kv_size import kv_size_table

        print(kv_size_table(args.model, args.tokens, args.dtype, args.budget_mb))
    else:
        from chatd.terminal import chat as run_chat

        asyncio.run(run_chat(args.url, args.system, args.session_id, args.max_new_tokens))
