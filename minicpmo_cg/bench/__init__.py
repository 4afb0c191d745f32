"""The benchmark (``minicpmo-cg-bench``, ``python -m minicpmo_cg.bench``): MiniCPM-o 4.5's encoder
CUDA graph adapter, eager vs graphed, capture cost, graph memory, the whole image call with both
SigLIP attentions, adapter bookkeeping, two traffic replays, the duplex session and shared vs
separate graph pools.

Runs on a CUDA GPU. The encoders are vllm-omni's own classes at the checkpoint's dimensions with
random bf16 weights (:func:`minicpmo_cg.standalone.build_thinker_encoders`); the adapter is the
patched ``vllm_omni...minicpmo_4_5.encoder_cuda_graph.EncoderCudaGraph``. One module per scenario
(``--only`` selects some; default all), each measuring and formatting its own section:

``vision`` / ``audio`` (:mod:`.per_shape`)
    Per input shape: eager vs graphed latency of the captured region (the whole image call from
    pixels to resampler output; Whisper + projection + 5x pooling), capture cost, graph memory. Inputs are recorded from the
    model's own call sites (``get_vision_hidden_states`` / ``get_audio_hidden_states``), so
    hidden states, padding masks and the chunked audio mask are exactly what MiniCPM-o builds.
    Each timed call rotates among :data:`~.context.ROTATE` pre-made inputs of the same shape (a
    replay reads fresh data, not a cached buffer). Latency: :class:`minicpmo_cg.measure.Timer`;
    median and p90 over n calls after a warm-up (n adapts to the call's cost). Memory per graph
    (each shape gets its own adapter with ``share_pools=False``, so its pool is its own): ``pool``
    = bytes of the CUDA caching-allocator segments of the graph's private pool
    (``torch.cuda.memory_snapshot()``, ``segment_pool_id``); ``static`` = the manager's input
    buffers + output buffer (allocated outside the graph); plus the allocated/reserved deltas
    around the capturing call. The graphed output must equal the eager one within
    :data:`minicpmo_cg.measure.GRAPH_REL_TOL`. Audio shapes run with Whisper's fused layers and
    without them (``layers``), each with the per-kernel profile of its graphed call.
``vision_path`` (:mod:`.vision_path`)
    The whole ``get_vision_hidden_states`` call (padding, then the graph from pixels to resampler
    output) for 1 slice (a duplex frame), 3 padded slices and 10 slices of real photos, with SigLIP's
    eager and SDPA attention on the same weights, SDPA with and without the fused encoder layers
    (``--hf-overrides encoder_fused_layers``): attention, layers, eager ms, graphed ms, ratio, graph
    MiB, graphed == eager (bitwise); the targets below, the per-kernel profile of every SDPA row's
    graphed call (kernels by GPU time, :mod:`.kernels`), and an operator profile of the call where a
    target is missed. ``--only vision_path`` runs it alone.
``bookkeeping`` (:mod:`.bookkeeping`)
    Host cost of the adapter per call, with a no-op forward returning a preallocated tensor. Hit
    path: a tiny captured forward; ``adapter(x)`` minus ``copy + graph.replay() + clone`` on the
    same captured graph (what any replay must do), split into vLLM's manager part
    (``manager.execute`` - bare) and the adapter's own part (``adapter(x)`` - ``manager.execute``).
    Miss paths (ineligible: autograd on / CPU tensor; warmup; capacity; memory floor with the real
    ``cudaMemGetInfo`` and with an injected reading; declined by the cost rule; byte budget;
    vLLM's start-up profiling): ``adapter(x)`` minus calling the forward directly. Host time
    (``perf_counter``) per call, median over batches of calls.
``streaming`` (:mod:`.streaming`)
    A duplex-style session: one 448x448 frame per second (one 32x32 slice) and one 1 s speech
    chunk per second for 120 s of simulated time, interleaved, through the patched call sites,
    eager vs graphed (default adapter options; captures happen inside the session and are paid
    there). Hit rate, misses by kind, graph memory, total encoder time. The audio here is the
    stateless call (``get_audio_hidden_states``); what a duplex session runs is ``duplex``.
``duplex`` (:mod:`.duplex`)
    What a duplex session encodes: each second one 448x448 camera frame through the duplex
    stage's vision call (``get_vision_hidden_states`` under ``torch.no_grad``, default options) and
    one 1 s speech chunk through ``get_audio_embedding_streaming`` with the stage's prefix/suffix
    context frames and per-session KV cache, 120 s of simulated time (cache resets before chunks
    29, 58, 87, 116), eager vs graphed in one run (cold session, warm session, two interleaved
    sessions of audio), every graphed chunk and frame bitwise against eager. Per-chunk and
    per-frame median and p90, session encoder time (frames + chunks), graph memory in total and per
    session; and graphed chunks with Whisper's fused layers against chunks without them, with the
    fused chunk's kernels. ``--only duplex`` runs it alone.
``duplex_concurrency`` (:mod:`.duplex_concurrency`)
    N = 1 ... 32 duplex sessions sharing steps: the streaming audio forward's ms per step eager,
    through the bucket graphs and as a plain CUDA graph of the same fused Whisper stack at batch N
    (the floor), interleaved; host ms per step; start-up capture's seconds and bytes and the first
    chunk of the first session after it.
``offline`` (:mod:`.offline`)
    Real photos (``skimage.data``) through MiniCPM-o's own slicer, random order with repeats.

    ``streaming`` and ``offline`` both run their calls eagerly and graphed with
    ``admission="count"`` and ``"cost"`` (other options at their defaults; offline in full mode
    also ``"cost"`` with 16 graphs), side by side: encoder time (every call timed at its call
    site, captures included), ratio vs eager, hit rate (streaming: also after the first 10 s),
    graphs, graph bytes (the adapters' ``get_detailed_stats`` and the allocator's view), declined
    calls and the other misses, every graph with its hits, bytes and capture time, and the
    targets below. One-time costs (lazy setup, the first capture in the process) are paid
    before the timed runs.
``pools`` (:mod:`.pools`)
    The same shapes captured with ``share_pools`` True and False: total pool bytes, reserved
    delta and replay latency per shape.

Targets printed next to the values (not asserted): graphed/eager >= 2x for one image slice,
>= 3x for a 1 s audio chunk (and, with the fused layers, the 1 s chunk graphed <= 1.5 ms),
bookkeeping < 20 us per call; duplex: graphed <= 2 ms per 1 s chunk and a session encoder time
(frames + chunks) >= 3x lower than eager; the whole image call with SDPA attention and the fused
layers: one slice graphed <= 2.8 ms, 10 slices <= 25 ms, a single-slice graph <= 64 MiB.
Full mode takes a few minutes on an H200.

The hit path's bookkeeping target is <= 15 us (vLLM's manager + the adapter; the 20 us above is
per miss path). Admission, ``"cost"`` against ``"count"``: the offline mix under ``"cost"`` >= 1.0x
eager (captures included) with fewer graph bytes than under ``"count"``; the streaming session
under ``"cost"`` >= 99% hits after warm-up and a speedup no worse than under ``"count"`` (within 2%
run-to-run noise). All targets are ``TARGETS`` in :mod:`.context`.

Usage::

    minicpmo-cg-bench [--quick] [--only vision,audio,...] [--json PATH] [--reduced]
    minicpmo-cg-bench --allow-cpu --quick     # logic dry run on tiny shapes

Without CUDA it exits with status 2 unless ``--allow-cpu``: then it runs every section on tiny
shapes with 2+2 encoder layers and a CPU stand-in for graph capture
(:class:`~.cpu_backend.CpuGraphBackend`: the adapter's real admission policy and cost rule on
scripted timings, captures timed by a scripted clock, eager "replays"), so its decisions do not
depend on the host's load; only the logic is exercised, the numbers mean nothing. The
report goes to stdout, progress and logs to stderr. Exit status: 0 done (targets are reported,
not enforced), 1 a graphed output differed from eager or a section failed, 2 usage/environment
error.
"""
