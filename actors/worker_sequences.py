"""The live sequences of the client sessions pinned to one worker, by the ids their callers hold (engine-loop
thread). The caller holds each sequence's history and sends it whole with every turn (history + new input);
the worker goes on from the KV it keeps (scheduling/sessions.py) while that history extends what it holds,
and otherwise builds it again: a sequence it never saw (the first turn, a turn moved here after a worker's
loss) or one whose history differs (a turn aborted by its caller holds tokens the caller never received)."""

from scheduling.request import Request
from scheduling.sessions import SequenceKV, SequenceStore


class WorkerSequences:
    def __init__(self, store: SequenceStore):
        self.store = store
        self.by_id: dict[str, SequenceKV] = {}

    def attach(self, req: Request, sequence_id: str) -> None:
        """req, a turn of sequence_id not yet queued, starts from its KV and leaves its own there."""
        seq = self.by_id.setdefault(sequence_id, SequenceKV())
        if req.token_ids[:len(seq.token_ids)] != seq.token_ids:
            self.store.reset(seq)
        req.sequence = seq

    def fork(self, sequence_id: str, fork_id: str) -> None:
        seq = self.by_id.get(sequence_id)
        if seq is not None:
            self.by_id[fork_id] = self.store.fork(seq)

    def free(self, sequence_ids: tuple[str, ...]) -> None:
        for sequence_id in sequence_ids:
            seq = self.by_id.pop(sequence_id, None)
            if seq is not None:
                self.store.reset(seq)
