# Shape of lightllm/server/router/model_infer/mode_backend/continues_batch/post_process.py @ v1.0.1
# (b418bdf0): sample(logits, reqs, eos_id) l.8 - v1.0.x has no mode_backend/generic_post_process.py;
# every backend imports sample from here by name. Greedy here, as the main stand-in's.
import torch


def sample(logits, reqs, eos_id=[2]):
    logits.div_(1.0)
    probs = torch.softmax(logits, dim=-1)
    batch_next_token_probs, batch_next_token_ids = probs.max(dim=-1)
    return batch_next_token_ids.view(-1), batch_next_token_probs.view(-1)
