"""What each results file's run was, where the file does not say it: the command that wrote it, the machine
and the commit, as the measurement notes recorded them (benchmarks/results/HISTORY.md). A file the JSON
describes fully needs no entry; a file without one is captioned from its own fields."""

from result_tables import Source

ZEN2 = "AMD EPYC Zen 2 VM, 2 cores (AVX2, FMA, F16C; no AVX-512)"
ZEN4 = "AMD EPYC Zen 4 VM, 2 cores (AVX-512 VNNI and BF16)"
ZEN1 = "AMD EPYC Zen 1 VM (family 23, model 1), 2 cores (AVX2, FMA, F16C; no AVX-512)"
DECODE = "python -m benchmarks.bench_decode"
CONTEXT = "python -m benchmarks.bench_context"
HTTP = ("python -m benchmarks.bench_http --concurrency 1,16 --dedicated-concurrency \"\" "
        "--stream-interval-ms {ms} --repeats 3 --out benchmarks/results/{name}")

SOURCES = {
    "architectures.json": Source("python -m benchmarks.bench_architectures"),
    "batching.json": Source("python -m benchmarks.bench_batching", machine=ZEN2),
    "calibration.json": Source("python -m benchmarks.bench_calibration"),
    "context.json": Source(CONTEXT, commit="2e1df79"),
    "context-b1.json": Source(f"{CONTEXT} --groups f16,q4_0 --batches 1 "
                              "--out benchmarks/results/context-b1.json", commit="d51917c"),
    "context-f16.json": Source(CONTEXT, commit="7a353c1",
                               note="The f16 group alone; its exact options were not recorded."),
    "context-q8_0.json": Source(f"{CONTEXT} --groups q8_0 --out benchmarks/results/context-q8_0.json",
                                commit="d51917c"),
    "decode.json": Source(f"{DECODE} --dtypes q8_0,q4_0,q4_k_m --activation-dtypes int8", commit="cb07a1e"),
    "decode-bf16.json": Source(f"{DECODE} --dtypes bfloat16 --activation-dtypes bfloat16 --no-torch-first "
                               "--out benchmarks/results/decode-bf16.json", commit="58c99ef"),
    "decode-2026-11-30-peak.json": Source(
        f"{DECODE} --dtypes q8_0,q4_k_m,bfloat16 --activation-dtypes int8,bfloat16 --samples 3 "
        "--no-torch-first --no-llamacpp --numaserve-threading tbb "
        "--out benchmarks/results/decode-2026-11-30-peak.json",
        commit="15f22e8",
        note="numaserve alone: llama.cpp (llama-cpp-python 0.3.36) crashed on this VM in its "
        "AMX matrix multiply (ggml_backend_amx_mul_mat; llama.cpp issue 20824). The first run with "
        "bench_peak's fractions."),
    "decode-2026-12-02-zen4.json": Source(
        f"{DECODE} --dtypes q4_k_m,q8_0,q4_0 --activation-dtypes int8 --samples 3 --no-torch-first "
        "--out benchmarks/results/decode-2026-12-02-zen4.json",
        machine=ZEN4, commit="1bb1d6e",
        note="After the 1-token prefetch. Both engines ran slower than on 2026-11-26 on this VM (llama.cpp's "
        "q8_0 batch 1 19.0 against 27.5 tok/s): compare ratios, not tokens a second, across the two runs."),
    "decode-2026-12-02-zen4-bf16.json": Source(
        f"{DECODE} --dtypes bfloat16 --activation-dtypes bfloat16 --samples 3 --no-torch-first "
        "--out benchmarks/results/decode-2026-12-02-zen4-bf16.json",
        machine=ZEN4, commit="1bb1d6e",
        note="Right after decode-2026-12-02-zen4.json. The batch-1 row's read probe swung to 20.9 GB/s "
        "(32 at the run's start), hence its fraction above 1."),
    "decode-2026-12-02-zen4-pairs.json": Source(
        f"{DECODE} --dtypes q8_0,q4_k_m,q4_0 --activation-dtypes int8 --contexts 1024 --samples 3 "
        "--no-torch-first --out benchmarks/results/decode-2026-12-02-zen4-pairs.json",
        machine=ZEN4, commit="8db80f4",
        note="After matmul_vnni's token pairs (q8_0, q4_0), before the K-quants' (Q4_K_M's rows: the 256-bit "
        "block). The first run with batch-1 rows at 1k tokens of context."),
    "decode-2026-12-02-zen4-head.json": Source(
        f"{DECODE} --dtypes q8_0,q4_k_m,q4_0 --activation-dtypes int8 --contexts 1024 --samples 3 "
        "--no-torch-first --out benchmarks/results/decode-2026-12-02-zen4-head.json",
        machine=ZEN4, commit="1a31aff",
        note="Every engine change of session 74 in (the int8 and K-quant token pairs, the attention tile). "
        "The read probe's median fell below what q8_0's batch-1 rows read (fractions 1.12 and 1.52)."),
    "decode-2026-12-02-zen4-head-bf16.json": Source(
        f"{DECODE} --dtypes bfloat16 --activation-dtypes bfloat16 --contexts 1024 --samples 3 "
        "--no-torch-first --out benchmarks/results/decode-2026-12-02-zen4-head-bf16.json",
        machine=ZEN4, commit="1a31aff"),
    "decode-2026-12-02-zen4-bf16-rowmajor.json": Source(
        f"{DECODE} --dtypes bfloat16 --activation-dtypes bfloat16 --contexts 1024 --samples 3 "
        "--no-torch-first --out benchmarks/results/decode-2026-12-02-zen4-bf16-rowmajor.json",
        machine=ZEN4, commit="d93ebe2",
        note="bf16 weights row-major: a 1-token block reads its 4 rows one after another "
        "(LAYOUT_VERSION 7)."),
    "decode-2026-12-02-zen4-bf16-512bit.json": Source(
        f"{DECODE} --dtypes bfloat16 --activation-dtypes bfloat16 --contexts 1024 --samples 7 "
        "--no-torch-first --out benchmarks/results/decode-2026-12-02-zen4-bf16-512bit.json",
        machine=ZEN4, commit="9eb9223",
        note="The bf16 block on 512-bit vectors, 6 tokens a block. Two 3-sample runs of the same hour, "
        "not kept: batch 1 1.40x and 0.81x (HISTORY \"bf16 on 512-bit vectors\")."),
    "decode-2026-11-30-iq4.json": Source(
        f"{DECODE} --dtypes iq4_xs,q4_k_m --activation-dtypes int8 --samples 3 --no-torch-first "
        "--out benchmarks/results/decode-2026-11-30-iq4.json",
        commit="4be02f5",
        note="llama.cpp (llama-cpp-python 0.3.36) with the libraries of its own llama.cpp built without AMX "
        "(benchmarks/llama_server.py's lib-noamx), through LLAMA_CPP_LIB_PATH."),
    "decode-2026-12-02-zen1.json": Source(
        f"{DECODE} --dtypes q8_0,q4_0,q4_k_m --activation-dtypes int8 --batches 8 --no-torch-first "
        "--samples 3 --out <outside the repository>",
        machine=ZEN1, commit="cd25cae",
        note="Before the K-quants' AVX2 kernels: Q4_K_M's matrices kept float32 activations on this CPU. Run "
        "from a clone of that commit, copied in. A test run on the same cores during the Q4_K_M batch-8 row "
        "slowed one llama.cpp sample (7.6 tok/s; the median is the other two's)."),
    "decode-2026-12-02-zen1-q4km.json": Source(
        f"{DECODE} --dtypes q4_k_m --activation-dtypes int8 --batches 8,32 --no-torch-first --samples 3 "
        "--out <outside the repository>",
        machine=ZEN1, commit="7408f0f",
        note="After the K-quants' and Q6_K's AVX2 int8 kernels (matmul_kquant_avx2, matmul_q6k_avx2). Run "
        "from a clone of that commit, copied in."),
    "decode-2026-11-26-1533-q8_0.json": Source(
        f"{DECODE} --dtypes q8_0 --activation-dtypes int8 "
        "--out benchmarks/results/decode-2026-11-26-1533-q8_0.json", commit="297e724"),
    "decode-2026-11-26-1315.json": Source(f"{DECODE} --dtypes q8_0,q4_0,q4_k_m --activation-dtypes int8",
                                          commit="aa5f69a", note="Written as decode.json, then renamed."),
    "decode-2026-11-25.json": Source(DECODE, machine=ZEN4, commit="52578e6",
                                     note="Every weight dtype with float32 and with its fast activations."),
    "decode-2026-11-24.json": Source(DECODE, machine=ZEN2 + ", the AVX2 kernels"),
    "decode-2026-11-22.json": Source(DECODE),
    "http.json": Source("python -m benchmarks.bench_http", commit="c2013d7"),
    "http-100ms.json": Source(HTTP.format(ms=100, name="http-100ms.json"), commit="b2363f2"),
    "http-step.json": Source(HTTP.format(ms=0, name="http-step.json"), commit="b2363f2"),
    "kv_quality.json": Source("python -m benchmarks.bench_kv_quality",
                              note="Deterministic: quality, not speed, so the machine does not matter."),
    "load.json": Source("python -m benchmarks.bench_load"),
    "load-q4_k_m.json": Source("python -m benchmarks.bench_load --dtype q4_k_m"),
    "serving_peers-2026-12-02-zen4.json": Source(
        "python -m benchmarks.bench_serving_peers --streams 8,32 --requests-per-stream 1 --samples 2 "
        "--out <outside the repository>",
        machine=ZEN4, commit="1a31aff",
        note="llama-server built this session from llama-cpp-python 0.3.36's sdist (-march=native)."),
    "stall-2026-12-02-zen4-paced-4k.json": Source(
        "python -m benchmarks.bench_stall --phases prefill,refusal_text --repeats 1 --prompt-len 4096 "
        "--max-prefill-stretch 1.25 --out <outside the repository>",
        machine=ZEN4, commit="1a31aff"),
    "load-2026-12-02-zen4-q8_0.json": Source(
        "python -m benchmarks.bench_load --samples 5 --out <outside the repository>",
        machine=ZEN4, commit="1a31aff",
        note="The uncommitted changes: bench_load.py's --dtype option, tests and docs; no engine code."),
    "load-2026-12-02-zen4-bf16.json": Source(
        "python -m benchmarks.bench_load --samples 5 --dtype bfloat16 --out <outside the repository>",
        machine=ZEN4, commit="1a31aff",
        note="--dtype bfloat16 added to bench_load after this commit (the run's own tree had it)."),
    "load-2026-12-03-zen4-q8_0.json": Source(
        "python -m benchmarks.bench_load --samples 5 --out <outside the repository>", machine=ZEN4,
        commit="332b11a"),
    "load-2026-12-03-zen4-bf16.json": Source(
        "python -m benchmarks.bench_load --samples 5 --dtype bfloat16 --out <outside the repository>",
        machine=ZEN4, commit="332b11a"),
    "http-2026-12-02-zen4.json": Source(
        "python -m benchmarks.bench_http --concurrency 1,16 --dedicated-concurrency 16 "
        "--out <outside the repository>",
        machine=ZEN4, commit="1a31aff", note="Run with benchmarks/ports.py's free_port (added after it)."),
    "stall-2026-12-02-zen4-refusals.json": Source(
        "python -m benchmarks.bench_stall --phases refusal_text,refusal_token_ids --repeats 3 "
        "--out <outside the repository>",
        machine=ZEN4, commit="1a31aff"),
    "stall-2026-12-02-zen4-refusals-process.json": Source(
        "python -m benchmarks.bench_stall --phases refusal_text,refusal_token_ids --repeats 3 "
        "--out benchmarks/results/stall-2026-12-02-zen4-refusals-process.json",
        machine=ZEN4, commit="ecf643e",
        note="Bodies of 1 MiB or more parsed in the body parser's process; a slower phase of the VM than the "
        "run before it (idle p50 95 against 74 ms)."),
    "stall-2026-12-02-zen4-stationary.json": Source(
        "python -m benchmarks.bench_stall --phases prefill --repeats 3 --prompt-len 4096 "
        "--max-prefill-stretch 1.25 --stream-tokens 256 "
        "--out benchmarks/results/stall-2026-12-02-zen4-stationary.json",
        machine=ZEN4, commit="16a2c6d",
        note="The streams' contexts held under 272 tokens (runs of 256-token completions); a 1-repeat run of "
        "the same hour, not kept: 1.51x (HISTORY \"Stalls of running streams\")."),
    "peak-2026-12-02-zen4.json": Source(
        "python -m benchmarks.bench_peak --out benchmarks/results/peak-2026-12-02-zen4.json",
        machine=ZEN4, commit="c0579d1"),
    "serving_peers-2026-12-01.json": Source(
        "python -m benchmarks.bench_serving_peers --streams 8,32 --requests-per-stream 1 --samples 2 "
        "--out benchmarks/results/serving_peers-2026-12-01.json",
        commit="68c75d0",
        note="Run from a clone of that commit, written outside the repository and copied in; llama-server "
        "built by benchmarks/llama_server.py from llama-cpp-python 0.3.36's sdist."),
    "load-2026-12-01-mapped.json": Source(
        "python -m benchmarks.bench_load --samples 5 --out benchmarks/results/load-2026-12-01-mapped.json",
        note="Run from a worktree of its commit (the repository's tree was being edited), written outside "
        "the repository and copied in."),
    "load-2026-12-01-mapped-slow-phase.json": Source(
        "python -m benchmarks.bench_load --samples 5 "
        "--out benchmarks/results/load-2026-12-01-mapped-slow-phase.json",
        note="The same command and commit as load-2026-12-01-mapped.json, run just before it, while the VM's "
        "memory bandwidth was about half its usual (every engine's decode and first token slower)."),
    "load-2026-12-01-lazy.json": Source(
        "python -m benchmarks.bench_load --samples 5 --out benchmarks/results/load-2026-12-01-lazy.json",
        commit="5106f7c",
        note="Run from a clone of that commit (the GGUF load copying each layer's tensors as it is built), "
        "written outside the repository and copied in."),
    "load-2026-12-01-parts.json": Source(
        "python -m benchmarks.bench_load --samples 3 --out benchmarks/results/load-2026-12-01-parts.json",
        commit="469bb2f",
        note="Run from a clone of that commit (resident memory by what holds it), written outside the "
        "repository and copied in."),
    "lora.json": Source("python -m benchmarks.bench_lora", machine="Intel Xeon VM, 2 cores"),
    "moe.json": Source("python -m benchmarks.bench_moe",
                       note="The measurement notes named commit 58c99ef for this run; the file records its "
                            "own."),
    "quant_quality.json": Source("python -m benchmarks.bench_quant_quality"),
    "imatrix_quality.json": Source("python -m benchmarks.bench_imatrix_quality"),
    "revisions.json": Source("python -m benchmarks.bench_revisions --old <worktree of 07b6f45> --samples 15"),
    "revisions-2026-11-29-int8-kv.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 3507f82> --rows tinyllama-1.1b:q8_0:1,"
        "tinyllama-1.1b:q8_0:4 --activation-dtype int8 --kv-dtype int8 --prompt-len 1024 --samples 5 "
        "--out benchmarks/results/revisions-2026-11-29-int8-kv.json"),
    "revisions-2026-11-29-house.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 6b8172e> --rows tinyllama-1.1b:q8_0:1,"
        "tinyllama-1.1b:q8_0:32,tinyllama-1.1b:q8_0:prefill512 --samples 7 "
        "--out benchmarks/results/revisions-2026-11-29-house.json",
        machine="AMD EPYC Zen 3 VM, 2 cores (AVX2, FMA, F16C; no AVX-512)",
        note="The house's tree (c32fd50) against the tree before it (6b8172e). Before the untimed first "
             "call per row: each engine's first timed sample of a row compiled kernels (old batch 1: 0.9, "
             "batch 32: 14.0 tok/s), so the medians lean new; the samples' ranges overlap on every row."),
    "revisions-2026-11-29-house-2.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 6b8172e> --rows tinyllama-1.1b:q8_0:1,"
        "tinyllama-1.1b:q8_0:32,tinyllama-1.1b:q8_0:prefill512 --samples 5 "
        "--out benchmarks/results/revisions-2026-11-29-house-2.json",
        machine="AMD EPYC Zen 3 VM, 2 cores (AVX2, FMA, F16C; no AVX-512)",
        note="The house's tree (0791320) against the tree before it (6b8172e), with an untimed first call "
             "per row (the file's command line names the path it was first written to)."),
    "revisions-2026-11-29-house-3.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 6b8172e> --rows tinyllama-1.1b:q8_0:1,"
        "tinyllama-1.1b:q8_0:32,tinyllama-1.1b:q8_0:prefill512 --samples 5 "
        "--out benchmarks/results/revisions-2026-11-29-house-3.json",
        machine="AMD EPYC Zen 3 VM, 2 cores (AVX2, FMA, F16C; no AVX-512)",
        note="The house's tree at 1d63f2c (attention compiled once per KV dtype, C-contiguous q/k/v) "
             "against the tree before it (6b8172e) (the file's command line names the path it was first "
             "written to)."),
    "revisions-2026-12-02-pairs.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 992c90a> --rows "
        "tinyllama-1.1b:q8_0:prefill512,tinyllama-1.1b:q4_0:prefill512,tinyllama-1.1b:q8_0:32,"
        "tinyllama-1.1b:q4_0:32,tinyllama-1.1b:q8_0:8,tinyllama-1.1b:q8_0:1 --activation-dtype int8 "
        "--samples 5 --out benchmarks/results/revisions-2026-12-02-pairs.json",
        machine=ZEN4, commit="7c44431",
        note="matmul_vnni's token pairs against the tree before them (the file's command line names the path "
             "it was first written to). Batch 1 does not use them (one token)."),
    "revisions-2026-12-02-kquant-pairs.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 8db80f4> --rows "
        "tinyllama-1.1b:q4_k_m:prefill512,tinyllama-1.1b:q4_k_m:32,tinyllama-1.1b:q4_k_m:8,"
        "tinyllama-1.1b:q8_0:prefill512 --activation-dtype int8 --samples 5 "
        "--out benchmarks/results/revisions-2026-12-02-kquant-pairs.json",
        machine=ZEN4, commit="ddbe97d",
        note="The K-quants' token pairs against the tree before them. q8_0's code is the same in both trees: "
             "its 1.155 is this VM's noise between the two processes."),
    "revisions-2026-12-02-attention.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of 8db80f4> --rows "
        "tinyllama-1.1b:q8_0:prefill512,tinyllama-1.1b:q4_k_m:prefill512 --activation-dtype int8 --samples 7 "
        "--out benchmarks/results/revisions-2026-12-02-attention.json",
        machine=ZEN4, commit="da57e1c",
        note="The prefill attention tile's vectorized exponentials (q8_0: that change alone) and, for "
             "Q4_K_M, the K-quants' token pairs, against the tree before both."),
    "revisions-2026-11-26-b1.json": Source(
        "python -m benchmarks.bench_revisions --old <worktree of cb07a1e> --rows tinyllama-1.1b:q8_0:1 "
        "--activation-dtype int8 --samples 9 --out benchmarks/results/revisions-2026-11-26-b1.json"),
    "sampling.json": Source("python -m benchmarks.bench_sampling"),
    "serving.json": Source("python -m benchmarks.bench_serving --repeats 5"),
    "serving-tinyllama-q8_0.json": Source(
        "python -m benchmarks.bench_serving --model tinyllama-1.1b --weight-dtype q8_0 "
        "--activation-dtype int8 --kv-cache-mb 512 --parts scaling --intervals-ms 100 --repeats 5 "
        "--out benchmarks/results/serving-tinyllama-q8_0.json",
        machine="AMD EPYC (family 26, model 2), 2 cores", commit="b2363f2"),
    "serving_peers.json": Source("python -m benchmarks.bench_serving_peers", commit="b2363f2"),
    "simulate_sweep.json": Source("python -m benchmarks.simulate.sweep --jobs 1", commit="c3719d8",
                                  machine="simulated, with the step-cost model of step_cost.json"),
    "simulate_validation.json": Source("python -m benchmarks.validate_simulator", machine=ZEN4,
                                       commit="9ffa93b"),
    "simulate_validation_saturated.json": Source(
        "python -m benchmarks.validate_simulator --rates 1.5,2.5 "
        "--out benchmarks/results/simulate_validation_saturated", machine=ZEN4, commit="1541b49"),
    "soak.json": Source("python -m benchmarks.bench_soak --duration-s 600 --rate 8"),
    "soak_http.json": Source("python -m benchmarks.bench_soak --http --duration-s 600", machine=ZEN4,
                             commit="1541b49"),
    "speculation_acceptance.json": Source("python -m benchmarks.bench_speculation acceptance"),
    "speculation_coupling.json": Source("python -m benchmarks.bench_speculation coupling",
                                        note="Acceptance rates, not speed: the machine does not matter."),
    "speculation_heads.json": Source(
        "python -m benchmarks.bench_speculation heads demo", machine=ZEN4, commit="af796f2",
        note="Then `heads tinyllama` and `heads rows` of the same command, which add their parts to the "
             "file."),
    "speculation_sweep.json": Source("python -m benchmarks.bench_speculation sweep", machine=ZEN2),
    "step_cost.json": Source(
        "python -m benchmarks.fit_step_cost",
        note="The model was fitted again (`--refit SAMPLES.json`) to the samples of that run."),
    "stream.json": Source(
        "NUMBA_THREADING_LAYER=omp OMP_WAIT_POLICY=ACTIVE python -m benchmarks.bench_stream", machine=ZEN4,
        commit="1bb1d6e",
        note="The VM's read probe swung from 15 to 46 GB/s within this run: compare a variant with the probe "
        "samples beside it, and the variants with each other."),
    "structured.json": Source("python -m benchmarks.bench_structured", commit="da74cf7"),
}
