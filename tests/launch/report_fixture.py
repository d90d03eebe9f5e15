"""A recorded run built by the production code without a server: conversations rendered by the tiny
checkpoint's own chat template (audio runs sized by vLLM's token rule, checked by
`check_alignment`), rewards from the built-in reward functions, advantages and filtering as the
trainer does them, written by `Recorder` (rollout.record_dir), `TrajectoryLog` (trainer logprobs
and logging.trajectories) and `MetricsLogger` (metrics.jsonl with the trainer's step metrics).
Only the sampled text and the two logprob vectors are made up (seeded)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

RATE = 16000
CROP_TOOL = {"type": "function", "function": {
    "name": "crop_audio", "description": "Return the clip between start_sec and end_sec.",
    "parameters": {"type": "object", "properties": {"start_sec": {"type": "number"}, "end_sec": {"type": "number"}},
                   "required": ["start_sec", "end_sec"]}}}
ANSWERS = ("<think>the dog barks early</think>[00:01 - 00:02]", "<think>late</think>[00:02 - 00:03]",
           "no idea", "<think>around one</think>[00:00 - 00:02]")


def _tone(seconds: float, hz: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    noise = np.random.default_rng(seed).standard_normal(t.size) * 0.01
    return (0.3 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


def _expand_audio(ids: list[int], audio_id: int, counts: list[int]) -> list[int]:
    out, k = [], 0
    for i in ids:
        if i == audio_id:
            out += [audio_id] * counts[k]
            k += 1
        else:
            out.append(i)
    assert k == len(counts)
    return out


def make_trajectory(tok, audio_id: int, prompt_index: int, group_id: int, sample: int, rng):
    from megatron_grpo.data.features import audio_token_counts
    from megatron_grpo.trajectory import Trajectory, check_alignment

    rec = _tone(3.0 + 0.5 * prompt_index, 220.0 + 40 * prompt_index, prompt_index)
    crop = rec[RATE * (sample % 2): RATE * (sample % 2 + 1)].copy()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio", "audio": "rec.wav"},
                                      {"type": "text", "text": "When does the dog bark? Answer [MM:SS - MM:SS]."}]}],
        tools=[CROP_TOOL], tokenize=False, add_generation_prompt=True)
    call = ('<tool_call>\n{"name": "crop_audio", "arguments": {"start_sec": %d, "end_sec": %d}}\n</tool_call><|im_end|>'
            % (sample % 2, sample % 2 + 1))
    tool = ("\n<|im_start|>user\n<tool_response>\n<|audio_start|><|audio_pad|><|audio_end|>\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n")
    answer = ANSWERS[sample % len(ANSWERS)] + "<|im_end|>"
    counts = audio_token_counts([rec, crop])
    parts = [(prompt, 0), (call, 1), (tool, 0), (answer, 1)]
    ids, mask = [], []
    runs = iter(counts)
    for text, m in parts:
        p = _expand_audio(tok(text, add_special_tokens=False)["input_ids"], audio_id,
                          [next(runs) for _ in range(text.count("<|audio_pad|>"))])
        ids += p
        mask += [m] * len(p)
    lp = [float(-rng.exponential(0.8)) if m else 0.0 for m in mask]
    t = Trajectory(prompt_index=prompt_index, group_id=group_id, input_ids_T=ids, loss_mask_T=mask,
                   rollout_logprobs_T=lp, audios=[rec, crop], audio_token_counts=counts,
                   completion_texts=[call.removesuffix("<|im_end|>"), answer.removesuffix("<|im_end|>")],
                   num_turns=2, finish_reason="answer" if sample % 4 != 2 else "max_turns", weight_version=0,
                   columns={"ground_truth": "[00:01 - 00:02]"})
    check_alignment(t, audio_id, check_audio_samples=True)
    return t


def record_run(root: Path, hf_dir, *, steps: int = 2, groups: int = 2, samples: int = 4, max_samples: int = 4,
               seed: int = 0) -> dict:
    """Writes root/run (config.json, metrics.jsonl, trajectories/) and root/rec (rollout.record_dir);
    returns {"run", "rec", "steps": {step: (trajectories, trainer logprobs)}}."""
    from transformers import AutoTokenizer

    from megatron_grpo.config import load_train_config
    from megatron_grpo.configtree import to_dict
    from megatron_grpo.metrics import MetricsLogger
    from megatron_grpo.rollout.rewards import compute_rewards, format_reward, make_iou_reward, run_sync
    from megatron_grpo.run.replay import Recorder
    from megatron_grpo.run.rollout_source import with_advantages
    from megatron_grpo.run.trajlog import TrajectoryLog
    from megatron_grpo.train import _step_metrics

    run, rec = root / "run", root / "rec"
    cfg = load_train_config(None, [f"model.hf_dir={hf_dir}", f"rollout.record_dir={rec}", f"trainer.run_dir={run}",
                                   "logging.trajectories.every=1", f"logging.trajectories.max_samples={max_samples}"])
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    audio_id = tok.convert_tokens_to_ids("<|audio_pad|>")
    recorder, kept = Recorder(cfg), TrajectoryLog(cfg, run, rank=0)
    logger = MetricsLogger(run, tensorboard=False, plot=False)
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(1, steps + 1):
        trajs = [make_trajectory(tok, audio_id, g, step * 10_000 + g, s, rng) for g in range(groups) for s in range(samples)]
        run_sync(compute_rewards(trajs, [("format", format_reward), ("iou", make_iou_reward())], [1.0, 1.0]))
        trajs = with_advantages(trajs, "grpo")
        recorder.record(step, trajs, {"requests": float(len(trajs)), "retries": 0.0})
        lps = {}
        for i, t in enumerate(trajs):  # the trainer's logprobs: the rollout's, a little off on some tokens
            m = torch.tensor(t.loss_mask_T, dtype=torch.bool)
            noise = torch.from_numpy(rng.standard_normal(len(t.loss_mask_T)) * rng.choice([1e-4, 0.03, 0.4]))
            lps[i] = torch.where(m, torch.tensor(t.rollout_logprobs_T) + noise, 0.0).to(torch.float32)
        assert kept.wants(step)
        kept.keep(step, trajs, lps)
        train = {"loss": 0.01 * step, "grad_norm": 1.5 / step, "mismatch_kl_k3": 1e-3 * step, "kl": 0.0}
        logger.log(step, _step_metrics(step, trajs, train, 0.25, {"rollout": 3.0 + step, "train": 2.0}))
        out[step] = (trajs, lps)
    logger.close()
    return {"run": run, "rec": rec, "steps": out, "audio_token_id": audio_id}
