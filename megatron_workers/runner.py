"""The per-rank Megatron runner shared by actor, reference and critic: the device seam, the pipeline
schedule, the optimizer step, offload / onload and checkpoints.

`MegatronRunner` lives inside one Ray actor per rank (see `worker_group.py`) and holds this
rank's shard of a GPTModel built from an HF checkpoint (`model.py`); `actor.py` and `critic.py`
add the heads. Batches arrive in verl's layout and are checked and cut into packed micro-batches by
`micro_batches.py`.

Where it departs from the textbook training loop:

- The device seam: batches arrive on the host; each micro-batch goes to the device once, whole
  (its window of columns), where its forward step starts (`device_check.to_device`), and the
  head's results come back to the host once (`device_check.to_host`). Nothing else crosses.
  `tests/test_device_seam.py` checks this on a CPU, where a mixed op would otherwise pass.
- Precision (`megatron.dtype`): bfloat16 parameters and activations with Megatron's mixed-precision
  optimizer (fp32 main params and Adam moments, gradients accumulated and reduced in fp32), or
  float32 throughout. Log-softmax, log-probs, values and losses are computed in fp32 either way.
- Loss aggregation is the caller's. `_train(batch, loss_fn, ...)` calls `loss_fn(mb) -> (loss, metrics)`
  once per micro-batch with the head's outputs (with grad), the batch's own tensors for those rows
  (on the device) and the ints `global_token_count` / `global_seq_count` (response tokens / samples
  of the whole mini-batch over all micro-batches and DP ranks). The returned loss is that
  micro-batch's *contribution*: the sum over micro-batches and DP ranks is the mini-batch loss.
  Megatron's schedule divides by the number of micro-batches and its DDP averages over DP ranks by
  default; here both are switched to summing (`calculate_per_token_loss=True` and a
  `finalize_model_grads` that does not rescale), so any `loss_agg_mode` is exact for any
  micro-batch count, dynamic batching and DP size. `metrics` values follow the same rule
  (summed over micro-batches and DP ranks, then averaged over mini-batches).
- No padding reaches the model: each micro-batch's real tokens are packed into one sequence
  (`packing.py`, Megatron's THD layout with `PackedSeqParams`; `attention.py` attends within each
  row's segment), and the head's outputs return onto the `(b, T)` response axis with the same
  masks. Dynamic batching (`use_dynamic_bsz`) fills micro-batches up to a budget of real tokens;
  pipeline stages exchange variable shapes (`variable_seq_lengths`). The forward-only passes have
  their own sizes (`log_prob_micro_batch_size_per_gpu`, `log_prob_use_dynamic_bsz`,
  `log_prob_max_token_len_per_gpu`).
- Virtual pipeline stages (`megatron.virtual_pipeline_model_parallel_size`, set in the process's parallel state
  by `parallel.init_distributed`): `self.model` holds one DDP-wrapped chunk per stage and Megatron's interleaved
  schedule runs them; a micro-batch still goes to the device once, its later chunks reuse it. The schedule wants
  micro-batch counts in groups of PP and one shape per pass (`split_micro_batches(interleaved_pp=...)`).
- Gradient reduction over DP overlaps the backward pass (`overlap_grad_reduce`, bucketed, with the schedule's
  `no_sync` for all but the last micro-batch).
- A non-finite gradient anywhere refuses the optimizer step with an error naming the
  mini-batch, instead of writing NaN into the weights; bad input is refused before any
  forward, naming the sample.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from megatron_workers import attention, checkpoint, device_check, model as mmodel
from megatron_workers.config import OptimConfig, WorkerConfig
from megatron_workers.micro_batches import Batch, MicroBatch, scatter_rows, split_micro_batches, validate_batch

logger = logging.getLogger(__name__)

LossFn = Callable[[dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]


class MegatronRunner:
    """One rank's model shard (DDP-wrapped), optimizer and schedule; subclasses add heads.

    Subclasses override `_head(mb, dev, output)` that turns the last stage's output into per-token
    response tensors (`dev`: the micro-batch on the device), and may override `_build_model` (the
    critic swaps the LM head).
    """

    def __init__(self, hf_dir: str | Path, cfg: WorkerConfig, trust_remote_code: bool = False) -> None:
        self.hf_dir = Path(hf_dir)
        self.cfg = cfg
        self.hf_config, hf_state = mmodel.load_hf_checkpoint(self.hf_dir, trust_remote_code)
        vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
        modules = [self._build_model(hf_state, vp_stage) for vp_stage in (range(vpp) if vpp else [None])]
        del hf_state
        for module in modules:
            module.config.finalize_model_grads_func = _finalize_grads_summed
        self.step = 0  # optimizer steps taken
        self.optimizer = None
        self._offloaded: dict[str, bool] = {}  # what `offload` moved to CPU memory: "params", "grads", "optimizer"
        self.scheduler = None
        if cfg.optim is None:  # reference policy: a bare model, no gradient buffers
            for module in modules:
                module.requires_grad_(False)
            self.model = modules
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=cfg.optim.use_distributed_optimizer
        )
        # Chunks after the first are one gradient bucket each (as Megatron-LM builds them): under the interleaved
        # schedule a chunk's reduction starts once its last micro-batch's backward is done.
        self.model = [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
                      for i, m in enumerate(modules)]
        # The DP reduction of each gradient bucket starts during the last micro-batch's backward, as soon as the
        # bucket is complete; earlier micro-batches only accumulate (the schedule enters no_sync around them), and
        # finalize_model_grads waits for the reductions.
        no_sync = [chunk.no_sync for chunk in self.model]
        for module in modules:
            module.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self._build_optimizer(cfg.optim)

    @property
    def modules(self) -> list[torch.nn.Module]:
        """This rank's GPTModel stage, without the DDP wrapper: one model chunk per virtual pipeline stage (one
        without them)."""
        return [unwrap_model(chunk) for chunk in self.model]

    # -- construction ---------------------------------------------------------------------
    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' and activations' dtype (`megatron.dtype`)."""
        return getattr(torch, self.cfg.megatron.dtype)

    def _build_model(self, hf_state: dict[str, torch.Tensor], vp_stage: int | None) -> torch.nn.Module:
        """This rank's model chunk `vp_stage` (None: its only one), filled from the HF state dict."""
        sp = self.cfg.megatron.sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1
        module = mmodel.build_gpt_model(
            self.hf_config, params_dtype=self.params_dtype, vp_stage=vp_stage,
            calculate_per_token_loss=True,  # the schedule sums the callers' loss contributions
            **{"sequence_parallel": sp,
               **self.cfg.megatron.override_transformer_config},  # verl's TransformerConfig passthrough
        )
        if vp_stage is None:
            # Micro-batches carry their own window length; set after construction because
            # TransformerConfig's MoE checks refuse it at init even for dense models.
            module.config.variable_seq_lengths = True
        else:
            # The interleaved schedule gets packs of one length per pass (`split_micro_batches`): with PP=2 its
            # stages exchange activations and gradients in both directions with the same peer, which only
            # Megatron's unbatched p2p keeps apart (a communicator per direction), and shapes it cannot exchange.
            module.config.overlap_p2p_comm, module.config.batch_p2p_comm = True, False
        mmodel.load_hf_weights(module, hf_state, self.hf_config)
        return module

    def _build_optimizer(self, o: OptimConfig) -> None:
        ocfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, use_distributed_optimizer=o.use_distributed_optimizer,
            params_dtype=self.params_dtype, bf16=self.params_dtype == torch.bfloat16,  # bf16: fp32 main params + Adam
        )
        self.optimizer = get_megatron_optimizer(ocfg, self.model)
        logger.info("optimizer: Megatron %s", type(self.optimizer).__name__)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=max(o.lr_decay_steps, o.lr_warmup_steps + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )

    # -- schedule -------------------------------------------------------------------------
    def _head(self, mb: MicroBatch, dev: Batch, output: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _forward_backward(
        self, mbs: list[MicroBatch],
        on_outputs: Callable[[MicroBatch, Batch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict]],
        forward_only: bool,
    ) -> list[dict]:
        """Run the micro-batches through the pipeline; `on_outputs(mb, dev, head_outputs)` gives
        `(loss contribution, record)` on the last stage, `dev` being the micro-batch on the device; a record
        holds host values only (it crosses back through `device_check.to_host`). Returns the records (last
        stage only)."""

        def loss_func(mb: MicroBatch, dev: Batch, output: torch.Tensor):
            loss, record = on_outputs(mb, dev, self._head(mb, dev, output))
            return loss, torch.ones((), dtype=torch.int, device=loss.device), record

        on_device: dict[int, tuple[Batch, int]] = {}  # id(micro-batch) -> (it on the device, chunks that took it)

        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator)
            dev, taken = on_device.pop(id(mb), (None, 0))
            if dev is None:
                dev = device_check.to_device(mb.device_batch(), self._device)  # the seam, inbound: once, whole
            if taken + 1 < len(self.model):  # this rank's later model chunks run the same micro-batch
                on_device[id(mb)] = (dev, taken + 1)
            output = model(  # (1, t, ...) on the last stage
                input_ids=dev["packed_ids"], position_ids=dev["packed_positions"], attention_mask=None,
                packed_seq_params=attention.packed_seq_params(dev["cu_seqlens"], mb.pack.max_seqlen),
            )
            return output, functools.partial(loss_func, mb, dev)

        if len(self.model) > 1:  # the interleaved schedule runs each chunk over groups of PP micro-batches
            pp = mpu.get_pipeline_model_parallel_world_size()
            if len(mbs) < pp:
                raise ValueError(
                    f"virtual pipeline stages need at least pipeline_model_parallel_size={pp} micro-batches per pass, "
                    f"and this rank has {sum(len(mb.rows) for mb in mbs)} samples; give each rank more samples "
                    "(ppo_mini_batch_size) or drop virtual_pipeline_model_parallel_size")
            for module in self.modules:  # a count that is not a multiple of PP (too few rows to spread) is one group
                module.config.microbatch_group_size_per_vp_stage = pp if len(mbs) % pp == 0 else len(mbs)
        ctx = torch.no_grad() if forward_only else torch.enable_grad()
        with ctx:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs),
                model=self.model,
                num_microbatches=len(mbs),
                seq_length=max(mb.tokens for mb in mbs),
                micro_batch_size=1,  # one packed sequence per micro-batch
                forward_only=forward_only,
            )

    def device_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank keeps on the device: parameters, buffers, gradient buffers, optimizer state."""
        for chunk in self.model:
            module = unwrap_model(chunk)
            yield from module.parameters()
            yield from module.buffers()
            for buf in chunk.buffers if isinstance(chunk, DistributedDataParallel) else []:  # DDP's flat buffers
                yield from (t for t in (buf.param_data, buf.grad_data) if t is not None)
            yield from (p.main_grad for p in module.parameters() if getattr(p, "main_grad", None) is not None)
        if self.optimizer is not None:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                for group in opt.optimizer.param_groups:
                    yield from group["params"]
                for state in opt.optimizer.state.values():
                    yield from (v for v in state.values() if torch.is_tensor(v))

    @property
    def _pack_multiple(self) -> int:
        """Sequence parallelism splits each pack over the TP ranks: its length must divide evenly."""
        config = self.modules[0].config
        return config.tensor_model_parallel_size if config.sequence_parallel else 1

    @property
    def _interleaved_pp(self) -> int:
        """The PP size under virtual pipeline stages (`split_micro_batches` shapes micro-batches for the interleaved
        schedule), else 1."""
        return mpu.get_pipeline_model_parallel_world_size() if len(self.model) > 1 else 1

    @property
    def _device(self) -> torch.device:
        return torch.device(torch.cuda.current_device())  # a GPU index, or the CPU adapter's device

    @staticmethod
    def _response_outputs(dev: Batch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's outputs at the pack positions that predict the response tokens.

        `output (1, t, ...)` -> `(pred (n, ...), targets (n,), real (b, T))`: the n real response tokens
        in row-major order of `real`; `on_response_axis` puts per-token results back onto `(b, T)`.
        """
        real = dev["response_index"] >= 0  # (b, T)
        pred = output[0].index_select(0, dev["response_index"][real])  # (n, ...)
        return pred, dev["responses"][real], real

    @staticmethod
    def on_response_axis(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """`values (n,)` in row-major order of `real (b, T)` -> `(b, T)`, 0 off `real` (keeps gradients)."""
        return values.new_zeros(real.shape).masked_scatter(real, values)

    def _global_counts(self, batch: Batch) -> tuple[int, int]:
        """Response tokens and samples of `batch` summed over the DP group."""
        counts = torch.tensor(
            [float(batch["response_mask"].sum()), float(batch["response_mask"].shape[0])], device=self._device
        )
        torch.distributed.all_reduce(counts, group=mpu.get_data_parallel_group())
        return int(counts[0]), int(counts[1])

    def _mini_batches(self, batch: Batch, num_mini_batches: int) -> list[Batch]:
        """This rank's piece of each global mini-batch (the group's mini-batch-aware split puts
        piece `d` of global mini-batch `i` at local rows `[i * B / n, (i + 1) * B / n)`)."""
        B = batch["input_ids"].shape[0]
        if num_mini_batches < 1 or B % num_mini_batches:
            raise ValueError(
                f"num_mini_batches={num_mini_batches} must be >= 1 and divide this rank's {B} samples; "
                "make the global batch a multiple of ppo_mini_batch_size * dp"
            )
        local = B // num_mini_batches
        return [{k: v[i:i + local] for k, v in batch.items()} for i in range(0, B, local)]

    def _infer(self, batch: Batch, keys: tuple[str, ...]) -> Batch:
        """Forward-only pass; the head's `keys` as `(B, T)` tensors (0 off the response mask),
        complete on the last pipeline stage (other stages return an empty dict)."""
        validate_batch(batch)
        records = self._forward_backward(
            split_micro_batches(batch, self.cfg, forward_only=True, multiple=self._pack_multiple,
                                interleaved_pp=self._interleaved_pp),
            lambda mb, dev, head: (head[keys[0]].new_zeros(()),
                                   {"rows": mb.rows, **device_check.to_host({k: head[k] for k in keys})}),  # the seam, outbound
            forward_only=True,
        )
        torch.cuda.empty_cache()  # the phase's cached activations go back to the GPU (colocated engines, the next phase)
        if not mpu.is_pipeline_last_stage():
            return {}
        B, T = batch["responses"].shape
        mask = batch["response_mask"].float()
        return {k: scatter_rows([(r["rows"], r[k]) for r in records], B, T) * mask for k in keys}

    def _train(self, batch: Batch, loss_fn: LossFn, num_mini_batches: int, epochs: int, prefix: str) -> dict[str, float]:
        """Mini-batch / epoch loop: per mini-batch one forward-backward over its micro-batches,
        a finite-gradient check, one optimizer step and one LR scheduler step."""
        if self.optimizer is None:
            raise RuntimeError("this worker has no optimizer (reference policy); build it with ActorConfig.optim set")
        totals: dict[str, float] = {}
        n_steps = 0
        for _ in range(epochs):
            for i, mini in enumerate(self._mini_batches(batch, num_mini_batches)):
                tokens, seqs = self._global_counts(mini)

                def on_outputs(mb: MicroBatch, dev: Batch, head: dict[str, torch.Tensor]):
                    loss, metrics = loss_fn({**dev, **head, "global_token_count": tokens, "global_seq_count": seqs})
                    metrics = device_check.to_host({k: v.detach() if torch.is_tensor(v) else v
                                                    for k, v in metrics.items()})  # the seam, outbound
                    return loss, {k: float(v) for k, v in metrics.items()}

                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                mbs = split_micro_batches(mini, self.cfg, multiple=self._pack_multiple,
                                          interleaved_pp=self._interleaved_pp)
                records = self._forward_backward(mbs, on_outputs, forward_only=False)
                self._check_finite_grads(i)
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
                _, grad_norm, _ = self.optimizer.step()
                self.scheduler.step(increment=1)
                self.step += 1
                n_steps += 1
                mb_sum: dict[str, float] = {}
                for r in records:
                    for k, v in r.items():
                        mb_sum[k] = mb_sum.get(k, 0.0) + v
                if mpu.is_pipeline_last_stage():  # DP groups are stage-uniform: all or none call
                    mb_sum = self._sum_over_dp(mb_sum)
                for k, v in {**mb_sum, "grad_norm": float(grad_norm or 0.0),
                             "lr": lr}.items():
                    totals[k] = totals.get(k, 0.0) + v
        torch.cuda.empty_cache()  # as after `_infer`
        return {f"{prefix}/{k}": v / n_steps for k, v in totals.items()}

    def _sum_over_dp(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._device)
        torch.distributed.all_reduce(t, group=mpu.get_data_parallel_group())
        return dict(zip(keys, t.tolist()))

    def _check_finite_grads(self, mini_batch: int) -> None:
        """Refuse the optimizer step when any rank holds a non-finite gradient, naming the first such parameter.

        One fused reduction (the largest |g| over every gradient: NaN or inf when any element is, never an overflow
        of finite values) and one host read per step; only on failure a second pass looks for the parameter.
        """
        grads = [(name, g) for chunk in self.model for name, p in chunk.named_parameters()
                 if (g := getattr(p, "main_grad", None)) is not None]
        bad = torch.zeros(1, device=self._device)
        if grads:
            peaks = torch._foreach_norm([g for _, g in grads], float("inf"))  # one scalar per gradient, on the device
            bad = (~torch.isfinite(torch.stack([x.float() for x in peaks]).max())).float().reshape(1)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item():  # the step's one host read
            name = next((n for n, g in grads if not torch.isfinite(g).all()), None)
            for chunk in self.model:
                chunk.zero_grad_buffer()
            raise FloatingPointError(
                f"non-finite gradient in mini-batch {mini_batch} ({f'first in {name}' if name else 'on another rank'}); "
                "the optimizer step was refused and the weights are unchanged (check the loss function and the "
                "batch's advantages / log-probs)"
            )

    # -- memory: offload/onload (colocated engines get the GPU between training phases) -----------
    def offload(self, params: bool, grads: bool, optimizer: bool) -> None:
        """Move the chosen state to CPU memory and free its device memory; `onload` brings it back.

        Parameters held in DDP's contiguous buffer keep their views: the buffer's storage is
        copied out and shrunk to 0, and regrown in place on onload (verl's approach). Gradient
        buffers are only shrunk: every mini-batch zeroes them before use.
        """
        self._offloaded = {"params": params, "grads": grads, "optimizer": optimizer and self.optimizer is not None}
        self._move(self._offloaded, to_host=True)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back to the device what `offload` moved (nothing when nothing was offloaded)."""
        self._move(self._offloaded, to_host=False)
        self._offloaded = {}

    @contextlib.contextmanager
    def params_on_device(self) -> Iterator[None]:
        """Offloaded parameters back on the device for the duration, offloaded again after: what reads or writes
        them between training phases (the weight sync, a checkpoint) must not touch their emptied device storage.
        The rest of the offloaded state stays in CPU memory."""
        if not self._offloaded.get("params"):
            yield
            return
        self._move({"params": True}, to_host=False)
        try:
            yield
        finally:
            self._move({"params": True}, to_host=True)
            torch.cuda.empty_cache()

    def _move(self, what: dict[str, bool], to_host: bool) -> None:
        """Move the state `what` names ("params", "grads", "optimizer") to CPU memory or back to the device."""
        device = torch.device("cpu") if to_host else self._device
        buffered: set[int] = set()
        for chunk in self.model:
            ddp_buffers = chunk.buffers + chunk.expert_parallel_buffers if isinstance(chunk, DistributedDataParallel) else []
            for buf in ddp_buffers:
                if what.get("params") and buf.param_data is not None:
                    buffered.update(id(p) for p in buf.params)
                    _move_storage(buf, "param_data", device, keep=True)
                if what.get("grads") and buf.grad_data is not None:
                    _move_storage(buf, "grad_data", device, keep=False)
        model_params = {id(p) for chunk in self.model for p in chunk.parameters()}
        if what.get("params"):
            for chunk in self.model:
                for p in chunk.parameters():
                    if id(p) not in buffered:
                        p.data = p.data.to(device, non_blocking=to_host)
        if what.get("optimizer"):
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner = opt.optimizer  # the torch optimizer: main params (when not the model's) and Adam states
                for group in inner.param_groups:
                    for p in group["params"]:
                        if id(p) not in model_params:
                            p.data = p.data.to(device, non_blocking=to_host)
                for state in inner.state.values():
                    for k, v in state.items():
                        if torch.is_tensor(v) and k != "step":  # torch's Adam keeps its step count on the host
                            state[k] = v.to(device, non_blocking=to_host)
        if to_host:
            torch.cuda.synchronize()  # the copies must land before the device memory is reused

    # -- checkpoint -----------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's model shard, optimizer, scheduler, RNG states and step (`checkpoint.py`); rank 0 adds
        the model's config and tokenizer (`checkpoint.HF_DIR`), which an HF export of the checkpoint needs."""
        with self.params_on_device():
            checkpoint.save_rank(path, self.modules, self.optimizer, self.scheduler, self.step)
        if torch.distributed.get_rank() == 0:
            checkpoint.save_hf_files(Path(path) / checkpoint.HF_DIR, self.hf_config, self.hf_dir)

    def load_checkpoint(self, path: str) -> int:
        """Restore what `save_checkpoint` wrote for this rank; returns the step."""
        with self.params_on_device():
            self.step = checkpoint.load_rank(path, self.modules, self.optimizer, self.scheduler)
        return self.step

    def hf_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The full HF-named state dict on global rank 0 (None elsewhere; collective)."""
        with self.params_on_device():
            return mmodel.export_hf_state_dict(self.modules, self.hf_config, dst_rank=0)

    def export_hf(self, path: str, dtype: str | None = None) -> None:
        """Write an HF checkpoint directory in `dtype` ("bfloat16" / "float32"; None: the parameters' dtype),
        gathered to global rank 0 (collective); the disk weight sync calls it between phases, offloaded."""
        with self.params_on_device():
            checkpoint.export_hf(path, self.modules, self.hf_config, self.hf_dir,
                                 getattr(torch, dtype) if dtype else self.params_dtype)


def _move_storage(buf: Any, attr: str, device: torch.device, keep: bool) -> None:
    """Offload (device "cpu") or onload a DDP buffer's flat tensor in place, so views into it stay valid.

    `keep=False` (gradients) drops the values instead of copying them out; onload then zeroes the buffer.
    """
    flat = getattr(buf, attr)
    storage = flat.untyped_storage()
    if device.type == "cpu":
        if flat.device.type == "cpu" or storage.size() == 0:
            return  # nothing to free: already in CPU memory, or offloaded before
        if keep:
            setattr(buf, f"_{attr}_cpu", flat.detach().to("cpu"))
        storage.resize_(0)
        return
    if storage.size() == 0:
        storage.resize_(flat.numel() * flat.element_size())
        saved = getattr(buf, f"_{attr}_cpu", None)
        if saved is None:
            flat.zero_()
        else:
            flat.copy_(saved)
            setattr(buf, f"_{attr}_cpu", None)


def _finalize_grads_summed(model, num_tokens=None, **kwargs) -> None:
    """Megatron's finalize_model_grads (DP all-reduce, embedding and layernorm sync) without the
    division by the token count: loss contributions are already normalised by the caller."""
    finalize_model_grads(model, None, **kwargs)

