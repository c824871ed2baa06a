"""Other libraries' environments as their users write them, recognised by their shape (rollout.multi_turn.env names
one, or a dict of them): no wrapper of the user's, the data as those libraries store it.

    … rollout.multi_turn.env=path/to/file.py:Game        # a class, a function, a lambda or a functools.partial
    … rollout.multi_turn.env=path/to/file.py:GAMES       # a dict {name: any of those}: each row routed by its column
                                                         # rollout.multi_turn.env_column (SkyRL's env_class)

The contracts (CONTRACTS), each the way its library's documentation writes it:

    trl     TRL's environment_factory: anything that builds an environment with no arguments (a class, a function,
            a lambda, functools.partial); reset(**columns) with the row's columns as stored (the dataset's, every one:
            never the library's prompt_ids, max_tokens, …) → None (the row's prompt) or a str appended to the last
            user message; its public methods are the tools (their docstrings and type hints the JSON schemas the
            chat template shows), called on the episode's own instance; get_reward() the episode's reward
            (agents/tools.py MethodEnvironment)
    skyrl   SkyRL-Gym's BaseTextEnv: built as Class(env_config={}, extras=the row's columns but prompt and env_class,
            as SkyRL's dataset hands them: reward_spec, extra_info, …); init(prompt) → (messages, metadata);
            step(action) → BaseTextEnvStepOutput {observations, reward, done, metadata}
    ours    reset(row), step(text), built with no arguments (agents/environments.py)

A factory that is not a class is called once in the episode worker at start-up to see what it builds (TRL builds
its environments the same way, up front). All of a dict's environments follow one contract.
"""
import inspect
from typing import Optional

LIBRARY_KEYS = ("prompt_ids", "prompt_text", "max_tokens", "columns", "conversation")  # never a user's column


def columns_of(row: dict) -> dict:
    """The row's own columns as stored (data.load_rl_dataset's "columns"); for a row built without them, its keys
    but the library's own."""
    if isinstance(row.get("columns"), dict):
        return dict(row["columns"])
    return {k: v for k, v in row.items() if k not in LIBRARY_KEYS}


def prompt_messages(row: dict) -> list:
    """The row's prompt as chat messages (a str is one user message)."""
    prompt = row["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


# What each contract's episode is built with and reset by: (row) → ((args, kwargs) to build, (method, args, kwargs))
CONTRACTS = {
    "ours": lambda row: (((), {}), ("reset", (row,), {})),
    "trl": lambda row: (((), {}), ("reset", (), columns_of(row))),
    "skyrl": lambda row: (((), {"env_config": {}, "extras": {k: v for k, v in columns_of(row).items()
                                                             if k not in ("prompt", "env_class")}}),
                          ("init", (prompt_messages(row),), {})),
}


def contract_of(factory, spec: str) -> dict:
    """{"contract": a name in CONTRACTS, "tools": [names], "schemas": JSON schemas or None, "get_reward": bool} of
    what `factory` builds; a ValueError in one sentence when it is none of them."""
    if inspect.isclass(factory):
        cls = factory
    elif callable(factory):  # TRL's factory: a function, a lambda, a functools.partial
        try:
            built = factory()
        except Exception as e:
            raise ValueError(f"{spec}() raised {type(e).__name__}: {e}; an environment factory is called with no "
                             f"arguments") from None
        cls = type(built)
        if not any(callable(getattr(cls, m, None)) for m in ("reset", "init")):
            raise ValueError(f"{spec}() returned {type(built).__name__} {str(built)[:60]!r}, not an environment "
                             f"(with reset(row) and step(text), reset(**row) and tools, or init(prompt) and step)")
        close = getattr(built, "close", None)
        if callable(close):
            close()
    else:
        raise ValueError(f"{spec} is a {type(factory).__name__}, not a class or a function that builds an environment")
    if callable(getattr(cls, "init", None)) and callable(getattr(cls, "step", None)) and not hasattr(cls, "reset"):
        return {"contract": "skyrl", "tools": [], "schemas": None, "get_reward": False}
    trl = check_environment_class(cls, spec, built=factory is not cls)
    return {"contract": "trl", **trl} if trl else {"contract": "ours", "tools": [], "schemas": None,
                                                   "get_reward": False}


def describe(target, spec: str) -> dict:
    """The episode worker's check of rollout.multi_turn.env's target: {route: contract_of(…)}, the route None for one
    factory, each key for a dict of them; a ValueError in one sentence when they differ in contract."""
    routes = {key: contract_of(f, f"{spec}[{key!r}]") for key, f in target.items()} if isinstance(target, dict) \
        else {None: contract_of(target, spec)}
    if not routes:
        raise ValueError(f"{spec} is an empty dict; name each environment by the value of the rows' column")
    kinds = {route: info["contract"] for route, info in routes.items()}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"{spec}'s environments follow different contracts ({kinds}); one dict holds one kind")
    return routes


def route_of(row: dict, routes: dict, column: str, spec: str):
    """The key of `routes` that builds this row's environment: None for one factory; for a dict, the row's
    `column`; a ValueError in one sentence when the row has none that the dict names."""
    if list(routes) == [None]:
        return None
    value = columns_of(row).get(column)
    if value not in routes:
        raise ValueError(f"the row's {column} is {value!r}, which rollout.multi_turn.env={spec} does not name "
                       f"(it names {', '.join(map(repr, routes))}; rollout.multi_turn.env_column picks the column)")
    return value


def first_call(contract: str, row: dict, route) -> tuple[tuple, tuple]:
    """How an episode of `contract` on `row` is built and reset: ((route, args, kwargs), (method, args, kwargs))."""
    (args, kwargs), call = CONTRACTS[contract](row)
    return (route, args, kwargs), call


def tools_by_route(routes: dict) -> Optional[dict]:
    """TRL's routes: {route: (tool names, schemas, has get_reward)}; None for another contract."""
    if next(iter(routes.values()))["contract"] != "trl":
        return None
    return {route: (set(info["tools"]), info["schemas"], info["get_reward"]) for route, info in routes.items()}


def check_environment_class(cls, spec: str, built: bool = False) -> Optional[dict]:
    """A ValueError in one sentence unless `cls` is a class built without arguments (or by a factory: `built`) with
    callable reset and step, or a class of TRL's environment_factory (reset, no step, public methods: the tools); for
    the latter, its tools {"tools": [names], "schemas": JSON schemas or None, "get_reward": bool}, None for the
    former."""
    if not inspect.isclass(cls):
        raise ValueError(f"{spec} is a {type(cls).__name__}, not a class")
    methods = [name for name, fn in inspect.getmembers(cls, callable) if not name.startswith("_")
               and name not in ("reset", "step", "get_reward", "close")]
    trl = callable(getattr(cls, "reset", None)) and not hasattr(cls, "step") and methods
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing and not trl:
        raise ValueError(f"{spec} has no method {' or '.join(missing)}: an environment needs reset(row) and step(text)")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = None  # a class implemented in C: built and seen at the first reset
    required = [p.name for p in signature.parameters.values() if p.default is p.empty and p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)] if signature and not built else []
    if required:
        raise ValueError(f"{spec}'s constructor needs {', '.join(required)}; an environment is built with no "
                         f"arguments (reset(row) gets the row)")
    if not trl:
        return None
    try:  # as TRL shows them to the chat template (transformers reads each method's docstring)
        from transformers.utils import get_json_schema
        schemas = [get_json_schema(getattr(cls, name)) for name in methods]
    except Exception:
        schemas = None  # the prompt must then describe the tools
    return {"tools": methods, "schemas": schemas, "get_reward": callable(getattr(cls, "get_reward", None))}
