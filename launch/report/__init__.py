"""`mgrpo report RUN_DIR`: a run's recorded trajectories as static web pages to read and listen to.

``load.py`` finds and reads what the run recorded (``rollout.record_dir``, ``logging.trajectories``,
metrics.jsonl), ``tokens.py`` turns token ids into text pieces, ``audio.py`` writes each clip once,
``conversation.py`` renders one sample's turns, ``pages.py`` the index and step pages (no server, no
external assets), ``render.py`` puts them together and ``cli.py`` is the subcommand. The recording
format is ``megatron_grpo/run/replay.py``'s (``megatron_grpo/run/trajlog.py`` adds the trainer's
logprobs).
"""
