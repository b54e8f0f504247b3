# Shape of lightllm/utils/dist_utils.py @ v1.0.0 (2d768aac): only torch.distributed wrappers, no
# get_current_rank_in_dp (that arrived with v1.0.1's DP groups). Not initialised in the stand-in.


def get_world_size():
    raise RuntimeError("Distributed package is not initialized.")


def get_rank():
    raise RuntimeError("Distributed package is not initialized.")
