"""``rollout.*``: how rollouts are sampled from the vLLM server(s), the multi-turn tool loop's limits,
and what happens when a server fails.  Checked on construction; an unknown key names the closest one.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, fields
from typing import Literal, Any, Optional, Union

__all__ = ["RolloutConfig", "ON_ERROR_CHOICES"]

ON_ERROR_CHOICES = ("raise", "drop_sample", "drop_group")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class RolloutConfig:
    """The rollout section of the run config (docs/rollout.md)."""

    # ------------------------------------------------------------------ servers and transport
    server: Literal["local", "remote", "replay"] = "local"
    """"local": `mgrpo train` starts a vLLM server itself (`mgrpo serve` on this machine, settings
    in the ``serve`` section) and stops it at exit; ``server_urls`` is then ignored. "remote":
    connect to the running servers in ``server_urls``. "replay": no server at all; step k trains on
    the trajectories recorded for step k in ``replay_dir`` (rewards and advantages as recorded), and
    no weights are pushed (docs/training.md, "Record and replay rollouts")."""
    record_dir: Optional[str] = None
    """Save each step's trajectories, exactly as the trainer consumed them (token ids, loss masks,
    rollout logprobs, audio, group ids, rewards, advantages) and the step's rollout counters to
    ``<record_dir>/step_{k:06d}.pt``, plus ``manifest.json`` (model, vocab size, audio feature
    dims, steps recorded, run config). None: no recording."""
    replay_dir: Optional[str] = None
    """A ``record_dir`` to replay with ``server: replay``; it must hold steps 1..trainer.steps."""
    server_urls: list = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """Base URLs of the vLLM servers (`mgrpo serve`), e.g. ``["http://10.0.0.5:8000", ...]``.
    Requests go to the least-loaded one (fewest requests in flight); a conversation prefers the
    server of its previous turn (its prefix cache) while that server is not busier than the others
    by more than ``affinity_slack``."""
    api_key: Optional[str] = field(default=None, repr=False)
    """Bearer token of the servers (`mgrpo serve --api-key`); default ``$VLLM_API_KEY``."""
    weight_transfer: Literal["auto", "gloo", "nccl", "nccl_m2n"] = "auto"
    """The servers' weight-transfer engine (`mgrpo serve --weight-transfer`; a local server is
    started with it): auto = gloo without CUDA, nccl with it; nccl_m2n = vLLM's many-to-many engine,
    which the multi-source push uses on GPU (weight_sync.mode; needs the nccl-extensions package on
    the trainer and the servers)."""
    model: Optional[str] = None
    """Served model name sent with each request; None asks each server (``GET /v1/models``)."""
    tokenizer: Optional[str] = None
    """Checkpoint dir whose tokenizer and chat template render prompts and tool turns (the one the
    servers serve).  The trainer passes its own; required when the engine loads it itself."""
    concurrency: int = 64
    """Requests in flight over all servers at once."""
    max_inflight_per_server: Optional[int] = None
    """Cap per server (None: only ``concurrency`` caps); keep <= the server's --max-num-seqs to
    avoid queueing inside vLLM."""
    affinity_slack: int = 2
    """A conversation's next turn stays on the server of its previous turn (prefix-cache hit)
    unless that server has more than this many requests in flight above the least-loaded one."""
    request_timeout_s: float = 600.0
    """Seconds one generate request may take (connect, queue, prefill, decode) before it is retried."""
    connect_timeout_s: float = 10.0
    """Seconds to open a connection to a server."""
    max_retries: int = 3
    """Retries of one request after a connection error, a timeout, a 5xx answer or an aborted
    request (e.g. a weight push paused the server), each on the least-loaded server other than
    the one that failed when there is one.  0: fail at once."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubles per retry (exponential backoff) up to ``backoff_max_s``."""
    backoff_max_s: float = 30.0
    """Longest wait between two retries."""
    on_error: str = "raise"
    """A sample whose request still fails after the retries: "raise" stops the rollout with a
    `RolloutServerError` naming the server (the other samples are cancelled, nothing is returned);
    "drop_sample" drops that sample whole; "drop_group" drops every sample of its prompt (GRPO
    groups stay complete).  A half-finished conversation never reaches training."""

    overlap: bool = False
    """One-step off-policy mode: the rollout of step k+1 runs (on the servers, still holding the
    weights of step k-1) while step k trains; the new weights are pushed once both are done. Each
    trajectory records its weight version, and the rollout correction (``importance``) absorbs the
    one-step lag. Off: every step rolls out with the newest weights."""

    # ------------------------------------------------------------------ sampling
    num_generations: int = 8
    """Samples (conversations) per prompt: the GRPO group size."""
    max_turns: int = 3
    """Generated (assistant) turns per conversation, the final answer included."""
    max_new_tokens: int = 1024
    """Tokens the policy may generate in one turn."""
    max_total_tokens: Optional[int] = None
    """Longest conversation (prompt, every turn and tool turn) in tokens; None: the server's
    max_model_len.  A turn gets at most what is left; a tool turn that does not fit ends the
    conversation (finish_reason "context_length")."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: off."""
    seed: Optional[int] = None
    """Base seed: sample k of prompt p, turn t is sampled with a seed derived from (seed, p, k, t),
    so a rollout can be repeated on the same server and weights.  None: vLLM's own randomness."""
    stop_token_ids: Optional[list] = None
    """Extra token ids that end a turn (the checkpoint's generation_config EOS ids, e.g.
    ``<|im_end|>``, always do)."""
    extra_sampling_params: dict = field(default_factory=dict)
    """Passed into vLLM's SamplingParams verbatim (e.g. ``{"repetition_penalty": 1.05}``)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra variables of the chat template (e.g. ``{"enable_thinking": true}``), used for the prompt
    and every tool turn alike."""

    # ------------------------------------------------------------------ tools, plugins, rewards
    plugin: Optional[str] = None
    """A Python file with reward functions, tools and a multi-turn policy (docs/rollout.md,
    "Plugin API"); its registrations add to (and may replace) the built-ins. A relative path is
    resolved against the current directory, then (when a --config file names it) against that
    file's directory; the run keeps the absolute path."""
    policy: Optional[str] = None
    """Name of the multi-turn policy: one the plugin registered, or "hermes" (built-in: runs the
    `<tool_call>` calls of a turn, ends on a turn without one).  None: the plugin's policy if it
    registered exactly one, else "hermes"."""
    tools: Optional[list] = None
    """Names of the tools the model may call; None: every registered tool."""
    max_tool_calls: int = 4
    """Tool calls per conversation; a turn that would exceed it ends the conversation
    (finish_reason "tool_limit")."""
    max_tool_calls_per_turn: int = 1
    """Tool calls executed from one turn; further calls in the same turn get an error message."""
    tool_timeout_s: float = 60.0
    """Seconds one tool call may run; a slower call is answered with an error message."""
    crop_min_seconds: float = 0.1
    """Shortest clip `crop_audio` returns (0.1 s = 2 audio tokens; below 161 samples a clip cannot
    be featurised)."""
    crop_max_seconds: Optional[float] = None
    """Longest clip `crop_audio` returns; a longer request is cut to this length from its start
    (the tool response says so).  None: no limit beyond the recording."""
    reward_funcs: list = field(default_factory=lambda: ["format", "iou"])
    """Reward functions by registered name (built-ins: "answer_chars", "format", "iou", "iou_raw", "think_length",
    "tool_call")."""
    reward_weights: Optional[list] = None
    """Weight of each reward function (default 1.0 each); the sample's reward is the weighted sum."""

    # ------------------------------------------------------------------ routing replay (R3)
    return_routed_experts: bool = False
    """Record vLLM's routed experts of every token (`Trajectory.routed_experts`, [T-1, layers, top_k]).
    Needs servers that return them: ``mgrpo serve --return-routed-experts`` (vLLM's
    ``--enable-return-routed-experts``; on CPU servers our worker extension does the capture), or the
    server `mgrpo train` starts itself (rollout.server "local"), which gets the flag from this."""
    routing_replay: Union[bool, str] = False
    """MoE routing replay in the training forward (docs/training.md, "Routing replay"): "r3" (or
    true) replays the rollout server's routes of every token (needs return_routed_experts), "r2"
    the routes the trainer chose in the step's old-policy logprob pass; false routes freely."""

    def __post_init__(self):
        if self.weight_transfer not in ("auto", "gloo", "nccl", "nccl_m2n"):
            raise ValueError(f"rollout.weight_transfer must be auto, gloo, nccl or nccl_m2n, got "
                             f"{self.weight_transfer!r}")
        if isinstance(self.server_urls, str):
            self.server_urls = [self.server_urls]
        if not isinstance(self.server_urls, (list, tuple)) or not self.server_urls:
            raise ValueError("rollout.server_urls must be a non-empty list of URLs like "
                             "'http://127.0.0.1:8000'")
        urls = []
        for u in self.server_urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"rollout.server_urls entry {u!r} is not an http(s):// URL")
            u = u.rstrip("/")
            if u in urls:
                raise ValueError(f"rollout.server_urls lists {u} twice")
            urls.append(u)
        self.server_urls = urls
        for name in ("record_dir", "replay_dir"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (str, os.PathLike)) or not os.fspath(v)):
                raise ValueError(f"rollout.{name} must be None or a directory path, got {v!r}")
            if v is not None:
                setattr(self, name, os.path.abspath(os.fspath(v)))
        if self.server == "replay":
            if self.replay_dir is None:
                raise ValueError("rollout.server=replay needs rollout.replay_dir=<a rollout.record_dir "
                                 "of an earlier run>")
            from megatron_grpo.run.replay import read_manifest
            read_manifest(self.replay_dir)  # exists, with a manifest
            if self.record_dir is not None:
                raise ValueError("rollout.record_dir with rollout.server=replay would only copy the "
                                 "recording; unset one of them")
        elif self.replay_dir is not None:
            raise ValueError(f"rollout.replay_dir is set but rollout.server={self.server!r}: "
                             "set rollout.server=replay to train on the recording")
        if self.api_key is None:
            self.api_key = os.environ.get("VLLM_API_KEY") or None

        for name, lo in (("concurrency", 1), ("affinity_slack", 0), ("max_retries", 0),
                         ("num_generations", 1), ("max_turns", 1), ("max_new_tokens", 1),
                         ("max_tool_calls", 0), ("max_tool_calls_per_turn", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ValueError(f"rollout.{name} must be an int >= {lo}, got {v!r}")
        for name in ("max_inflight_per_server", "max_total_tokens", "seed"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < (0 if name == "seed" else 1)):
                raise ValueError(f"rollout.{name} must be None or an int >= "
                                 f"{0 if name == 'seed' else 1}, got {v!r}")
        for name in ("request_timeout_s", "connect_timeout_s", "tool_timeout_s"):
            v = getattr(self, name)
            if not _is_num(v) or v <= 0:
                raise ValueError(f"rollout.{name} must be a number of seconds > 0, got {v!r}")
        for name in ("backoff_s", "backoff_max_s"):
            v = getattr(self, name)
            if not _is_num(v) or v < 0:
                raise ValueError(f"rollout.{name} must be a number of seconds >= 0, got {v!r}")
        if self.on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"rollout.on_error must be one of {', '.join(ON_ERROR_CHOICES)}, "
                             f"got {self.on_error!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"rollout.top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple)) or
                                                not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"rollout.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for name in ("extra_sampling_params", "chat_template_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"rollout.{name} must be a mapping, got {getattr(self, name)!r}")
        reserved = {"n", "logprobs", "prompt_logprobs", "max_tokens", "detokenize",
                    "routed_experts_prompt_start", "output_kind"} & set(self.extra_sampling_params)
        if reserved:
            raise ValueError(f"rollout.extra_sampling_params may not set {sorted(reserved)}: the "
                             "engine sets them (use max_new_tokens, num_generations)")
        if self.plugin is not None:
            if not isinstance(self.plugin, (str, os.PathLike)) or not os.fspath(self.plugin):
                raise ValueError(f"rollout.plugin must be a path to a .py file, got {self.plugin!r}")
            self.plugin = os.fspath(self.plugin)
        if self.tools is not None and (not isinstance(self.tools, (list, tuple)) or
                                       not all(isinstance(t, str) and t for t in self.tools)):
            raise ValueError(f"rollout.tools must be None or a list of tool names, got {self.tools!r}")
        if not _is_num(self.crop_min_seconds) or self.crop_min_seconds < 0:
            raise ValueError(f"rollout.crop_min_seconds must be >= 0, got {self.crop_min_seconds!r}")
        if self.crop_max_seconds is not None and (not _is_num(self.crop_max_seconds) or
                                                  self.crop_max_seconds <= self.crop_min_seconds):
            raise ValueError(f"rollout.crop_max_seconds must be None or > crop_min_seconds, "
                             f"got {self.crop_max_seconds!r}")
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if not isinstance(self.reward_funcs, (list, tuple)) or not all(
                isinstance(r, str) and r for r in self.reward_funcs):
            raise ValueError(f"rollout.reward_funcs must be a list of reward names, got {self.reward_funcs!r}")
        self.reward_funcs = list(self.reward_funcs)
        if self.reward_weights is not None:
            if (not isinstance(self.reward_weights, (list, tuple)) or
                    not all(_is_num(w) for w in self.reward_weights)):
                raise ValueError(f"rollout.reward_weights must be a list of numbers, got {self.reward_weights!r}")
            if len(self.reward_weights) != len(self.reward_funcs):
                raise ValueError(f"rollout.reward_weights has {len(self.reward_weights)} entries for "
                                 f"{len(self.reward_funcs)} reward_funcs {self.reward_funcs}: give one weight per "
                                 "reward, or rollout.reward_weights=null for 1.0 each")
            self.reward_weights = [float(w) for w in self.reward_weights]
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"rollout.return_routed_experts must be true or false, got {self.return_routed_experts!r}")
        if self.routing_replay is True:
            self.routing_replay = "r3"
        if self.routing_replay not in (False, "r2", "r3"):
            raise ValueError(f"rollout.routing_replay must be false, true (= r3), r3 or r2, got {self.routing_replay!r}")
        if self.routing_replay == "r3" and not self.return_routed_experts:
            raise ValueError("rollout.routing_replay=r3 replays the rollout server's routes: set "
                             "rollout.return_routed_experts=true too (or use routing_replay=r2, the trainer's own)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RolloutConfig":
        """Build from a plain dict (YAML/JSON); an unknown key raises with the closest name."""
        names = [f.name for f in fields(cls)]
        for k in d:
            if k not in names:
                near = difflib.get_close_matches(k, names, n=1)
                raise ValueError(f"unknown key rollout.{k}" + (f"; did you mean rollout.{near[0]}?"
                                                                 if near else f"; known keys: {', '.join(names)}"))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["api_key"] = None if self.api_key is None else "***"
        return out
