"""What a Ray failure means to a caller: the one place Ray's errors are unwrapped."""

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError

from cluster_configs.errors import NumaserveError, Unavailable

WORKER_LOST = (RayActorError, ObjectLostError, NodeDiedError)  # the actor, not the request, failed


def unwrap(error: BaseException, actor: str) -> BaseException:
    """The error a caller of `actor` ("router", "adapter cache", ...) sees: numaserve's own (InvalidRequest,
    Overloaded, ...) as themselves, the actor's death as Unavailable, anything else as it is."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, NumaserveError):
        return error.cause
    if isinstance(error, RayActorError):
        return Unavailable(f"the deployment's {actor} is down or restarting; retry in a few seconds")
    return error
