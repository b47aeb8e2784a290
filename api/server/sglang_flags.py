"""SGLang 0.5.7's `launch_server` flags that `actorserve serve` does not take as its own.

A launch script carried over from SGLang must not stop at argparse's "unrecognized arguments".
Every one of SGLang 0.5.7's 321 server flags (sglang/srt/server_args.py) is, here, either
- honoured: a flag of `actorserve serve` with SGLang's meaning (api/server/cli.py), or
- accepted for compatibility (COMPATIBLE): what the flag asks for is what actorserve always does,
  so it is taken and changes nothing, or
- accepted with SGLang's default value only (DEFAULT_ONLY), refused with the reason otherwise, or
- refused by name with a one-line reason (REFUSED), before anything loads.
A flag that `actorserve serve` defines itself is honoured even where a table here still lists it.
tests/test_sglang_flags.py checks this against the sglang wheel's own list when it is installed.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Takes = Literal["flag", "int", "float", "str"]  # a store_true switch, or one value of this type


class Compatible(NamedTuple):
    takes: Takes
    why: str  # why taking it and doing nothing is SGLang's meaning here


class DefaultOnly(NamedTuple):
    takes: Takes
    values: tuple[str, ...]  # the values that mean what actorserve does
    reason: str  # why another value cannot apply


COMPATIBLE: dict[str, Compatible] = {
    "--enable-metrics": Compatible("flag", "GET /metrics is always served"),
    "--enable-cache-report": Compatible("flag", "cached prompt tokens are always reported (usage, meta_info)"),
    "--skip-server-warmup": Compatible("flag", "no warmup request is ever sent"),
    "--sleep-on-idle": Compatible("flag", "an idle engine waits on its mailboxes, it never spins"),
    "--disable-outlines-disk-cache": Compatible("flag", "grammars compile with xgrammar, never outlines"),
    "--disable-custom-all-reduce": Compatible("flag", "tensor parallelism all-reduces with torch.distributed only"),
    "--enable-p2p-check": Compatible("flag", "no GPU peer-to-peer access is assumed"),
    "--enable-tokenizer-batch-encode": Compatible("flag", "each prompt is tokenized on its own; results are the same"),
    "--disable-tokenizer-batch-decode": Compatible("flag", "each request is detokenized on its own"),
    "--show-time-cost": Compatible("flag", "no timing printout here: per-actor CPU time is in /get_server_info"),
    "--log-level-http": Compatible("str", "no per-request HTTP access lines are logged (see --log-requests)"),
    "--decode-log-interval": Compatible("int", "no periodic decode log here: GET /metrics has the throughput"),
}

DEFAULT_ONLY: dict[str, DefaultOnly] = {
    "--tokenizer-mode": DefaultOnly("str", ("auto",), "the fast (Rust) tokenizer is always used"),
    "--tokenizer-worker-num": DefaultOnly("int", ("1",), "one tokenizer, in the server's process"),
    "--model-impl": DefaultOnly("str", ("auto", "sglang"), "models run on actorserve's own implementations"),
    "--sampling-backend": DefaultOnly("str", ("pytorch",), "sampling runs in PyTorch (gpu/sampler.py)"),
    "--grammar-backend": DefaultOnly("str", ("xgrammar",), "constrained decoding uses xgrammar"),
    "--pipeline-parallel-size": DefaultOnly("int", ("1",), "no pipeline parallelism: use --tp-size or --dp-size"),
    "--pp-size": DefaultOnly("int", ("1",), "no pipeline parallelism: use --tp-size or --dp-size"),
    "--nnodes": DefaultOnly("int", ("1",), "one node: every rank and replica runs on this machine"),
    "--node-rank": DefaultOnly("int", ("0",), "one node: every rank and replica runs on this machine"),
    "--expert-parallel-size": DefaultOnly("int", ("1",), "no mixture-of-experts models here"),
    "--ep-size": DefaultOnly("int", ("1",), "no mixture-of-experts models here"),
    "--ep": DefaultOnly("int", ("1",), "no mixture-of-experts models here"),
    "--base-gpu-id": DefaultOnly("int", ("0",), "the engine uses --device (cuda: the current device); pick GPUs with CUDA_VISIBLE_DEVICES"),
    "--gpu-id-step": DefaultOnly("int", ("1",), "pick GPUs with CUDA_VISIBLE_DEVICES"),
    "--num-continuous-decode-steps": DefaultOnly("int", ("1",), "the scheduler forms every batch anew; overlap hides its cost"),
}

_OFFLINE = "models are never downloaded here: give --model-path a local checkpoint directory or .gguf file"
_LOADER = "weights load from local safetensors or GGUF files by actorserve's one loader"
_QUANT = "no quantized checkpoints here but GGUF files (dequantized at load, or their quantized blocks kept with --quantization gguf; --quantization int8 quantizes at load on a CPU)"
_LORA = "no LoRA adapters here"
_SPEC = "no speculative decoding here"
_MOE = "no mixture-of-experts models or expert parallelism here"
_ARCH = "only dense full-attention models (Llama, Qwen2, Qwen3) run here: no hybrid, sliding-window, state-space or sparse attention"
_HICACHE = "only the file storage tier (--hicache-storage-backend file) here: no host-tier sizing in GB, other I/O backends or layouts, backend config, external KV store or KV event stream"
_DISAGG = "no prefill/decode or encoder disaggregation here"
_MM = "only text generation models run here (no embedding, scoring or multimodal models)"
_PARSERS = "no completion templates, files API or tool servers here"
_KERNELS = "no such kernel option here: attention is torch (CPU, CUDA) or FlashInfer (CUDA), decode runs as CUDA graphs"
_PARALLEL = "parallelism here is --tp-size (torch.distributed) and --dp-size (replicas behind a router)"
_OFFLOAD = "weights and KV stay on --device: no offloading, memory saver or NUMA binding"
_METRICS = "/metrics has fixed buckets and labels; no tracing, crash dumps or metrics files here"


def _each(reason: str, *flags: str) -> dict[str, str]:
    return dict.fromkeys(flags, reason)


# Every SGLang 0.5.7 server flag that is neither honoured nor accepted, with why.
REFUSED: dict[str, str] = {
    **_each(_OFFLINE, "--revision", "--download-dir"),
    **_each(
        _LOADER, "--model-loader-extra-config", "--custom-weight-loader", "--weight-loader-disable-mmap",
        "--checkpoint-engine-wait-weights-before-ready", "--delete-ckpt-after-loading", "--decrypted-config-file",
        "--decrypted-draft-config-file", "--remote-instance-weight-loader-seed-instance-ip",
        "--remote-instance-weight-loader-seed-instance-service-port", "--remote-instance-weight-loader-send-weights-group-ports",
        "--remote-instance-weight-loader-backend", "--remote-instance-weight-loader-start-seed-via-transfer-engine",
    ),
    "--weight-version": "weights cannot be updated at run time, so they have no version",
    "--json-model-override-args": "no config.json overrides: edit a copy of the checkpoint's config.json",
    **_each(
        _QUANT, "--quantization-param-path", "--modelopt-quant", "--modelopt-checkpoint-restore-path",
        "--modelopt-checkpoint-save-path", "--modelopt-export-path", "--quantize-and-serve", "--rl-quant-profile",
        "--fp8-gemm-backend", "--torchao-config",
    ),
    "--enable-fp32-lm-head": "the LM head computes in the model's dtype (--dtype float32 for all of it)",
    **_each(
        _LORA, "--enable-lora", "--max-lora-rank", "--lora-target-modules", "--lora-paths", "--max-loras-per-batch",
        "--max-loaded-loras", "--lora-eviction-policy", "--lora-backend", "--max-lora-chunk-size",
    ),
    **_each(
        _SPEC, "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
        "--speculative-draft-model-revision", "--speculative-draft-load-format", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--speculative-accept-threshold-single",
        "--speculative-accept-threshold-acc", "--speculative-token-map", "--speculative-attention-mode",
        "--speculative-draft-attention-backend", "--speculative-moe-runner-backend", "--speculative-moe-a2a-backend",
        "--speculative-draft-model-quantization", "--speculative-ngram-min-match-window-size",
        "--speculative-ngram-max-match-window-size", "--speculative-ngram-min-bfs-breadth",
        "--speculative-ngram-max-bfs-breadth", "--speculative-ngram-match-type", "--speculative-ngram-branch-length",
        "--speculative-ngram-capacity", "--enable-multi-layer-eagle",
    ),
    **_each(
        _MOE, "--moe-a2a-backend", "--moe-runner-backend", "--flashinfer-mxfp4-moe-precision",
        "--enable-flashinfer-allreduce-fusion", "--deepep-mode", "--ep-num-redundant-experts", "--ep-dispatch-algorithm",
        "--init-expert-location", "--enable-eplb", "--eplb-algorithm", "--eplb-rebalance-num-iterations",
        "--eplb-rebalance-layers-per-chunk", "--eplb-min-rebalancing-utilization-threshold",
        "--expert-distribution-recorder-mode", "--expert-distribution-recorder-buffer-size",
        "--enable-expert-distribution-metrics", "--deepep-config", "--moe-dense-tp-size", "--elastic-ep-backend",
        "--mooncake-ib-device", "--kt-weight-path", "--kt-method", "--kt-cpuinfer", "--kt-threadpool-count",
        "--kt-num-gpu-experts", "--kt-max-deferred-experts-per-token", "--disable-flashinfer-cutlass-moe-fp4-allgather",
        "--disable-shared-experts-fusion", "--enable-return-routed-experts",
    ),
    **_each(
        _ARCH, "--hybrid-kvcache-ratio", "--swa-full-tokens-ratio", "--disable-hybrid-swa-memory", "--nsa-prefill-backend",
        "--nsa-decode-backend", "--enable-nsa-prefill-context-parallel", "--max-mamba-cache-size", "--mamba-ssm-dtype",
        "--mamba-full-memory-ratio", "--mamba-scheduler-strategy", "--mamba-track-interval", "--dllm-algorithm",
        "--dllm-algorithm-config", "--enable-double-sparsity", "--ds-channel-config-path", "--ds-heavy-channel-num",
        "--ds-heavy-token-num", "--ds-heavy-channel-type", "--ds-sparse-decode-threshold", "--flashinfer-mla-disable-ragged",
        "--disable-chunked-prefix-cache",
    ),
    # A flag that the parser defines itself (honoured) overrides its entry here (api/server/cli.py).
    **_each(
        _HICACHE, "--hicache-size", "--hicache-io-backend", "--hicache-mem-layout",
        "--hicache-storage-backend-extra-config", "--enable-lmcache", "--kv-events-config",
    ),
    **_each(
        _DISAGG, "--disaggregation-mode", "--disaggregation-transfer-backend", "--disaggregation-bootstrap-port",
        "--disaggregation-decode-tp", "--disaggregation-decode-dp", "--disaggregation-prefill-pp", "--disaggregation-ib-device",
        "--disaggregation-decode-enable-offload-kvcache", "--disaggregation-decode-enable-fake-auto",
        "--num-reserved-decode-tokens", "--disaggregation-decode-polling-interval", "--encoder-only", "--language-only",
        "--encoder-transfer-backend", "--encoder-urls", "--enable-pdmux", "--pdmux-config-path", "--sm-group-num",
    ),
    **_each(
        _MM, "--is-embedding", "--enable-multimodal", "--mm-attention-backend", "--multi-item-scoring-delimiter",
        "--disable-fast-image-processor", "--keep-mm-feature-on-device", "--enable-precise-embedding-interpolation",
        "--mm-max-concurrent-calls", "--mm-per-request-timeout", "--enable-broadcast-mm-inputs-process", "--mm-process-config",
        "--mm-enable-dp-encoder", "--limit-mm-data-per-request", "--enable-prefix-mm-cache",
    ),
    **_each(_PARSERS, "--completion-template", "--file-storage-path", "--tool-server"),
    "--prefill-attention-backend": "one backend serves prefill and decode: use --attention-backend",
    "--decode-attention-backend": "one backend serves prefill and decode: use --attention-backend",
    "--cuda-graph-bs": "captured batch sizes follow --cuda-graph-max-bs",
    "--disable-cuda-graph-padding": "decode batches are always padded to a captured size (--disable-cuda-graph runs them eagerly)",
    **_each(
        _KERNELS, "--disable-flashinfer-autotune", "--enable-profile-cuda-graph", "--enable-cudagraph-gc",
        "--enable-layerwise-nvtx-marker", "--enable-torch-compile", "--enable-torch-compile-debug-mode",
        "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-tokens", "--piecewise-cuda-graph-compiler",
        "--torch-compile-max-bs", "--piecewise-cuda-graph-max-tokens", "--enable-nan-detection",
        "--triton-attention-reduce-in-fp32", "--triton-attention-num-kv-splits", "--triton-attention-split-tile-size",
        "--enable-fused-qk-norm-rope", "--debug-tensor-dump-output-folder", "--debug-tensor-dump-layers",
        "--debug-tensor-dump-input-file", "--debug-tensor-dump-inject", "--forward-hooks",
    ),
    "--enable-custom-logit-processor": "no custom logit processors (code sent in requests) here",
    "--enable-return-hidden-states": "hidden states are never returned",
    **_each(
        _PARALLEL, "--nccl-port", "--pp-max-micro-batch-size", "--pp-async-batch-depth", "--prefill-round-robin-balance",
        "--enable-nccl-nvls", "--enable-symm-mem", "--enable-mscclpp", "--enable-torch-symm-mem", "--enable-dp-attention",
        "--enable-dp-lm-head", "--enable-two-batch-overlap", "--enable-single-batch-overlap",
        "--tbo-token-distribution-threshold", "--enable-attn-tp-input-scattered",
    ),
    **_each(
        _OFFLOAD, "--cpu-offload-gb", "--offload-group-size", "--offload-num-in-group", "--offload-prefetch-step",
        "--offload-mode", "--enable-memory-saver", "--enable-weights-cpu-backup", "--enable-draft-weights-cpu-backup",
        "--numa-node",
    ),
    **_each(
        _METRICS, "--enable-metrics-for-all-schedulers", "--tokenizer-metrics-custom-labels-header",
        "--tokenizer-metrics-allowed-custom-labels", "--bucket-time-to-first-token", "--bucket-inter-token-latency",
        "--bucket-e2e-request-latency", "--collect-tokens-histogram", "--prompt-tokens-buckets", "--generation-tokens-buckets",
        "--gc-warning-threshold-secs", "--enable-request-time-stats-logging", "--enable-trace", "--otlp-traces-endpoint",
        "--export-metrics-to-file", "--export-metrics-to-file-dir", "--crash-dump-folder", "--custom-sigquit-handler",
    ),
    "--soft-watchdog-timeout": "only the hard watchdog exists: --watchdog-timeout fails the server",
    "--enable-dynamic-chunking": "the chunk size is fixed: --chunked-prefill-size",
    "--allow-auto-truncate": "a prompt longer than the context is refused with a 400, never truncated",
    "--stream-output": "native /generate streams cumulative text, as SGLang's default",
    "--constrained-json-whitespace-pattern": "JSON grammars use xgrammar's whitespace rules",
    "--constrained-json-disable-any-whitespace": "JSON grammars use xgrammar's whitespace rules",
    "--scheduler-recv-interval": "the scheduler's actors receive on every message (bounded mailboxes)",
    "--rl-on-policy-target": "no RL training integration",
    "--enable-dynamic-batch-tokenizer": "each prompt is tokenized on its own (long ones in a thread)",
    "--dynamic-batch-tokenizer-batch-size": "each prompt is tokenized on its own (long ones in a thread)",
    "--dynamic-batch-tokenizer-batch-timeout": "each prompt is tokenized on its own (long ones in a thread)",
    "--fastapi-root-path": "the server answers at / (put a proxy in front to mount it elsewhere)",
    "--grpc-mode": "the server speaks HTTP only",
    "--warmups": "no warmup requests are run",
    "--config": "no config files: give the flags on the command line",
}
