# Shape of lightllm/server/router/req_queue/base_queue.py BaseQueue @ fc72ffab.


class BaseQueue:
    def __init__(self, args, router, dp_index, dp_size_in_node):
        self.args = args
        self.router = router
        self.dp_index = dp_index
        self.dp_size_in_node = dp_size_in_node
        self.waiting_req_list = []

    def extend(self, req_group):
        self.waiting_req_list.extend(req_group)

    def get_wait_req_num(self):
        return len(self.waiting_req_list)

    def _admit(self, current_batch, limit):
        from lightllm.server.router.batch import Batch

        running = len(current_batch.reqs) if current_batch is not None else 0
        room = max(0, self.args.get("running_max_req_size", 8) - running)
        if limit is not None:
            room = min(room, limit)
        take, self.waiting_req_list = self.waiting_req_list[:room], self.waiting_req_list[room:]
        if not take:
            return None
        self.router.batch_seq += 1
        return Batch(self.router.batch_seq, take, self.dp_size_in_node)
