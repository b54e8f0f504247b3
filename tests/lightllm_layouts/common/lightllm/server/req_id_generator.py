# Shape of lightllm/server/req_id_generator.py @ fc72ffab: ReqIDGenerator keeps its counters in a
# shared-memory numpy int64 array (ShmArray "<name>_req_id_gen", shape (2,)) shared by all HTTP
# workers and hands out group ids in steps of MAX_BEST_OF; generate_id() returns the array element
# itself, a numpy.int64. (v1.0.1: shape (1,), no range check - the same ids.) Here the array is a
# view of the stand-in's shared block (lightllm/_standin.py), passed in instead of named by the
# service, the one difference from the real constructor.
import numpy as np

from lightllm import _standin

MAX_BEST_OF = 8


class ReqIDGenerator:
    def __init__(self, shm_raw):
        self.current_id = np.frombuffer(shm_raw, dtype=np.int64, count=_standin.ID_SLOTS, offset=_standin.ids_offset())
        self.current_id[0] = 0
        self.current_id[1] = 0

    def _check_and_set_new_id_range(self):
        if self.current_id[0] + MAX_BEST_OF >= self.current_id[1]:
            self.current_id[0] = MAX_BEST_OF
            self.current_id[1] = np.iinfo(np.int64).max

    def generate_id(self):
        self._check_and_set_new_id_range()
        id = self.current_id[0]
        self.current_id[0] += MAX_BEST_OF
        return id


def convert_sub_id_to_group_id(sub_req_id):
    return (sub_req_id // MAX_BEST_OF) * MAX_BEST_OF
