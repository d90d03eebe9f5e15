"""Notices from megatron-core, torch and transformers about things we knowingly do without or
that are not problems; the CLI commands (`mgrpo train`, `mgrpo convert`) keep them out of the output."""
from __future__ import annotations

import logging

# megatron-core and torch warn about optional kernels we knowingly do without; keep the run's
# output to what the user needs (the progress bar and real problems)
_QUIET = (r".*(Apex|Transformer Engine|TE) (is|are) not installed.*", r".*full scope is deprecated.*",
          r".*torch.distributed.*deprecated.*", r".*GPTModel IS DEPRECATED.*",
          # megatron's dist checkpointing loads through torch's ShardedTensor API (resume, convert)
          r".*`load_state_dict` is deprecated.*", r".*deprecating ShardedTensor.*",
          # the CPU shim's torch function mode (model_bridge/mcore_cpu.py) sees every `.grad` read,
          # megatron's reads of non-leaf tensors included, and torch names the shim's line as the culprit
          r".*\.grad attribute of a Tensor that is not a leaf Tensor is being accessed.*")


class _KnownNotices(logging.Filter):
    """transformers' RoPE validation does not know the keys of Qwen3-Omni's interleaved MRoPE
    (``mrope_section``, ``interleaved``: the released model's own config.json has them), and says
    so once per process; nothing is wrong, so the run does not print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Unrecognized keys in `rope_parameters`") and "mrope_section" in msg)


def quiet_known_notices() -> None:
    """Filter the notices above (warnings and the RoPE log line) in this process; idempotent."""
    import warnings

    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    from model_bridge.dist_ckpt.runs import CheckpointWarning

    # the checkpoint log line already says it; the warning would print it again, with a source line
    warnings.filterwarnings("ignore", category=CheckpointWarning)
    import torch

    if not torch.cuda.is_available():  # megatron's advice on CUDA streams, meaningless without CUDA
        warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    if not any(isinstance(f, _KnownNotices) for f in rope_log.filters):
        rope_log.addFilter(_KnownNotices())
