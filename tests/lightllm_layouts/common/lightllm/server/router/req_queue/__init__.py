# Shape of lightllm/server/router/req_queue/__init__.py build_req_queue @ fc72ffab.
from .chunked_prefill.impl import ChunkedPrefillQueue
from .continues_batch.impl import ContinuesBatchQueue


def build_req_queue(args, router, dp_size_in_node):
    queue_class = ContinuesBatchQueue if args.get("disable_chunked_prefill") else ChunkedPrefillQueue
    return queue_class(args, router, 0, dp_size_in_node)
