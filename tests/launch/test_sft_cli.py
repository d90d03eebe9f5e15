"""`mgrpo sft` refuses bad input in one line before any rank starts."""
import json


def test_bad_row_and_bad_key_are_one_line(mgrpo_inproc, tiny_ckpt, tmp_path):
    bad = tmp_path / "sft.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    r = mgrpo_inproc("sft", f"sft.data={bad}", f"model.hf_dir={tiny_ckpt}", f"sft.run_dir={tmp_path / 'run'}")
    assert (r.returncode, r.stderr) == (2, f"mgrpo sft: data error: {bad} line 1: messages has no assistant turn: "
                                           "nothing to train on — add the assistant's reply (SFT trains on assistant "
                                           "turns only)\n")
    assert not (tmp_path / "run").exists()
    r = mgrpo_inproc("sft", "sft.stepz=3")
    assert (r.returncode, r.stderr) == (2, "mgrpo sft: config error: unknown config key 'sft.stepz' (did you mean "
                                           "'sft.steps'?); valid keys here: ['data', 'export', 'lr', 'run_dir', "
                                           "'samples_per_step', 'steps']\n")
