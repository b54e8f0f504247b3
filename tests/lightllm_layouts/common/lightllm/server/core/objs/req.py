# Shape of lightllm/server/core/objs/req.py @ fc72ffab: Req is a ctypes struct in shared memory;
# request_id / group_req_id are ctypes.c_int64 there (l.63-64). The struct is built in _standin.py.
import ctypes

from lightllm._standin import FinishStatus, make_req  # noqa: F401

Req = make_req(ctypes.c_int64)
