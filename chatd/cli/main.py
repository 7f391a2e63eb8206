"""The `chatd` command: serve, chat, bench, kv-size."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import SettingsError

from chatd.config import Settings

CLIENT_KEY_ENV = "CHATD_CLIENT_API_KEY"  # safer than --api-key: command lines are visible to every user


def _serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve a chat model over websockets")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        described = field.description.replace("%", "%%")  # (argparse formats help text with %)
        if field.annotation in (bool, bool | None):
            serve.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{described} (default: {field.get_default(call_default_factory=True)})")
        elif field.annotation == list[str]:
            serve.add_argument(flag, dest=name, action="append", default=None, help=described)
        else:
            serve.add_argument(flag, dest=name, default=None,
                               help=f"{described} (default: {field.get_default(call_default_factory=True)})")


def _setting_source(loc: tuple, overrides: dict) -> str:
    """Where a bad value came from: its flag, or its environment variable."""
    if not loc:
        return "settings"
    name = str(loc[0])
    return "--" + name.replace("_", "-") if name in overrides else "CHATD_" + name.upper()


def _chat_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser("chat", help="chat with a running server from the terminal")
    chat.add_argument("--url", default="ws://127.0.0.1:8765/ws")
    chat.add_argument("--system", default=None, help="system prompt for a new session")
    chat.add_argument("--session-id", default=None, help="continue an existing session")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--api-key", default=os.environ.get(CLIENT_KEY_ENV),
                      help=f"for a server with API keys (default: ${CLIENT_KEY_ENV})")
    chat.add_argument("--tools", type=Path, default=None, metavar="JSON_FILE",
                      help="functions the model may call (a JSON list of {name, description, parameters}); you "
                           "type each call's result")
    chat.add_argument("--tool-choice", default=None, metavar="CHOICE",
                      help="with --tools: none, auto (the default), required, or one function's name")
    chat.add_argument("--json-schema", type=Path, default=None, metavar="JSON_FILE",
                      help="hold every reply to this JSON Schema")


def _kv_size_parser(commands: argparse._SubParsersAction) -> None:
    kv_size = commands.add_parser("kv-size", help="print the KV cache size per session for a model")
    kv_size.add_argument("--model", default="smollm2-135m")
    kv_size.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    kv_size.add_argument("--dtype", nargs="+", default=["float32", "float16", "int8"],
                         choices=["float32", "float16", "bfloat16", "int8"])
    kv_size.add_argument("--budget-mb", type=float, default=None, help="also show how many sessions fit this budget")
    kv_size.add_argument("--shared-prompt", type=int, default=0, metavar="TOKENS",
                         help="also show sessions per GB after a shared prompt of this length, held once or copied")


def _bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="simulated customers against one or two servers")
    target = bench.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="bench a running server: ws://…/ws for chatd, or http://…/v1 for an "
                        "OpenAI-compatible peer (the client then resends the history every turn)")
    target.add_argument("--serve", metavar="FLAGS", help="start a server with these `chatd serve` flags and bench it")
    target.add_argument("--compare", action="store_true",
                        help="start two servers, with the flags of --a and --b, and run the same workload on each")
    bench.add_argument("--a", default="", metavar="FLAGS", help="`chatd serve` flags of configuration A "
                       "(write --a=FLAGS when FLAGS starts with a dash)")
    bench.add_argument("--b", default="", metavar="FLAGS", help="`chatd serve` flags of configuration B")
    bench.add_argument("--a-checkout", type=Path, default=None, metavar="DIR",
                       help="serve configuration A with the code of this checkout (a git worktree of the commit "
                            "before a change), so that both are measured in one run")
    bench.add_argument("--b-checkout", type=Path, default=None, metavar="DIR",
                       help="the same for configuration B")
    bench.add_argument("--api", choices=["websocket", "openai"], default="websocket",
                       help="how the customers talk to a server it starts: chatd's websocket protocol, or its "
                            "OpenAI-compatible API as stateless clients that resend the whole history each turn")
    bench.add_argument("--customers", type=int, default=8)
    bench.add_argument("--turns", type=int, default=6)
    bench.add_argument("--think-s", type=float, default=1.0, help="mean pause between a customer's turns")
    bench.add_argument("--max-new-tokens", type=int, default=32)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--rounds", type=int, default=1, help="workloads per configuration, alternating")
    bench.add_argument("--api-key", default=os.environ.get(CLIENT_KEY_ENV),
                       help=f"for a chatd server with API keys (default: ${CLIENT_KEY_ENV})")
    bench.add_argument("--scenarios", type=Path, default=None,
                       help="folder of scenario files (default: bench/scenarios)")
    bench.add_argument("--output", type=Path, default=Path("bench/results/chatd-bench.json"),
                       help="JSON result; the plot goes next to it as .png")


def _serve(args: argparse.Namespace) -> None:
    """Settings from the flags over the environment; a bad value, an unservable model or an unreachable Redis is one
    line and a non-zero exit, never a traceback."""
    overrides = {name: value for name, value in vars(args).items()
                 if name in Settings.model_fields and value is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as error:  # one line naming the flag or variable, never a traceback
        print("chatd serve: " + "; ".join(f"{_setting_source(e['loc'], overrides)}: "
                                          f"{e['msg'].removeprefix('Value error, ')}" for e in error.errors()),
              file=sys.stderr)
        sys.exit(2)
    except SettingsError as error:  # a value pydantic-settings itself could not read
        print(f"chatd serve: {error}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per connection and probe is noise in production; frame dumps (DEBUG) would show API keys.
    logging.getLogger("websockets").setLevel(logging.INFO if settings.log_level == "debug" else logging.WARNING)
    from chatd.api.server import EngineFailed, ModelLoadError, run
    from chatd.model.loader import check_model
    from chatd.model.servable import Unservable
    from sessions.redis_client import RedisSetupError

    try:
        check_model(settings.model)
    except Unservable as error:  # one line, before the port opens
        print(f"chatd serve: model {settings.model!r} cannot be served: {error}", file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(run(settings))
    except (ModelLoadError, EngineFailed) as error:
        sys.exit(f"chatd: {error}")
    except RedisSetupError as error:  # one line naming Redis and the setting, before the model loads
        sys.exit(f"chatd serve: {error}")


def _bench(args: argparse.Namespace) -> None:
    from chatd.cli import bench as bench_command

    args.scenarios = args.scenarios or bench_command.DEFAULT_SCENARIOS
    bench_command.main(args)


def _kv_size(args: argparse.Namespace) -> None:
    from chatd.model.kv_size import kv_size_table

    print(kv_size_table(args.model, args.tokens, args.dtype, args.budget_mb, shared_prompt=args.shared_prompt))


def _chat(args: argparse.Namespace) -> None:
    from websockets.exceptions import InvalidHandshake

    from chatd.cli.client import ChatError
    from chatd.cli.terminal import chat as run_chat
    from chatd.cli.terminal import tool_fields_from

    try:
        tool_fields = tool_fields_from(args.tools, args.json_schema, args.tool_choice)
        asyncio.run(run_chat(args.url, args.system, args.session_id, args.max_new_tokens, args.api_key,
                             tool_fields))
    except (ChatError, InvalidHandshake, OSError, ValueError) as error:
        sys.exit(f"chatd chat: {error}")


COMMANDS = {"serve": (_serve_parser, _serve), "chat": (_chat_parser, _chat), "kv-size": (_kv_size_parser, _kv_size),
            "bench": (_bench_parser, _bench)}


def main(argv: list[str] | None = None) -> None:
    """The entry point: parse the command line and run the command (each command's modules load only when it
    runs, so that `--help` and a bad flag answer before torch loads)."""
    parser = argparse.ArgumentParser(prog="chatd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in COMMANDS.values():
        add_parser(commands)
    args = parser.parse_args(argv)
    COMMANDS[args.command][1](args)
