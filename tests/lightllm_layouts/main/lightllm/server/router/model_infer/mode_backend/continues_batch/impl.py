# Shape of lightllm/server/router/model_infer/mode_backend/continues_batch/impl.py @ fc72ffab: imports
# sample by name (l.9) and calls it in normal_decode (l.92). The "model" makes logits whose
# greedy token and its log-prob are the fake model's (lightllm/_standin.py).
import math

import torch

from lightllm import _standin
from lightllm.server.router.model_infer.mode_backend.generic_post_process import sample

VOCAB = 128


class ContinuesBatchBackend:
    eos_id = [_standin.EOS_ID]

    def forward(self, run_reqs):
        logits = torch.empty((len(run_reqs), VOCAB), dtype=torch.float32)
        for i, req in enumerate(run_reqs):
            token, logprob = _standin.FakeModel.next_token(req.shm_req.input_len, req.cur_output_len)
            # every other token at c, the target at 0: log-softmax of the target is exactly `logprob`
            logits[i].fill_(math.log((math.exp(-logprob) - 1.0) / (VOCAB - 1)))
            logits[i, token] = 0.0
        return logits

    def normal_decode(self, run_reqs):
        next_token_ids, next_token_probs = sample(self.forward(run_reqs), run_reqs, self.eos_id)
        return next_token_ids.tolist(), torch.log(next_token_probs).tolist()
