"""llama.cpp through llama-cpp-python's low-level API: prefill, batch-1 and batched greedy decode.

Set up as the issue's notes require: n_threads_batch = n_threads, no mmap (the VM reclaims idle file
pages), logging silenced (it slows decode about tenfold), several sequence ids in one llama_batch; every
other setting is llama.cpp's default. Run as a module it is llama.cpp's side of `numaserve bench`: its own
process, started with a clean environment (no OMP_WAIT_POLICY of ours), that loads the model once and
answers commands (benchmarks/engine_process.py). It imports no numaserve code.

    python -m benchmarks.llamacpp_runner MODEL.gguf --threads 2 --n-ctx 4096 --n-seq-max 32 [--kv-type q8_0]
"""

import argparse
import ctypes
import time

import llama_cpp as lc
import numpy as np

KV_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0}


@lc.llama_log_callback
def _silent(level, text, user_data):
    pass


class LlamaCppRunner:
    def __init__(self, gguf_path: str, threads: int, n_ctx: int, n_seq_max: int, n_batch: int = 512,
                 kv_type: str | None = None):
        """kv_type: "f16", "q8_0" or "q4_0" keys and values under flash attention (which quantized values
        need); None: llama.cpp's defaults for both."""
        lc.llama_log_set(_silent, ctypes.c_void_p(0))
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.load_mode = lc.LLAMA_LOAD_MODE_NONE  # read into memory, no mmap
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = n_seq_max
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.kv_unified = True  # one KV buffer for all sequences (else each gets n_ctx / n_seq_max)
        if kv_type is not None:
            ctx_params.type_k = ctx_params.type_v = KV_TYPES[kv_type]
            ctx_params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lc.llama_init_from_model(self.model, ctx_params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def clear(self) -> None:
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: list[int], positions: list[int], seq_ids: list[int],
                want_logits: list[bool]) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (tok, pos, seq, logits) in enumerate(zip(tokens, positions, seq_ids, want_logits)):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to process the prompt (in n_batch chunks) up to its last logits."""
        return self.prefill_batch([prompt])

    def prefill_batch(self, prompts: list[list[int]]) -> float:
        """Seconds to process every prompt (one sequence id each) up to their last logits."""
        self.clear()
        start = time.perf_counter()
        self._prefill(prompts)
        return time.perf_counter() - start

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """Every prompt's tokens, sequence after sequence, in llama_batches of n_batch; -> each prompt's
        greedy next token."""
        flat = [(tok, pos, seq, pos == len(p) - 1)
                for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        nxt = []
        for s in range(0, len(flat), self.n_batch):
            chunk = flat[s:s + self.n_batch]
            self._decode(*(list(column) for column in zip(*chunk)))
            nxt += [self._argmax(i) for i, row in enumerate(chunk) if row[3]]
        return nxt

    def decode_seconds(self, prompts: list[list[int]], num_steps: int) -> float:
        return self.decode(prompts, num_steps)[0]

    def decode(self, prompts: list[list[int]], num_steps: int) -> tuple[float, list[list[int]]]:
        """Greedy decode of every prompt at once (one sequence id each); -> (decode seconds, tokens)."""
        self.clear()
        nxt = self._prefill(prompts)
        outs = [[t] for t in nxt]
        start = time.perf_counter()
        for step in range(num_steps):
            self._decode(nxt, [len(p) + step for p in prompts], list(range(len(prompts))),
                         [True] * len(prompts))
            nxt = [self._argmax(i) for i in range(len(prompts))]
            for o, t in zip(outs, nxt):
                o.append(t)
        return time.perf_counter() - start, outs


    def open_decode(self, prompts: list[list[int]]) -> float:
        """Prefill every prompt (one sequence id each; untimed by the caller) and keep them: later
        `decode_more` calls time steps over this context. Clears the context before. -> seconds."""
        self.clear()
        start = time.perf_counter()
        self._next = self._prefill(prompts)
        self._positions = [len(p) for p in prompts]
        return time.perf_counter() - start

    def decode_more(self, num_steps: int) -> float:
        """Seconds of num_steps greedy decode steps of the open context (one token a sequence a step)."""
        num_seqs = len(self._next)
        start = time.perf_counter()
        for _ in range(num_steps):
            self._decode(self._next, self._positions, list(range(num_seqs)), [True] * num_seqs)
            self._next = [self._argmax(i) for i in range(num_seqs)]
            self._positions = [p + 1 for p in self._positions]
        return time.perf_counter() - start

    def close_decode(self) -> None:
        self.clear()


def main() -> None:
    from benchmarks.engine_process import serve

    parser = argparse.ArgumentParser()
    parser.add_argument("gguf_path")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, required=True)
    parser.add_argument("--n-seq-max", type=int, required=True)
    parser.add_argument("--kv-type", choices=list(KV_TYPES), help="KV type, flash attention on")
    args = parser.parse_args()
    runner = LlamaCppRunner(args.gguf_path, args.threads, args.n_ctx, args.n_seq_max, kv_type=args.kv_type)
    runner.decode([[5] * 16] * 2, 2)  # warm-up, as numaserve's side gets
    serve({"prefill": runner.prefill, "prefill_batch": runner.prefill_batch,
           "decode": runner.decode_seconds, "open_decode": runner.open_decode,
           "decode_more": runner.decode_more, "close_decode": runner.close_decode,
           "info": lambda: {"system_info": lc.llama_print_system_info().decode(), "threads": args.threads}})


if __name__ == "__main__":
    main()
