"""Plugin loading from a file path: registrations, overrides, and clear errors for bad files."""
import asyncio
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megatron_grpo.rollout.engine import HermesToolPolicy, MultiTurnPolicy
from megatron_grpo.rollout.plugins import (PluginError, builtin_registry, load_plugin,
                                           load_registry)
from megatron_grpo.rollout.tools import ToolCall, ToolContext

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "plugins" / "audio_agent.py"


def _write(tmp_path, body, name="plug.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_builtins():
    reg = builtin_registry()
    assert sorted(reg.rewards) == ["answer_chars", "format", "iou", "iou_raw", "think_length",
                                  "tool_call"]
    assert list(reg.tools.tools) == ["crop_audio"]
    assert reg.policy_class(None) is HermesToolPolicy
    assert reg.policy_class("single_turn") is MultiTurnPolicy


def test_load_plugin_registers_all_kinds(tmp_path):
    p = _write(tmp_path, """
        from megatron_grpo.rollout.plugins import reward, tool, policy, HermesToolPolicy, ToolResult

        @reward
        def short(completions, **kwargs):
            return [1.0 if len(c) < 5 else 0.0 for c in completions]

        @reward("async_one")
        async def one(completions, **kwargs):
            return [1.0] * len(completions)

        @reward(name="format")          # replaces the built-in
        def my_format(completions, **kwargs):
            return [0.25] * len(completions)

        @tool(name="echo", description="Repeat.", parameters={"type": "object",
              "properties": {"text": {"type": "string"}}, "required": ["text"]})
        def echo(text, *, ctx):
            return ToolResult(text=text.upper())

        @policy
        class Mine(HermesToolPolicy):
            name = "mine"
    """)
    own = load_plugin(p)
    assert sorted(own.rewards) == ["async_one", "format", "short"] and "echo" in own.tools
    reg = load_registry(p)
    assert reg.reward("format")(["x"]) == [0.25]
    assert reg.reward("iou") is builtin_registry().reward("iou")
    assert reg.policy_class(None).__name__ == "Mine" and reg.policy_class("hermes") is HermesToolPolicy
    res = asyncio.run(reg.tools.execute(ToolCall("echo", {"text": "hi"}, ""), ToolContext(audios=[])))
    assert res.text == "HI" and not res.error
    with pytest.raises(PluginError, match="unknown reward function 'shrot' \\(did you mean 'short'\\?\\)"):
        reg.reward("shrot")


@pytest.mark.parametrize("body, pattern", [
    ("def f(:\n    pass\n", r"syntax error at line 1"),
    ("x = 1\nimport no_such_module_xyz\n", r"failed while loading \(line 2\): ModuleNotFoundError"),
    ("x = 1\n", r"registers no reward, tool or policy"),
    ("from megatron_grpo.rollout.plugins import reward\n\n@reward\ndef f(completions):\n    return []\n",
     r"failed while loading \(line 3\): PluginError: reward 'f' must accept \*\*kwargs"),
    ("from megatron_grpo.rollout.plugins import tool\n\n@tool(name='t')\ndef t(x):\n    return x\n",
     r"tool 't': fn must accept a keyword argument `ctx`"),
    ("from megatron_grpo.rollout.plugins import policy\n\n@policy\nclass P:\n    pass\n",
     r"policy 'P' must be a class derived from MultiTurnPolicy"),
    ("raise RuntimeError('no config')\n", r"failed while loading \(line 1\): RuntimeError: no config"),
])
def test_bad_plugin_files(tmp_path, body, pattern):
    p = _write(tmp_path, body)
    with pytest.raises(PluginError, match=pattern) as ei:
        load_plugin(p)
    assert str(p) in str(ei.value)


def test_missing_and_non_python_files(tmp_path):
    with pytest.raises(PluginError, match="plugin file not found: .*nope.py"):
        load_plugin(tmp_path / "nope.py")
    with pytest.raises(PluginError, match="must be a Python file ending in .py"):
        load_plugin(_write(tmp_path, "x", name="plug.txt"))
    with pytest.raises(PluginError, match="must be a Python file"):
        load_plugin(tmp_path)


def test_several_policies_need_a_choice(tmp_path):
    p = _write(tmp_path, """
        from megatron_grpo.rollout.plugins import policy, HermesToolPolicy
        @policy
        class A(HermesToolPolicy):
            name = "a"
        @policy
        class B(HermesToolPolicy):
            name = "b"
    """)
    reg = load_registry(p)
    with pytest.raises(PluginError, match="several policies registered"):
        reg.policy_class(None)
    assert reg.policy_class("b").__name__ == "B"
    with pytest.raises(PluginError, match="unknown policy 'c'"):
        reg.policy_class("c")


def test_audio_agent_example_plugin():
    reg = load_registry(EXAMPLE)
    assert {"audio_format", "audio_iou", "think_quality"} <= set(reg.rewards)
    assert reg.policy_class(None).name == "audio_agent"
    crop = reg.tools.tools["crop_audio"]
    assert crop.parameters["required"] == ["start_sec", "end_sec"] and "audio_path" not in crop.parameters["properties"]
    good = "<think>\nI heard the beep around eleven seconds, so the span is clear.\n</think>\n[00:10 - 00:20]"
    assert reg.reward("audio_format")([good, "[00:10 - 00:20]"]) == [1.0, 0.0]
    assert reg.reward("audio_iou")([good, "<think>x</think>[00:16 - 00:20]"],
                                   ground_truth=["[00:10 - 00:20]"] * 2) == [2.0, 0.5]
    assert reg.reward("think_quality")([good, "none"]) == [pytest.approx(12 / 15), 0.0]   # 12 words
    w = np.zeros(16000 * 5, np.float32)
    res = asyncio.run(reg.tools.execute(ToolCall("crop_audio", {"start_sec": 1, "end_sec": 2}, ""),
                                        ToolContext(audios=[w])))
    assert not res.error and len(res.audios[0]) == 16000
