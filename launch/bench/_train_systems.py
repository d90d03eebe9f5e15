"""The timed systems of :mod:`launch.bench.train`, all on one engine (the same weights, DDP buffers
and optimizer) and the same trajectories; each is one "step" over the step's micro-batches:

* ``train``: the training phase exactly as ``mgrpo train`` runs it (``train.py``'s step 3-4):
  ``plan_step`` -> ``build_train_microbatches`` (featurising every clip with the trainer's
  featurizer; the first micro-batch's audio-tower batches start during the packing, as
  ``mgrpo train`` runs them) -> ``check_schedule`` -> ``train_step``; timed with a sync at its end only;
* ``train_recompute``: the same with ``trainer.shared_clips_keep: 0`` (every shared recording's
  first pass recomputed in the backward instead of kept);
* ``train_serial``: ``train`` with no tower batch started during the build (the device idle until
  the step's first forward but for the featurizer's work: what the prefetch saves);
* ``train_split``: the same calls with syncs between them (and no tower batch started during the
  build), so each part has its time:
  featurise (inside the build), pack (the build minus featurise, every micro-batch assembled, plus
  ``plan_step`` and the schedule check; each of the three also on its own: ``plan_s``, ``build_s``,
  ``check_s``; ``train`` assembles each micro-batch when its schedule reads it),
  ``forward_backward``, ``optimizer_update`` (the zeroing of the grads in front
  goes to ``zero_grad``);
* ``stack``: the layer stack alone on the same micro-batches (already on the device): the token
  embedding, the decoder layers, the final norm, loss ``sum(hidden * R)`` (``bench layers``' ours);
* ``stack_lm``: the same plus the fused LM-head logprob (``token_logprobs(..., lm_head_weight=)``,
  the trainer's) with loss = minus the mean logprob over the loss tokens;
* ``audio``: the audio tower alone as the trainer runs it (``OmniThinker.audio_rows``): fwd+bwd of
  each micro-batch's own clips, and once per step the clips several samples share (a group's
  recording: a first pass, then the backward through its kept graph or a recomputation in its last
  user's backward, as ``train``), ``sum(out * R)``;
* ``h2d``: every micro-batch copied to the device (``TrainMicroBatch.to``, as the forward step does).

The gradients of ``stack``/``stack_lm``/``audio`` go into the same DDP buffers and are zeroed after
each of their steps (no optimizer step).
"""
from __future__ import annotations

import time
from functools import partial

__all__ = ["TrainBench", "PHASE"]

