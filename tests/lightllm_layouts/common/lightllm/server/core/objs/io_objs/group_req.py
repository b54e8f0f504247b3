# Same dataclasses as lightllm/server/core/objs/io_objs/group_req.py @ fc72ffab.
from dataclasses import dataclass
from typing import List

from lightllm.server.multimodal_params import MultimodalParams


@dataclass
class GroupReqIndexes:
    group_req_id: int
    multimodal_params: MultimodalParams
    shm_req_indexes: List[int]
    time_mark: float


@dataclass
class GroupReqObjs:
    group_req_id: int
    multimodal_params: MultimodalParams
    shm_req_objs: list
    time_mark: float

    def to_group_req_index(self):
        return GroupReqIndexes(self.group_req_id, self.multimodal_params,
                               [r.index_in_shm_mem for r in self.shm_req_objs], self.time_mark)
