"""A request's outputs straight from a NumaWorker, as a caller reads them (actors/worker_feed.py): submitted
under a caller id, read from that caller's channel, the caller's lease renewed meanwhile."""

import threading
import uuid
from contextlib import contextmanager
from dataclasses import replace

import ray

from actors.caller_lease import RENEW_INTERVAL_S
from actors.channel_wire import decode
from actors.messages import GenerateRequest
from scheduling.outputs import RequestOutput


@contextmanager
def renewing(worker, caller_id: str):
    """caller_id's lease on worker renewed inside the block, as a caller's LeaseKeeper does."""
    done = threading.Event()

    def renew() -> None:
        while not done.wait(RENEW_INTERVAL_S):
            worker.renew_lease.remote(caller_id)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def worker_outputs(worker, request: GenerateRequest) -> list[RequestOutput]:
    caller_id = uuid.uuid4().hex
    with renewing(worker, caller_id):
        ray.get(worker.submit.remote(replace(request, caller_id=caller_id)))
        outputs = []
        while True:  # the channel may idle out between the submit and its first read: read it again
            for ref in worker.caller_stream.remote(caller_id, (request.request_id,)):
                for request_id, item in decode(ray.get(ref)):
                    assert request_id == request.request_id
                    if isinstance(item, Exception):  # CallerGone too: the lease is renewed meanwhile
                        raise item
                    outputs.append(item)
                    if item.finished:
                        return outputs