PHASE = "phase"
"""The host range (``megatron_grpo.host_ranges``) around a ``train`` step, from its start to its
final sync: a profile's device timeline covers that window (not the profiler's own teardown)."""


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class TrainBench:
    """One engine, one list of trajectories, the systems above as methods returning their times (s)."""

    def __init__(self, engine, trajectories, packing, step_cfg, featurize, device, shared_clips: bool = True,
                 keep_shared: float = 0.5):
        import torch

        from megatron_grpo.engine.setup import unwrapped
        from megatron_grpo.engine.step import audio_prefetch_tower
        from megatron_grpo.packing import plan_step

        self.engine, self.trajs, self.packing, self.cfg, self.featurize = engine, trajectories, packing, step_cfg, featurize
        self.device, self.shared_clips, self.keep_shared = device, shared_clips, keep_shared
        self.shared_kept = None
        self.thinker = unwrapped(engine.model[0])
        self.tower = audio_prefetch_tower(engine, step_cfg)  # what mgrpo train hands the build
        self.step_no = 0
        self.lengths = [t.num_tokens for t in trajectories]
        plan = plan_step(self.lengths, 1, packing)
        self.host_mbs = list(self._build(plan, [0.0]))
        self.dev_mbs = [m.to(device) for m in self.host_mbs]
        dtype = next(self.thinker.parameters()).dtype
        g = torch.Generator(device="cpu").manual_seed(0)
        h = self.thinker.spec.text.hidden_size
        self.probes = [torch.randn(m.num_tokens, 1, h, generator=g).to(device, dtype) for m in self.host_mbs]
        self.audio_probes = []
        for m in self.host_mbs:
            n = m.count_tokens(self.thinker.spec.audio_token_id)
            self.audio_probes.append(torch.randn(n, h, generator=g).to(device, dtype) if m.has_audio else None)
        self.real_tokens = sum(m.mb.num_real_tokens for m in self.host_mbs)
        self.total_tokens = sum(m.num_tokens for m in self.host_mbs)
        self.num_clips = sum(m.num_clips for m in self.host_mbs)

    # ---- the training phase -------------------------------------------------------------------

    def _build(self, plan, feat_s: list | None, keep_shared=None, prefetch: bool = False):
        """The step's micro-batches; with ``feat_s``, featurising is timed into ``feat_s[0]`` (with a
        sync after the device featurizer's kernels); without it, it runs as in ``mgrpo train``: the
        featurizer's kernels overlap the host's packing. ``prefetch``: the first micro-batch's tower
        batches run during the packing too, as ``mgrpo train`` runs them (``audio_prefetch_tower``)."""
        from megatron_grpo.engine.batch import build_train_microbatches

        def timed(waves):
            t = time.perf_counter()
            out = self.featurize(waves)
            if out[0].device.type == "cuda":  # device features: their kernels are part of featurising
                _sync(out[0].device)
            feat_s[0] += time.perf_counter() - t
            return out

        return build_train_microbatches(self.trajs, plan, 0, self.packing,
                                        featurize=self.featurize if feat_s is None else timed,
                                        n_window=self.engine.spec.audio.n_window, share_clips=self.shared_clips,
                                        keep_shared=self.keep_shared if keep_shared is None else keep_shared,
                                        audio_tower=self.tower if prefetch else None)

    def train(self, keep_shared=None, prefetch: bool = True) -> dict:
        """``mgrpo train``'s step 3-4 as it runs (one sync, at the end); ``keep_shared`` overrides
        ``trainer.shared_clips_keep``; ``prefetch=False``: no tower batch runs during the build."""
        from megatron_grpo.engine.step import train_step
        from megatron_grpo.hang import StepSchedule, check_schedule
        from megatron_grpo.host_ranges import host_range
        from megatron_grpo.packing import plan_step

        self.step_no += 1
        _sync(self.device)
        t0 = time.perf_counter()
        with host_range(PHASE):
            with host_range("plan"):
                plan = plan_step(self.lengths, 1, self.packing)
            mbs = self._build(plan, None, keep_shared, prefetch=prefetch)
            check_schedule(StepSchedule.from_microbatches(self.step_no, mbs))
            m = train_step(self.engine, mbs, self.cfg, step=self.step_no)
            with host_range("end_sync"):
                _sync(self.device)
        if keep_shared is None and prefetch:
            self.last_metrics = m
            shared = next((x.clip_use.shared for x in mbs if x.clip_use), None)
            self.shared_kept = None if shared is None else {"batches": len(shared.batches),
                                                            "kept": shared.kept_batches}
        return {"phase_s": time.perf_counter() - t0, "grad_norm": m["grad_norm"], "loss": m["loss"],
                "skipped": m["skipped"]}

    def train_split(self) -> dict:
        """The same calls as :meth:`train` (``train_step``'s body inlined) with a sync between parts;
        no tower batch runs during the build (its share is the host's alone)."""
        from megatron_grpo.engine.step import forward_backward, optimizer_update
        from megatron_grpo.hang import StepSchedule, check_schedule
        from megatron_grpo.packing import plan_step

        self.step_no += 1
        feat = [0.0]
        _sync(self.device)
        t0 = time.perf_counter()
        plan = plan_step(self.lengths, 1, self.packing)
        tp = time.perf_counter()
        mbs = self._build(plan, feat)
        mbs[:]  # every micro-batch assembled here (train's schedule assembles each as it reads it): the whole pack
        _sync(self.device)  # the build's own device work (the micro-batches' feature copies)
        tb = time.perf_counter()
        check_schedule(StepSchedule.from_microbatches(self.step_no, mbs))
        _sync(self.device)
        t1 = time.perf_counter()
        for m in self.engine.model:
            m.zero_grad_buffer()
        self.engine.optimizer.zero_grad()
        _sync(self.device)
        t2 = time.perf_counter()
        fb = forward_backward(self.engine, mbs, self.cfg)
        _sync(self.device)
        t3 = time.perf_counter()
        up = optimizer_update(self.engine, None, self.step_no)
        _sync(self.device)
        t4 = time.perf_counter()
        return {"phase_s": t4 - t0, "featurise_s": feat[0], "pack_s": t1 - t0 - feat[0], "plan_s": tp - t0,
                "build_s": tb - tp - feat[0], "check_s": t1 - tb, "zero_grad_s": t2 - t1,
                "forward_backward_s": t3 - t2, "optimizer_s": t4 - t3, "grad_norm": up["grad_norm"],
                "loss": fb["loss"], "skipped": up["skipped"]}

    # ---- the side systems -----------------------------------------------------------------------

    def _hidden(self, t, host):
        """Final-normed hidden states ``[T, 1, h]`` of the layer stack on micro-batch ``t``: the token
        embedding (audio rows as plain tokens), the decoder, the final norm (the thinker's own
        modules, as ``OmniThinker.forward(return_hidden=True)`` runs them without the audio tower)."""
        thinker = self.thinker
        lm = thinker.language_model
        ids = t.input_ids_T.unsqueeze(0)
        psp = host.packed_seq_params(self.device, defer_copy=True)
        emb = lm.embedding(input_ids=ids, position_ids=None)
        lm.post_process = False
        try:
            out = lm(ids, t.position_ids(), None, decoder_input=emb, packed_seq_params=psp)
        finally:
            lm.post_process = True
        return thinker.lm_head_input(out)

    def _zero(self) -> None:
        for m in self.engine.model:
            m.zero_grad_buffer()

    def stack(self, with_lm: bool = False) -> dict:
        import torch

        from megatron_grpo.engine.logprobs import token_logprobs

        _sync(self.device)
        t0 = time.perf_counter()
        for host, t, probe in zip(self.host_mbs, self.dev_mbs, self.probes):
            hidden = self._hidden(t, host)
            if with_lm:
                mask = t.loss_mask_T.to(torch.bool)
                lp, _ = token_logprobs(hidden, t.input_ids_T, t.cu_seqlens_S, vocab_size=self.engine.spec.text.vocab_size,
                                       token_mask_T=mask, chunk_size=self.cfg.logprob_chunk_size,
                                       with_entropy=self.cfg.with_entropy,
                                       lm_head_weight=self.thinker.lm_head_weight(),
                                       num_scored=host.mb.scored_tokens)  # as the trainer's loss
                loss = -(lp * mask).sum() / mask.sum().clamp_min(1)
            else:
                loss = (hidden * probe).sum(dtype=torch.float32)
            loss.backward()
        _sync(self.device)
        s = time.perf_counter() - t0
        self._zero()
        return {"step_s": s}

    def audio(self) -> dict:
        import torch

        from megatron_grpo.engine.batch import reset_shared_clips

        _sync(self.device)
        t0 = time.perf_counter()
        reset_shared_clips(self.host_mbs)  # as run_schedule does before a pass
        for host, t, probe in zip(self.host_mbs, self.dev_mbs, self.audio_probes):
            if probe is None:
                continue
            out = self.thinker.audio_rows(t.audio_features, host.audio_feature_lens, host.clip_use)
            (out * probe).sum(dtype=torch.float32).backward()
        _sync(self.device)
        s = time.perf_counter() - t0
        self._zero()
        return {"step_s": s}

    def h2d(self) -> dict:
        _sync(self.device)
        t0 = time.perf_counter()
        moved = [m.to(self.device, non_blocking=True) for m in self.host_mbs]
        _sync(self.device)
        s = time.perf_counter() - t0
        del moved
        return {"step_s": s}

    def systems(self, names) -> dict:
        """name -> callable returning that system's times of one step."""
        table = {"train": self.train, "train_recompute": partial(self.train, 0.0),
                 "train_serial": partial(self.train, None, False), "train_split": self.train_split,
                 "stack": self.stack,
                 "stack_lm": partial(self.stack, True), "audio": self.audio, "h2d": self.h2d}
        unknown = [n for n in names if n not in table]
        if unknown:
            raise ValueError(f"unknown systems {unknown}; choose from {sorted(table)}")
        return {n: table[n] for n in names}


def optimizer_bound(engine, device) -> dict:
    """The optimizer step's memory-bandwidth bound: the fewest bytes one Adam step with fp32 master
    weights must move per parameter (read the fp32 grad 4, read+write the fp32 master 8, read+write
    both fp32 moments 16, write the bf16 weight 2 = 30 B; fp32 weights: 28 B) over the device's
    copy bandwidth measured here (a 1 GiB device-to-device copy; bytes read + written)."""
    import statistics

    import torch

    n = sum(p.numel() for m in engine.model for p in m.parameters())
    bf16 = next(engine.model[0].parameters()).dtype != torch.float32
    per = 30 if bf16 else 28
    nbytes = 2**30 if device.type == "cuda" else 2**26
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    y = torch.empty_like(x)
    times = []
    for _ in range(7):
        _sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    bw = 2 * nbytes / statistics.median(times[2:])
    del x, y
    return {"params": n, "bytes_per_param": per, "bytes": n * per, "copy_bandwidth_B_s": bw,
            "bound_s": n * per / bw}
