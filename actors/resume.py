"""Resuming a request on another worker after its worker was lost, exactly where it was.

The router re-submits prompt + the tokens already streamed with a Resume record, replayed from those
tokens; the new worker turns them back into output, so max_tokens, penalties, stop strings and the
detokenizer go on as if nothing had happened. A seeded sampler needs nothing: its draws are keyed by
(seed, position), and the request continues at its position.
"""

from dataclasses import dataclass

from cluster_configs.sampling_params import SamplingParams
from models.tokenizer import IncrementalDetokenizer, Tokenizer
from scheduling.request import Request


@dataclass(frozen=True)
class Resume:
    """How far another (lost) worker had got with a request whose prompt_token_ids now end in its output."""

    num_prompt_tokens: int  # of the original prompt
    text: str  # decoded but not yet sent (an unfinished character, or a possible start of a stop string)
    # IncrementalDetokenizer (token_ids, prefix_offset, read_offset)
    detokenizer: tuple[list[int], int, int] | None


def resume_state(tokenizer: Tokenizer | None, prompt_ids: list[int], output_ids: list[int],
                 emitted_text: str) -> Resume:
    """Where a lost worker was with a request: its detokenizer replayed token by token, as its engine ran
    it."""
    if tokenizer is None:
        return Resume(len(prompt_ids), "", None)
    d = IncrementalDetokenizer(tokenizer, prompt_ids)
    text = "".join(d.add([t]) for t in output_ids)  # the engine's req.text: emitted_text + what it held back
    return Resume(len(prompt_ids), text[len(emitted_text):],
                  (d.token_ids[d.prefix_offset:], 0, d.read_offset - d.prefix_offset))


def resume_request(req: Request, params: SamplingParams, resume: Resume) -> None:
    """Make req continue where the lost worker stopped: the tokens past the original prompt are output again,
    so max_tokens, penalties, stop strings and the detokenizer go on exactly as they were (the sampler's draws
    are keyed by position: nothing to replay)."""
    num_output = req.num_tokens - resume.num_prompt_tokens
    req.params = params
    req.num_prompt_tokens = resume.num_prompt_tokens
    req.num_emitted_tokens = num_output  # the client has them
    req.text = resume.text
    if req.detokenizer is not None and resume.detokenizer is not None:
        token_ids, prefix_offset, read_offset = resume.detokenizer
        req.detokenizer.token_ids = list(token_ids)
        req.detokenizer.prefix_offset, req.detokenizer.read_offset = prefix_offset, read_offset
