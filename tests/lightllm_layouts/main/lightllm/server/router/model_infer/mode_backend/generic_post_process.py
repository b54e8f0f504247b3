# Shape of lightllm/server/router/model_infer/mode_backend/generic_post_process.py @ fc72ffab:
# sample(logits, reqs, eos_id) l.9 returns (next token ids, their probabilities) as 1-D tensors and
# modifies the logits in place (penalties, temperature) - greedy here.
import torch


def sample(logits, reqs, eos_id=[2]):
    logits.div_(1.0)
    probs = torch.softmax(logits, dim=-1)
    batch_next_token_probs, batch_next_token_ids = probs.max(dim=-1)
    return batch_next_token_ids.view(-1), batch_next_token_probs.view(-1)
