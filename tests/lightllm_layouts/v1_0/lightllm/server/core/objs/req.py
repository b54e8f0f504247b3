# Shape of lightllm/server/core/objs/req.py @ v1.0.1 (b418bdf0): request_id / group_req_id are
# ctypes.c_int there (l.63-64), 32-bit. The struct is built in _standin.py.
import ctypes

from lightllm._standin import FinishStatus, make_req  # noqa: F401

Req = make_req(ctypes.c_int)
