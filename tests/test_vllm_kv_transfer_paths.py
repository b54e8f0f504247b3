"""The KV-transfer paths the real ExampleConnector run (tests/test_vllm_disaggregated.py) cannot
reach on a CPU: asynchronous loads (NIXL pull: the request waits in WAITING_FOR_REMOTE_KVS until
``finished_recving``), loads that fail (``failed_recving``, ``invalid_block_ids`` under vLLM's
``kv_load_failure_policy``), requests gone before their KV arrived, and sends the peer pulls
(``request_finished`` -> ``delay_free_blocks``, until ``finished_sending``).

Real: vLLM's ``KVConnectorOutput`` and ``ModelRunnerOutput`` (vllm/v1/outputs.py), the ``SchedulerKV``
tracker and the core's spans and metrics. Stand-ins: the scheduler (the fields SchedulerKV reads:
``connector``, ``vllm_config.kv_transfer_config``, ``block_size``, ``kv_cache_config``,
``requests``) and a connector with the scheduler-side signatures of ``KVConnectorBase_V1`` (the
contract tests hold those to vLLM's source); the calls come in the order vLLM's scheduler makes them.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, set_step_kv_time
from llm_otel.instrumentation.vllm.kv_transfer import SchedulerKV, request_role, trace_context_of

outputs = pytest.importorskip("vllm.v1.outputs")


class _Connector:
    """Scheduler-side methods with ``KVConnectorBase_V1``'s signatures; the answers a NIXL
    connector gives (asynchronous loads, blocks held for the peer)."""

    def __init__(self, external: int, asynchronous: bool, delay_free: bool) -> None:
        self.external, self.asynchronous, self.delay_free = external, asynchronous, delay_free

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external, self.asynchronous

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def request_finished(self, request, block_ids):
        return self.delay_free, {
            "do_remote_prefill": True,
            "remote_engine_id": "engine-p",
            "remote_block_ids": block_ids,
        }


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def _scheduler(connector, role: str, policy: str = "recompute"):
    spec = types.SimpleNamespace(page_size_bytes=16 * 2048, block_size=16)
    return types.SimpleNamespace(
        connector=connector,
        vllm_config=types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(
                kv_connector="NixlConnector", kv_role=role, kv_load_failure_policy=policy
            )
        ),
        block_size=16,
        kv_cache_config=types.SimpleNamespace(
            kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])]
        ),
        requests={},
    )


def _request(rid: str, sampled: bool = True, params=None):
    flags = "01" if sampled else "00"
    extra = {CARRIER_KEY: f"00-{'ab' * 16}-{'12' * 8}-{flags}"}
    return types.SimpleNamespace(
        request_id=rid,
        sampling_params=types.SimpleNamespace(extra_args=extra),
        kv_transfer_params=params,
        num_prompt_tokens=40,
    )


def _step(scheduled=(), new=()):
    return types.SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(scheduled, 1),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r) for r in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[]),
    )


def _output(**kv):
    return dataclasses.replace(outputs.EMPTY_MODEL_RUNNER_OUTPUT, kv_connector_output=outputs.KVConnectorOutput(**kv))


def _receive(kv: SchedulerKV, sched, rid: str, blocks=(3, 4, 5)):
    req = _request(rid, params={"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": 5600})
    sched.requests[rid] = req
    n, asynchronous = sched.connector.get_num_new_matched_tokens(req, 0)
    sched.connector.update_state_after_alloc(req, _Blocks(blocks), n)
    return req


def _spans(captured):
    return [s for s in captured.finished() if s.name == "llm.kv_transfer"]


def test_asynchronous_receive_ends_when_the_connector_reports_it(captured):
    sched = _scheduler(_Connector(40, True, False), "kv_consumer")
    kv = SchedulerKV(captured.telemetry, sched)
    _receive(kv, sched, "r1")
    assert kv.on_output(sched, _step(), _output()) is None  # still waiting for remote KV
    assert _spans(captured) == []
    figures = kv.on_output(sched, _step(), _output(finished_recving={"r1"}))
    assert figures == (0.0, 0.0, 1)
    (span,) = _spans(captured)
    a = span.attributes
    assert a["llm.kv_transfer.direction"] == "receive" and a["llm.kv_transfer.asynchronous"] is True
    assert a["llm.kv_transfer.tokens"] == 40 and a["llm.kv_transfer.blocks"] == 3
    assert a["llm.kv_transfer.bytes"] == 40 * 2048
    assert a["llm.kv_transfer.remote_engine"] == "10.0.0.7:5600"
    assert a["llm.disaggregation.role"] == "decode" and "error.type" not in a
    assert span.parent.span_id == int("12" * 8, 16)


@pytest.mark.parametrize(
    ("kv_output", "error"),
    [
        ({"failed_recving": {"r1"}, "finished_recving": {"r1"}}, "kv_load_failed"),
        ({"invalid_block_ids": {4}}, "kv_invalid_blocks"),
    ],
)
def test_a_failed_load_ends_the_receive_with_its_error_and_the_policy(captured, kv_output, error):
    sched = _scheduler(_Connector(40, True, False), "kv_consumer", policy="fail")
    kv = SchedulerKV(captured.telemetry, sched)
    _receive(kv, sched, "r1")
    _receive(kv, sched, "r2", blocks=(9,))  # another request's blocks are not affected
    kv.on_output(sched, _step(), _output(**kv_output))
    (span,) = _spans(captured)
    assert span.attributes["llm.request.id"] == "r1"
    assert span.attributes["error.type"] == error
    assert span.attributes["llm.kv_transfer.load_failure_policy"] == "fail"
    assert not span.status.is_ok
    (point,) = [p for p in captured.metric_points("llm.kv_transfer.duration")]
    assert point.attributes["error.type"] == error and point.count == 1


def test_a_request_gone_before_its_kv_arrived_ends_the_receive_as_aborted(captured):
    sched = _scheduler(_Connector(40, True, False), "kv_consumer")
    kv = SchedulerKV(captured.telemetry, sched)
    _receive(kv, sched, "r1")
    del sched.requests["r1"]  # aborted by the client while waiting for remote KV
    kv.on_output(sched, _step(), _output())
    (span,) = _spans(captured)
    assert span.attributes["error.type"] == "aborted"


def test_a_synchronous_load_takes_the_worker_window_of_its_step(captured):
    sched = _scheduler(_Connector(32, False, False), "kv_consumer")
    kv = SchedulerKV(captured.telemetry, sched)
    _receive(kv, sched, "r1")
    mro = _output()
    set_step_kv_time(mro, (5_000_000, 1_000_000_000_000_000_000, 0, 0))
    assert kv.on_output(sched, _step(scheduled=["r1"], new=["r1"]), mro) == (0.005, 0.0, 1)
    (span,) = _spans(captured)
    assert span.attributes["llm.kv_transfer.asynchronous"] is False
    assert (span.start_time, span.end_time) == (1_000_000_000_000_000_000, 1_000_000_000_005_000_000)


def test_a_send_the_peer_pulls_lasts_until_finished_sending(captured):
    sched = _scheduler(_Connector(0, False, True), "kv_producer")
    kv = SchedulerKV(captured.telemetry, sched)
    req = _request("p1", params={"do_remote_decode": True})
    sched.requests["p1"] = req
    sched.connector.request_finished(req, [1, 2, 3])
    assert _spans(captured) == []  # blocks held for the peer
    kv.on_output(sched, _step(), _output(finished_sending={"p1"}))
    (span,) = _spans(captured)
    a = span.attributes
    assert a["llm.kv_transfer.direction"] == "send" and a["llm.kv_transfer.asynchronous"] is True
    assert a["llm.kv_transfer.tokens"] == 40 and a["llm.disaggregation.role"] == "prefill"
    assert a["llm.kv_transfer.remote_engine"] == "engine-p"


def test_unsampled_requests_are_counted_without_spans(captured):
    sched = _scheduler(_Connector(40, True, False), "kv_consumer")
    kv = SchedulerKV(captured.telemetry, sched)
    req = _request("u1", sampled=False)
    sched.requests["u1"] = req
    n, _ = sched.connector.get_num_new_matched_tokens(req, 0)
    sched.connector.update_state_after_alloc(req, _Blocks((1,)), n)
    kv.on_output(sched, _step(), _output(finished_recving={"u1"}))
    assert _spans(captured) == []
    (point,) = captured.metric_points("llm.kv_transfer.duration")
    assert point.count == 1


@pytest.mark.parametrize(
    "params",
    [None, "x", {"trace_context": "00-bad"}, {"trace_context": {"traceparent": "00-zz-yy-01"}}, {"trace_context": {}}],
)
def test_hostile_trace_context_in_kv_transfer_params_is_ignored(params):
    assert trace_context_of(types.SimpleNamespace(kv_transfer_params=params)) is None


def test_a_valid_trace_context_in_kv_transfer_params_is_joined():
    tp = f"00-{'cd' * 16}-{'34' * 8}-01"
    carrier = trace_context_of(types.SimpleNamespace(kv_transfer_params={"trace_context": {"traceparent": tp}}))
    assert carrier is not None and carrier["traceparent"] == tp


@pytest.mark.parametrize(
    ("role", "params", "expected"),
    [
        ("prefill", {"do_remote_prefill": True}, "prefill"),  # a client cannot turn a kv_producer's hop into decode
        ("decode", {"do_remote_decode": True}, "decode"),
        ("both", {"do_remote_decode": True}, "prefill"),
        ("both", {"do_remote_prefill": True}, "decode"),
        ("both", {"do_remote_prefill": "yes", "do_remote_decode": [1]}, "both"),  # booleans only
        ("both", None, "both"),
        (None, {"do_remote_decode": True}, None),  # no KV connector: no role
    ],
)
def test_the_request_role_is_the_instance_role_unless_it_can_take_both(role, params, expected):
    assert request_role(role, params) == expected
