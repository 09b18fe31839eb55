"""channel_wire (actors/channel_wire.py): a caller channel's batch comes back from its bytes as it was sent,
every RequestOutput field (logprobs' integer keys, prompt logprobs' None rows) and every exception's type and
message; nothing is unpickled: an exception of a class the caller does not handle comes back a RuntimeError
naming it."""

from hypothesis import given
from hypothesis import strategies as st

from actors.caller_lease import CallerGone
from actors.channel_wire import decode, encode
from cluster_configs.errors import EngineClosed, InvalidRequest, Overloaded
from scheduling.outputs import RequestOutput

logprob_rows = st.dictionaries(st.integers(0, 200_000), st.floats(allow_nan=False, width=64), max_size=4)
outputs = st.builds(
    RequestOutput, st.text(max_size=40), st.lists(st.integers(0, 200_000), max_size=8), st.text(max_size=40),
    st.sampled_from([None, "stop", "length", "abort"]), st.none() | st.lists(logprob_rows, max_size=8),
    st.none() | st.lists(st.none() | logprob_rows, max_size=8))
errors = st.builds(RuntimeError, st.text(max_size=20)) | st.builds(InvalidRequest, st.text(max_size=20)) | \
    st.builds(CallerGone, st.text(max_size=20)) | st.builds(Overloaded, st.text(max_size=20)) | \
    st.builds(EngineClosed, st.text(max_size=20))


rows = outputs.map(lambda out: (out.request_id, out)) | st.tuples(st.text(max_size=40), errors)


@given(st.lists(rows, max_size=20))
def test_a_batch_comes_back_from_its_bytes_as_it_was_sent(batch):
    back = decode(encode(batch))
    assert [r for r, _ in back] == [r for r, _ in batch]
    for (_, sent), (_, got) in zip(batch, back):
        if isinstance(sent, Exception):
            assert type(got) is type(sent) and got.args == sent.args
        else:
            assert got == sent


def test_an_invalid_request_keeps_the_field_at_fault():
    [(_, got)] = decode(encode([("r", InvalidRequest("max_tokens must be positive", param="max_tokens"))]))
    assert type(got) is InvalidRequest and got.args == ("max_tokens must be positive",)
    assert got.param == "max_tokens"


@given(st.text(max_size=20))
def test_an_exception_of_another_class_comes_back_a_runtime_error_naming_it(message):
    class Unheard(Exception):
        pass

    [(_, unheard), (_, key)] = decode(encode([("r", Unheard(message)), ("s", KeyError(message))]))
    assert type(unheard) is RuntimeError and unheard.args == (f"Unheard: {message}",)
    assert type(key) is RuntimeError and key.args == (f"KeyError: {KeyError(message)}",)
