"""Config trees: YAML + dotted overrides -> typed dataclasses, errors name the key."""
from dataclasses import dataclass, field

import pytest

from megatron_grpo.configtree import (ConfigKeyError, apply_overrides, field_docs, from_dict, load_config,
                                      render_markdown, to_dict)


@dataclass
class Inner:
    """An inner section."""

    lr: float = 1e-6
    """Learning rate."""
    steps: int = 10
    """How many steps."""
    name: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclass
class Outer:
    """The tree."""

    seed: int = 0
    """Random seed."""
    tags: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 3\ninner:\n  lr: 1e-5\n")
    cfg = load_config(Outer, p, ["inner.steps=7", "tags=[a, b]", "inner.name=x"])
    assert cfg == Outer(seed=3, tags=["a", "b"], inner=Inner(lr=1e-5, steps=7, name="x"))
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigKeyError, match=r"unknown config key 'inner.stpes' \(did you mean 'inner.steps'\?\)"):
        from_dict(Outer, {"inner": {"stpes": 3}})


def test_wrong_type_and_post_init_errors_name_the_key():
    with pytest.raises(ConfigKeyError, match=r"^inner.steps: expected an integer, got 'many'$"):
        from_dict(Outer, {"inner": {"steps": "many"}})
    with pytest.raises(ConfigKeyError, match=r"^inner: steps must be >= 1, got 0$"):
        from_dict(Outer, {"inner": {"steps": 0}})
    with pytest.raises(ConfigKeyError, match="not of the form"):
        apply_overrides({}, ["inner.steps"])
    with pytest.raises(ConfigKeyError, match=r"^tags: expected a list, got '/data' \(one item: \[/data\]\)$"):
        from_dict(Outer, {"tags": "/data"})
    with pytest.raises(ConfigKeyError, match=r"^inner.name: expected a string, got \[1\]$"):  # Optional[str]
        from_dict(Outer, {"inner": {"name": [1]}})


def test_yaml_syntax_error_names_the_file_and_place(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 3\ninner: {lr: 1\n")
    with pytest.raises(ConfigKeyError, match=rf"^config file {p} is not valid YAML at line 3, column 1: "):
        load_config(Outer, p)


def test_field_docs_and_markdown():
    assert field_docs(Inner) == {"lr": "Learning rate.", "steps": "How many steps."}
    md = render_markdown(Outer, "Config")
    assert "| `inner.lr` | `1.0e-06` | Learning rate. |" in md
    assert "| `seed` | `0` | Random seed. |" in md
