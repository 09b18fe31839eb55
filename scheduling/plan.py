"""StepPlan: what one step computes, as the batcher scheduled it and speculation added drafts to it."""

from dataclasses import dataclass, field
from functools import cached_property

from models.proposers.token_tree import TokenTree
from scheduling.request import Request

_NO_DRAFTS = TokenTree((), ())  # a plain decode row


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # this step's tokens of the request, its drafts included
    # after its last verified token: a chain, or a tree's nodes in order
    draft_token_ids: tuple[int, ...] = ()
    tree: TokenTree | None = None  # the drafts' tree when it is not a chain
    draft_method: str | None = None  # the speculation method that drafted them
    is_decoding: bool = field(init=False)  # computing only its last token (so it may draft after it)

    def __post_init__(self):  # the request's state as scheduled (processing the step moves it on)
        req = self.request
        object.__setattr__(self, "is_decoding", self.num_base_tokens == 1 and not req.prompt_only
                           and req.num_computed_tokens + 1 == req.num_tokens)

    @property
    def num_base_tokens(self) -> int:
        """Tokens of the request's own (prompt, output) this step computes: all but the drafts."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def draft_tree(self) -> TokenTree:
        """The drafts as a tree (a chain when they are one; no node when there is no draft)."""
        if self.tree is not None:
            return self.tree
        return TokenTree.chain(self.draft_token_ids) if self.draft_token_ids else _NO_DRAFTS


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[Request, ...] = ()  # running requests whose blocks were freed (recomputed later)
    token_budget_left: int = 0
    num_prefix_lookup_tokens: int = 0  # prompt tokens of the requests admitted this step, looked up
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache

    @cached_property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def decoding(self) -> list[int]:
        """Indices into scheduled of the requests computing only their last token (those may draft)."""
        return [i for i, s in enumerate(self.scheduled) if s.is_decoding]
