"""The packages import downwards only (tools -> api -> observability -> engine -> config -> model, with
cache_store and sessions below all of chatd), cache_store's rooms too (what ties the tiers -> Redis -> host ->
device -> checks -> the shared sizes), and no module imports itself back through others. The rooms a change reads end
to end (the engine, the cache store, the APIs) keep files under 450 lines and functions under 60."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chatd", "cache_store", "sessions")
# What each layer may import, besides itself.
BELOW_CHATD = {"cache_store", "sessions"}
MAY_IMPORT = {
    "chatd.cli": {"chatd.api", "chatd.observability", "chatd.engine", "chatd.config", "chatd.model", *BELOW_CHATD},
    "chatd.api": {"chatd.observability", "chatd.engine", "chatd.config", "chatd.model", *BELOW_CHATD},
    "chatd.observability": {"chatd.engine", "chatd.config", "chatd.model", *BELOW_CHATD},
    "chatd.engine": {"chatd.config", "chatd.model", *BELOW_CHATD},
    "chatd.config": {"chatd.model", *BELOW_CHATD},
    "chatd.model": BELOW_CHATD,
    "cache_store": {"sessions"},  # the Redis key scheme and the token-id encoding (sessions.encoding)
    "sessions": set(),
}


# cache_store's rooms, lowest first: a module imports from its own room and the rooms below it (imports made for type
# hints alone, under `if TYPE_CHECKING:`, do not count: they run nothing).
ROOMS = ("shared", "checks", "device", "host", "remote", "top")
SHARED = {"cache_store.units", "cache_store.identity", "cache_store.sizing", "cache_store.failure_log",
          "cache_store.session_notes", "cache_store.tier_events"}


def room(module: str) -> str:
    """The room of a cache_store module: a sub-package's name, the shared sizes and names, or the top."""
    parts = module.split(".")
    if module in SHARED:
        return "shared"
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "top"


def runtime_imports(path: Path) -> set[str]:
    """The project modules a file imports when it runs (not those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    hinted = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
              and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
              for statement in block.body for node in ast.walk(statement)}
    imported = set()
    for node in ast.walk(tree):
        if id(node) in hinted:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {target for target in imported if target.split(".")[0] in PACKAGES}


def test_cache_store_rooms_import_downwards():
    wrong = []
    for path in (ROOT / "cache_store").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        wrong += [(module, target) for target in runtime_imports(path) if target.startswith("cache_store.")
                  and ROOMS.index(room(target)) > ROOMS.index(room(module))]
    assert not wrong, wrong


def modules() -> dict[str, set[str]]:
    """Every module of the three packages and the project modules it imports (anywhere in its body)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            imported = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    imported.add(node.module)
                elif isinstance(node, ast.Import):
                    imported.update(alias.name for alias in node.names)
            found[name] = {target for target in imported if target.split(".")[0] in PACKAGES}
    return found


def layer(module: str) -> str:
    for name in sorted(MAY_IMPORT, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return module  # chatd itself, chatd.__main__


def test_imports_point_downwards():
    wrong = [(module, target) for module, targets in modules().items() for target in targets
             if layer(module) in MAY_IMPORT and layer(target) != layer(module)
             and layer(target) not in MAY_IMPORT[layer(module)]]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = modules()
    graph = {module: {target for target in targets if target in graph} for module, targets in graph.items()}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph[module]:
            assert state.get(target) != "open", " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_each_api_is_a_room_that_only_the_composition_root_enters():
    """The OpenAI routes, the Anthropic routes and the websocket protocol share what lies beside them (conversations,
    admission, errors, tool calling, constants, the turn runner), never each other's modules: only the server, which
    composes them, imports them."""
    rooms = {"chatd.api.openai": "chatd.api.openai.", "chatd.api.anthropic": "chatd.api.anthropic.",
             "chatd.api.websocket": "chatd.api.websocket."}
    wrong = [(module, target) for module, targets in modules().items() for target in targets
             for room, prefix in rooms.items()
             if target.startswith(prefix) and not module.startswith(room) and module != "chatd.api.server"
             and layer(module) == "chatd.api" and module != "chatd.api.schema"]
    assert not wrong, wrong


def test_chatd_has_a_handful_of_loose_modules():
    loose = sorted(path.name for path in (ROOT / "chatd").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "config.py"], loose


def test_every_public_class_and_function_says_why_it_exists():
    undocumented = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                    for node in ast.parse(path.read_text()).body
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and not node.name.startswith("_") and ast.get_docstring(node) is None]
    assert not undocumented, undocumented


def test_the_engine_the_cache_store_and_the_apis_stay_readable():
    """No file over 450 lines and no function over 60 in the rooms a change most often reads end to end."""
    too_long = []
    for folder in ("chatd/engine", "cache_store", "chatd/api"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if (lines := text.count("\n")) > 450:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
            too_long += [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines"
                         for node in ast.walk(ast.parse(text))
                         if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                         and (length := node.end_lineno - node.lineno + 1) > 60]
    assert not too_long, too_long


def test_chatd_reaches_the_cache_store_through_its_boundary():
    """chatd imports cache_store's own names and its top floor, never a room's module (a room may then move what it
    holds without chatd noticing)."""
    wrong = [(module, target) for module, targets in modules().items() if module.startswith("chatd")
             for target in targets if target.startswith("cache_store.") and room(target) not in ("top", "shared")]
    assert not wrong, wrong


TURN_STATES = {"queued", "head", "prefilling", "decoding", "fetching"}


def test_a_turn_changes_state_in_one_place():
    """Only `TurnQueues` moves a turn between its states: no other engine module changes a state's queue, and the
    updater, which moves turns on after a step, does not reach into the planner."""
    wrong = []
    for path in (ROOT / "chatd" / "engine").glob("*.py"):
        if path.name in ("turn_queues.py", "fetching.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            changed = [node.func.value] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("append", "appendleft", "pop", "popleft", "remove", "clear", "extend") else []
            if isinstance(node, ast.Assign | ast.AugAssign):
                changed = node.targets if isinstance(node, ast.Assign) else [node.target]
            wrong += [f"{path.name}:{node.lineno}" for target in changed
                      if isinstance(target, ast.Attribute) and target.attr in TURN_STATES]
    assert not wrong, wrong
    assert "chatd.engine.planner" not in modules()["chatd.engine.updater"]


TIERS = ("DeviceTier", "HostTier", "RemoteCaches")
# Besides `CacheTiers`, the one decision-maker that holds every tier: the helpers that each work on one tier.
TIER_HELPERS = {"SharedSegments": "DeviceTier", "TierMoves": "HostTier", "RemoteMoves": "RemoteCaches"}


def test_only_the_tiers_hold_a_tier():
    """No class in cache_store keeps a tier (the device, the host, Redis) but `CacheTiers` and the helper that works
    on that one tier: the cache store, lookups, branches and statistics ask the tiers."""
    wrong = []
    for path in (ROOT / "cache_store").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name == "CacheTiers":
                continue
            for init in (item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"):
                handed = {arg.arg: tier for arg in init.args.args + init.args.kwonlyargs if arg.annotation is not None
                          for tier in TIERS if tier in ast.unparse(arg.annotation)}
                kept = {handed[name.id] for statement in ast.walk(init) if isinstance(statement, ast.Assign)
                        for name in (statement.value.elts if isinstance(statement.value, ast.Tuple)
                                     else [statement.value]) if isinstance(name, ast.Name) and name.id in handed}
                wrong += [f"{node.name} keeps {tier}" for tier in kept if TIER_HELPERS.get(node.name) != tier]
    assert not wrong, wrong
