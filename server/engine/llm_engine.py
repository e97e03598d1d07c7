"""The synchronous engine: requests in, one `step()` at a time, per-request deltas out.

A step = schedule → copy-on-write block copies → model forward → sample → detokenize / stop checks
→ finished sequences free their blocks at once.
"""

from __future__ import annotations

import logging
import time

import torch
from pagoda.server.engine import prompt_logprobs, validation
from pagoda.server.engine.beam_search import BeamSearch
from pagoda.server.engine.block_manager import BlockManager
from pagoda.server.engine.capacity import capacity_report
from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.detokenizer import IncrementalDetokenizer
from pagoda.server.engine.device_peaks import device_peaks
from pagoda.server.engine.kv_events import KVEventLog
from pagoda.server.engine.model_runner import KVCacheSpec, ModelRunner
from pagoda.server.engine.outputs import EngineStats, RequestOutput
from pagoda.server.engine.parallel.group import SINGLE
from pagoda.server.engine.placement import resolve_device, set_cpu_threads
from pagoda.server.engine.roofline import ModelCosts, RooflineMeter, shape_of
from pagoda.server.engine.sampler import Sampler
from pagoda.server.engine.sampling_params import SamplingParams
from pagoda.server.engine.scheduler import ScheduledSeq, Scheduler, step_token_budget
from pagoda.server.engine.sequence import Request, Sequence
from pagoda.server.engine.step_histograms import StepHistograms
from pagoda.server.engine.validation import RequestError

