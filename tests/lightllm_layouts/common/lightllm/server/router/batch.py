# Shape of lightllm/server/router/batch.py Batch @ fc72ffab (same in v1.0.0 and 746bf849).


class Batch:
    def __init__(self, batch_id, reqs, dp_size_in_node):
        self.batch_id = batch_id
        self.reqs = reqs
        self.id_to_reqs = {req.request_id: req for req in reqs}
        self.dp_size_in_node = dp_size_in_node

    def filter_out_finished_req(self, shm_req_manager):
        unfinished_req_ids = []
        for req in self.reqs:
            if req.is_aborted:
                req.router_aborted = True
            if req.shm_infer_released:
                shm_req_manager.put_back_req_obj(req)
            else:
                unfinished_req_ids.append(req.request_id)
        self.reqs = [self.id_to_reqs[req_id] for req_id in unfinished_req_ids]
        self.id_to_reqs = {req.request_id: req for req in self.reqs}

    def is_clear(self):
        return len(self.reqs) == 0

    def merge(self, mini_batch):
        for req in mini_batch.reqs:
            self.reqs.append(req)
        self.id_to_reqs = {req.request_id: req for req in self.reqs}

    @staticmethod
    def merge_two_batch(batch1, batch2):
        if batch1 is None:
            return batch2
        if batch2 is None:
            return batch1
        merged = Batch(-1, list(batch1.reqs) + list(batch2.reqs), batch1.dp_size_in_node)
        return merged
