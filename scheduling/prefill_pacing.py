"""How many prompt tokens a step may carry while other requests decode, so that a long prompt arriving never
freezes the streams already running (Sarathi-Serve's stall-free batching, its budget from this engine's
measured step costs rather than an offline profile).

A decode step's time is what a running stream waits between tokens. A step that also carries a prompt chunk
of p tokens takes about decode_s + p * prompt_token_s, so holding it to max_stretch * decode_s gives

    p = (max_stretch - 1) * decode_s / prompt_token_s   (at least 1: a prompt always moves on)

decode_s is an average of the steps that decoded with no prompt token, prompt_token_s of what each prompt
token added to the steps that carried some (the step's seconds less decode_s, over its prompt tokens). Until
both were measured a chunk is FIRST_CHUNK tokens, and a chunk is never more than GROWTH times the largest one
measured: an estimate is tried at a size near what it was measured at before it is trusted further (a prompt
token's cost grows with its context, and small chunks pay per token what large ones share). With nothing
decoding, or pacing off, only the token budget bounds a step.
"""

FIRST_CHUNK = 16  # prompt tokens beside decodes before a chunk's cost was measured
GROWTH = 2  # a chunk at most this times the largest measured
EMA_WEIGHT = 0.25  # of the newest step in either average: the VM's speed swings within seconds


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


class PrefillPacer:
    def __init__(self, max_stretch: float | None):
        """max_stretch: a step with prompt tokens beside decodes takes at most this times a decode-only step
        (EngineConfig.max_prefill_stretch); None: unpaced."""
        self.max_stretch = max_stretch
        self.decode_s: float | None = None  # a decode-only step
        self.prompt_token_s: float | None = None  # what one prompt token adds to a step
        self.largest_chunk = 0  # the most prompt tokens a measured step beside decodes carried

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step's tokens (decoding requests' and all others') and its wall time."""
        if num_decode_tokens == 0 or seconds <= 0:
            return  # nothing decoded: no stream waited on it
        if num_prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            added = max(seconds - self.decode_s, 0.0) / num_prompt_tokens
            self.prompt_token_s = _average(self.prompt_token_s, added)
            self.largest_chunk = max(self.largest_chunk, num_prompt_tokens)

    def prompt_tokens(self, num_decoding: int) -> int | None:
        """Prompt tokens the next step may carry beside num_decoding decoding requests (None: no bound)."""
        if self.max_stretch is None or num_decoding == 0:
            return None
        if self.decode_s is None or self.prompt_token_s is None:
            return FIRST_CHUNK
        fits = (self.max_stretch - 1.0) * self.decode_s / max(self.prompt_token_s, 1e-9)
        return max(1, min(int(fits + 1e-6), GROWTH * max(self.largest_chunk, FIRST_CHUNK)))  # 4.9999... is 5
