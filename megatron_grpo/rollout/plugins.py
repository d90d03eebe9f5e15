"""Plugin API: one Python file (``rollout.plugin=FILE``) that registers reward
functions, tools and a multi-turn policy with decorators.

.. code-block:: python

    from megatron_grpo.rollout.plugins import reward, tool, policy, HermesToolPolicy, ToolResult

    @reward("short_answer")                       # ms-swift / TRL signature, sync or async
    def short_answer(completions, **kwargs):
        return [1.0 if len(c) < 200 else 0.0 for c in completions]

    @tool(name="echo", description="Repeat a text.",
          parameters={"type": "object", "properties": {"text": {"type": "string"}},
                      "required": ["text"]})
    def echo(text, *, ctx):                        # ctx: ToolContext (audio, roots, columns)
        return ToolResult(text=text)               # or a str, or (text, [waveforms])

    @policy
    class MyPolicy(HermesToolPolicy):              # is_finished(state) / step(state, response)
        name = "mine"

Registrations of a plugin add to the built-ins (rewards "format", "iou", "iou_raw",
"think_length"; tool "crop_audio"; policies "hermes", "single_turn") and may replace them by
name.  `load_plugin` executes the file in a fresh module and returns its `Registry`; every problem
(missing file, syntax error, an exception while importing, a bad registration, a file that
registers nothing) raises `PluginError` naming the file and, where there is one, the line.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Optional

from megatron_grpo.rollout.policies import HermesToolPolicy, MultiTurnPolicy, tool_message
from megatron_grpo.rollout.rewards import BUILTIN_REWARDS, RewardError, check_reward_fn
from megatron_grpo.rollout.state import NextTurn, RolloutState, TurnResponse
from megatron_grpo.rollout.tools import (BUILTIN_TOOLS, Tool, ToolCall, ToolContext, ToolRefused,
                                         ToolRegistry, ToolResult, parse_tool_calls)

__all__ = ["reward", "tool", "policy", "Registry", "PluginError", "load_plugin", "load_registry",
           "builtin_registry", "MultiTurnPolicy", "HermesToolPolicy", "NextTurn", "RolloutState",
           "TurnResponse", "ToolResult", "ToolContext", "ToolRefused", "ToolCall", "tool_message",
           "parse_tool_calls"]


class PluginError(ValueError):
    """A plugin file that cannot be used; the message names the file, the line and the reason."""


class Registry:
    """Reward functions, tools and policy classes by name."""

    def __init__(self, source: str = "<builtin>"):
        self.source = source
        self.rewards: dict[str, Callable] = {}
        self.tools = ToolRegistry()
        self.policies: dict[str, type] = {}

    def __len__(self) -> int:
        return len(self.rewards) + len(self.tools) + len(self.policies)

    def add_reward(self, name: str, fn: Callable) -> None:
        check_reward_fn(name, fn)
        self.rewards[name] = fn

    def add_tool(self, t: Tool) -> None:
        self.tools.add(t)

    def add_policy(self, name: str, cls: type) -> None:
        if not (inspect.isclass(cls) and issubclass(cls, MultiTurnPolicy)):
            raise PluginError(f"policy {name!r} must be a class derived from MultiTurnPolicy, got {cls!r}")
        self.policies[name] = cls

    def update(self, other: "Registry") -> "Registry":
        """Add ``other``'s registrations, replacing same-named ones."""
        self.rewards.update(other.rewards)
        for t in other.tools.tools.values():
            self.tools.add(t)
        self.policies.update(other.policies)
        return self

    def reward(self, name: str) -> Callable:
        if name not in self.rewards:
            near = difflib.get_close_matches(name, list(self.rewards), n=1)
            raise PluginError(f"unknown reward function {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                              + f"; registered: {sorted(self.rewards)}")
        return self.rewards[name]

    def policy_class(self, name: Optional[str]) -> type:
        """The policy ``name``; None: the one non-built-in policy registered, else "hermes"."""
        if name is None:
            own = [n for n, c in self.policies.items() if n not in _BUILTIN_POLICIES or
                   c is not _BUILTIN_POLICIES[n]]
            if len(own) == 1:
                return self.policies[own[0]]
            if len(own) > 1:
                raise PluginError(f"several policies registered ({sorted(own)}): choose one with rollout.policy")
            name = "hermes"
        if name not in self.policies:
            raise PluginError(f"unknown policy {name!r}; registered: {sorted(self.policies)}")
        return self.policies[name]


_BUILTIN_POLICIES = {"hermes": HermesToolPolicy, "single_turn": MultiTurnPolicy}


def builtin_registry() -> Registry:
    reg = Registry()
    for n, fn in BUILTIN_REWARDS.items():
        reg.add_reward(n, fn)
    for t in BUILTIN_TOOLS.values():
        reg.add_tool(t)
    for n, c in _BUILTIN_POLICIES.items():
        reg.add_policy(n, c)
    return reg


# ---------------------------------------------------------------------------------------------
# Decorators (register into the plugin being loaded, else into the process-wide registry)
# ---------------------------------------------------------------------------------------------

_local = threading.local()
GLOBAL = Registry(source="<process>")
"""Registrations made outside a plugin file (e.g. in a training script before the engine starts)."""


def _current() -> Registry:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else GLOBAL


@contextmanager
def _collecting(reg: Registry):
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(reg)
    try:
        yield reg
    finally:
        stack.pop()


def reward(name=None):
    """Register a reward function ``fn(completions, **kwargs) -> list[float]`` (sync or async).
    Use as ``@reward``, ``@reward("name")`` or ``@reward(name="name")``; default name: fn's name."""
    def deco(fn, _name=None):
        n = _name or getattr(fn, "__name__", None)
        if not isinstance(n, str) or not n:
            raise PluginError(f"@reward needs a name for {fn!r}")
        try:
            _current().add_reward(n, fn)
        except RewardError as e:
            raise PluginError(str(e)) from None
        return fn

    if callable(name) and not isinstance(name, str):
        return deco(name)
    return lambda fn: deco(fn, name)


def tool(name=None, *, description: str = "", parameters: Optional[dict] = None,
         timeout_s: Optional[float] = None):
    """Register a tool: ``fn(**arguments, ctx) -> ToolResult | str | (text, [waveforms])``, sync or
    async.  ``parameters``: JSON schema of the arguments (checked before the call)."""
    def deco(fn, _name=None):
        n = _name or getattr(fn, "__name__", None)
        try:
            t = Tool(name=n, fn=fn, description=description or (inspect.getdoc(fn) or "").split("\n")[0],
                     parameters=parameters or {"type": "object", "properties": {}}, timeout_s=timeout_s)
        except ValueError as e:
            raise PluginError(str(e)) from None
        _current().add_tool(t)
        return fn

    if callable(name) and not isinstance(name, str):
        return deco(name)
    return lambda fn: deco(fn, name)


def policy(cls=None, *, name: Optional[str] = None):
    """Register a `MultiTurnPolicy` subclass (``@policy`` or ``@policy(name="x")``); default name:
    the class's ``name`` attribute if it defines one, else the class name."""
    def deco(c):
        n = name or c.__dict__.get("name") or c.__name__
        _current().add_policy(n, c)
        return c

    if cls is not None:
        return deco(cls)
    return deco


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def load_plugin(path) -> Registry:
    """Execute the plugin file ``path`` and return what it registered."""
    p = os.path.abspath(os.fspath(path))
    if not os.path.exists(p):
        raise PluginError(f"plugin file not found: {path} (rollout.plugin)")
    if os.path.isdir(p) or not p.endswith(".py"):
        raise PluginError(f"plugin {path} must be a Python file ending in .py")
    modname = "mgrpo_plugin_" + hashlib.sha256(p.encode()).hexdigest()[:12]
    reg = Registry(source=p)
    spec = importlib.util.spec_from_file_location(modname, p)
    module = importlib.util.module_from_spec(spec)
    added_path = os.path.dirname(p) not in sys.path
    if added_path:
        sys.path.insert(0, os.path.dirname(p))
    sys.modules[modname] = module
    try:
        with _collecting(reg):
            spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(modname, None)
        raise PluginError(f"plugin {path} has a syntax error at line {e.lineno}: {e.msg}"
                          + (f"\n    {e.text.rstrip()}" if e.text else "")) from None
    except Exception as e:
        sys.modules.pop(modname, None)
        line = _line_in(e, p)
        raise PluginError(f"plugin {path} failed while loading{f' (line {line})' if line else ''}: "
                          f"{type(e).__name__}: {e}") from e
    finally:
        if added_path:
            try:
                sys.path.remove(os.path.dirname(p))
            except ValueError:
                pass
    if len(reg) == 0:
        raise PluginError(f"plugin {path} registers no reward, tool or policy: decorate them with "
                          "@reward / @tool / @policy from megatron_grpo.rollout.plugins")
    reg.module = module
    return reg


def _line_in(e: BaseException, path: str) -> Optional[int]:
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if os.path.abspath(fr.filename) == path:
            return fr.lineno
    return None


def load_registry(plugin_path=None) -> Registry:
    """Built-ins, then process-wide registrations, then the plugin's (later ones replace)."""
    reg = builtin_registry().update(GLOBAL)
    if plugin_path:
        reg.update(load_plugin(plugin_path))
    return reg


def resolve_rollout_names(reg: Registry, cfg, policy: Optional[str] = None):
    """``(tools, policy class)`` of the rollout config ``cfg`` in ``reg``, every reward function
    looked up too; a `PluginError` (a ValueError) names the first unknown name."""
    tools = reg.tools.select(cfg.tools)
    policy_cls = reg.policy_class(policy or cfg.policy)
    for name in cfg.reward_funcs:
        reg.reward(name)
    return tools, policy_cls


def check_rollout_names(cfg) -> Registry:
    """Load ``cfg.plugin`` and resolve every name the rollout config uses (:func:`resolve_rollout_names`).
    `mgrpo train` calls this before any rank or server starts; the rollout engine resolves the
    names again (the same function) when it is built."""
    reg = load_registry(cfg.plugin)
    resolve_rollout_names(reg, cfg)
    return reg
