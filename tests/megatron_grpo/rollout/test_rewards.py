"""Built-in rewards: exact numbers for format, tiered IoU, raw IoU, think length/repetition."""
import asyncio

import pytest

from megatron_grpo.rollout import rewards as R
from megatron_grpo.trajectory import Trajectory

GOOD = "<think>\nThe beep starts near ten seconds.\n</think>\n\nThe beep is at [00:10 - 00:20]."


def test_format_reward():
    cases = [
        (GOOD, 1.0),
        ("<think>x</think>[00:10 - 00:20]", 1.0),
        ("<think>x</think>answer [1:05 - 1:20.5]", 1.0),
        ("The beep is at [00:10 - 00:20].", 0.0),                 # no think block
        ("<think>  \n </think>[00:10 - 00:20]", 0.0),             # empty think
        ("<think>x</think>around ten seconds", 0.0),              # no span
        ("<think>x</think>[00:20 - 00:10]", 0.0),                 # span ends before it starts
        ("<think>x</think>[00:10 - 00:20]<think>y</think>", 0.0),
        ('<think>x</think><tool_call>{"name": "crop_audio"}</tool_call> [00:10 - 00:20]', 0.0),
        ("<think>x [00:10 - 00:20]", 0.0),                        # unclosed think
    ]
    assert R.format_reward([c for c, _ in cases]) == [w for _, w in cases]


def test_span_iou():
    assert R.span_iou((10, 20), (10, 20)) == 1.0
    assert R.span_iou((10, 20), (15, 25)) == pytest.approx(5 / 15)
    assert R.span_iou((0, 5), (5, 10)) == 0.0
    assert R.span_iou((3, 3), (3, 3)) == 1.0 and R.span_iou((3, 3), (4, 4)) == 0.0


def test_iou_tiers_exact():
    gt = "[00:10 - 00:20]"
    # predicted span -> IoU with [10, 20]
    cases = [
        ("[00:10 - 00:20]", 2.0),     # 1.0
        ("[00:11 - 00:20]", 2.0),     # 0.9
        ("[00:12 - 00:20]", 1.0),     # 0.8: the tier is "> 0.8"
        ("[00:14 - 00:20]", 1.0),     # 0.6
        ("[00:16 - 00:20]", 0.5),     # 0.4: "> 0.4" fails, "> 0.1" holds
        ("[00:18 - 00:20]", 0.5),     # 0.2
        ("[00:19 - 00:20]", 0.0),     # 0.1: not > 0.1
        ("[00:30 - 00:40]", 0.0),     # disjoint
        ("no span at all", 0.0),
    ]
    comps = [f"<think>t</think>{c}" for c, _ in cases]
    assert R.iou_reward(comps, ground_truth=[gt] * len(comps)) == [w for _, w in cases]
    raw = R.iou_raw_reward(comps, ground_truth=[gt] * len(comps))
    assert raw == pytest.approx([1.0, 0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0, 0.0])


def test_iou_uses_last_span_of_answer_not_think():
    c = "<think>maybe [00:00 - 00:05]?</think>first guess [00:30 - 00:40], final [00:10 - 00:20]"
    assert R.iou_reward([c], ground_truth=["[00:10 - 00:20]"]) == [2.0]
    # no think block: the whole text is the answer
    assert R.iou_raw_reward(["[00:15 - 00:20]"], ground_truth=["[00:10 - 00:20]"]) == [0.5]


def test_iou_custom_tiers_and_missing_ground_truth():
    f = R.make_iou_reward(tiers=[(0.5, 1.0), (0.0, 0.25)])
    assert f(["[00:10 - 00:20]", "[00:19 - 00:30]", "[00:40 - 00:50]"],
             ground_truth=["[00:10 - 00:20]"] * 3) == [1.0, 0.25, 0.0]
    assert R.iou_reward(["[00:10 - 00:20]"], ground_truth=[None]) == [None]
    with pytest.raises(R.RewardError, match="needs a 'ground_truth' column"):
        R.iou_reward(["x"])
    with pytest.raises(R.RewardError, match="threshold must be in"):
        R.make_iou_reward(tiers=[(1.5, 1.0)])


def test_think_length_reward_exact():
    f = R.make_think_length_reward(min_words=10, max_words=20, ngram=2, max_repeat=0.5)
    words = [f"w{i}" for i in range(40)]
    cases = [
        ("no think", 0.0),
        (f"<think>{' '.join(words[:5])}</think>x", 0.5),           # 5 / 10
        (f"<think>{' '.join(words[:15])}</think>x", 1.0),
        (f"<think>{' '.join(words[:30])}</think>x", 0.5),          # 1 - (30 - 20) / 20
        (f"<think>{' '.join(words[:40])}</think>x", 0.0),
        # 12 words "a b a b ...": 11 bigrams, 2 unique -> r = 9/11; penalty (9/11 - 0.5) / 0.5
        (f"<think>{' '.join(['a', 'b'] * 6)}</think>x", 1.0 - (9 / 11 - 0.5) / 0.5),
    ]
    got = f([c for c, _ in cases])
    assert got == pytest.approx([w for _, w in cases])
    assert R.repetition_ratio("a b c d", 2) == 0.0 and R.repetition_ratio("a", 3) == 0.0


