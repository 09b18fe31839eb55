"""Decides when a request is done and how much of its text may be shown yet."""

from cluster_configs.sampling_params import SamplingParams


def finish_reason_after_token(token_id: int, num_output: int, num_tokens: int, max_num_tokens: int,
                              params: SamplingParams, eos_ids: tuple[int, ...]) -> str | None:
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
        return "stop"
    if num_output >= params.max_tokens or num_tokens >= max_num_tokens:
        return "length"
    return None


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in text, searching only where the new chars can reach."""
    best = -1
    for stop in stops:
        i = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def num_safe_chars(text: str, stops: tuple[str, ...]) -> int:
    """How much of unfinished text can be streamed: hold back a tail that may start a stop string."""
    if not stops:
        return len(text)
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return len(text) - hold
