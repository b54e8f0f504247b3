# Shape of lightllm/server/router/req_queue/__init__.py build_req_queue @ v1.0.1: ContinuesBatchQueue
# unless --enable_chunked_prefill (main: chunked prefill is the default); beam and P/D decode queues
# as there.
from .chunked_prefill.impl import ChunkedPrefillQueue
from .continues_batch.beam_impl import BeamContinuesBatchQueue  # noqa: F401
from .continues_batch.impl import ContinuesBatchQueue
from .continues_batch.pd_decode_impl import ContinuesBatchQueueForPDDecode  # noqa: F401


def build_req_queue(args, router, dp_size):
    queue_class = ChunkedPrefillQueue if args.get("enable_chunked_prefill") else ContinuesBatchQueue
    return queue_class(args, router, 0, dp_size)
