"""The worker: one GPU's engine behind valora.internal.v1.WorkerService.

server.py        gRPC servicer and create_server
convert.py       engine results, log-probabilities, status, step times as protobuf
startup.py       start-up and shutdown: tile table, the engine (or TP leader + followers), registration
watchdog.py      health follows the engine thread, TP followers and heartbeat; samples gauges
worker_metrics.py the Prometheus series from the engine: requests, mode changes, sampled gauges
__main__.py      `python -m services.worker`: settings, then serve create_server's service
config.py        WorkerSettings (VALORA_*), EngineConfig and the engine's config from them
registration.py  joining the scheduler's pool (RegisterWorker, heartbeats, deregistration)
engine.py        the iteration-level loop over the collaborators below
inbox.py         what other threads send the loop (requests, commands, stops); TP lockstep
intake.py        a request checked, processed and staged before it is queued (prepare)
prefiller.py     the step's prefill batch or chunk, and each request's hand-off after it
decoder.py       the step's decode, pipelined with the host
mixed_step.py    the running rows' decode riding in the step's prefill forward
outputs.py       a sequence's tokens to events: stream, stop checks, early release, LABEL answers
step_scheduler.py the queues, admission, prefill budget and chunking, KV growth, preemption
model_runner.py  the prefill forward and the decode step over the KV pool
token_choice.py  a forward's next tokens and log-probabilities, on the device
step_graphs.py   CUDA graphs of the forwards keyed by shape: warm-up, capture, retries
prefill_graphs.py the packed prefill forward, CUDA graphs keyed by its token bucket
step_trace.py    where each step's host and device time went (VALORA_STEP_TRACE)
lora_manager.py  the adapters' lifecycle (host, resident, pinned, merged) and the mode, as Commands
lora_plans.py    each forward's LoRA plan: rows to entries (adapter / mixture), merged adapter
sequence.py      PreparedRequest, Sequence (a running request), PendingStep (pipelined decode)
requests.py      domain objects: WorkRequest, GenerationResult, events, stats
kv_cache.py      the paged KV pool, block manager and block tables; the HF cache over them
decode_graphs.py the decode step over the pool, CUDA graphs keyed by the padded batch size
attention.py     decode attention through the block tables (kernels.paged_attention), prefill SDPA
lora.py          LoRA-aware linears, the per-step plan (StepLora) and its entries
lora_model.py    the model loaded (whole, dummy, or a TP shard) with its LoRA layers installed
fused_layers.py  the decoder layers on the fused elementwise ops (kernels.layer_ops)
tensor_parallel.py the ranks' process group: collectives, lockstep, agreement on failures
tp_sharding.py   the language model sharded over ranks, S-LoRA's LoRA partitioning
tp_ranks.py      starting a tensor-parallel worker's follower ranks
atmm_backend.py  the step's multi-LoRA term on the ATMM CUDA kernel
switcher.py      merge / unmerge / switch in place, drift-free
adapter_weights.py an adapter version's weights (multi-LoRA layout), parsed from a PEFT bundle
adapter_staging.py an adapter's host and device copies: aligned packing, pinned buffers, copy stream
adapter_pool.py  the host/device adapter pool (LRU device slots)
store_client.py  FetchAdapter from the adapter store + disk cache by sha256
detokenizer.py   incremental detokenization and stop sequences
sampling.py      greedy / temperature, top-k, top-p, min-p, seeded
processor.py     Qwen2-VL processor (no torchvision), frames -> video patches, build_inputs (any family)
preprocess.py    WorkItem -> WorkRequest -> processor inputs, optionally in spawned processes
relay.py         engine-thread events to the request streams, one loop wake-up per burst
vision.py        images/videos -> prompt embeddings, the image-feature cache by content hash
vision_tower.py  the vision tower over items of one grid, replayed from a CUDA graph per grid
architectures.py the served model families (one entry each), a model directory's family
llava.py         LLaVA-1.5's chat format, inputs, placeholder count, vision tower, tiny model
model.py         loading the model; re-exports build_inputs
tiny_model.py    a family's tiny model built locally (python -m services.worker.tiny_model PATH)
testing.py       random PEFT-layout bundles, PEFT dirs, an in-memory adapter store
"""