logger = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, engine_args: EngineArgs, loaded=None) -> None:
        """`loaded`: an already loaded `LoadedModel` (tests share one across engines)."""
        self.engine_args = args = engine_args
        device = resolve_device(args.device)
        tp_group = None
        if args.tensor_parallel_size > 1 or args.nnodes > 1:
            from pagoda.server.engine.parallel.executor import start_group

            if loaded is not None:
                raise ValueError("tensor_parallel_size: each rank loads its own shard; pass no model")
            tp_group = start_group(args, device)
            args = tp_group.args
        try:
            self._build(args, device, loaded, tp_group)
        except BaseException:
            if tp_group is not None:  # the workers wait for commands that will never come
                tp_group.abort()
            raise

    def _build(self, args: EngineArgs, device: torch.device, loaded, tp_group) -> None:
        from pagoda.server.engine.loader import load_model

        if device.type == "cpu":
            set_cpu_threads(args.cpu_threads)
        if loaded is None:
            loaded = load_model(
                args.model,
                dtype=args.dtype,
                device=device,
                quantization=args.quantization,
                tp=tp_group.tp if tp_group else SINGLE,
            )
        self.loaded = loaded
        self.model_name: str = loaded.name
        self.tokenizer = loaded.tokenizer
        if args.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.vocab_size = loaded.model.vocab_size  # the embedding rows: what a token id may be below
        self.max_model_len = min(args.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.dtype = loaded.dtype
        self.quantization = loaded.quantization
        batch_tokens = step_token_budget(args, self.max_model_len)
        self.max_num_batched_tokens = batch_tokens
        model = loaded.model
        self.tp_size = tp_group.tp.size if tp_group else 1
        self.spec = KVCacheSpec(
            model.num_layers, model.num_kv_heads, model.head_dim, self.dtype, args.block_size
        )
        if tp_group is None:
            self.runner = ModelRunner(model, self.spec, loaded.device, args.attention_backend)
        else:
            from pagoda.server.engine.parallel.executor import TensorParallelRunner

            self.runner = TensorParallelRunner(model, self.spec, loaded.device, tp_group, args.attention_backend)
        num_blocks = args.num_blocks or self.runner.num_blocks_for_budget(
            args.kv_cache_memory, args.gpu_memory_utilization, batch_tokens
        )
        if num_blocks < 1:
            raise ValueError("kv_cache_memory: the KV cache budget holds no block; give it more memory")
        self.runner.allocate(num_blocks)
        if loaded.device.type == "cuda" and not args.enforce_eager and self.tp_size == 1:
            self.runner.capture_decode_graphs(args.max_num_seqs, self.max_model_len)
        self.kv_events = KVEventLog()
        self.block_manager = BlockManager(
            num_blocks, args.block_size, args.enable_prefix_caching, events=self.kv_events
        )
        self.roofline = RooflineMeter(
            ModelCosts.from_model(model, self.spec.bytes_per_token),
            device_peaks(loaded.device, self.dtype),
            args.block_size,
        )
        self.scheduler = Scheduler(
            self.block_manager, args.max_num_seqs, batch_tokens, args.enable_chunked_prefill
        )
        self.sampler = Sampler(args.seed)
        self.beam_search = BeamSearch(self.block_manager)
        self._stopped: list[Sequence] = []  # finished or pruned during a step, released after it
        self.requests: dict[str, Request] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.step_histograms = StepHistograms()
        if self.tp_size > 1:
            logger.info(
                "tensor parallelism: %d ranks, %d KV heads each; bytes below are per rank, tokens the group's",
                self.tp_size,
                model.num_kv_heads,
            )
        for line in capacity_report(
            self.spec.bytes_per_token, args.block_size, num_blocks, self.max_model_len
        ):
            logger.info(line)

    # ---- requests ---------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Prompt token ids of a conversation through the model's chat template. The tokenizer adds
        no special tokens of its own: the template writes BOS where the model wants one."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The one prompt encoder: (text or None, token ids). Text goes through the tokenizer with its
        special tokens (BOS where the model wants one); token ids are taken as given."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        return None, list(prompt)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        max_tokens_must_fit: bool = False,
    ) -> Request:
        """Validate and tokenize (no engine state and no torch op: safe from any thread); raises
        `RequestError`. `max_tokens_must_fit`: refuse a max_tokens that overruns the context (the
        server's rule for a value the client gave) instead of cutting the output there."""
        params = params or SamplingParams()
        prompt_text, prompt_ids = self.encode(prompt)
        limits = validation.EngineLimits(self.vocab_size, self.max_model_len, self.scheduler.max_num_seqs)
        max_total = validation.check_request(params, prompt_ids, limits, max_tokens_must_fit)
        self._check_fits(len(prompt_ids), max_total, params)
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop_strings, params.include_stop_str_in_output
        )
        seq = Sequence(0, prompt_ids, len(prompt_ids), detok)
        return Request(
            request_id, prompt_text, list(prompt_ids), params, arrival_time or time.monotonic(), seq
        )

    def _check_fits(self, prompt_len: int, max_total: int, params: SamplingParams) -> None:
        """A request that can never fit in the pool, even alone, is refused up front."""
        needed = self.block_manager.blocks_for_request(prompt_len, max_total, params.num_seqs)
        validation.check_pool(needed, self.block_manager.num_blocks, prompt_len, max_total, params.num_seqs)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        return self.enqueue(self.make_request(request_id, prompt, params, arrival_time))

    def enqueue(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise RequestError("request_id", f"{request.request_id!r} is already running")
        if request.params.seed is not None:  # a torch object: made here, on the engine's thread
            request.seqs[0].generator = torch.Generator().manual_seed(request.params.seed)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish_request(request)
        return self._finish_aborted(request)

    def _finish_aborted(self, request: Request) -> RequestOutput:
        """Mark a request whose blocks are already freed as aborted and forget it."""
        for seq in request.live_seqs():
            seq.finished = True
            seq.finish_reason = "abort"
        self.requests.pop(request.request_id, None)
        request.metrics.finished_time = time.monotonic()
        output = request.take_output()
        assert output is not None  # a finished request always has its last output
        return output

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a one-rank engine holds nothing to stop)."""
        self.runner.shutdown()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; the outputs of the requests it moved: what is new for each since its last one."""
        self.kv_events.step = self.num_steps + 1  # events of this step; snapshots show completed steps
        out = self.scheduler.schedule()
        for request in out.unservable:
            logger.error("request %s: the whole KV cache pool cannot hold it; aborted", request.request_id)
        dropped = [self._finish_aborted(request) for request in out.unservable]
        if out.empty:
            return dropped
        now = time.monotonic()
        for item in out.scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = now
        shape, started = shape_of(out), time.perf_counter()
        logits, sampled = self.runner.execute(out)
        roofline = self.roofline.observe(
            shape, len(sampled), len(out.block_copies), time.perf_counter() - started
        )
        self.step_histograms.observe(out.num_tokens, roofline)
        prompt_logprobs.record(out.prompt_scores)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_full_blocks(item.seq)
        touched = self._process(logits, sampled)
        self.scheduler.release(self._stopped)  # sequences that finished or were pruned this step
        self._stopped.clear()
        outputs = dropped
        now = time.monotonic()
        for request in touched:
            if request.finished:
                request.metrics.finished_time = now
                self.scheduler.finish_request(request)
                self.requests.pop(request.request_id, None)
            output = request.take_output()
            if output is not None:
                outputs.append(output)
        self.scheduler.drop_finished()
        self.num_steps += 1
        return outputs

    def _process(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> list[Request]:
        """Sample a token for every sequence that completed its pending tokens this step."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        requests: list[Request] = []
        beam_items: list[tuple[Request, list[Sequence], list[int]]] = []
        touched: dict[str, Request] = {}
        for row, item in enumerate(sampled):
            request = item.request
            touched[request.request_id] = request
            if request.params.use_beam_search:
                if beam_items and beam_items[-1][0] is request:
                    beam_items[-1][1].append(item.seq)
                    beam_items[-1][2].append(row)
                else:
                    beam_items.append((request, [item.seq], [row]))
                continue
            if not request.forked:
                self._fork(request)
                family = request.seqs
            else:
                family = [item.seq]
            for seq in family:
                rows.append(row)
                seqs.append(seq)
                requests.append(request)
        if rows:
            params = [r.params for r in requests]
            token_lists = [
                (s.token_ids[: s.prompt_len], s.output_token_ids) if p.needs_penalties else ([], [])
                for s, p in zip(seqs, params, strict=True)
            ]
            rows_logits = logits if rows == list(range(logits.shape[0])) else logits[rows]  # no copy: every row
            result = self.sampler(rows_logits, params, [s.generator for s in seqs], token_lists)
            for i, (seq, request) in enumerate(zip(seqs, requests, strict=True)):
                self._append_token(
                    request, seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i]
                )
        for request, beam_seqs, beam_rows in beam_items:
            # Beam search ranks all beams together. A beam whose logits come early (the others still
            # recomputing after a preemption, or left out of a full step's token budget) waits for them.
            for seq, row in zip(beam_seqs, beam_rows, strict=True):
                request.pending_beam_logits[seq.index] = logits[row].to("cpu", copy=True)  # ranked on CPU
            beams = request.live_seqs()
            if all(beam.index in request.pending_beam_logits for beam in beams):
                ready = torch.stack([request.pending_beam_logits[beam.index] for beam in beams])
                request.pending_beam_logits.clear()
                self._beam_step(request, beams, ready)
        return list(touched.values())

    def _fork(self, request: Request) -> None:
        """n > 1: after the prompt, the first sequence forks into n that share its blocks."""
        leader = request.seqs[0]
        for index in range(1, request.params.n):
            child = self.block_manager.fork(leader, index)
            if request.params.seed is not None:
                child.generator = torch.Generator().manual_seed(
                    hash((request.params.seed, index)) & (2**62 - 1)
                )
            request.seqs.append(child)
        request.forked = True

    def _append_token(
        self, request: Request, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None
    ) -> None:
        params = request.params
        self._count_generated(request, 1)
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.output_logprobs.append(top)
        if token in params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            self._finish(seq, "stop", None)
        else:
            stop = seq.detokenizer.append(token)
            if stop is not None:
                self._finish(seq, "stop", stop)
        if not seq.finished and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            seq.detokenizer.flush()
            self._finish(seq, "length", None)

    def _count_generated(self, request: Request, num_tokens: int) -> None:
        """Token counters and timestamps: the prompt counts once, with the request's first token."""
        now = time.monotonic()
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
            self.prompt_tokens += request.seqs[0].prompt_len
        request.metrics.last_token_time = now
        self.generation_tokens += num_tokens

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finished = True
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._stopped.append(seq)  # its blocks go back at the end of this step

    def _beam_step(self, request: Request, beams: list[Sequence], logits: torch.Tensor) -> None:
        self._count_generated(request, len(beams))
        self._stopped += self.beam_search.step(request, beams, logits, self.eos_token_ids, self.max_model_len)
        request.forked = True

    # ---- introspection ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A plain read: gauges and cumulative counters (readers take differences)."""
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_shared_blocks=bm.num_shared_blocks,
            block_size=bm.block_size,
            capacity_tokens=bm.num_blocks * bm.block_size,
            tensor_parallel_size=self.tp_size,
            kv_cache_bytes=bm.num_blocks * self.spec.bytes_per_block * self.tp_size,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_steps=self.num_steps,
            step_histograms=self.step_histograms.copy(),
            **self.roofline.stats_fields(),
        )
