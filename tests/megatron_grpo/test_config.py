"""The train config tree: examples load, the embedded default round-trips, docs are current."""
from pathlib import Path

import pytest

from megatron_grpo.config import TrainConfig, load_train_config
from megatron_grpo.configtree import ConfigKeyError, render_markdown

REPO = Path(__file__).resolve().parents[2]


def test_tiny_example_is_the_embedded_default():
    assert load_train_config(REPO / "examples" / "audio_agent_tiny.yaml") == TrainConfig()


def _dotted_fields(obj, prefix: str = "") -> set:
    import dataclasses

    out = set()
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out |= _dotted_fields(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {prefix + f.name}
    return out


def _dotted_keys(d: dict, prefix: str = "", sections: frozenset = frozenset()) -> set:
    out = set()
    for k, v in d.items():
        key = prefix + k
        out |= _dotted_keys(v, key + ".", sections) if key in sections else {key}
    return out


def test_tiny_example_writes_out_every_key():
    """The example says it is the embedded default written out: it names every key of the tree,
    and nothing else."""
    import dataclasses

    import yaml

    cfg = TrainConfig()
    fields = _dotted_fields(cfg)
    # every dotted prefix of a field is a section (a YAML mapping); other mappings are values
    sections = frozenset(".".join(k.split(".")[:i]) for k in fields for i in range(1, k.count(".") + 1))
    written = _dotted_keys(yaml.safe_load((REPO / "examples" / "audio_agent_tiny.yaml").read_text()), "", sections)
    assert dataclasses.is_dataclass(cfg)
    assert not fields - written, f"keys missing from the example: {sorted(fields - written)}"
    assert not written - fields, f"keys the tree does not have: {sorted(written - fields)}"


def test_30b_example_loads_with_its_layout():
    cfg = load_train_config(REPO / "examples" / "qwen3_omni_30b_a3b_audio_agent.yaml")
    p = cfg.parallel
    assert (p.nproc, p.tp, p.ep, p.pp, cfg.rollout.max_turns, cfg.rollout.num_generations) == (32, 2, 8, 2, 5, 8)


def test_30b_example_finds_its_plugin_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_train_config(REPO / "examples" / "qwen3_omni_30b_a3b_audio_agent.yaml")
    assert cfg.rollout.plugin == str(REPO / "examples" / "plugins" / "audio_agent.py")


def test_relative_plugin_is_found_in_the_current_then_the_config_files_directory(tmp_path, monkeypatch):
    tmp_path = tmp_path.resolve()  # as os.getcwd() gives it
    conf, here = tmp_path / "conf", tmp_path / "here"
    for d in (conf, here):
        (d / "plugins").mkdir(parents=True)
    (conf / "run.yaml").write_text("rollout:\n  plugin: plugins/p.py\n")
    (conf / "plugins" / "p.py").write_text("")
    monkeypatch.chdir(here)
    assert load_train_config(conf / "run.yaml").rollout.plugin == str(conf / "plugins" / "p.py")
    (here / "plugins" / "p.py").write_text("")  # the current directory comes first
    assert load_train_config(conf / "run.yaml").rollout.plugin == str(here / "plugins" / "p.py")
    assert load_train_config(None, ["rollout.plugin=plugins/p.py"]).rollout.plugin == str(here / "plugins" / "p.py")
    with pytest.raises(ConfigKeyError) as ei:
        load_train_config(conf / "run.yaml", ["rollout.plugin=plugins/q.py"])  # the command line's: here only
    assert str(ei.value) == (f"plugin file not found: plugins/q.py (rollout.plugin; tried {here / 'plugins' / 'q.py'}: "
                             "a relative path given on the command line is resolved against the current directory)")
    (conf / "run.yaml").write_text("rollout:\n  plugin: plugins/q.py\n")
    with pytest.raises(ConfigKeyError) as ei:
        load_train_config(conf / "run.yaml")
    assert str(ei.value) == (f"plugin file not found: plugins/q.py (rollout.plugin; tried {here / 'plugins' / 'q.py'} "
                             f"and {conf / 'plugins' / 'q.py'}: a relative path is resolved against the current "
                             "directory, then the config file's directory)")


def test_cross_section_checks_name_the_keys():
    with pytest.raises(ConfigKeyError, match=r"parallel.nproc=3 is not a multiple of tp\*pp=2"):
        load_train_config(None, ["parallel.nproc=3"])
    with pytest.raises(ConfigKeyError, match=r"parallel.etp=1 with parallel.ep=1 and parallel.tp=2"):
        load_train_config(None, ["parallel.etp=1"])


def test_configuration_doc_is_generated_from_the_tree():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc.strip() == render_markdown(TrainConfig, "Configuration reference (`mgrpo train`)").strip(), \
        "docs/configuration.md is stale: regenerate with `python -m megatron_grpo.config --docs > docs/configuration.md`"


def test_overrides_without_a_yaml_change_the_embedded_job_and_nothing_else():
    """``mgrpo train rollout.overlap=true``: the embedded job with one change (not the rollout
    section's class defaults, which use other rewards and longer turns)."""
    import dataclasses

    base = TrainConfig()
    cfg = load_train_config(None, ["rollout.overlap=true"])
    assert cfg.rollout == dataclasses.replace(base.rollout, overlap=True)
    assert dataclasses.replace(cfg, rollout=base.rollout) == base
    with pytest.raises(ConfigKeyError, match=r"rollout.reward_weights has 4 entries for 1 reward_funcs \['format'\]: "
                                             r"give one weight per reward, or rollout.reward_weights=null for 1.0 each"):
        load_train_config(None, ["rollout.reward_funcs=[format]"])  # the embedded job weighs its 4 rewards
    one = load_train_config(None, ["rollout.reward_funcs=[format]", "rollout.reward_weights=null"])
    assert one.rollout.reward_funcs == ["format"] and one.rollout.max_new_tokens == base.rollout.max_new_tokens