def _traj(text, **cols):
    return Trajectory(prompt_index=0, group_id=0, input_ids_T=[1, 2], loss_mask_T=[0, 1],
                      rollout_logprobs_T=[0.0, -0.5], completion_texts=["turn 1", text],
                      num_turns=2, finish_reason="stop", columns=cols)


def test_compute_rewards_weighted_and_columns():
    seen = {}

    async def async_bonus(completions, ground_truth=None, completion_texts=None, **kwargs):
        seen.update(kwargs, ground_truth=ground_truth, completion_texts=completion_texts)
        return [0.5] * len(completions)

    trajs = [_traj(GOOD, ground_truth="[00:10 - 00:20]", id="a"),
             _traj("<think>x</think>[00:14 - 00:20]", ground_truth="[00:10 - 00:20]"),
             _traj("nothing", ground_truth=None, id="c")]
    fns = [("format", R.format_reward), ("iou", R.iou_reward), ("bonus", async_bonus)]
    out = asyncio.run(R.compute_rewards(trajs, fns, weights=[0.5, 1.0, 2.0]))
    assert out == [0.5 + 2.0 + 1.0, 0.5 + 1.0 + 1.0, 0.0 + 0.0 + 1.0]
    assert trajs[2].reward_terms == {"format": 0.0, "iou": None, "bonus": 0.5}
    assert seen["id"] == ["a", None, "c"] and seen["completion_texts"][0] == ["turn 1", GOOD]
    assert seen["finish_reasons"] == ["stop"] * 3 and seen["trajectories"][0] is trajs[0]


def test_compute_rewards_bad_functions():
    t = [_traj(GOOD)]
    with pytest.raises(R.RewardError, match="'short' returned list of length 0"):
        asyncio.run(R.compute_rewards(t, [("short", lambda completions, **k: [])]))
    with pytest.raises(R.RewardError, match="'nan' returned nan"):
        asyncio.run(R.compute_rewards(t, [("nan", lambda completions, **k: [float("nan")])]))
    with pytest.raises(R.RewardError, match="'boom' raised ZeroDivisionError"):
        asyncio.run(R.compute_rewards(t, [("boom", lambda completions, **k: [1 / 0])]))
    with pytest.raises(R.RewardError, match="must accept \\*\\*kwargs"):
        R.check_reward_fn("f", lambda completions: [])


def test_answer_chars_shaping_reward():
    from megatron_grpo.rollout.rewards import answer_chars_reward

    assert answer_chars_reward(["[00:01 - 00:05]", "ab 12", "", "  \n"]) == [1.0, 0.5, 0.0, 0.0]


def test_tool_call_reward_scores_an_executed_well_formed_crop():
    def call(body):
        return f"<think>\nLook closer.\n</think>\n\n<tool_call>\n{body}\n</tool_call>"

    crop = call('{"name": "crop_audio", "arguments": {"start_sec": 8, "end_sec": 17.5}}')
    texts = [
        [crop, GOOD],                                   # called, then answered
        [crop, crop, GOOD],                             # two crops
        [GOOD],                                         # answered at once
        [crop],                                         # the call is the last turn: never executed
        [call('{"name": "crop_audio", "arguments": {"start_sec": 8, "end_sec": 8}}'), GOOD],      # empty span
        [call('{"name": "crop_audio", "arguments": {"start_sec": -1, "end_sec": 3}}'), GOOD],     # before 0
        [call('{"name": "crop_audio", "arguments": {"start_sec": "8", "end_sec": 9}}'), GOOD],    # not a number
        [call('{"name": "crop_audio", "arguments": {"start_sec": 8, "end_sec": 9.}'), GOOD],      # bad JSON
        [call('{"name": "zoom", "arguments": {"start_sec": 8, "end_sec": 9}}'), GOOD],            # another tool
        ["I will crop 8 to 9 seconds.", GOOD],                                                     # no <tool_call>
    ]
    assert R.tool_call_reward([t[-1] for t in texts], completion_texts=texts) == [1.0, 1.0] + [0.0] * 8
    trajs = [_traj(GOOD)]  # through compute_rewards, which passes every turn's text
    trajs[0].completion_texts = [crop, GOOD]
    assert asyncio.run(R.compute_rewards(trajs, [("tool_call", R.BUILTIN_REWARDS["tool_call"])], [0.5])) == [0.5]
    with pytest.raises(R.RewardError, match="the tool_call reward needs completion_texts"):
        R.tool_call_reward([GOOD])
