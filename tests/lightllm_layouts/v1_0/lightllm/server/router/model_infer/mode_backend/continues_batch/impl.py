# Shape of lightllm/server/router/model_infer/mode_backend/continues_batch/impl.py @ v1.0.1: imports
# sample by name from .post_process (l.10) and calls it in decode (l.35). The "model" is the fake
# one (lightllm/_standin.py fake_logits).
import torch

from lightllm import _standin

from .post_process import sample


class ContinuesBatchBackend:
    eos_id = [_standin.EOS_ID]

    def normal_decode(self, run_reqs):
        next_token_ids, next_token_probs = sample(_standin.fake_logits(run_reqs), run_reqs, self.eos_id)
        return next_token_ids.tolist(), torch.log(next_token_probs).tolist()
